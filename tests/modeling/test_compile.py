"""torch.compile and torch.export: the models' forward and one decoding step trace without graph breaks where the
recurrence allows (on the PyTorch kernel backend, MEMLM_KERNELS=torch), and the clear errors for bad input stay."""

import pytest
import torch
import torch._dynamo

from tests.modeling.test_common import _model

# The masks the forward is traced with: none, all real tokens (what generate passes) and left padding.
MASKS = {
    "none": None,
    "ones": torch.ones(2, 5, dtype=torch.long),
    "left": torch.tensor([[0] * 2 + [1] * 3, [1] * 5]),
}


def _breaks(model, mask) -> tuple[list[str], list[str]]:
    """Where the graph breaks in a forward over 5 tokens and in one decoding step after it: the file of the innermost
    frame of each break explain() reports, and "?" for each break it counts without a reason."""
    input_ids = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(0))
    step_mask = None if mask is None else torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
    found = []
    with torch.no_grad():
        torch._dynamo.reset()
        forward = torch._dynamo.explain(model)(input_ids=input_ids, attention_mask=mask, use_cache=True)
        cache = model(input_ids, attention_mask=mask, use_cache=True).cache
        torch._dynamo.reset()
        step = torch._dynamo.explain(model)(
            input_ids=input_ids[:, :1], attention_mask=step_mask, cache=cache, use_cache=True
        )
        torch._dynamo.reset()
    for explained in (forward, step):
        assert len(explained.break_reasons) <= explained.graph_break_count
        found.append(
            [reason.user_stack[-1].filename.rsplit("memlm/", 1)[-1] for reason in explained.break_reasons]
            + ["?"] * (explained.graph_break_count - len(explained.break_reasons))
        )
    return found[0], found[1]


# Each trace takes several seconds: the left-padded one (the most paths) runs in the CPU suite, the others are slow.
SLOW_MASKS = [pytest.param(mask, marks=pytest.mark.slow) if mask != "left" else mask for mask in MASKS]


@pytest.mark.parametrize("mask", SLOW_MASKS)
@pytest.mark.parametrize("name", ["deltanet", "feedback"])
def test_forward_and_decoding_step_compile_without_graph_breaks(name, mask, monkeypatch):
    monkeypatch.setenv("MEMLM_KERNELS", "torch")
    forward, step = _breaks(_model(name), MASKS[mask])
    assert forward == [] and step == []


@pytest.mark.slow
@pytest.mark.parametrize("mask", list(MASKS))
def test_expire_span_breaks_only_to_compact_its_memories(mask, monkeypatch):
    """Expire-Span deletes expired memories, so its memory's width is data: compiled, the layers mask dead memories
    and the forward compacts them once at its end, the one place its graph breaks (the kernel, sdpa.py, has no
    data-dependent branch under compile)."""
    monkeypatch.setenv("MEMLM_KERNELS", "torch")
    for breaks in _breaks(_model("expire_span"), MASKS[mask]):
        located = [where for where in breaks if where != "?"]
        assert located == ["modeling/modeling_expire_span.py"], breaks
        assert len(breaks) <= 2, breaks


@pytest.mark.parametrize("name", ["deltanet", pytest.param("feedback", marks=pytest.mark.slow)])
def test_export_gives_the_eager_logits(name, monkeypatch):
    """torch.export traces the forward (the ids' range check runs in eager mode only) and gives the same logits."""
    monkeypatch.setenv("MEMLM_KERNELS", "torch")
    model = _model(name)
    input_ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        program = torch.export.export(model, (input_ids,), kwargs={"use_cache": False})
        torch.testing.assert_close(
            program.module()(input_ids, use_cache=False).logits, model(input_ids, use_cache=False).logits
        )
    with pytest.raises(ValueError, match=r"input_ids must lie in \[0, vocab_size=258\); got values from 0 to 300"):
        model(torch.tensor([[0, 300]]))


@pytest.mark.parametrize("use_cache", [False, True])
def test_export_of_expire_span_is_refused_in_words(use_cache, monkeypatch):
    """Its memory's width is data, so an exported graph would answer other inputs wrongly: refused, never wrong."""
    monkeypatch.setenv("MEMLM_KERNELS", "torch")
    model = _model("expire_span")
    input_ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad(), pytest.raises(ValueError, match="torch.export cannot capture Expire-Span: the number of"):
        torch.export.export(model, (input_ids,), kwargs={"use_cache": use_cache})
    with torch.no_grad():  # eager runs as before
        assert model(input_ids, use_cache=use_cache).logits.shape == (2, 9, 258)
