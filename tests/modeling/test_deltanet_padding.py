"""DeltaNet on padded batches: padding anywhere in a row is skipped, so each row gives what it gives alone. The
PyTorch backend masks the padding; the Triton backend packs the real tokens back to back with `cu_seqlens` (run in
Triton's interpreter without a GPU, see tests/conftest.py)."""

import os

import pytest
import torch

from memlm import DeltaNetForCausalLM
from memlm.compat import activation_checkpointing_enable
from memlm.kernels import triton_available
from memlm.modeling.modeling_deltanet import DeltaNetShortConvolution
from tests.conftest import DELTANET_VARIANTS
from tests.modeling.padding import LAYOUTS, check_rows_alone, padding_mask

TRITON_RUNS = triton_available() and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(not TRITON_RUNS, reason="needs Triton"))]
WIDTH = 12
PREFIX = 4


def _randomised(model):
    torch.manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    return model


def _mask(layout: str) -> torch.Tensor:
    return padding_mask(layout, (9, 5, 3), WIDTH)


def _record_packed_calls(monkeypatch) -> list:
    """The cu_seqlens of every call of the Triton chunk kernel (None when a call was not packed)."""
    from memlm.kernels.delta_rule import triton_chunk

    calls, function = [], triton_chunk.delta_rule_chunk_triton

    def recorded(*args, **kwargs):
        calls.append(args[7] if len(args) > 7 else kwargs.get("cu_seqlens"))
        return function(*args, **kwargs)

    monkeypatch.setattr(triton_chunk, "delta_rule_chunk_triton", recorded)
    return calls


# The Triton backend gathers each row's real tokens wherever they are: padding between them is the general case of the
# gather and an empty row its edge (padding only at the left or the right runs the same gather; the PyTorch backend,
# which masks instead, takes every layout).
LAYOUTS_BY_BACKEND = [(layout, "torch") for layout in LAYOUTS] + [
    pytest.param(layout, "triton", marks=pytest.mark.skipif(not TRITON_RUNS, reason="needs Triton"))
    for layout in ("between", "empty_row")
]


@pytest.mark.parametrize(("layout", "backend"), LAYOUTS_BY_BACKEND)
@pytest.mark.parametrize("variant", ["fla", "favor_conv_gate", "sum_rule_normalised"])
def test_padding_anywhere_gives_each_row_alone(variant, layout, backend, monkeypatch):
    """Logits, continuation and memory (fast weights, convolution tails) of each row equal the row alone, which
    runs on the (separately tested) PyTorch path."""
    monkeypatch.setenv("MEMLM_KERNELS", backend)
    calls = _record_packed_calls(monkeypatch) if backend == "triton" else []
    config = DELTANET_VARIANTS[variant]()
    model = _randomised(DeltaNetForCausalLM(config).eval())
    mask = _mask(layout)

    def snapshot(cache):
        return [
            (layer.fast_weights.clone(), layer.convolution_tail) for layer in cache.layers
        ]  # replaced, not mutated

    batch, rows = check_rows_alone(model, mask, config.pad_token_id, PREFIX, 3, snapshot=snapshot,
                                   before_alone=lambda: monkeypatch.setenv("MEMLM_KERNELS", "torch"))  # fmt: skip
    for row, alone in enumerate(rows):
        for (fast_weights, tail), (alone_fast_weights, alone_tail) in zip(batch, alone):
            torch.testing.assert_close(fast_weights[row], alone_fast_weights[0], atol=1e-5, rtol=0)
            if config.short_convolution:
                torch.testing.assert_close(tail[row], alone_tail[0])
    monkeypatch.setenv("MEMLM_KERNELS", backend)
    packs = backend == "triton" and config.update_rule == "delta"
    assert model.model.packs_padding(mask.bool()) == packs
    if packs:  # the padded chunk ran packed in each layer: one sequence per row, empty ones included
        packed = [offsets for offsets in calls if offsets is not None]
        assert len(packed) == config.num_hidden_layers
        assert packed[0].tolist() == [0, *mask.sum(1).cumsum(0).tolist()]


@pytest.mark.skipif(not TRITON_RUNS, reason="needs Triton")
def test_packed_training_gives_the_masked_gradients(monkeypatch):
    """A right-padded training batch (as collators build them), loss on real tokens only: the packed Triton run and
    the masked PyTorch run give the same loss and parameter gradients."""
    config = DELTANET_VARIANTS["fla_gated"]()
    model = _randomised(DeltaNetForCausalLM(config)).train()
    mask = _mask("right")
    input_ids = torch.randint(0, 256, mask.shape).masked_fill(mask == 0, config.pad_token_id)
    labels = input_ids.masked_fill(mask == 0, -100)
    results = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("MEMLM_KERNELS", backend)
        model.zero_grad(set_to_none=True)
        loss = model(input_ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        results[backend] = loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}
    torch.testing.assert_close(results["triton"][0], results["torch"][0], atol=1e-5, rtol=0)
    for name, gradient in results["torch"][1].items():
        torch.testing.assert_close(results["triton"][1][name], gradient, atol=1e-5, rtol=1e-4, msg=name)
    activation_checkpointing_enable(model)  # the packed layout through recomputed layers
    model.zero_grad(set_to_none=True)
    model(input_ids, attention_mask=mask, labels=labels).loss.backward()
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(parameter.grad, results["triton"][1][name], atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.skipif(not TRITON_RUNS, reason="needs Triton")
def test_packed_hidden_states_come_back_in_the_callers_layout(monkeypatch):
    config = DELTANET_VARIANTS["fla"]()
    model = _randomised(DeltaNetForCausalLM(config).eval())
    mask = _mask("between")
    input_ids = torch.randint(0, 256, mask.shape).masked_fill(mask == 0, config.pad_token_id)
    outputs = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("MEMLM_KERNELS", backend)
        with torch.no_grad():
            outputs[backend] = model(input_ids, attention_mask=mask, output_hidden_states=True)
    real = mask.bool()
    assert len(outputs["triton"].hidden_states) == config.num_hidden_layers + 1
    for packed, masked in zip(outputs["triton"].hidden_states, outputs["torch"].hidden_states):
        assert packed.shape == masked.shape == (*mask.shape, config.hidden_size)
        torch.testing.assert_close(packed[real], masked[real], atol=1e-5, rtol=0)
    assert torch.count_nonzero(outputs["triton"].hidden_states[-1][~real]) == 0  # nothing computed at padding


@pytest.mark.skipif(not TRITON_RUNS, reason="needs Triton")
def test_left_padded_generation_packs_and_equals_torch(monkeypatch):
    calls = _record_packed_calls(monkeypatch)
    config = DELTANET_VARIANTS["fla"]()
    model = _randomised(DeltaNetForCausalLM(config).eval())
    mask = _mask("left")
    input_ids = torch.randint(0, 256, mask.shape).masked_fill(mask == 0, config.pad_token_id)
    generated = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("MEMLM_KERNELS", backend)
        generated[backend] = model.generate(input_ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                                            pad_token_id=config.pad_token_id)  # fmt: skip
    assert torch.equal(generated["triton"], generated["torch"])
    assert sum(offsets is not None for offsets in calls) == config.num_hidden_layers  # the prefill, packed


@pytest.mark.parametrize("kernel_size", [2, 4])
def test_packed_short_convolution_equals_each_sequence_alone(kernel_size):
    torch.manual_seed(0)
    convolution = DeltaNetShortConvolution(6, kernel_size)
    torch.nn.init.normal_(convolution.weight)
    lengths = [5, 0, 1, 7]
    sequences = [torch.randn(1, length, 6) for length in lengths]
    tails = torch.randn(len(lengths), kernel_size - 1, 6)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    outputs, new_tails = convolution(torch.cat(sequences, 1), tails, cu_seqlens=cu_seqlens)
    assert outputs.shape == (1, sum(lengths), 6) and new_tails.shape == tails.shape
    fresh_outputs, _ = convolution(torch.cat(sequences, 1), None, cu_seqlens=cu_seqlens)
    for index, sequence in enumerate(sequences):
        if not lengths[index]:  # an empty sequence keeps its tail
            torch.testing.assert_close(new_tails[index], tails[index])
            continue
        expected, expected_tail = convolution(sequence, tails[index : index + 1])
        start, end = cu_seqlens[index], cu_seqlens[index + 1]
        torch.testing.assert_close(outputs[:, start:end], expected)
        torch.testing.assert_close(new_tails[index], expected_tail[0])  # shorter than the kernel: part of the old tail
        torch.testing.assert_close(fresh_outputs[:, start:end], convolution(sequence, None)[0])


def test_right_padded_rows_keep_the_tail_of_their_last_real_inputs():
    torch.manual_seed(0)
    convolution = DeltaNetShortConvolution(3, 4)
    torch.nn.init.normal_(convolution.weight)
    inputs = torch.randn(2, 6, 3)
    lengths = torch.tensor([6, 2])
    outputs, tails = convolution(inputs, None, lengths=lengths)
    torch.testing.assert_close(tails[0], inputs[0, 3:])
    torch.testing.assert_close(tails[1], torch.cat([torch.zeros(1, 3), inputs[1, :2]]))
    torch.testing.assert_close(outputs, convolution(inputs, None)[0])


def _document_rows(config):
    """Two rows with padding and packed documents: [pad pad A(3) B(4)] and [C(5) pad D(2) pad]; position_ids count
    from 0 in each document, as 🤗's DataCollatorWithFlattening lays them out."""
    generator = torch.Generator().manual_seed(5)
    documents = {name: torch.randint(0, 256, (length,), generator=generator)
                 for name, length in (("A", 3), ("B", 4), ("C", 5), ("D", 2))}  # fmt: skip
    pad = torch.tensor([config.pad_token_id])
    rows = [[pad, pad, documents["A"], documents["B"]], [documents["C"], pad, documents["D"], pad]]
    input_ids = torch.stack([torch.cat(row) for row in rows])
    mask = (input_ids != config.pad_token_id).long()
    position_ids = torch.stack([torch.cat([torch.arange(len(piece)) for piece in row]) for row in rows])
    spans = {"A": (0, 2, 5), "B": (0, 5, 9), "C": (1, 0, 5), "D": (1, 6, 8)}  # row, start, end
    return input_ids, mask, position_ids, documents, spans


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", ["fla", "paper", "sum_rule_normalised"])
def test_packed_documents_each_start_from_an_empty_memory(variant, backend, monkeypatch):
    monkeypatch.setenv("MEMLM_KERNELS", backend)
    config = DELTANET_VARIANTS[variant]()
    model = _randomised(DeltaNetForCausalLM(config).eval())
    input_ids, mask, position_ids, documents, spans = _document_rows(config)
    with torch.no_grad():
        packed = model(input_ids, attention_mask=mask, position_ids=position_ids, use_cache=True)
        alone = {name: model(ids[None], use_cache=True) for name, ids in documents.items()}
    for name, (row, start, end) in spans.items():
        torch.testing.assert_close(packed.logits[row, start:end], alone[name].logits[0], atol=1e-4, rtol=0)
    for row, last in enumerate(("B", "D")):  # a row's memory afterwards is its last document's
        for layer, alone_layer in zip(packed.cache.layers, alone[last].cache.layers):
            torch.testing.assert_close(layer.fast_weights[row], alone_layer.fast_weights[0], atol=1e-5, rtol=0)
            if config.short_convolution:
                torch.testing.assert_close(layer.convolution_tail[row], alone_layer.convolution_tail[0])
    # Without restarts position_ids change nothing.
    with torch.no_grad():
        counted = model(input_ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp_min(0)).logits
        torch.testing.assert_close(counted, model(input_ids, attention_mask=mask).logits)


def test_documents_are_marked_explicitly_never_by_a_repeated_position():
    """seq_idx and cu_seq_lens (DataCollatorWithFlattening's return_seq_idx / return_flash_attn_kwargs) mark the same
    documents as position_ids restarting at 0. Positions that repeat or fall to a non-zero value, as 🤗 generate
    gives the tokens after a right-padded prompt, start no document: the logits equal those without position_ids."""
    config = DELTANET_VARIANTS["fla"]()
    model = _randomised(DeltaNetForCausalLM(config).eval())
    input_ids, mask, position_ids, documents, _ = _document_rows(config)
    seq_idx = (position_ids == 0).long().cumsum(1)
    single = torch.cat([documents["A"], documents["B"], documents["C"]])[None]
    offsets = torch.tensor([0, 3, 7, 12], dtype=torch.int32)
    single_positions = torch.cat([torch.arange(3), torch.arange(4), torch.arange(5)])[None]
    generated = torch.tensor([[0, 1, 2, 0, 0, 1, 2, 3, 4], [0, 1, 2, 3, 3, 4, 5, 1, 2]])  # no restart at 0
    with torch.no_grad():
        by_positions = model(input_ids, attention_mask=mask, position_ids=position_ids).logits
        torch.testing.assert_close(model(input_ids, attention_mask=mask, seq_idx=seq_idx).logits, by_positions)
        single_by_positions = model(single, position_ids=single_positions).logits
        for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
            torch.testing.assert_close(model(single, **{key: offsets}).logits, single_by_positions)
        torch.testing.assert_close(single_by_positions[:, 3:7], model(documents["B"][None]).logits)
        right_padded = torch.ones_like(generated)
        right_padded[0, 3:5] = 0  # row 0 as generate leaves a right-padded prompt: padding at positions 0, then 1
        unmarked = model(input_ids, attention_mask=right_padded).logits
        torch.testing.assert_close(
            model(input_ids, attention_mask=right_padded, position_ids=generated).logits, unmarked
        )
        with pytest.raises(ValueError, match=r"cu_seq_lens_q / cu_seq_lens_k must be .* for a batch of 2"):
            model(input_ids, cu_seq_lens_q=offsets)


def test_packed_documents_cannot_continue_a_cache():
    config = DELTANET_VARIANTS["fla"]()
    model = DeltaNetForCausalLM(config).eval()
    input_ids, mask, position_ids, _, _ = _document_rows(config)
    with torch.no_grad():
        cache = model(input_ids[:, :2], use_cache=True).cache
        with pytest.raises(ValueError, match="cannot continue a cache that has seen 2 tokens"):
            model(input_ids, attention_mask=torch.cat([torch.ones(2, 2), mask], 1).long(), position_ids=position_ids,
                  cache=cache)  # fmt: skip
        with pytest.raises(ValueError, match=r"position_ids must have shape \(batch=2, length=9\)"):
            model(input_ids, attention_mask=mask, position_ids=position_ids[:, :5])


@pytest.mark.parametrize("layout", ["left", "between"])
def test_padded_hidden_states_lie_on_the_path_to_the_loss(layout):
    """With padding the layers run on reordered rows; the hidden states returned are still the tensors the next
    layer runs on, so retain_grad() gives each the gradient at its real tokens (and none at padding)."""
    config = DELTANET_VARIANTS["fla"]()
    model = _randomised(DeltaNetForCausalLM(config).eval())
    mask = _mask(layout)
    input_ids = torch.randint(0, 256, mask.shape).masked_fill(mask == 0, config.pad_token_id)
    output = model(input_ids, attention_mask=mask, output_hidden_states=True)
    for hidden_states in output.hidden_states:
        hidden_states.retain_grad()
    output.logits[mask.bool()].pow(2).mean().backward()
    for hidden_states in output.hidden_states:
        assert hidden_states.grad is not None
        assert (hidden_states.grad.abs().sum(-1) > 0)[mask.bool()].all()
        assert (hidden_states.grad[~mask.bool()] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_offsets_are_read_back_once_per_forward_not_per_layer(backend, monkeypatch):
    """The packed offsets go to every layer with their host copy, so no layer reads them back from the device (a
    GPU→CPU sync each): a forward over padded rows reads as many values back with 4 layers as with 1."""
    from tests.kernels.test_delta_rule import DeviceReads

    monkeypatch.setenv("MEMLM_KERNELS", backend)
    input_ids = torch.randint(0, 256, (3, WIDTH))
    mask = _mask("right")
    position_ids = torch.arange(WIDTH).repeat(3, 1)
    position_ids[:, 6:] -= 6  # a second document in each row (position_ids restarting at 0)
    reads = []
    for layers in (1, 4):
        model = DeltaNetForCausalLM(DELTANET_VARIANTS["favor_conv_gate"](num_hidden_layers=layers)).eval()
        with torch.no_grad(), DeviceReads() as counted:
            model(input_ids, attention_mask=mask, position_ids=position_ids)
        reads.append(counted.count)
    assert reads[0] == reads[1], reads


def test_a_packed_sequence_without_tokens_keeps_its_key_sum():
    """The attention normaliser z of a row that is all padding in a packed call (a sequence of length 0) stays its
    z_0, not the sum of the sequence packed before it."""
    from memlm.modeling.modeling_deltanet import running_key_sums

    keys = torch.rand(1, 2, 3, 4)  # three tokens, all of the first sequence
    initial = torch.rand(2, 2, 4)
    _, last = running_key_sums(keys, initial, torch.tensor([0, 3, 3]))
    torch.testing.assert_close(last[0], initial[0] + keys[0].sum(1))
    torch.testing.assert_close(last[1], initial[1])
    _, last = running_key_sums(keys, None, torch.tensor([0, 3, 3]))
    assert torch.equal(last[1], torch.zeros(2, 4))
