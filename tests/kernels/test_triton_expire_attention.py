"""The Triton Expire-Span attention kernel (forward and backward) against the reference of paper Eqs. 4-5.

Without CUDA the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1) on small shapes
with 16 x 16 tiles, so that every shape below crosses tiles and has tails. The CUDA tests use realistic shapes.
"""

import itertools
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from memlm.kernels.expire_attention import (  # noqa: E402
    expire_span_attention_reference,
    expire_span_mask,
    visible_keys,
)
from memlm.kernels.expire_attention.triton_attention import (  # noqa: E402
    _FAR,
    _dot_precision,
    _grid,
    _kernel_positions,
    _launch_configs,
    _options,
    _visible_key_tiles,
    _visible_query_tiles,
    expire_span_attention_triton,
)

RAMP = 4.0
NAMES = ("query", "key", "value", "spans")


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative RMS error ‖a − b‖ / ‖b‖ in float64."""
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).norm() / expected.norm()).item()


def make_inputs(
    *,
    length=16,
    memory=0,
    key_dim=16,
    value_dim=16,
    spans=True,
    integer_spans=False,
    holes=True,
    shuffle=True,
    max_span=24.0,
    batch_size=2,
    num_heads=2,
    dtype=torch.float32,
    device="cpu",
    seed=0,
):
    """One block of ``length`` queries attending to ``memory`` earlier memories and to itself.

    Row 0's memories are the positions just before its block; row 1's block starts at 4 × memory + 50 and its
    memories are a random sample of the earlier positions, so some have long expired. Keys are shuffled so that
    causality must come from the positions; integer spans put pairs exactly on the ends of the ramp. Returns the differentiable tensors (a dict), the other keyword
    arguments and a random output gradient, all float32 on the CPU before moving to ``dtype`` and ``device``.
    """
    generator = torch.Generator().manual_seed(seed)
    num_keys = memory + length
    key_positions, query_positions = [], []
    for row in range(batch_size):
        start = memory if row % 2 == 0 else 4 * memory + 50
        if row % 2 == 0:
            memories = torch.arange(start - memory, start)
        else:
            memories = torch.randperm(start, generator=generator)[:memory].sort().values
        block = torch.arange(start, start + length)
        key_positions.append(torch.cat([memories, block]))
        query_positions.append(block)
    key_positions, query_positions = torch.stack(key_positions), torch.stack(query_positions)
    if shuffle:
        key_positions = key_positions[:, torch.randperm(num_keys, generator=generator)]
    tensors = {
        "query": torch.randn(batch_size, num_heads, length, key_dim, generator=generator),
        "key": torch.randn(batch_size, num_heads, num_keys, key_dim, generator=generator),
        "value": torch.randn(batch_size, num_heads, num_keys, value_dim, generator=generator),
        "spans": torch.rand(batch_size, num_keys, generator=generator) * max_span if spans else None,
    }
    if integer_spans:
        tensors["spans"] = tensors["spans"].floor()
    key_valid = torch.rand(batch_size, num_keys, generator=generator) > 0.2 if holes else None
    grad_output = torch.randn(batch_size, num_heads, length, value_dim, generator=generator).to(device)
    tensors = {name: None if t is None else t.to(device, dtype).requires_grad_() for name, t in tensors.items()}
    options = {
        "query_positions": query_positions.to(device),
        "key_positions": key_positions.to(device),
        "key_valid": None if key_valid is None else key_valid.to(device),
        "ramp": RAMP,
    }
    return tensors, options, grad_output


def run(function, tensors, options, grad_output, **kwargs):
    """The output and a dict of the gradients of the inputs that require grad."""
    output = function(**tensors, **options, **kwargs)
    differentiable = {name: t for name, t in tensors.items() if t is not None and t.requires_grad}
    grads = torch.autograd.grad((output.float() * grad_output).sum(), list(differentiable.values()))
    return output, dict(zip(differentiable, grads))


def float32_copies(tensors):
    return {
        name: None if t is None else t.detach().float().requires_grad_(t.requires_grad) for name, t in tensors.items()
    }


def mask_parts(tensors, options, max_distance=None):
    """How many visible (query, key) pairs are expired (m = 0), on the ramp (0 < m < 1) and fully alive (m = 1)."""
    positions = options["query_positions"], options["key_positions"]
    visible = visible_keys(*positions, options["key_valid"], max_distance)
    mask = expire_span_mask(tensors["spans"], *positions, options["ramp"])
    return [int((visible & part).sum()) for part in (mask == 0, (mask > 0) & (mask < 1), mask == 1)]


CASES = {
    # name: (make_inputs arguments, attention arguments)
    "block_only": ({"length": 16, "memory": 0, "key_dim": 16, "value_dim": 16}, {}),
    "memories_and_tails": ({"length": 29, "memory": 16, "key_dim": 32, "value_dim": 16}, {}),
    "spans_none": ({"length": 16, "memory": 29, "value_dim": 32, "spans": False}, {}),
    "max_distance": ({"length": 29, "memory": 16}, {"max_distance": 9.5}),
    "in_order_without_holes": ({"length": 16, "memory": 29, "holes": False, "shuffle": False}, {"max_distance": 12}),
    "decoding": ({"length": 1, "memory": 29, "key_dim": 32, "value_dim": 32}, {"scale": 0.3}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference_float32(case):
    inputs, kwargs = CASES[case]
    tensors, options, grad_output = make_inputs(**inputs)
    if tensors["spans"] is not None:  # the inputs exercise every part of the mask (Eq. 5)
        assert min(mask_parts(tensors, options, kwargs.get("max_distance"))) > 0
    output, grads = run(expire_span_attention_triton, tensors, options, grad_output, **kwargs)
    expected, expected_grads = run(expire_span_attention_reference, tensors, options, grad_output, **kwargs)
    assert output.dtype == torch.float32 and output.shape == expected.shape
    assert relative_error(output, expected) < 1e-5
    assert set(grads) == set(expected_grads)
    for name in grads:
        assert grads[name].dtype == tensors[name].dtype and grads[name].shape == tensors[name].shape
        assert relative_error(grads[name], expected_grads[name]) < 1e-5, name
    if tensors["spans"] is not None:
        assert expected_grads["spans"].abs().max() > 1e-3  # the spans do learn, through the ramp


def test_strided_inputs_and_spans_without_grad():
    """Query, key and value in the (batch, tokens, heads, width) layout a model produces, transposed; spans fixed."""
    tensors, options, grad_output = make_inputs(length=29, memory=16, key_dim=16, value_dim=32, seed=1)
    strided = {name: tensors[name].detach().transpose(1, 2).contiguous().transpose(1, 2) for name in NAMES[:3]}
    strided = {name: t.requires_grad_() for name, t in strided.items()}
    strided["spans"] = tensors["spans"].detach()
    assert not strided["query"].is_contiguous()
    output, grads = run(expire_span_attention_triton, strided, options, grad_output)
    expected, expected_grads = run(expire_span_attention_reference, strided, options, grad_output)
    assert set(grads) == {"query", "key", "value"}
    assert relative_error(output, expected) < 1e-5
    for name in grads:
        assert relative_error(grads[name], expected_grads[name]) < 1e-5, name
    # The gradient of a sum reaches the backward as an expanded tensor with zero strides.
    (grad_query,) = torch.autograd.grad(expire_span_attention_triton(**strided, **options).sum(), strided["query"])
    expected = expire_span_attention_reference(**strided, **options)
    (expected_grad_query,) = torch.autograd.grad(expected.sum(), strided["query"])
    assert relative_error(grad_query, expected_grad_query) < 1e-5


def test_float16_close_to_float32_reference():
    # bfloat16 runs only on CUDA: Triton 3.9's interpreter multiplies the raw bits of bfloat16 operands in tl.dot.
    tensors, options, grad_output = make_inputs(length=29, memory=16, dtype=torch.float16)
    output, grads = run(expire_span_attention_triton, tensors, options, grad_output)
    expected, expected_grads = run(expire_span_attention_reference, float32_copies(tensors), options, grad_output)
    assert output.dtype == torch.float16
    assert relative_error(output, expected) < 2e-3
    for name in NAMES:
        assert grads[name].dtype == torch.float16
        assert relative_error(grads[name], expected_grads[name]) < 3e-3, name


def test_exact_ends_of_the_ramp():
    """Integer spans and a ramp of 3 (whose inverse is inexact): pairs with r = −R have m = 0 exactly, as in the
    reference, and pairs with r = 0 have m = 1 and no span gradient."""
    tensors, options, grad_output = make_inputs(length=29, memory=16, integer_spans=True, seed=2)
    options["ramp"] = 3.0
    distance = options["query_positions"][:, :, None] - options["key_positions"][:, None, :]
    remaining = tensors["spans"].detach()[:, None, :] - distance
    visible = visible_keys(options["query_positions"], options["key_positions"], options["key_valid"])
    assert (visible & (remaining == -3)).sum() > 10 and (visible & (remaining == 0)).sum() > 10
    output, grads = run(expire_span_attention_triton, tensors, options, grad_output)
    expected, expected_grads = run(expire_span_attention_reference, tensors, options, grad_output)
    assert relative_error(output, expected) < 1e-5
    for name in NAMES:
        assert relative_error(grads[name], expected_grads[name]) < 1e-5, name

    # A query whose only visible key sits exactly at r = −R (t − i = 7, e = 4) sees nothing: zeros.
    query, key, value = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 2, 16), torch.randn(1, 1, 2, 16)
    inputs = (query, key, value, torch.tensor([[4.0, 4.0]]), torch.tensor([[10]]), torch.tensor([[3, 11]]))
    assert torch.equal(expire_span_attention_triton(*inputs, ramp=3.0), torch.zeros(1, 1, 1, 16))
    assert torch.equal(expire_span_attention_reference(*inputs, ramp=3.0), torch.zeros(1, 1, 1, 16))
    # One token less far, the key is on the ramp (m = 1/3) and alone: the output is its value.
    inputs = (query, key, value, torch.tensor([[4.0, 4.0]]), torch.tensor([[9]]), torch.tensor([[3, 11]]))
    torch.testing.assert_close(expire_span_attention_triton(*inputs, ramp=3.0), value[:, :, :1])


@pytest.mark.parametrize("spans", [True, False])
def test_queries_that_see_no_key_output_zeros_with_zero_gradients(spans):
    # Row 0: keys at 10..54, so the queries at 0..9 come before every key. Row 1: every key slot is empty.
    # Row 2: the keys at 0..44 have spans below 3, so with spans every key has expired for the queries at 60..88.
    # Row 0's spans below 12 put some of its keys on the ramp, so the span gradient is not zero.
    length, num_keys = 29, 45
    query_positions = torch.stack([torch.arange(length), torch.arange(100, 100 + length), torch.arange(60, 89)])
    key_positions = torch.stack([torch.arange(10, 55), torch.arange(50, 95), torch.arange(num_keys)])
    key_valid = torch.ones(3, num_keys, dtype=torch.bool)
    key_valid[1] = False
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "query": torch.randn(3, 2, length, 16, generator=generator),
        "key": torch.randn(3, 2, num_keys, 16, generator=generator),
        "value": torch.randn(3, 2, num_keys, 32, generator=generator),
        "spans": torch.rand(3, num_keys, generator=generator) * torch.tensor([[12.0], [20.0], [3.0]]),
    }
    tensors = {name: t.requires_grad_() for name, t in tensors.items()}
    if not spans:
        tensors["spans"] = None
    options = {"query_positions": query_positions, "key_positions": key_positions, "key_valid": key_valid}
    grad_output = torch.randn(3, 2, length, 32, generator=generator)
    output, grads = run(expire_span_attention_triton, tensors, options | {"ramp": RAMP}, grad_output)
    expected, expected_grads = run(expire_span_attention_reference, tensors, options | {"ramp": RAMP}, grad_output)

    mask = expire_span_mask(tensors["spans"], query_positions, key_positions, RAMP)
    sees_a_key = (visible_keys(query_positions, key_positions, key_valid) & (mask > 0)).any(dim=-1)  # (B, T)
    expected_empty = torch.zeros(3, length, dtype=torch.bool)
    expected_empty[0, :10] = True
    expected_empty[1] = True
    expected_empty[2] = spans
    assert torch.equal(~sees_a_key, expected_empty)
    assert torch.equal(output.permute(0, 2, 1, 3)[expected_empty], torch.zeros(int(expected_empty.sum()), 2, 32))
    assert (output.permute(0, 2, 1, 3)[~expected_empty] != 0).all()
    assert relative_error(output, expected) < 1e-5
    for name, grad in grads.items():
        assert torch.isfinite(grad).all(), name
        assert relative_error(grad, expected_grads[name]) < 1e-5, name
    assert torch.equal(
        grads["query"].permute(0, 2, 1, 3)[expected_empty], torch.zeros(int(expected_empty.sum()), 2, 16)
    )
    assert (grads["key"][1] == 0).all() and (grads["value"][1] == 0).all()
    if spans:
        assert (grads["key"][2] == 0).all() and (grads["value"][2] == 0).all() and (grads["spans"][1:] == 0).all()
        assert (grads["spans"][0] != 0).sum() > 5


@pytest.mark.parametrize("max_distance", [None, 50])
def test_invisible_key_tiles_are_skipped(max_distance):
    """Key tiles before the first tile a query can see are never read: their keys and values are NaN and nothing
    turns NaN (the loops run from the first to the last visible tile).

    Keys in tiles of 16 for queries at 200..215: expired (positions 0..15, spans below 5 + R = 9: m = 0), empty
    slots (16..31, huge spans), in the future (300..315), too far for max_distance = 50 (100..115, huge spans),
    then live memories 170..190 with spans that put them on the ramp or alive, and the block itself. Had a
    kernel read a poisoned tile, 0 × NaN in the weights-times-values product would make its output NaN.
    """
    length, num_heads = 16, 2
    query_positions = torch.arange(200, 200 + length).expand(2, -1)
    tiles = [torch.arange(0, 16), torch.arange(16, 32), torch.arange(300, 316), torch.arange(100, 116)]
    live = [torch.arange(170, 191), torch.arange(200, 200 + length)]
    key_positions = torch.cat(tiles + live).expand(2, -1)
    num_keys = key_positions.shape[1]
    generator = torch.Generator().manual_seed(0)
    spans = torch.full((2, num_keys), 1000.0)
    spans[:, :16] = torch.rand(2, 16, generator=generator) * 5
    spans[:, 64:85] = torch.rand(2, 21, generator=generator) * 40
    key_valid = torch.ones(2, num_keys, dtype=torch.bool)
    key_valid[:, 16:32] = False
    key_valid[1, 70] = False
    poisoned = slice(0, 64) if max_distance is not None else slice(0, 48)
    clean = {
        "query": torch.randn(2, num_heads, length, 16, generator=generator),
        "key": torch.randn(2, num_heads, num_keys, 16, generator=generator),
        "value": torch.randn(2, num_heads, num_keys, 16, generator=generator),
        "spans": spans,
    }
    clean = {name: t.requires_grad_() for name, t in clean.items()}
    tensors = {name: t.detach().clone() for name, t in clean.items()}
    tensors["key"][:, :, poisoned] = float("nan")
    tensors["value"][:, :, poisoned] = float("nan")
    tensors = {name: t.requires_grad_() for name, t in tensors.items()}
    options = {"query_positions": query_positions, "key_positions": key_positions, "key_valid": key_valid}
    options |= {"ramp": RAMP, "max_distance": max_distance}
    grad_output = torch.randn(2, num_heads, length, 16, generator=generator)
    assert min(mask_parts(clean, options, max_distance)) > 0

    output, grads = run(expire_span_attention_triton, tensors, options, grad_output)
    expected, expected_grads = run(expire_span_attention_reference, clean, options, grad_output)
    assert torch.isfinite(output).all()
    assert relative_error(output, expected) < 1e-5
    for name in NAMES:
        assert torch.isfinite(grads[name]).all(), name
        assert relative_error(grads[name], expected_grads[name]) < 1e-5, name
    for name in ("key", "value"):
        assert (grads[name][:, :, poisoned] == 0).all()
    assert expected_grads["spans"][:, 64:85].abs().max() > 1e-3


# The official code's options (SPEC §8) in the kernels: name -> (make_inputs arguments, options). "table": rows of
# learned relative positions (fewer than the distances, so that some pairs have none), "pairs": per-pair scores,
# "duplicates": some keys share a position (two keys of one query then add to one relative position's gradient).
OFFICIAL_CASES = {
    "relative_positions": ({"length": 29, "memory": 16}, {"table": 20}),
    "relative_beyond_the_table": ({"length": 29, "memory": 29, "key_dim": 32}, {"table": 7, "max_distance": 30}),
    "position_scores": ({"length": 29, "memory": 16, "value_dim": 32}, {"pairs": True}),
    "not_self": ({"length": 29, "memory": 16}, {"attend_to_self": False}),
    "epsilon": ({"length": 29, "memory": 16}, {"renormalization_epsilon": 1e-2}),
    "official_layout": (
        {"length": 29, "memory": 16},
        {"table": 40, "attend_to_self": False, "renormalization_epsilon": 1e-3, "max_distance": 35},
    ),
    "official_without_spans": (
        {"length": 16, "memory": 29, "spans": False},
        {"table": 40, "attend_to_self": False, "renormalization_epsilon": 1e-3},
    ),
    "official_decoding": (
        {"length": 1, "memory": 29, "key_dim": 32},
        {"table": 40, "attend_to_self": False, "renormalization_epsilon": 1e-3},
    ),
    "duplicate_positions": ({"length": 29, "memory": 16, "holes": False}, {"table": 40, "duplicates": True}),
}


def official_inputs(case, dtype=torch.float32):
    """make_inputs with the case's position terms added to the differentiable tensors, and the other options."""
    arguments, kwargs = OFFICIAL_CASES[case]
    kwargs = dict(kwargs)
    tensors, options, grad_output = make_inputs(**arguments, dtype=dtype)
    generator = torch.Generator().manual_seed(7)
    batch_size, num_heads, length, key_dim = tensors["query"].shape
    if rows := kwargs.pop("table", None):
        table = torch.randn(rows, key_dim, generator=generator)
        tensors["relative_positions"] = table.to(dtype).requires_grad_()
    if kwargs.pop("pairs", False):
        scores = torch.randn(batch_size, num_heads, length, tensors["key"].shape[2], generator=generator)
        tensors["position_scores"] = scores.to(dtype).requires_grad_()
    if kwargs.pop("duplicates", False):
        options["key_positions"] = options["key_positions"].clone()
        options["key_positions"][:, :6] = options["key_positions"][:, 6:12]
    return tensors, options, grad_output, kwargs


@pytest.mark.parametrize("case", list(OFFICIAL_CASES))
def test_official_options_match_reference_float32(case):
    tensors, options, grad_output, kwargs = official_inputs(case)
    output, grads = run(expire_span_attention_triton, tensors, options, grad_output, **kwargs)
    expected, expected_grads = run(expire_span_attention_reference, tensors, options, grad_output, **kwargs)
    assert relative_error(output, expected) < 1e-5
    assert set(grads) == set(expected_grads) and len(grads) == len([t for t in tensors.values() if t is not None])
    for name in grads:
        assert grads[name].dtype == tensors[name].dtype and grads[name].shape == tensors[name].shape
        assert relative_error(grads[name], expected_grads[name]) < 1e-5, name
    # The options change the result: a kernel that ignored them would fail above.
    plain = {name: tensors[name] for name in NAMES}
    without = expire_span_attention_reference(**plain, **options, max_distance=kwargs.get("max_distance"))
    assert relative_error(without, expected) > 1e-4


def test_official_options_float16_close_to_float32_reference():
    tensors, options, grad_output, kwargs = official_inputs("official_layout", dtype=torch.float16)
    output, grads = run(expire_span_attention_triton, tensors, options, grad_output, **kwargs)
    expected, expected_grads = run(
        expire_span_attention_reference, float32_copies(tensors), options, grad_output, **kwargs
    )
    assert output.dtype == torch.float16
    assert relative_error(output, expected) < 2e-3
    for name in grads:
        assert grads[name].dtype == torch.float16
        assert relative_error(grads[name], expected_grads[name]) < 3e-3, name


def test_official_options_dispatch_to_the_kernel(monkeypatch):
    """backend="triton" runs the official options in the kernel, not official.py; both kinds of position term at
    once (which the kernel refuses) run official.py."""
    import memlm.kernels.expire_attention as dispatch

    tensors, options, grad_output, kwargs = official_inputs("official_layout")
    expected = expire_span_attention_triton(**tensors, **options, **kwargs)

    def refuse(*arguments, **keywords):
        raise AssertionError("official.py ran")

    with monkeypatch.context() as patch:
        patch.setattr(dispatch, "expire_span_attention_official", refuse)
        assert torch.equal(dispatch.expire_span_attention(**tensors, **options, **kwargs, backend="triton"), expected)
    both = dict(tensors, position_scores=torch.randn(*tensors["query"].shape[:3], tensors["key"].shape[2]))
    with pytest.raises(ValueError, match=r"position_scores or relative_positions, not both"):
        expire_span_attention_triton(**both, **options, **kwargs)
    output = dispatch.expire_span_attention(**both, **options, **kwargs, backend="triton")
    reference = expire_span_attention_reference(**both, **options, **kwargs)
    assert relative_error(output, reference) < 1e-5


def test_rejects_what_the_kernel_does_not_support():
    tensors, options, _ = make_inputs(length=3, memory=2)
    with pytest.raises(ValueError, match=r"dropout=0.1.*torch backend"):
        expire_span_attention_triton(**tensors, **options, dropout=0.1)
    as_double = {name: t.detach().double() for name, t in tensors.items()}
    with pytest.raises(ValueError, match=r"float32, bfloat16 or float16.*got torch.float64"):
        expire_span_attention_triton(**as_double, **options)
    wide = dict(tensors, value=torch.zeros(2, 2, 5, 129))
    with pytest.raises(ValueError, match=r"widths up to 128, got 16 and 129"):
        expire_span_attention_triton(**wide, **options)
    elsewhere = dict(tensors, spans=torch.zeros(2, 5, device="meta"))
    with pytest.raises(ValueError, match=r"spans is on meta but query is on cpu"):
        expire_span_attention_triton(**elsewhere, **options)


@triton.jit
def _tile_ranges_kernel(
    QueryPositions,
    KeyPositions,
    Spans,
    KeyRanges,
    QueryRanges,
    num_queries,
    num_keys,
    max_distance,
    min_distance,
    ramp,
    HAS_SPANS: tl.constexpr,
    HAS_MAX_DISTANCE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Per row: the key-tile range of every query tile and the query-tile range of every key tile."""
    row = tl.program_id(0)
    QueryPositions += row * num_queries
    KeyPositions += row * num_keys
    if HAS_SPANS:
        Spans += row * num_keys
    num_query_tiles = tl.cdiv(num_queries, BLOCK_M)
    num_key_tiles = tl.cdiv(num_keys, BLOCK_N)
    for tile in range(0, num_query_tiles):
        queries = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        query_in_range = queries < num_queries
        query_positions = tl.load(QueryPositions + queries, mask=query_in_range, other=0)
        first, end = _visible_key_tiles(
            KeyPositions,
            Spans,
            query_positions,
            query_in_range,
            num_keys,
            max_distance,
            min_distance,
            ramp,
            HAS_SPANS,
            HAS_MAX_DISTANCE,
            BLOCK_N,
        )
        tl.store(KeyRanges + (row * num_query_tiles + tile) * 2, first)
        tl.store(KeyRanges + (row * num_query_tiles + tile) * 2 + 1, end)
    for tile in range(0, num_key_tiles):
        keys = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        key_in_range = keys < num_keys
        key_positions = tl.load(KeyPositions + keys, mask=key_in_range, other=_FAR)
        spans = tl.zeros([BLOCK_N], tl.float32)
        if HAS_SPANS:
            spans = tl.load(Spans + keys, mask=key_in_range, other=0.0)
        first, end = _visible_query_tiles(
            QueryPositions,
            key_positions,
            spans,
            num_queries,
            max_distance,
            min_distance,
            ramp,
            HAS_SPANS,
            HAS_MAX_DISTANCE,
            BLOCK_M,
        )
        tl.store(QueryRanges + (row * num_key_tiles + tile) * 2, first)
        tl.store(QueryRanges + (row * num_key_tiles + tile) * 2 + 1, end)


def tile_visibility(query_positions, key_positions, spans, ramp, max_distance, block_m, block_n, min_distance=0):
    """Per (row, query tile, key tile), written out in torch from the kernel positions: whether some pair is
    visible with m > 0 in the kernel's float32 arithmetic, and the per-tile bound a tile-skipping kernel used
    (the earliest query against the latest valid key, the longest remaining life at the earliest query).
    `min_distance` 1: no attention to the token itself (t − i ≥ 1)."""
    batch_size, num_queries = query_positions.shape
    num_keys = key_positions.shape[1]
    query_tiles, key_tiles = triton.cdiv(num_queries, block_m), triton.cdiv(num_keys, block_n)
    pairs = torch.zeros(batch_size, query_tiles, key_tiles, dtype=torch.bool)
    bound = torch.zeros(batch_size, query_tiles, key_tiles, dtype=torch.bool)
    far = _FAR.value
    for row in range(batch_size):
        for query_tile in range(query_tiles):
            queries = query_positions[row, query_tile * block_m : (query_tile + 1) * block_m]
            for key_tile in range(key_tiles):
                keys = key_positions[row, key_tile * block_n : (key_tile + 1) * block_n]
                distance = queries[:, None] - keys[None, :]
                visible = distance >= min_distance
                if max_distance is not None:
                    visible &= distance <= max_distance
                valid = keys < far
                tile_visible = bool(keys.min() + min_distance <= queries.max())
                if max_distance is not None:
                    tile_visible &= bool(queries.min() - keys[valid].max() <= max_distance) if valid.any() else False
                if spans is not None:
                    tile_spans = spans[row, key_tile * block_n : (key_tile + 1) * block_n]
                    remaining = tile_spans[None, :] - distance.float()  # float32, as the kernel computes r_ti
                    visible &= remaining > -ramp
                    earliest = tile_spans - (queries.min() - keys).float()
                    tile_visible &= bool(earliest[valid].max() > -ramp) if valid.any() else False
                pairs[row, query_tile, key_tile] = visible.any()
                bound[row, query_tile, key_tile] = tile_visible
    return pairs, bound


def first_and_end(visible: torch.Tensor) -> torch.Tensor:
    """[first, end) of the True entries along the last axis; [n, 0) when there is none."""
    count = visible.shape[-1]
    index = torch.arange(count)
    first = torch.where(visible, index, count).amin(dim=-1)
    end = torch.where(visible, index + 1, 0).amax(dim=-1)
    return torch.stack([first, end], dim=-1)


@pytest.mark.parametrize("seed", range(4))
def test_loop_bounds_cover_every_visible_tile(seed):
    """The main loops run over [first, end) of the tiles a tile-skipping kernel kept, on random positions, holes
    and spans: the range is exactly that of the per-tile bound, and no pair visible with m > 0 lies outside it."""
    generator = torch.Generator().manual_seed(seed)
    batch_size, num_queries, num_keys, ramp = 3, 37, 75, 4.0
    block_m, block_n = [(16, 16), (16, 32), (32, 16), (8, 16)][seed]
    max_distance = [None, 20, None, 35][seed]
    # Row 0: in-order keys at 0..149 for queries at 60..96, so early tiles expire and late ones are in the future;
    # row 1: shuffled keys with holes; row 2: queries at 0..36 before every key at 50.. (empty ranges).
    query_positions = torch.tensor([[60], [int(torch.randint(0, 60, (), generator=generator))], [0]])
    query_positions = query_positions + torch.arange(num_queries)
    if seed % 2:  # queries need not be in order
        query_positions = query_positions[:, torch.randperm(num_queries, generator=generator)]
    key_positions = torch.randint(0, 150, (batch_size, num_keys), generator=generator)
    key_positions[0] = key_positions[0].sort().values
    key_positions[2] += 50
    key_valid = torch.rand(batch_size, num_keys, generator=generator) > 0.3
    key_valid[0] = True
    spans = None if seed == 2 else torch.rand(batch_size, num_keys, generator=generator) ** 3 * 60
    queries, keys = _kernel_positions(query_positions, key_positions, key_valid)
    attend_to_self = seed in (0, 2)
    options = _options(ramp, max_distance, 1.0, spans is not None, attend_to_self)
    query_tiles, key_tiles = triton.cdiv(num_queries, block_m), triton.cdiv(num_keys, block_n)
    key_ranges = torch.full((batch_size, query_tiles, 2), -1, dtype=torch.int32)
    query_ranges = torch.full((batch_size, key_tiles, 2), -1, dtype=torch.int32)
    _tile_ranges_kernel[(batch_size,)](
        queries,
        keys,
        spans,
        key_ranges,
        query_ranges,
        num_queries,
        num_keys,
        options["max_distance"],
        options["min_distance"],
        options["ramp"],
        HAS_SPANS=options["HAS_SPANS"],
        HAS_MAX_DISTANCE=options["HAS_MAX_DISTANCE"],
        BLOCK_M=block_m,
        BLOCK_N=block_n,
    )
    pairs, bound = tile_visibility(queries, keys, spans, ramp, max_distance, block_m, block_n, options["min_distance"])
    assert torch.equal(key_ranges.long(), first_and_end(bound))
    assert torch.equal(query_ranges.long(), first_and_end(bound.transpose(1, 2)))
    inside = torch.arange(key_tiles)[None, None, :]
    in_range = (inside >= key_ranges[..., :1]) & (inside < key_ranges[..., 1:])
    assert not (pairs & ~in_range).any()  # no visible pair is skipped
    assert (bound | ~pairs).all()  # the per-tile bound keeps every tile with a visible pair
    # The inputs exercise every case: empty ranges, ranges that start after the first tile or end before the last.
    assert (key_ranges[..., 0] >= key_ranges[..., 1]).any()
    assert (key_ranges[..., 0] > 0).any() and (key_ranges[..., 1] < key_tiles).any()
    assert pairs.any() and not pairs.all()


def test_grid_launches_any_batch_times_heads():
    """Batch × heads goes on the grid's first axis (2^31 − 1 blocks), not a second one (65 535): B·H = 2 × 40 000."""
    grid = _grid(triton.cdiv(2048, 64), 2 * 40_000)
    assert grid == (32 * 80_000,)
    assert grid[0] <= 2**31 - 1 and all(size <= 65_535 for size in grid[1:])
    with pytest.raises(ValueError, match=r"2147483648 programs, above the 2147483647 CUDA allows; split the batch"):
        _grid(2**16, 2**15)


def test_many_heads_in_one_grid_axis():
    """Each program decodes its (tile, batch × head) from the one grid axis: 3 × 3 (batch, heads), tails."""
    tensors, options, grad_output = make_inputs(length=17, memory=3, batch_size=3, num_heads=3, seed=3)
    output, grads = run(expire_span_attention_triton, tensors, options, grad_output)
    expected, expected_grads = run(expire_span_attention_reference, tensors, options, grad_output)
    assert relative_error(output, expected) < 1e-5
    for name in NAMES:
        assert relative_error(grads[name], expected_grads[name]) < 1e-5, name


ADDRESSES_PAST_TWO_TO_THE_31 = """
import torch
from memlm.kernels.expire_attention import expire_span_attention_reference
from memlm.kernels.expire_attention.triton_attention import expire_span_attention_triton

num_tokens, width, stride = 17, 16, 2**27 + 64
assert (num_tokens - 1) * stride > 2**31
buffer = torch.empty((num_tokens - 1) * stride + 3 * width, dtype=torch.float16)
generator = torch.Generator().manual_seed(0)
compact = torch.randn(3, 1, 1, num_tokens, width, generator=generator).half()
views = [
    buffer.as_strided((1, 1, num_tokens, width), (0, 0, stride, 1), storage_offset=index * width)
    for index in range(3)
]
for view, values in zip(views, compact):
    view.copy_(values)
views = [view.requires_grad_() for view in views]
spans = (torch.rand(1, num_tokens, generator=generator) * 12).requires_grad_()
positions = torch.arange(num_tokens)[None]
grad_output = torch.randn(1, 1, num_tokens, width, generator=generator)
for function, inputs in (
    (expire_span_attention_triton, views),
    (expire_span_attention_reference, [view.detach().float().requires_grad_() for view in views]),
):
    output = function(*inputs, spans, positions, positions, ramp=4.0)
    grads = torch.autograd.grad((output.float() * grad_output).sum(), [*inputs, spans])
    torch.save([output.detach().float(), *[grad.float() for grad in grads]], f"{{directory}}/{function.__name__}.pt")
"""


def test_addresses_past_two_to_the_31(tmp_path):
    """Token × stride products above 2^31 elements: query, key and value are views with a token stride of
    2^27 + 64 elements into one float16 buffer (4 GiB of address space, of which a few pages are touched), so
    the 17th token starts past element 2^31. An int32 product wraps and reads 4 GiB before the buffer (a
    segmentation fault in the interpreter), hence a subprocess."""
    script = ADDRESSES_PAST_TWO_TO_THE_31.replace("{{directory}}", str(tmp_path))
    environment = {**os.environ, "TRITON_INTERPRET": "1"}  # CPU tensors: Triton's interpreter
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=environment)
    assert result.returncode == 0, f"exit code {result.returncode}: {result.stderr[-2000:]}"
    actual = torch.load(tmp_path / "expire_span_attention_triton.pt")
    expected = torch.load(tmp_path / "expire_span_attention_reference.pt")
    assert relative_error(actual[0], expected[0]) < 2e-3
    for name, grad, expected_grad in zip(NAMES, actual[1:], expected[1:]):
        assert relative_error(grad, expected_grad) < 3e-3, name


def test_heads_wider_than_the_kernel_run_the_torch_backend():
    """The config allows any even head width; above 128 (no checked tiles) the dispatcher runs the torch backend
    even when the Triton backend is asked for, and the kernel itself refuses such widths."""
    from memlm.kernels.expire_attention import expire_span_attention, expire_span_attention_sdpa

    tensors, options, _ = make_inputs(length=9, memory=4, key_dim=130, value_dim=130)
    tensors = {name: t.detach() for name, t in tensors.items()}
    output = expire_span_attention(**tensors, **options, backend="triton")
    assert torch.equal(output, expire_span_attention_sdpa(**tensors, **options))
    assert relative_error(output, expire_span_attention_reference(**tensors, **options)) < 1e-5
    with pytest.raises(ValueError, match=r"widths up to 128, got 130 and 130"):
        expire_span_attention_triton(**tensors, **options)


def test_launch_configurations_and_dot_precision():
    """Every head width the kernel takes (up to 128) has GPU tiles, default first, for every dtype and target;
    float32 dots are exact unless PyTorch's float32 matmuls may use TF32."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for width in range(2, 129, 2):
            for capability, positions in itertools.product((None, 80, 86, 90), (False, True)):
                configs = _launch_configs(dtype, width, width, capability, positions)
                assert set(configs) == {"forward", "key", "query"}
                for kernel, candidates in configs.items():
                    again = _launch_configs(dtype, width, width, capability, positions)[kernel]
                    assert candidates and candidates == again
                    assert candidates[0]["BLOCK_D"] >= width and candidates[0]["num_stages"] >= 1
    default = _launch_configs(torch.bfloat16, 64, 64)
    assert all(config["num_stages"] >= 2 for configs in default.values() for config in configs)
    # A position term per pair takes smaller tiles where the default ones spill (checked in test_gpu_compile.py).
    with_positions = _launch_configs(torch.bfloat16, 128, 128, 90, positions=True)
    assert with_positions["key"][0]["BLOCK_M"] < _launch_configs(torch.bfloat16, 128, 128, 90)["key"][0]["BLOCK_M"]
    assert _dot_precision(torch.bfloat16) == "ieee" and _dot_precision(torch.float32) == "ieee"
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        assert _dot_precision(torch.float32) == "tf32"
        assert all(config["num_stages"] >= 2 for config in _launch_configs(torch.float32, 128, 128)["key"])
    finally:
        torch.set_float32_matmul_precision(previous)


@pytest.fixture
def autotuning_as_on_a_gpu(monkeypatch):
    """The GPU launch path in the interpreter with the autotuner's timing as a GPU runs it: every candidate
    configuration runs (twice) on the real arguments before the chosen one. Tensors stay on CPU; the launcher is
    told they are on a capability-9.0 device."""
    from memlm.kernels.expire_attention import triton_attention

    def timed_twice(kernel_call, quantiles):
        kernel_call()
        kernel_call()
        return [0.0 for _ in quantiles]

    launch = triton_attention._launch

    def launch_as_on_a_gpu(name, kernel, arguments, options, num_items, batch_heads, device):
        return launch(name, kernel, arguments, options, num_items, batch_heads, torch.device("cuda"))

    monkeypatch.setattr(triton_attention, "_untimed", timed_twice)
    monkeypatch.setattr(triton_attention, "_launch", launch_as_on_a_gpu)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    triton_attention._autotuned.cache_clear()
    yield
    triton_attention._autotuned.cache_clear()


@pytest.mark.parametrize("case", ["table", "pairs"])
def test_autotuning_keeps_the_position_gradients_of_one_run(case, autotuning_as_on_a_gpu):
    """The query kernel adds its position gradients with atomics; the autotuner times every candidate on the real
    arguments, so they are zeroed before each run (seen on an H200: the query gradient 450× too large)."""
    tensors, options, grad_output = make_inputs(length=40, memory=24, key_dim=64, value_dim=64, dtype=torch.float16)
    generator = torch.Generator().manual_seed(5)
    batch_size, num_heads, length, key_dim = tensors["query"].shape
    if case == "table":
        tensors["relative_positions"] = torch.randn(48, key_dim, generator=generator).half().requires_grad_()
    else:
        scores = torch.randn(batch_size, num_heads, length, tensors["key"].shape[2], generator=generator)
        tensors["position_scores"] = scores.half().requires_grad_()
    kwargs = {"attend_to_self": False, "renormalization_epsilon": 1e-3}
    assert len(_launch_configs(torch.float16, 64, 64, 90, positions=True)["query"]) > 1  # autotuned
    output, grads = run(expire_span_attention_triton, tensors, options, grad_output, **kwargs)
    expected, expected_grads = run(
        expire_span_attention_reference, float32_copies(tensors), options, grad_output, **kwargs
    )
    assert relative_error(output, expected) < 3e-3
    for name in grads:
        assert relative_error(grads[name], expected_grads[name]) < 3e-3, name


@pytest.mark.parametrize(("dtype", "key_dim", "value_dim"), [(torch.float16, 64, 64), (torch.float32, 40, 72)])
def test_gpu_tiles_in_the_interpreter(dtype, key_dim, value_dim):
    """The GPU launch path (tiles of _launch_configs, autotuned kernels, one configuration launched directly) runs
    in the interpreter on tensors that report ``cuda`` (devtools.gpu_compile): the first configuration of each
    kernel runs, with a result equal to the reference."""
    from devtools.gpu_compile import backward, on_gpu, record_launches

    tensors, options, grad_output = make_inputs(
        length=45, memory=100, key_dim=key_dim, value_dim=value_dim, max_span=60.0, dtype=dtype
    )
    expected, expected_grads = run(expire_span_attention_reference, float32_copies(tensors), options, grad_output)
    with record_launches(all_configs=False) as recorder:
        gpu_tensors = {name: on_gpu(t) for name, t in tensors.items()}
        gpu_options = {name: on_gpu(t) if isinstance(t, torch.Tensor) else t for name, t in options.items()}
        output = expire_span_attention_triton(**gpu_tensors, **gpu_options)
        backward(output.float(), on_gpu(grad_output))
    firsts = {name: configs[0] for name, configs in _launch_configs(dtype, key_dim, value_dim).items()}
    kernels = {"_forward_kernel": "forward", "_backward_key_kernel": "key", "_backward_query_kernel": "query"}
    assert sorted(kernels[launch.name] for launch in recorder.launches) == ["forward", "key", "query"]
    for launch in recorder.launches:
        first = firsts[kernels[launch.name]]
        assert {name: launch.keywords[name] for name in first} == first, launch.name
    tolerance = 1e-5 if dtype == torch.float32 else 3e-3
    assert relative_error(output, expected) < tolerance
    for name in NAMES:
        assert relative_error(tensors[name].grad, expected_grads[name]) < tolerance, name


PIPELINED_LOADS = """
import torch
import triton
from triton.backends.compiler import GPUTarget

from memlm.kernels.expire_attention import triton_attention

kernels = {
    "forward": triton_attention._forward_kernel,
    "key": triton_attention._backward_key_kernel,
    "query": triton_attention._backward_query_kernel,
}
pointers = {"QueryPositions": "*i32", "KeyPositions": "*i32", "Spans": "*fp32", "LogSumExp": "*fp32", "Delta": "*fp32"}
pointers |= {"GradSpans": "*fp32", "Positions": "*fp32", "GradPositions": "*fp32"}
for name, config in triton_attention._launch_configs(torch.bfloat16, 64, 64).items():
    kernel, config = kernels[name], dict(config[0])
    options = {"num_warps": config.pop("num_warps"), "num_stages": config.pop("num_stages")}
    constants = config | {"HAS_SPANS": True, "HAS_MAX_DISTANCE": True, "DOT_PRECISION": "ieee"}
    constants |= {"HAS_EPSILON": False, "POSITIONS": 0}
    constants |= {"SPANS_NEED_GRAD": True} if name == "key" else {}
    signature, attributes = {}, {}
    for index, argument in enumerate(kernel.arg_names):
        if argument in constants:
            signature[argument] = "constexpr"
        elif argument.endswith("_stride_dim"):  # contiguous rows: a stride of 1, specialised as a constant
            signature[argument], constants[argument] = "constexpr", 1
        elif argument[0].isupper():
            signature[argument] = pointers.get(argument, "*bf16")
            attributes[(index,)] = [["tt.divisibility", 16]]
        elif argument in ("scale", "ramp", "inverse_ramp", "epsilon"):
            signature[argument] = "fp32"
        else:
            signature[argument] = "i32"
            plain = argument in ("max_distance", "min_distance", "num_positions")
            attributes[(index,)] = [] if plain else [["tt.divisibility", 16]]
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attributes)
    compiled = triton.compile(source, target=GPUTarget("cuda", 80, 32), options=options)
    print(name, options["num_stages"], "cp.async" in compiled.asm["ptx"])
"""


@pytest.mark.slow
def test_loads_are_pipelined_on_sm80():
    """Compiled ahead of time for sm_80 (bfloat16, width 64, default tiles), every kernel's key/value (or
    query/output-gradient) loads become asynchronous copies that overlap the dots: no load sits under a
    data-dependent branch. A subprocess without Triton's interpreter; about a minute on 2 cores."""
    environment = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", PIPELINED_LOADS], capture_output=True, text=True, env=environment)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = sorted(result.stdout.split("\n")[-4:-1])
    assert [line.split()[0] for line in lines] == ["forward", "key", "query"], result.stdout
    for line in lines:
        name, stages, asynchronous = line.split()
        assert int(stages) >= 2 and asynchronous == "True", line


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize(
    ("length", "memory", "key_dim", "value_dim", "dtype", "tolerance"),
    [
        (1024, 0, 64, 64, torch.bfloat16, 2e-2),
        (2048, 2048, 128, 128, torch.bfloat16, 2e-2),
        (1024, 3072, 128, 64, torch.float16, 5e-3),
        (1, 4095, 64, 64, torch.bfloat16, 2e-2),
        (1024, 1024, 64, 32, torch.float32, 2e-5),
    ],
)
def test_cuda_matches_float32_reference(length, memory, key_dim, value_dim, dtype, tolerance):
    tensors, options, grad_output = make_inputs(
        length=length,
        memory=memory,
        key_dim=key_dim,
        value_dim=value_dim,
        max_span=1.5 * max(length, memory),
        num_heads=4,
        dtype=dtype,
        device="cuda",
    )
    options["ramp"] = 64.0  # long enough for the single query of the decoding case to see memories on the ramp
    assert min(mask_parts(tensors, options)) > 0
    output, grads = run(expire_span_attention_triton, tensors, options, grad_output)
    expected, expected_grads = run(expire_span_attention_reference, float32_copies(tensors), options, grad_output)
    assert output.dtype == dtype
    assert relative_error(output, expected) < tolerance
    for name in NAMES:
        assert grads[name].dtype == dtype
        assert relative_error(grads[name], expected_grads[name]) < tolerance, name


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize(
    ("key_dim", "dtype", "tolerance"),
    [(64, torch.bfloat16, 2e-2), (128, torch.float16, 5e-3), (64, torch.float32, 2e-5)],
)
def test_cuda_official_options_match_float32_reference(key_dim, dtype, tolerance):
    """The official code's options (learned relative positions over part of the distances, no attention to self,
    ε) on the GPU's tiles, against the reference."""
    tensors, options, grad_output = make_inputs(
        length=512, memory=1536, key_dim=key_dim, value_dim=key_dim, max_span=2048, num_heads=4, dtype=dtype,
        device="cuda",
    )  # fmt: skip
    options["ramp"] = 64.0
    generator = torch.Generator().manual_seed(3)
    tensors["relative_positions"] = torch.randn(1024, key_dim, generator=generator).to("cuda", dtype).requires_grad_()
    kwargs = {"attend_to_self": False, "renormalization_epsilon": 1e-3, "max_distance": 1800}
    output, grads = run(expire_span_attention_triton, tensors, options, grad_output, **kwargs)
    expected, expected_grads = run(
        expire_span_attention_reference, float32_copies(tensors), options, grad_output, **kwargs
    )
    assert relative_error(output, expected) < tolerance
    for name in grads:
        assert grads[name].dtype == dtype
        assert relative_error(grads[name], expected_grads[name]) < tolerance, name


@pytest.mark.gpu
@requires_cuda
def test_cuda_float32_with_tf32_dots():
    """float32 inputs with torch's TF32 switch on: tensor-core dots, 10-bit mantissas like float16, hence
    float16's tolerance."""
    tensors, options, grad_output = make_inputs(
        length=1024, memory=1024, key_dim=64, value_dim=64, max_span=1536.0, device="cuda"
    )
    options["ramp"] = 64.0
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        output, grads = run(expire_span_attention_triton, tensors, options, grad_output)
    finally:
        torch.set_float32_matmul_precision(previous)
    expected, expected_grads = run(expire_span_attention_reference, tensors, options, grad_output)
    assert relative_error(output, expected) < 5e-3
    for name in NAMES:
        assert relative_error(grads[name], expected_grads[name]) < 5e-3, name


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("max_distance", [None, 300])
def test_cuda_long_memory_with_expired_tiles(max_distance):
    """In-order memories of 4096 tokens of which most expired long ago: the skipped tiles change nothing."""
    tensors, options, grad_output = make_inputs(
        length=1024,
        memory=4096,
        key_dim=64,
        value_dim=64,
        max_span=400.0,
        shuffle=False,
        dtype=torch.bfloat16,
        device="cuda",
    )
    output, grads = run(expire_span_attention_triton, tensors, options, grad_output, max_distance=max_distance)
    expected, expected_grads = run(
        expire_span_attention_reference, float32_copies(tensors), options, grad_output, max_distance=max_distance
    )
    assert relative_error(output, expected) < 2e-2
    for name in NAMES:
        assert relative_error(grads[name], expected_grads[name]) < 2e-2, name
