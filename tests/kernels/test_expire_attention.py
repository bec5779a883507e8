"""Expire-Span attention (SPEC §2): the mask against paper Eqs. 4-5 by hand, SDPA against the reference, dispatch."""

import pytest
import torch

from memlm.kernels.expire_attention import (
    expire_span_attention,
    expire_span_attention_decoding,
    expire_span_attention_reference,
    expire_span_attention_sdpa,
    expire_span_mask,
    memory_statistics,
    visible_keys,
)

BACKENDS = ["torch", "reference"]
RAMP = 3.0


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in float64."""
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).norm() / expected.norm()).item()


def make_inputs(
    *,
    batch_size=2,
    num_heads=3,
    memory=9,
    length=6,
    key_dim=8,
    value_dim=5,
    spans=True,
    holes=True,
    shuffle=True,
    max_span=12.0,
    dtype=torch.float32,
    seed=0,
):
    """Inputs of one block of ``length`` queries attending to ``memory`` earlier memories plus the block itself.

    Row 0's memories are the positions just before its block; row 1's block starts at 30 and its memories are a
    random sample of earlier positions (as left after deleting expired ones). The keys are shuffled so that
    causality must come from the positions, not the order. Returns the differentiable tensors (a dict), the
    remaining keyword arguments and a random output gradient.
    """
    generator = torch.Generator().manual_seed(seed)
    starts = [memory, 30]
    key_positions, query_positions = [], []
    for row, start in enumerate(starts):
        if row == 0:
            memories = torch.arange(start - memory, start)
        else:
            memories = torch.randperm(start, generator=generator)[:memory].sort().values
        block = torch.arange(start, start + length)
        key_positions.append(torch.cat([memories, block]))
        query_positions.append(block)
    key_positions = torch.stack(key_positions)[:batch_size]
    query_positions = torch.stack(query_positions)[:batch_size]
    num_keys = memory + length
    if shuffle:
        key_positions = key_positions[:, torch.randperm(num_keys, generator=generator)]
    tensors = {
        "query": torch.randn(batch_size, num_heads, length, key_dim, generator=generator),
        "key": torch.randn(batch_size, num_heads, num_keys, key_dim, generator=generator),
        "value": torch.randn(batch_size, num_heads, num_keys, value_dim, generator=generator),
        "spans": torch.rand(batch_size, num_keys, generator=generator) * max_span if spans else None,
    }
    tensors = {name: None if t is None else t.to(dtype).requires_grad_() for name, t in tensors.items()}
    key_valid = torch.rand(batch_size, num_keys, generator=generator) > 0.2 if holes else None
    options = {
        "query_positions": query_positions,
        "key_positions": key_positions,
        "key_valid": key_valid,
        "ramp": RAMP,
    }
    grad_output = torch.randn(batch_size, num_heads, length, value_dim, generator=generator)
    return tensors, options, grad_output


def run(function, tensors, options, grad_output, **kwargs):
    """The output and a dict of the gradients of the differentiable inputs that are not None."""
    output = function(**tensors, **options, **kwargs)
    differentiable = {name: t for name, t in tensors.items() if t is not None}
    grads = torch.autograd.grad((output.float() * grad_output).sum(), list(differentiable.values()))
    return output, dict(zip(differentiable, grads))


# One hand-checked example of paper Eqs. 4-5: queries at t = 10, 11; keys at i = 2, 5, 8, 10 and a future one at 12;
# spans e = (3, 7.5, 1.5, 0, 5); ramp R = 2. Each key is one-hot (scale 1), so the query row holds the scores.
HAND_QUERY_POSITIONS = [[10, 11]]
HAND_KEY_POSITIONS = [[2, 5, 8, 10, 12]]
HAND_SPANS = [[3.0, 7.5, 1.5, 0.0, 5.0]]
HAND_RAMP = 2.0
# m_ti = clamp(1 + (e_i − (t − i)) / R, 0, 1)                          (Eq. 5)
# t = 10: i=2:  1 + (3   − 8) / 2 = −1.5 → 0      i=5:  1 + (7.5 − 5) / 2 = 2.25 → 1
#         i=8:  1 + (1.5 − 2) / 2 =  0.75         i=10: 1 + (0   − 0) / 2 = 1
#         i=12: 1 + (5  + 2) / 2 =  4.5 → 1 (but in the future: not visible)
# t = 11: i=2:  1 + (3   − 9) / 2 = −2 → 0        i=5:  1 + (7.5 − 6) / 2 = 1.75 → 1
#         i=8:  1 + (1.5 − 3) / 2 =  0.25         i=10: 1 + (0   − 1) / 2 = 0.5
#         i=12: 1 + (5  + 1) / 2 =  4 → 1
HAND_MASK = [[[0.0, 1.0, 0.75, 1.0, 1.0], [0.0, 1.0, 0.25, 0.5, 1.0]]]
# Scores s_ti = log of these, so the plain softmax weights are proportional to them.
HAND_EXP_SCORES = [[1.0, 2.0, 3.0, 4.0, 5.0], [4.0, 3.0, 2.0, 1.0, 5.0]]
# Eq. 4: a'_ti = m_ti a_ti / Σ_j m_tj a_tj ∝ m_ti e^{s_ti} over the visible keys (i ≤ t).
# t = 10: m·e^s = (0, 2, 2.25, 4)  sum 8.25 → a' = (0, 8/33, 9/33, 16/33), key 12 gets 0
# t = 11: m·e^s = (0, 3, 0.5, 0.5) sum 4    → a' = (0, 3/4, 1/8, 1/8)
HAND_WEIGHTS = [[0, 8 / 33, 9 / 33, 16 / 33, 0], [0, 3 / 4, 1 / 8, 1 / 8, 0]]
HAND_VALUES = [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [2.0, -1.0], [100.0, 100.0]]
# o_10 = 8/33 (0, 1) + 9/33 (1, 1) + 16/33 (2, −1) = (41/33, 1/33)
# o_11 = 3/4 (0, 1) + 1/8 (1, 1) + 1/8 (2, −1) = (3/8, 3/4)
HAND_OUTPUT = [[41 / 33, 1 / 33], [3 / 8, 3 / 4]]
# Only key 8 is on the ramp for t = 10, so d(o_10,0 + o_10,1)/de is zero except for e_8:
# ∂o_10/∂m_8 = e^{s_8} / Σ_j m_j e^{s_j} · (v_8 − o_10) = 3/8.25 · (−8/33, 32/33) and ∂m_8/∂e_8 = 1/R = 1/2,
# so d(o_10,0 + o_10,1)/de_8 = 4/11 · 24/33 / 2 = 16/121.
HAND_SPAN_GRADIENT_FIRST_QUERY = [0.0, 0.0, 16 / 121, 0.0, 0.0]


def hand_inputs():
    dtype = torch.float64
    query = torch.tensor(HAND_EXP_SCORES, dtype=dtype).log()[None, None].requires_grad_()  # (1, 1, 2, 5)
    key = torch.eye(5, dtype=dtype)[None, None]
    value = torch.tensor(HAND_VALUES, dtype=dtype)[None, None]
    spans = torch.tensor(HAND_SPANS, dtype=dtype, requires_grad=True)
    positions = {
        "query_positions": torch.tensor(HAND_QUERY_POSITIONS),
        "key_positions": torch.tensor(HAND_KEY_POSITIONS),
    }
    return query, key, value, spans, positions


def test_mask_by_hand():
    _, _, _, spans, positions = hand_inputs()
    mask = expire_span_mask(spans, positions["query_positions"], positions["key_positions"], HAND_RAMP)
    torch.testing.assert_close(mask, torch.tensor(HAND_MASK, dtype=torch.float64), rtol=0, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_by_hand(backend):
    query, key, value, spans, positions = hand_inputs()
    output = expire_span_attention(query, key, value, spans, **positions, ramp=HAND_RAMP, scale=1.0, backend=backend)
    expected = torch.tensor(HAND_OUTPUT, dtype=torch.float64)[None, None]
    torch.testing.assert_close(output, expected, rtol=0, atol=1e-12)
    # The weights themselves: the output for one-hot values is the weight row.
    weights = expire_span_attention(
        query,
        key,
        torch.eye(5, dtype=torch.float64)[None, None],
        spans,
        **positions,
        ramp=HAND_RAMP,
        scale=1.0,
        backend=backend,
    )
    torch.testing.assert_close(
        weights, torch.tensor(HAND_WEIGHTS, dtype=torch.float64)[None, None], rtol=0, atol=1e-12
    )
    (span_gradient,) = torch.autograd.grad(output[0, 0, 0].sum(), spans)
    expected_gradient = torch.tensor([HAND_SPAN_GRADIENT_FIRST_QUERY], dtype=torch.float64)
    torch.testing.assert_close(span_gradient, expected_gradient, rtol=0, atol=1e-12)


CASES = {
    "memory_and_block": {},
    "max_distance": {"max_distance": 7.5},
    "integer_max_distance": {"max_distance": 4},
    "spans_none": {"spans": False},
    "decoding": {"length": 1},
    "in_order_without_holes": {"holes": False, "shuffle": False},
    "value_width_equals_key_width": {"value_dim": 8},
    "one_row_one_head": {"batch_size": 1, "num_heads": 1},
}


def split_case(case):
    """Separate the keyword arguments of make_inputs from those of the attention function."""
    inputs = {name: value for name, value in case.items() if name != "max_distance"}
    kwargs = {"max_distance": case["max_distance"]} if "max_distance" in case else {}
    return inputs, kwargs


@pytest.mark.parametrize("case", list(CASES))
def test_sdpa_matches_reference_float32(case):
    inputs, kwargs = split_case(CASES[case])
    tensors, options, grad_output = make_inputs(**inputs)
    mask = expire_span_mask(tensors["spans"], options["query_positions"], options["key_positions"], RAMP)
    if tensors["spans"] is not None:  # the inputs exercise every part of the mask
        assert ((mask > 0) & (mask < 1)).any() and (mask == 0).any() and (mask == 1).any()
    output, grads = run(expire_span_attention_sdpa, tensors, options, grad_output, **kwargs)
    expected, expected_grads = run(expire_span_attention_reference, tensors, options, grad_output, **kwargs)
    assert output.dtype == torch.float32 and output.shape == expected.shape
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-6)
    assert set(grads) == set(expected_grads)
    for name in grads:
        torch.testing.assert_close(grads[name], expected_grads[name], rtol=1e-5, atol=2e-6, msg=name)
    if tensors["spans"] is not None:
        assert expected_grads["spans"].abs().max() > 1e-3  # spans do learn through the bias


@pytest.mark.parametrize("case", ["memory_and_block", "max_distance", "decoding", "spans_none"])
def test_sdpa_bfloat16_close_to_float32_reference(case):
    inputs, kwargs = split_case(CASES[case])
    tensors, options, grad_output = make_inputs(**inputs, dtype=torch.bfloat16)
    exact = {name: None if t is None else t.detach().float().requires_grad_() for name, t in tensors.items()}
    output, grads = run(expire_span_attention_sdpa, tensors, options, grad_output, **kwargs)
    expected, expected_grads = run(expire_span_attention_reference, exact, options, grad_output, **kwargs)
    assert output.dtype == torch.bfloat16
    assert relative_error(output, expected) < 1e-2
    for name in grads:
        assert grads[name].dtype == tensors[name].dtype
        assert relative_error(grads[name], expected_grads[name]) < 1e-2, name


@pytest.mark.parametrize("value_dim", [8, 5])
@pytest.mark.parametrize("spans", [True, False])
def test_sdpa_without_grad_matches_reference(value_dim, spans):
    """Inference: with no mask requiring grad (and d_v = d) SDPA may pick its fused CPU kernel."""
    tensors, options, _ = make_inputs(value_dim=value_dim, spans=spans)
    with torch.no_grad():
        output = expire_span_attention_sdpa(**tensors, **options)
        expected = expire_span_attention_reference(**tensors, **options)
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradcheck_float64(backend):
    tensors, options, _ = make_inputs(batch_size=2, num_heads=1, memory=4, length=3, key_dim=4, value_dim=3)
    tensors = {name: t.detach().double().requires_grad_() for name, t in tensors.items()}
    mask = expire_span_mask(tensors["spans"], options["query_positions"], options["key_positions"], RAMP)
    assert ((mask > 0) & (mask < 1)).any()

    def function(query, key, value, spans):
        return expire_span_attention(query, key, value, spans, **options, backend=backend)

    assert torch.autograd.gradcheck(function, tuple(tensors.values()), eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_span_gradient_only_on_the_ramp(backend):
    tensors, options, grad_output = make_inputs(memory=12, length=4, max_span=16.0, seed=3)
    _, grads = run(expire_span_attention, tensors, options, grad_output, backend=backend)
    # Independently of the kernel: the ramp of Eq. 5 is −R < r_ti < 0 with r_ti = e_i − (t − i).
    distance = (options["query_positions"][:, :, None] - options["key_positions"][:, None, :]).float()
    remaining = tensors["spans"].detach()[:, None, :] - distance
    visible = (distance >= 0) & options["key_valid"][:, None, :]
    on_ramp = ((remaining > -RAMP) & (remaining < 0) & visible).any(dim=1)  # (B, N): on the ramp for some query
    alive_or_dead = visible.any(dim=1) & ~on_ramp
    assert on_ramp.sum() >= 3 and alive_or_dead.sum() >= 3
    assert torch.equal(grads["spans"] != 0, on_ramp)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("official", [False, True], ids=["default", "official_options"])
def test_no_keys_at_all_give_zeros_and_zero_gradients(backend, official):
    """A memory of width 0 (no key slot at all): every query sees no key, so zeros, as for a query before every key;
    with the official options (learned positions, no attention to self, ε) too, whose fused passes cannot shape an
    empty product."""
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(2, 2, 3, 4, generator=generator, requires_grad=True)
    key, value = torch.zeros(2, 2, 0, 4, requires_grad=True), torch.zeros(2, 2, 0, 6, requires_grad=True)
    spans = torch.zeros(2, 0, requires_grad=True)
    options = {"relative_positions": torch.randn(5, 4, generator=generator), "attend_to_self": False,
               "renormalization_epsilon": 1e-8} if official else {}  # fmt: skip
    output = expire_span_attention(query, key, value, spans, torch.arange(3).repeat(2, 1),
                                   torch.zeros(2, 0, dtype=torch.long), ramp=2.0, backend=backend, **options)  # fmt: skip
    assert output.shape == (2, 2, 3, 6) and not output.any()
    grads = torch.autograd.grad(output.square().sum(), [query, key, value, spans], allow_unused=True)
    assert all(grad is None or not grad.any() for grad in grads)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("spans", [True, False])
def test_queries_that_see_no_key_output_zeros(backend, spans):
    # Row 0: query at 2 comes before every key, query at 6 sees keys 5 and 6.
    # Row 1: every key slot is empty.  Row 2: every key has expired (m = 0) when spans are given.
    query_positions = torch.tensor([[2, 6], [6, 7], [10, 11]])
    key_positions = torch.tensor([[5, 6, 7], [5, 6, 7], [0, 1, 2]])
    key_valid = torch.tensor([[True, True, True], [False, False, False], [True, True, True]])
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(3, 2, 2, 4, generator=generator, requires_grad=True)
    key = torch.randn(3, 2, 3, 4, generator=generator, requires_grad=True)
    value = torch.randn(3, 2, 3, 6, generator=generator, requires_grad=True)
    span_values = torch.tensor([[4.0, 4.0, 4.0], [4.0, 4.0, 4.0], [0.5, 0.5, 0.5]], requires_grad=True)
    output = expire_span_attention(
        query,
        key,
        value,
        span_values if spans else None,
        query_positions,
        key_positions,
        ramp=2.0,
        key_valid=key_valid,
        backend=backend,
    )
    empty = torch.tensor([[True, False], [True, True], [spans, spans]])  # (B, T)
    for row, column in empty.nonzero().tolist():
        assert torch.equal(output[row, :, column], torch.zeros(2, 6))
    assert (output[0, :, 1].abs() > 0).all()
    inputs = [query, key, value] + ([span_values] if spans else [])
    grads = torch.autograd.grad(output.square().sum(), inputs)
    for grad in grads:
        assert torch.isfinite(grad).all()
    grad_query, grad_key, grad_value = grads[:3]
    assert (grad_query[0, :, 0] == 0).all() and (grad_query[1] == 0).all() and (grad_query[0, :, 1] != 0).any()
    assert (grad_key[1] == 0).all() and (grad_value[1] == 0).all()
    if spans:
        assert (grad_query[2] == 0).all() and (grad_key[2] == 0).all() and (grads[3][1:] == 0).all()


def causal_attention(query, key, value, window=None):
    """Plain softmax attention with positions 0..T−1, optionally only over the last ``window + 1`` keys."""
    length = query.shape[2]
    distance = torch.arange(length)[:, None] - torch.arange(length)[None, :]
    allowed = distance >= 0
    if window is not None:
        allowed &= distance <= window
    scores = (query @ key.mT) * query.shape[-1] ** -0.5
    return scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1) @ value


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("spans", ["huge", "none"])
def test_huge_spans_are_plain_causal_attention(backend, spans):
    generator = torch.Generator().manual_seed(1)
    query, key, value = (torch.randn(2, 3, 7, 8, generator=generator) for _ in range(3))
    positions = torch.arange(7).expand(2, 7)
    span_values = torch.full((2, 7), 1e6) if spans == "huge" else None
    output = expire_span_attention(query, key, value, span_values, positions, positions, ramp=4, backend=backend)
    torch.testing.assert_close(output, causal_attention(query, key, value), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_max_distance_is_a_sliding_window(backend):
    generator = torch.Generator().manual_seed(2)
    query, key, value = (torch.randn(1, 2, 9, 4, generator=generator) for _ in range(3))
    positions = torch.arange(9)[None]
    output = expire_span_attention(
        query, key, value, None, positions, positions, ramp=1, max_distance=3, backend=backend
    )
    torch.testing.assert_close(output, causal_attention(query, key, value, window=3), rtol=1e-5, atol=1e-6)
    # max_distance = 0: each query sees only the key at its own position, so it returns that value.
    output = expire_span_attention(
        query, key, value, None, positions, positions, ramp=1, max_distance=0, backend=backend
    )
    torch.testing.assert_close(output, value, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_drops_weights_and_keeps_the_mean(backend):
    tensors, options, _ = make_inputs(batch_size=1, num_heads=1, memory=3, length=4, holes=False)
    copies = 4000
    tensors = {name: t.detach().expand(copies, *t.shape[1:]) for name, t in tensors.items()}
    for name in ("query_positions", "key_positions"):
        options[name] = options[name].expand(copies, -1)
    torch.manual_seed(0)
    exact = expire_span_attention(**tensors, **options, backend=backend)
    dropped = expire_span_attention(**tensors, **options, dropout=0.5, backend=backend)
    assert (dropped - exact).abs().max() > 0.1
    torch.testing.assert_close(dropped.mean(dim=0), exact[0], rtol=0, atol=0.1)


def test_mask_dtype_and_no_spans():
    query_positions, key_positions = torch.tensor([[3, 4]]), torch.tensor([[0, 1, 2]])
    spans = torch.tensor([[1000.0, 2.0, 1.0]])
    mask = expire_span_mask(spans.bfloat16(), query_positions, key_positions, 2.0)
    assert mask.dtype == torch.float32 and mask.shape == (1, 2, 3)
    # t − i = 3, 2, 1 and 4, 3, 2: m = (1, 1, 1) and (1, 0.5, 0.5).
    torch.testing.assert_close(mask, torch.tensor([[[1.0, 1.0, 1.0], [1.0, 0.5, 0.5]]]))
    assert expire_span_mask(spans.double(), query_positions, key_positions, 2.0).dtype == torch.float64
    assert torch.equal(expire_span_mask(None, query_positions, key_positions, 2.0), torch.ones(1, 2, 3))


def test_backend_argument_and_environment_variable(monkeypatch):
    tensors, options, _ = make_inputs()
    with torch.no_grad():
        reference_output = expire_span_attention_reference(**tensors, **options)
        sdpa_output = expire_span_attention_sdpa(**tensors, **options)
        assert not torch.equal(reference_output, sdpa_output)  # the two paths are distinguishable

        monkeypatch.delenv("MEMLM_KERNELS", raising=False)
        assert torch.equal(expire_span_attention(**tensors, **options), sdpa_output)
        assert torch.equal(expire_span_attention(**tensors, **options, backend="reference"), reference_output)
        monkeypatch.setenv("MEMLM_KERNELS", "reference")
        assert torch.equal(expire_span_attention(**tensors, **options), reference_output)
        assert torch.equal(expire_span_attention(**tensors, **options, backend="torch"), sdpa_output)
        monkeypatch.setenv("MEMLM_KERNELS", "naive")
        with pytest.raises(ValueError, match=r"MEMLM_KERNELS='naive'.*'torch', 'triton', 'reference'"):
            expire_span_attention(**tensors, **options)
    with pytest.raises(ValueError, match=r"argument backend='cuda'.*'torch', 'triton', 'reference'"):
        expire_span_attention(**tensors, **options, backend="cuda")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"query": torch.zeros(2, 6, 8)}, r"query must be a 4-dimensional tensor.*got \(2, 6, 8\)"),
        ({"key": torch.zeros(2, 3, 15, 7)}, r"key must have shape .*query \(2, 3, 6, 8\) and key \(2, 3, 15, 7\)"),
        ({"value": torch.zeros(2, 3, 14, 5)}, r"value must share .*value \(2, 3, 14, 5\) and key \(2, 3, 15, 8\)"),
        ({"value": torch.zeros(2, 3, 15, 5, dtype=torch.float64)}, r"must share a dtype.*torch.float64"),
        ({"query": torch.zeros(2, 3, 6, 8, dtype=torch.long)}, r"query must be a floating-point tensor"),
        (
            {"spans": torch.zeros(2, 16)},
            r"spans must be None or a tensor of shape \(batch, keys\) = \(2, 15\), got \(2, 16\)",
        ),
        ({"spans": torch.zeros(2, 15, dtype=torch.long)}, r"spans must be a floating-point tensor"),
        ({"query_positions": torch.zeros(2, 6)}, r"query_positions must hold integer .*got dtype torch.float32"),
        (
            {"query_positions": torch.zeros(2, 5, dtype=torch.long)},
            r"query_positions .* \(batch, tokens\) = \(2, 6\), got \(2, 5\)",
        ),
        ({"key_positions": torch.zeros(2, 15, dtype=torch.bool)}, r"key_positions must hold integer .*torch.bool"),
        (
            {"key_positions": torch.zeros(15, dtype=torch.long)},
            r"key_positions .* \(batch, keys\) = \(2, 15\), got \(15,\)",
        ),
        ({"key_valid": torch.ones(2, 15, dtype=torch.long)}, r"key_valid must be a bool tensor"),
        ({"key_valid": torch.ones(2, 14, dtype=torch.bool)}, r"key_valid .* = \(2, 15\), got \(2, 14\)"),
        ({"ramp": 0}, r"ramp must be a positive finite number.*got 0"),
        ({"ramp": -2.0}, r"ramp must be a positive finite number.*got -2.0"),
        ({"ramp": float("nan")}, r"ramp must be a positive finite number.*got nan"),
        ({"ramp": True}, r"ramp must be a positive finite number.*got True"),
        ({"max_distance": -1}, r"max_distance must be None or a number >= 0.*got -1"),
        ({"max_distance": "7"}, r"max_distance must be None or a number >= 0.*got '7'"),
        ({"scale": float("inf")}, r"scale must be None .* or a finite number, got inf"),
        ({"dropout": 1.0}, r"dropout must be a number in \[0, 1\), got 1.0"),
        ({"dropout": -0.1}, r"dropout must be a number in \[0, 1\), got -0.1"),
    ],
)
def test_bad_inputs_raise_value_errors(change, message):
    tensors, options, _ = make_inputs()
    arguments = {**{n: t.detach() for n, t in tensors.items()}, **options, **change}
    for backend in BACKENDS:
        with pytest.raises(ValueError, match=message):
            expire_span_attention(**arguments, backend=backend)


@pytest.mark.parametrize("max_distance", [None, 9, 4.5])
def test_memory_statistics_count_what_the_dense_mask_shows(max_distance):
    generator = torch.Generator().manual_seed(7)
    batch, keys, ramp = 3, 40, 3.0
    key_positions = torch.randint(0, 30, (batch, keys), generator=generator)
    spans = torch.rand(batch, keys, generator=generator) * 12
    spans[0, :5] = torch.tensor([0.0, 1.0, 2.5, 3.0, 7.0])  # integer and half-integer spans hit the ramp's ends
    key_valid = torch.rand(batch, keys, generator=generator) > 0.2
    first = torch.tensor([20, 25, 31])
    last = torch.tensor([35, 27, 30])  # the last row has no queries
    read, on_ramp = memory_statistics(spans, key_positions, key_valid, first, last, ramp, max_distance)
    for row in range(batch):
        queries = torch.arange(int(first[row]), int(last[row]) + 1)[None]
        if queries.numel() == 0:
            assert read[row].sum() == 0 and on_ramp[row].sum() == 0
            continue
        visible = visible_keys(queries, key_positions[row : row + 1], key_valid[row : row + 1], max_distance)
        mask = expire_span_mask(spans[row : row + 1], queries, key_positions[row : row + 1], ramp)
        torch.testing.assert_close(read[row], (visible & (mask > 0)).sum(1)[0].float())
        torch.testing.assert_close(on_ramp[row], (visible & (mask > 0) & (mask < 1)).sum(1)[0].float())
    assert read.sum() > 0 and on_ramp.sum() > 0


@pytest.mark.parametrize("backend", ["torch", "reference", "triton"])
@pytest.mark.parametrize("where", ["key", "value", "spans"])
@pytest.mark.parametrize("official", [False, True], ids=["memlm", "official_options"])
def test_a_non_finite_key_reaches_only_the_queries_that_see_it(backend, where, official):
    """Causality with non-finite inputs (issue 33): a NaN or inf key, value or span at position i leaves every query
    that cannot see it (earlier positions) as it was without it; the queries that see it output NaN."""
    if backend == "triton":
        pytest.importorskip("triton")
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(2, 2, 12, 8, generator=generator) for _ in range(3))
    spans = torch.rand(2, 12, generator=generator) * 12
    positions = torch.arange(12)[None].expand(2, -1)
    options = {"ramp": 2.0, "backend": backend}
    if official:
        options |= {"attend_to_self": False, "renormalization_epsilon": 1e-8,
                    "position_scores": torch.randn(2, 2, 12, 12, generator=generator)}  # fmt: skip
    clean = expire_span_attention(query, key, value, spans, positions, positions, **options)
    inputs = {"key": key.clone(), "value": value.clone(), "spans": spans.clone()}
    if where == "spans":
        inputs["spans"][1, 7] = float("nan")
    else:
        inputs[where][1, 0, 7, 2] = float("inf") if where == "value" else float("nan")
    output = expire_span_attention(query, inputs["key"], inputs["value"], inputs["spans"], positions, positions,
                                   **options)  # fmt: skip
    first_seeing = 8 if official else 7  # the official mask hides a key from its own query
    heads = [0, 1] if where == "spans" else [0]  # a span is every head's; a key or value one head's
    for head in heads:
        assert torch.equal(output[1, head, :first_seeing], clean[1, head, :first_seeing])
        assert output[1, head, first_seeing:].isnan().all()
    assert torch.equal(output[0], clean[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_decoding_attention_is_the_general_attention_of_one_query_bit_for_bit(dtype):
    """`expire_span_attention_decoding` (a decoding step: one query after every key, its own key valid) gives
    `expire_span_attention`'s output bit for bit, and the mask it attended with (Eq. 5's, 0 at invalid keys), over
    memories that are read whole, on the ramp, expired and invalid, also without the validity when every key is
    valid; with a non-finite value at a key no query sees, it answers None (its caller then takes the general
    attention, which keeps that value in place) where the general attention stays finite."""
    tensors, options, _ = make_inputs(length=1, memory=25, dtype=dtype, seed=3)
    query, key, value, spans = (tensors[name].detach() for name in ("query", "key", "value", "spans"))
    at, positions = options["query_positions"], options["key_positions"]
    valid = options["key_valid"] | (positions == at)  # the token's own memory is valid
    distance = at - positions
    remaining = spans.double() - distance  # e_i − (t − i), Eq. 5
    assert (valid & (remaining >= 0)).any() and (valid & (remaining < 0) & (remaining > -RAMP)).any()
    assert (valid & (remaining <= -RAMP)).any() and (~valid).any()
    arguments = (query, key, value, spans, at, positions)
    expected = expire_span_attention(*arguments, ramp=RAMP, key_valid=valid, backend="torch")
    output, mask = expire_span_attention_decoding(query, key, value, spans, distance, valid, RAMP)
    assert output.dtype == dtype and torch.equal(output, expected)
    expected_mask = expire_span_mask(spans, at, positions, RAMP)[:, 0].masked_fill(~valid, 0)  # Eq. 5, read m > 0
    torch.testing.assert_close(mask, expected_mask, atol=0, rtol=0)
    every = torch.ones_like(valid)  # every key valid: the same without the validity (None)
    with_validity, without = (expire_span_attention_decoding(query, key, value, spans, distance, given, RAMP)
                              for given in (every, None))  # fmt: skip
    assert all(torch.equal(first, second) for first, second in zip(with_validity, without))

    hidden = (~valid).nonzero()[0]
    value[hidden[0], :, hidden[1]] = float("nan")
    assert expire_span_attention_decoding(query, key, value, spans, distance, valid, RAMP) is None
    general = expire_span_attention(*arguments, ramp=RAMP, key_valid=valid, backend="torch")
    assert torch.equal(general, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "options",
    [{"table": True, "attend_to_self": False, "renormalization_epsilon": 1e-2}, {"table": True},
     {"attend_to_self": False}, {"renormalization_epsilon": 1e-2},
     {"table": 64, "attend_to_self": False, "renormalization_epsilon": 1e-2}],
    ids=["official", "positions", "no_self", "epsilon", "official_long_table"],
)  # fmt: skip
def test_the_official_decoding_attention_is_the_general_attention_of_one_query(options, dtype):
    """`expire_span_attention_official_decoding` (a decoding step with the official options: learned relative
    positions, no attention to the token itself, ε; each alone and together) gives `expire_span_attention`'s output
    to rounding and the mask it attended with (Eq. 5's, 0 at hidden keys), over memories read whole, on the ramp,
    expired, invalid and farther than the table reaches; the same bits with the table padded by the caller (as a
    decoding step pads it once for its layers) and with no validity for keys all valid; None where a hidden key's value
    is NaN (the general attention keeps it in place) and where no key is visible."""
    from memlm.kernels.expire_attention import expire_span_attention_official_decoding, padded_position_table

    tensors, arguments, _ = make_inputs(length=1, memory=25, value_dim=8, dtype=dtype, seed=3)
    query, key, value, spans = (tensors[name].detach() for name in ("query", "key", "value", "spans"))
    at, positions = arguments["query_positions"], arguments["key_positions"]
    valid = arguments["key_valid"] | (positions == at)  # the token's own memory is valid
    distance = at - positions
    rows = 6 if options.get("table") is True else options.get("table", 6)
    table = torch.randn(rows, query.shape[-1], dtype=dtype, generator=torch.Generator().manual_seed(1))
    table = table if options.get("table") else None
    self_attention, epsilon = options.get("attend_to_self", True), options.get("renormalization_epsilon", 0.0)
    if rows == 6:  # keys within and beyond the table's reach
        assert (valid & (distance > 6)).any() and (valid & (distance >= 1) & (distance <= 6)).any()
    else:  # a table longer than every distance: the rows the keys reach are read, the farthest one's too
        assert distance.max() + 1 < rows
        farthest = (torch.arange(len(distance)), distance.argmax(-1))
        spans[farthest], valid[farthest] = float(distance.max() + RAMP), True  # read whole

    def general():
        return expire_span_attention(query, key, value, spans, at, positions, ramp=RAMP, key_valid=valid,
                                     relative_positions=table, attend_to_self=self_attention,
                                     renormalization_epsilon=epsilon, backend="torch")  # fmt: skip

    def decoding():
        return expire_span_attention_official_decoding(query, key, value, spans, distance, valid, RAMP, table,
                                                       self_attention, epsilon)  # fmt: skip

    expected = general()
    output, mask = decoding()
    tolerance = {"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-13, "rtol": 0}
    assert output.dtype == dtype
    torch.testing.assert_close(output, expected, **tolerance)
    hidden = ~valid | (distance == 0) if not self_attention else ~valid
    expected_mask = expire_span_mask(spans, at, positions, RAMP)[:, 0].masked_fill(hidden, 0)
    torch.testing.assert_close(mask, expected_mask, atol=0, rtol=0)
    remaining = spans.double() - distance
    assert (mask == 1).any() and ((mask > 0) & (mask < 1)).any() and (~hidden & (remaining <= -RAMP)).any()
    if table is not None:  # the table padded once by the caller (a decoding step, for its layers): the same numbers
        padded = padded_position_table(table, dtype)
        assert padded.shape == (table.shape[0] + 2, table.shape[1]) and not padded[[0, -1]].any()
        given = expire_span_attention_official_decoding(query, key, value, spans, distance, valid, RAMP, table,
                                                        self_attention, epsilon, padded)  # fmt: skip
        assert torch.equal(given[0], output) and torch.equal(given[1], mask)
    # Without a validity to apply (None: every key valid), as with every key marked valid.
    all_valid, no_validity = (
        expire_span_attention_official_decoding(query, key, value, spans, distance, argument, RAMP, table,
                                                self_attention, epsilon)
        for argument in (torch.ones_like(valid), None)
    )  # fmt: skip
    assert all(torch.equal(x, y) for x, y in zip(all_valid, no_validity))
    assert (no_validity[1] > 0).sum() > (mask > 0).sum()  # (the invalid keys became visible)

    masked = (~valid).nonzero()[0]
    value[masked[0], :, masked[1]] = float("nan")
    assert decoding() is None
    torch.testing.assert_close(general(), expected, atol=0, rtol=0)
    valid = torch.zeros_like(valid)  # no key visible: the general attention gives zeros
    assert decoding() is None and not general().any()


@pytest.mark.parametrize("band", [False, True], ids=["every_column", "band"])
@pytest.mark.parametrize("keep_weights", [False, True], ids=["weights_rebuilt", "weights_kept"])
@pytest.mark.parametrize("epsilon", [0.0, 1e-3])
@pytest.mark.parametrize("positions_as", ["table", "scores", "both"])
@pytest.mark.parametrize("memory", ["carried", "block_only", "holes", "far"])
def test_the_official_options_give_the_outputs_and_gradients_of_the_reference(memory, positions_as, epsilon,
                                                                              keep_weights, band, monkeypatch):  # fmt: skip
    """The learned relative positions given as their table (P, d), as `position_scores` (B, H, T, N) or half each;
    with gradients the official options run a forward that keeps only its inputs (and the weights, with
    `keep_weights`) and a backward written out (`official.py`): the output and every gradient (query, key, value,
    spans, the table) equal the reference's under autograd, in float64, with and without the renormalisation ε, for
    queries that see no key (the first of a block without memories, as attend_to_self=False hides its own), for a
    memory with holes (invalid slots, keys out of order, a maximum distance, attention to self) and for memories
    further back than the table reaches (its term built only in the columns it reaches, as for blocks of 16 queries
    or more, or in every column, as for fewer); a second backward through
    the same graph gives the same gradients again (kept weights are not overwritten); without gradients the forward
    gives the reference's output."""
    from memlm.kernels.expire_attention import official, relative_position_scores

    monkeypatch.setattr(official, "_BAND_QUERIES", 1 if band else 1000)
    generator = torch.Generator().manual_seed(3)
    width = 0 if memory == "block_only" else 8
    query = torch.randn(2, 3, 6, 5, generator=generator, dtype=torch.float64)
    key, value = (torch.randn(2, 3, 6 + width, 5, generator=generator, dtype=torch.float64) for _ in range(2))
    spans = torch.rand(2, 6 + width, generator=generator, dtype=torch.float64) * 9
    table = torch.randn(7, 5, generator=generator, dtype=torch.float64)
    query_positions = torch.arange(width, width + 6)[None].expand(2, -1)
    key_positions = torch.arange(6 + width)[None].expand(2, -1)
    options = {"ramp": 2.0, "attend_to_self": False, "renormalization_epsilon": epsilon, "keep_weights": keep_weights}
    if memory == "far":  # the first 3 memories 8+ tokens back from every query: only later columns get the table's
        key_positions = torch.cat([torch.arange(3), torch.arange(6, 6 + 11)])[None].expand(2, -1)
        query_positions = query_positions + 9
        spans = spans * 3
    if memory == "holes":
        key_positions = torch.cat([torch.randperm(width, generator=generator)[None].expand(2, -1),
                                   query_positions], dim=1)  # fmt: skip
        key_valid = torch.rand(2, 6 + width, generator=generator) > 0.3
        options |= {"attend_to_self": True, "key_valid": key_valid, "max_distance": 9.0}
    distance = query_positions[:, None, :, None] - key_positions[:, None, None, :]
    leaves = [tensor.clone().requires_grad_() for tensor in (query, key, value, spans, table)]

    def positions(leaves):
        scores = relative_position_scores(leaves[4], leaves[0], distance)
        if positions_as == "table":
            return {"relative_positions": leaves[4]}
        if positions_as == "scores":  # the same scores as a differentiable (B, H, T, N) input
            return {"position_scores": scores}
        return {"relative_positions": leaves[4] / 2, "position_scores": scores / 2}

    built, bands = [], []  # how often the weights are built (forward, and each backward unless kept); the bands
    build_weights, find_band = official._weights, official._position_band
    monkeypatch.setattr(official, "_weights", lambda *args: built.append(1) or build_weights(*args))
    monkeypatch.setattr(official, "_position_band", lambda *args: bands.append(find_band(*args)) or bands[-1])
    output = expire_span_attention(*leaves[:4], query_positions, key_positions, **positions(leaves), **options)
    assert output.grad_fn is not None and "OfficialAttention" in type(output.grad_fn).__name__
    grad_output = torch.randn(output.shape, generator=generator, dtype=torch.float64)
    output.backward(grad_output, retain_graph=True)
    first = [leaf.grad.clone() for leaf in leaves]
    output.backward(grad_output)
    assert len(built) == (1 if keep_weights else 3)
    if positions_as != "scores" and memory == "far":  # only memories 1..7 back get the table (positions 10..16)
        assert all((found.start, found.stop) == ((7, 14) if band else (0, 14)) for found in bands), bands
    expected_leaves = [tensor.clone().requires_grad_() for tensor in (query, key, value, spans, table)]
    scores = relative_position_scores(expected_leaves[4], expected_leaves[0], distance)
    del options["keep_weights"]
    expected = expire_span_attention_reference(*expected_leaves[:4], query_positions, key_positions,
                                               position_scores=scores, **options)  # fmt: skip
    expected.backward(grad_output)
    assert (output - expected).abs().max() < 1e-13
    for ours, once, theirs in zip(leaves, first, expected_leaves):
        assert (once - theirs.grad).abs().max() < 1e-12
        assert (ours.grad - 2 * theirs.grad).abs().max() < 1e-12
    assert leaves[4].grad.abs().max() > 0 and leaves[3].grad.abs().max() > 0  # the table and the spans learn
    with torch.no_grad():
        inference = expire_span_attention(*leaves[:4], query_positions, key_positions, **positions(leaves), **options)
    assert (inference - expected).abs().max() < 1e-13


@pytest.mark.parametrize("rows", [1, 4, 5])
def test_the_position_products_of_a_few_query_rows_are_the_matrix_product(rows):
    """The learned positions' products q · p_d taken row by row (`by_row`, as a Feedback step asks for its heads: one
    matrix-vector product each on a CPU, up to 4 rows; a matrix product above) equal the matrix product, with the
    query's leading shape, and their gradients too."""
    from memlm.kernels.expire_attention.reference import _position_products

    generator = torch.Generator().manual_seed(5)
    query = torch.randn(1, rows, 1, 5, generator=generator, dtype=torch.float64, requires_grad=True)
    table = torch.randn(7, 5, generator=generator, dtype=torch.float64, requires_grad=True)
    ours, expected = _position_products(query, table, by_row=True), query @ table.mT
    assert ours.shape == expected.shape == (1, rows, 1, 7)
    torch.testing.assert_close(ours, expected, atol=1e-14, rtol=0)
    grad = torch.randn(expected.shape, generator=generator, dtype=torch.float64)
    ours_grads = torch.autograd.grad(ours, (query, table), grad)
    expected_grads = torch.autograd.grad(expected, (query, table), grad)
    for mine, theirs in zip(ours_grads, expected_grads):
        torch.testing.assert_close(mine, theirs, atol=1e-13, rtol=0)


def test_the_official_options_in_float32_stay_close_to_the_float64_reference():
    """The official path computes in float32 for float32 inputs (scores accumulated onto log m, the ε sum): its
    output and gradients stay within float32 rounding of the float64 reference, with spans long and short."""
    generator = torch.Generator().manual_seed(5)
    query = torch.randn(2, 4, 32, 16, generator=generator, dtype=torch.float64)
    key, value = (torch.randn(2, 4, 96, 16, generator=generator, dtype=torch.float64) for _ in range(2))
    spans = torch.rand(2, 96, generator=generator, dtype=torch.float64) * 80
    table = torch.randn(48, 16, generator=generator, dtype=torch.float64) / 4
    query_positions = torch.arange(64, 96)[None].expand(2, -1)
    key_positions = torch.arange(96)[None].expand(2, -1)
    options = {"ramp": 8.0, "attend_to_self": False, "renormalization_epsilon": 1e-3}
    results = []
    for dtype in (torch.float64, torch.float32):
        leaves = [tensor.detach().to(dtype).requires_grad_() for tensor in (query, key, value, spans, table)]
        call = expire_span_attention if dtype == torch.float32 else expire_span_attention_reference
        output = call(*leaves[:4], query_positions, key_positions, relative_positions=leaves[4], **options)
        output.backward(torch.ones_like(output))
        results.append([output] + [leaf.grad for leaf in leaves])
    for expected, ours in zip(*results):
        # float32 rounding (2^-24 relative) accumulated over 96 keys and a few passes
        torch.testing.assert_close(ours.double(), expected, rtol=1e-4, atol=1e-4)
