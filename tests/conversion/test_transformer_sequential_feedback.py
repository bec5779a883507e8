"""The official Feedback Transformer of Fan et al. (facebookresearch/transformer-sequential, `models/feedback.py`)
converted into memlm's gives what the official code gave: the reference data in
../shared/official-reference/transformer-sequential (produced by running the official code, float64) — per-position
log-probabilities over blocks with the memory carried, the per-block losses (LM and adaptive span), the carried
hidden states, and the gradients of the first blocks mapped back onto the official names through
`convert_state_dict`."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from memlm import FeedbackTransformerForCausalLM
from memlm.conversion.transformer_sequential_feedback import convert_state_dict
from tests.tolerances import OFFICIAL_FLOAT64

REFERENCE = Path(__file__).resolve().parents[2].parent / "shared" / "official-reference" / "transformer-sequential"
CASES = sorted(path.stem for path in REFERENCE.glob("feedback_*.json")) if REFERENCE.is_dir() else []
TOLERANCE = OFFICIAL_FLOAT64  # absolute, float64, recorded by the official code elsewhere (tests/tolerances.py)

pytestmark = pytest.mark.skipif(not CASES, reason=f"no reference data in {REFERENCE} (../shared beside the repo)")


def load_case(case: str) -> tuple[dict, dict, dict]:
    meta = json.loads((REFERENCE / f"{case}.json").read_text(encoding="utf-8"))
    tensors = load_file(REFERENCE / f"{case}.safetensors")
    official = {
        name.removeprefix("official."): value for name, value in tensors.items() if name.startswith("official.")
    }
    return meta, tensors, official


def blocks(meta: dict, tensors: dict, count: int | None = None):
    length = meta["official_args"]["mem_sz"]
    for index in range(meta["sizes"]["blocks"] if count is None else count):
        window = slice(index * length, (index + 1) * length)
        yield index, tensors["input_ids"][:, window], tensors["labels"][:, window]


def lm_loss(log_probs: torch.Tensor, labels: torch.Tensor, official_args: dict) -> torch.Tensor:
    """The official trainer's LM loss of a block: the mean of −log p(label), or with omitted labels
    (`--data-omit-labels`) the sum over the others divided by (their count + 1e-6), the count formed in float32."""
    nll = -log_probs.gather(-1, labels[..., None]).reshape(-1)
    omitted = official_args.get("data_omit_label_idx")
    if not omitted:
        return nll.mean()
    mask = 1 - sum(labels.reshape(-1).eq(label) for label in omitted).float()
    return (nll * mask).sum() / (mask.sum() + 1e-6)


def converted_model(official: dict, meta: dict) -> FeedbackTransformerForCausalLM:
    config, state_dict = convert_state_dict(official, meta["official_args"])
    model = FeedbackTransformerForCausalLM(config).to(torch.float64)
    model.load_state_dict(state_dict, strict=True)
    return model


@pytest.mark.parametrize("case", CASES)
def test_log_probabilities_losses_and_carried_memory_equal_the_official_code(case):
    meta, tensors, official = load_case(case)
    model = converted_model(official, meta).eval()
    cache, log_probs, losses, aux_losses = None, [], [], []
    with torch.no_grad():
        for index, input_ids, labels in blocks(meta, tensors):
            # As users feed memlm: no cache first (the official zero initial memory), then the previous block's.
            output = model(input_ids=input_ids, cache=cache, use_cache=True)
            cache = output.cache
            log_probs.append(output.logits.log_softmax(-1))
            losses.append(lm_loss(log_probs[-1], labels, meta["official_args"]))
            aux_losses.append(output.aux_loss if output.aux_loss is not None else torch.zeros((), dtype=torch.float64))
            carried = tensors[f"carried.{index}.hidden.0"]  # (B, attn_lim, H), oldest first
            layer = cache.layers[0]  # its slots in position order (a ring holds them at position mod τ)
            order = layer.positions.masked_fill(~layer.valid, torch.iinfo(torch.long).max).argsort(dim=1)
            hidden = layer.hidden.gather(1, order[..., None].expand_as(layer.hidden))
            assert hidden.shape == carried.shape and bool(layer.valid.all())
            assert (hidden - carried).abs().max() <= TOLERANCE
    log_probs = torch.cat(log_probs, dim=1)
    assert log_probs.dtype == torch.float64
    assert (log_probs - tensors["log_probs"]).abs().max() <= TOLERANCE
    assert (torch.stack(losses) - tensors["loss_lm"]).abs().max() <= TOLERANCE
    assert (torch.stack(aux_losses) - tensors["loss_aux"]).abs().max() <= TOLERANCE
    assert (output.aux_loss is not None) == meta["official_args"]["adapt_span"]


@pytest.mark.parametrize("case", CASES)
def test_gradients_of_the_training_blocks_map_back_onto_the_official_names(case):
    meta, tensors, official = load_case(case)
    # Leaves under the official names; a tied parameter is one leaf under each of its names.
    leaves = {name: value.clone().requires_grad_(True) for name, value in official.items()}
    for other, first in meta["tied_parameters"].items():
        leaves[other] = leaves[first]
    config, state_dict = convert_state_dict(leaves, meta["official_args"])
    assert config.memory_carry == "hidden_states"  # the official training: keys and values recomputed each block
    model = FeedbackTransformerForCausalLM(config).to(torch.float64).train()  # dropout 0, as the reference
    cache, losses, aux_losses = None, [], []
    for _, input_ids, labels in blocks(meta, tensors, meta["sizes"]["grad_blocks"]):
        output = torch.func.functional_call(
            model, state_dict, args=(), kwargs={"input_ids": input_ids, "cache": cache, "use_cache": True}
        )
        cache = output.cache  # carries detached hidden states, as the official trainer's memory
        loss = lm_loss(output.logits.log_softmax(-1), labels, meta["official_args"])
        total = loss if output.aux_loss is None else loss + output.aux_loss
        total.backward()  # per block, as the official trainer; gradients accumulate
        losses.append(loss.detach())
        aux_losses.append(torch.zeros(()) if output.aux_loss is None else output.aux_loss.detach())
    assert (torch.stack(losses) - tensors["train.loss_lm"]).abs().max() <= TOLERANCE
    assert (torch.stack(aux_losses).double() - tensors["train.loss_aux"]).abs().max() <= TOLERANCE
    gradients = {name.removeprefix("grad."): value for name, value in tensors.items() if name.startswith("grad.")}
    assert set(gradients) == set(meta["parameters"])
    for name, expected in gradients.items():
        error = (leaves[name].grad - expected).abs().max().item()
        assert error <= TOLERANCE, f"{name}: {error:.3g}"
    # the projections get gradients through the carried memories too: without recomputation they would differ
    assert any("proj_key" in name for name in gradients)


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        ({"feedback": False}, "--feedback"),
        ({"expire_span": True}, "--expire-span"),
        ({"staircase": True}, "--staircase"),
        ({"adapt_span": True, "adapt_span_layer": True}, "--adapt-span-layer"),
        ({"adapt_span": True, "adapt_span_cache": True}, "--adapt-span-cache"),
    ],
)
def test_what_memlm_cannot_express_is_refused_naming_the_official_flag(flags, named):
    meta, _, official = load_case("feedback_enwik8")
    with pytest.raises(NotImplementedError, match=named):
        convert_state_dict(official, {**meta["official_args"], **flags})


def test_the_adaptive_span_options_reach_the_config():
    meta, _, official = load_case("feedback_enwik8")
    config, _ = convert_state_dict(official, {**meta["official_args"], "adapt_span_trim_step": 8})
    assert config.adaptive_span and config.adaptive_span_trim_step == 8 and config.adaptive_span_ramp == 8
    assert config.adaptive_span_loss_coefficient == 5e-7 and config.renormalization_epsilon == 1e-8
    meta, _, official = load_case("feedback_postnorm_shared_kv")
    config, _ = convert_state_dict(official, meta["official_args"])
    assert not config.adaptive_span and config.adaptive_span_trim_step is None


def test_a_state_dict_that_does_not_fit_the_arguments_is_refused():
    meta, _, official = load_case("feedback_algorithmic_3var")
    with pytest.raises(NotImplementedError, match="no place for: extra.weight"):
        convert_state_dict({**official, "extra.weight": torch.zeros(1)}, meta["official_args"])
    missing = {name: value for name, value in official.items() if name != "layers.2.ff.fc2.bias"}
    with pytest.raises(ValueError, match="no 'layers.2.ff.fc2.bias'"):
        convert_state_dict(missing, meta["official_args"])
    with pytest.raises(ValueError, match="official_args must be a dict"):
        convert_state_dict(official, ["--feedback"])
