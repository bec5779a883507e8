"""The chunkwise delta and sum rules against their recurrent references (SPEC §1), and the dispatcher."""

import os

import pytest
import torch
import torch.nn.functional as F

from memlm.kernels import resolve_backend, triton_available
from memlm.kernels.delta_rule import chunk as chunk_module
from memlm.kernels.delta_rule import delta_rule, delta_rule_reference, sum_rule, sum_rule_reference
from memlm.kernels.delta_rule.chunk import (
    delta_rule_chunk,
    delta_rule_step,
    sum_rule_chunk,
    sum_rule_step,
    unit_lower_triangular_inverse,
)

# (key width, value width, how keys and queries are made): L2-normalised as the fla preset; positive and
# sum-normalised as the paper preset; DPFP-3 features of width 2·ν·d = 24 from d = 4, sum-normalised.
FEATURES = [(8, 12, "l2"), (8, 12, "sum"), (24, 4, "dpfp")]


def dpfp(features: torch.Tensor, nu: int) -> torch.Tensor:
    """Paper Eq. 37: r = [relu(x), relu(−x)], φ(x) = concat_{j=1..ν} r ⊙ roll(r, j)."""
    r = torch.cat([F.relu(features), F.relu(-features)], dim=-1)
    return torch.cat([r * torch.roll(r, shifts=j, dims=-1) for j in range(1, nu + 1)], dim=-1)


def feature_vectors(shape, kind: str, generator: torch.Generator) -> torch.Tensor:
    if kind == "l2":
        return F.normalize(torch.randn(shape, generator=generator), dim=-1)
    if kind == "sum":
        positive = torch.rand(shape, generator=generator) + 0.05
        return positive / positive.sum(-1, keepdim=True)
    widened = dpfp(torch.randn(*shape[:-1], shape[-1] // 6, generator=generator), nu=3)
    return widened / (widened.sum(-1, keepdim=True) + 1e-6)


def make_inputs(
    *,
    batch_size=2,
    num_heads=2,
    length=37,
    key_dim=8,
    value_dim=12,
    kind="l2",
    beta=True,
    initial_state=True,
    dtype=torch.float32,
    seed=0,
):
    """query, key, value, beta, initial_state (requires_grad), and random output/state gradients."""
    generator = torch.Generator().manual_seed(seed)
    shape = (batch_size, num_heads, length)
    tensors = {
        "query": feature_vectors((*shape, key_dim), kind, generator),
        "key": feature_vectors((*shape, key_dim), kind, generator),
        "value": torch.randn(*shape, value_dim, generator=generator),
        "beta": torch.rand(shape, generator=generator) if beta else None,
    }
    tensors = {name: None if t is None else t.to(dtype).requires_grad_() for name, t in tensors.items()}
    state = torch.randn(batch_size, num_heads, key_dim, value_dim, generator=generator) if initial_state else None
    tensors["initial_state"] = (
        None
        if state is None
        else state.to(torch.float64 if dtype == torch.float64 else torch.float32).requires_grad_()
    )
    grad_output = torch.randn(*shape, value_dim, generator=generator)
    grad_state = torch.randn(batch_size, num_heads, key_dim, value_dim, generator=generator)
    return tensors, grad_output, grad_state


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in float64, as flash-linear-attention's tests measure kernels against references."""
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).norm() / expected.norm()).item()


def run(rule, tensors, grad_output, grad_state, **kwargs):
    """Output, final state, and a dict of the gradients of the inputs that are not None."""
    arguments = {name: t for name, t in tensors.items() if not (name == "beta" and rule is sum_rule)}
    output, final_state = rule(**arguments, output_final_state=True, **kwargs)
    loss = (output.float() * grad_output).sum() + (final_state * grad_state).sum()
    differentiable = [t for t in arguments.values() if t is not None]
    grads = dict(zip([n for n, t in arguments.items() if t is not None], torch.autograd.grad(loss, differentiable)))
    return output, final_state, grads


def assert_matches(rule, tensors, grad_output, grad_state, *, tolerance, state_tolerance=None, **kwargs):
    output, final_state, grads = run(rule, tensors, grad_output, grad_state, backend="torch", **kwargs)
    expected_output, expected_state, expected_grads = run(rule, tensors, grad_output, grad_state, backend="reference")
    assert output.dtype == tensors["value"].dtype
    assert final_state.dtype == (torch.float64 if tensors["value"].dtype == torch.float64 else torch.float32)
    assert relative_error(output, expected_output) < tolerance
    assert relative_error(final_state, expected_state) < (state_tolerance or tolerance)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        assert grad.dtype == tensors[name].dtype, name
        assert expected_grads[name].abs().max() > 0, name  # the comparison below is not 0 vs 0
        assert relative_error(grad, expected_grads[name]) < tolerance, name


@pytest.mark.parametrize("chunk_size", [4, 16, 64])
@pytest.mark.parametrize(("key_dim", "value_dim", "kind"), FEATURES)
def test_delta_rule_chunk_matches_reference(chunk_size, key_dim, value_dim, kind):
    tensors, grad_output, grad_state = make_inputs(key_dim=key_dim, value_dim=value_dim, kind=kind)
    assert_matches(delta_rule, tensors, grad_output, grad_state, tolerance=1e-5, chunk_size=chunk_size)


@pytest.mark.parametrize("chunk_size", [4, 16, 64])
@pytest.mark.parametrize(("key_dim", "value_dim", "kind"), FEATURES)
def test_sum_rule_chunk_matches_reference(chunk_size, key_dim, value_dim, kind):
    tensors, grad_output, grad_state = make_inputs(key_dim=key_dim, value_dim=value_dim, kind=kind)
    assert_matches(sum_rule, tensors, grad_output, grad_state, tolerance=1e-5, chunk_size=chunk_size)


@pytest.mark.parametrize(("beta", "initial_state"), [(False, True), (True, False), (False, False)])
@pytest.mark.parametrize("length", [16, 37])
def test_delta_rule_without_beta_or_initial_state(beta, initial_state, length):
    tensors, grad_output, grad_state = make_inputs(length=length, beta=beta, initial_state=initial_state)
    assert_matches(delta_rule, tensors, grad_output, grad_state, tolerance=1e-5, chunk_size=16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rule", [delta_rule, sum_rule])
def test_low_precision_inputs_keep_a_float32_state(rule, dtype):
    # Both paths read the same low-precision inputs; the state is float32 in both, so it agrees far more
    # tightly than the low-precision output and gradients, which are rounded once at the end.
    tensors, grad_output, grad_state = make_inputs(length=50, kind="l2", dtype=dtype)
    assert_matches(rule, tensors, grad_output, grad_state, tolerance=1e-2, state_tolerance=1e-5, chunk_size=16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_output_is_close_to_float32(dtype):
    tensors, _, _ = make_inputs(length=50)
    low = {name: None if t is None else t.detach().to(dtype) for name, t in tensors.items()}
    low["initial_state"] = tensors["initial_state"].detach()
    with torch.no_grad():
        output, state = delta_rule(**low, output_final_state=True)
        expected_output, expected_state = delta_rule(**tensors, output_final_state=True, backend="reference")
    assert output.dtype == dtype and state.dtype == torch.float32
    assert relative_error(output, expected_output) < 1e-2
    assert relative_error(state, expected_state) < 1e-2


@pytest.mark.parametrize("rule", [delta_rule, sum_rule])
def test_gradcheck_float64(rule):
    tensors, _, _ = make_inputs(batch_size=1, num_heads=2, length=7, key_dim=3, value_dim=4, dtype=torch.float64)
    names = (
        ["query", "key", "value", "beta", "initial_state"]
        if rule is delta_rule
        else ["query", "key", "value", "initial_state"]
    )

    def function(*inputs):
        arguments = dict(zip(names, inputs))
        state = arguments.pop("initial_state")
        return rule(**arguments, initial_state=state, output_final_state=True, chunk_size=3, backend="torch")

    inputs = tuple(tensors[name] for name in names)
    output, state = function(*inputs)
    assert output.dtype == torch.float64 and state.dtype == torch.float64
    assert torch.autograd.gradcheck(function, inputs)


def test_gradcheck_float64_without_beta():
    tensors, _, _ = make_inputs(batch_size=1, num_heads=1, length=5, key_dim=3, value_dim=2, dtype=torch.float64)
    assert torch.autograd.gradcheck(
        lambda query, key, value: delta_rule_chunk(query, key, value, chunk_size=2)[0],
        (tensors["query"], tensors["key"], tensors["value"]),
    )


@pytest.mark.parametrize("used", ["output", "final_state"])
def test_gradients_when_only_one_result_is_used(used):
    # The unused result's gradient reaches the backward as None.
    tensors, grad_output, grad_state = make_inputs()
    names = ["key", "value", "beta", "initial_state"] + (["query"] if used == "output" else [])

    def gradients(backend):
        output, state = delta_rule(**tensors, output_final_state=True, backend=backend, chunk_size=16)
        loss = (output * grad_output).sum() if used == "output" else (state * grad_state).sum()
        return torch.autograd.grad(loss, [tensors[name] for name in names])

    for name, grad, expected in zip(names, gradients("torch"), gradients("reference")):
        assert relative_error(grad, expected) < 1e-5, name


@pytest.mark.parametrize("length", [1, 5, 37])
@pytest.mark.parametrize("backend", ["torch", "reference", "triton"])
@pytest.mark.parametrize("rule", [delta_rule, sum_rule])
def test_a_final_state_with_gradients_is_not_a_view(rule, backend, length):
    """A layer returns the final state as its cache's new one: FSDP2 warns about a view among a wrapped module's outputs
    (an in-place operation on it would drop FSDP's pre-backward hook), as it did for the chunkwise kernels' (B·H, ·, ·)
    results reshaped to (B, H, ·, ·)."""
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernels run on CPU tensors only inside Triton's interpreter")
    tensors, _, _ = make_inputs(length=length)
    if rule is sum_rule:
        del tensors["beta"]
    output, state = rule(**tensors, output_final_state=True, chunk_size=4, backend=backend)
    assert state.requires_grad and state._base is None
    expected = (delta_rule_reference if rule is delta_rule else sum_rule_reference)(**tensors, output_final_state=True)
    torch.testing.assert_close(state, expected[1], rtol=1e-5, atol=1e-5)


def time_slice(tensors, rule, start, end):
    """The sequence inputs of ``rule`` (beta only for the delta rule) restricted to tokens [start, end)."""
    names = ["query", "key", "value"] + (["beta"] if rule is delta_rule else [])
    return {name: tensors[name][:, :, start:end] for name in names}


@pytest.mark.parametrize("rule", [delta_rule, sum_rule])
def test_chained_calls_equal_one_call(rule):
    tensors, grad_output, grad_state = make_inputs(length=45)
    full_output, full_state, full_grads = run(rule, tensors, grad_output, grad_state, chunk_size=8)

    split = 19  # neither part is a whole number of chunks
    head_output, middle_state = rule(
        **time_slice(tensors, rule, 0, split),
        initial_state=tensors["initial_state"],
        output_final_state=True,
        chunk_size=8,
    )
    tail_output, final_state = rule(
        **time_slice(tensors, rule, split, None), initial_state=middle_state, output_final_state=True, chunk_size=8
    )
    output = torch.cat([head_output, tail_output], dim=2)
    assert relative_error(output, full_output) < 1e-5
    assert relative_error(final_state, full_state) < 1e-5
    # Gradients flow back through the state handed from the first call to the second.
    loss = (output * grad_output).sum() + (final_state * grad_state).sum()
    grads = torch.autograd.grad(loss, [tensors[name] for name in full_grads])
    for name, grad in zip(full_grads, grads):
        assert relative_error(grad, full_grads[name]) < 1e-5, name


@pytest.mark.parametrize(
    ("rule", "reference", "step"),
    [(delta_rule, delta_rule_reference, delta_rule_step), (sum_rule, sum_rule_reference, sum_rule_step)],
)
def test_single_token_step(rule, reference, step):
    tensors, grad_output, grad_state = make_inputs(length=1)
    arguments = {n: t for n, t in tensors.items() if not (n == "beta" and rule is sum_rule)}
    output, state = rule(**arguments, output_final_state=True)
    # The dispatcher takes the O(1) step for T == 1, not the padded chunk path.
    step_output, step_state = step(**arguments, output_final_state=True)
    assert torch.equal(output, step_output) and torch.equal(state, step_state)
    assert state.dtype == torch.float32
    assert_matches(rule, tensors, grad_output, grad_state, tolerance=1e-6)  # outputs, state and gradients


@pytest.mark.parametrize("beta", [True, False])
@pytest.mark.parametrize("initial_state", [True, False])
def test_delta_rule_step_matches_reference_in_float64(beta, initial_state):
    # The decoding step (one bmm per product over B·H rows) against the recurrent loop, with and without β and an
    # entering state, output and gradients.
    tensors, grad_output, grad_state = make_inputs(
        length=1, beta=beta, initial_state=initial_state, dtype=torch.float64
    )
    assert_matches(delta_rule, tensors, grad_output, grad_state, tolerance=1e-12)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("rule", [delta_rule, sum_rule])
def test_a_step_in_place_writes_the_new_state_into_the_old_one(rule, backend):
    """`in_place`: a decoding cache's memory is updated where it lies (no new state to copy back), with the numbers of
    a step that returns a new state; what cannot be updated in place (gradients, several tokens) returns a new state
    and leaves the given one as it was."""
    if backend == "triton":
        pytest.importorskip("triton")
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("the Triton step runs on CPU tensors only inside Triton's interpreter")
    tensors, _, _ = make_inputs(length=1)
    arguments = {n: t.detach() for n, t in tensors.items() if not (n == "beta" and rule is sum_rule)}
    state = arguments.pop("initial_state")
    expected_output, expected_state = rule(**arguments, initial_state=state, output_final_state=True, backend=backend)
    updated = state.clone()
    with torch.no_grad():
        output, final_state = rule(**arguments, initial_state=updated, output_final_state=True, backend=backend,
                                   in_place=True)  # fmt: skip
    assert final_state is updated
    torch.testing.assert_close(output, expected_output, rtol=0, atol=1e-6)
    torch.testing.assert_close(updated, expected_state, rtol=0, atol=1e-6)
    # A transposed state: updated where it lies (the torch step) or replaced (the Triton kernel takes row-major states).
    transposed = state.mT.contiguous().mT
    with torch.no_grad():
        output, final_state = rule(**arguments, initial_state=transposed, output_final_state=True, backend=backend,
                                   in_place=True)  # fmt: skip
    torch.testing.assert_close(final_state, expected_state, rtol=0, atol=1e-6)
    assert (final_state is transposed) == (backend == "torch")
    # Not in place: with autograd, and over two tokens.
    for case in ("gradients", "tokens"):
        given = state.clone().requires_grad_(case == "gradients")
        inputs = {n: torch.cat([t, t], dim=2) if case == "tokens" else t for n, t in arguments.items()}
        before = given.detach().clone()
        _, final_state = rule(**inputs, initial_state=given, output_final_state=True, backend=backend, in_place=True)
        assert final_state is not given and torch.equal(given.detach(), before), case


@pytest.mark.parametrize("rule", [delta_rule, sum_rule])
def test_token_by_token_decoding_equals_reference(rule):
    tensors, _, _ = make_inputs(length=12)
    arguments = {n: t.detach() for n, t in tensors.items() if t is not None and not (n == "beta" and rule is sum_rule)}
    state = arguments.pop("initial_state")
    outputs = []
    for t in range(12):
        step = {n: x[:, :, t : t + 1] for n, x in arguments.items()}
        output, state = rule(**step, initial_state=state, output_final_state=True)
        outputs.append(output)
    expected_output, expected_state = rule(
        **arguments, initial_state=tensors["initial_state"].detach(), output_final_state=True, backend="reference"
    )
    assert relative_error(torch.cat(outputs, dim=2), expected_output) < 1e-5
    assert relative_error(state, expected_state) < 1e-5


@pytest.mark.parametrize("chunk_size", [4, 16])
def test_no_grad_path_in_segments_matches_reference(monkeypatch, chunk_size):
    # Without autograd the chunk path runs the sequence in segments; make them small so T = 53 spans several.
    monkeypatch.setattr(chunk_module, "_SEGMENT_ELEMENTS", 2 * 2 * chunk_size * (8 + 12) * 2)
    tensors, _, _ = make_inputs(length=53)
    with torch.no_grad():
        output, state = delta_rule(**tensors, output_final_state=True, chunk_size=chunk_size)
        expected_output, expected_state = delta_rule(**tensors, output_final_state=True, backend="reference")
    assert output.shape == expected_output.shape
    assert relative_error(output, expected_output) < 1e-5
    assert relative_error(state, expected_state) < 1e-5


def test_final_state_only_when_asked():
    tensors, _, _ = make_inputs()
    for backend in ("torch", "reference"):
        output, state = delta_rule(**tensors, backend=backend)
        assert state is None and output.shape == tensors["value"].shape
        output, state = sum_rule(tensors["query"], tensors["key"], tensors["value"], backend=backend)
        assert state is None and output.shape == tensors["value"].shape


def test_backend_argument_and_environment_variable(monkeypatch):
    tensors, _, _ = make_inputs()
    with torch.no_grad():
        reference_output, _ = delta_rule_reference(**tensors)
        chunk_output, _ = delta_rule_chunk(**tensors)
        assert not torch.equal(reference_output, chunk_output)  # the two paths are distinguishable

        monkeypatch.delenv("MEMLM_KERNELS", raising=False)
        assert torch.equal(delta_rule(**tensors)[0], chunk_output)
        assert torch.equal(delta_rule(**tensors, backend="reference")[0], reference_output)

        monkeypatch.setenv("MEMLM_KERNELS", "reference")
        assert torch.equal(delta_rule(**tensors)[0], reference_output)
        assert torch.equal(delta_rule(**tensors, backend="torch")[0], chunk_output)  # the argument wins

        sum_reference, _ = sum_rule_reference(tensors["query"], tensors["key"], tensors["value"])
        sum_chunk, _ = sum_rule_chunk(tensors["query"], tensors["key"], tensors["value"])
        assert not torch.equal(sum_reference, sum_chunk)
        assert torch.equal(sum_rule(tensors["query"], tensors["key"], tensors["value"])[0], sum_reference)
        monkeypatch.setenv("MEMLM_KERNELS", "torch")
        assert torch.equal(sum_rule(tensors["query"], tensors["key"], tensors["value"])[0], sum_chunk)


def test_resolve_backend(monkeypatch):
    monkeypatch.delenv("MEMLM_KERNELS", raising=False)
    assert resolve_backend(None) == "torch"
    assert resolve_backend(None, torch.device("cpu")) == "torch"
    assert resolve_backend(None, torch.device("cuda", 0)) == ("triton" if triton_available() else "torch")
    monkeypatch.setenv("MEMLM_KERNELS", "")
    assert resolve_backend(None) == "torch"
    monkeypatch.setenv("MEMLM_KERNELS", "reference")
    assert resolve_backend(None) == "reference"
    assert resolve_backend("torch") == "torch"


def test_bad_backend_values(monkeypatch):
    tensors, _, _ = make_inputs()
    with pytest.raises(ValueError, match=r"argument backend='cuda'.*'torch', 'triton', 'reference'"):
        delta_rule(**tensors, backend="cuda")
    monkeypatch.setenv("MEMLM_KERNELS", "naive")
    with pytest.raises(ValueError, match=r"MEMLM_KERNELS='naive'.*'torch', 'triton', 'reference'"):
        sum_rule(tensors["query"], tensors["key"], tensors["value"])
    monkeypatch.setenv("MEMLM_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # CPU tensors outside the interpreter
    if triton_available():
        with pytest.raises(ValueError, match=r"'triton' kernel backend runs on CUDA tensors.*got tensors on cpu"):
            delta_rule(**tensors)
    else:
        with pytest.raises(ValueError, match=r"MEMLM_KERNELS='triton' needs the triton package"):
            delta_rule(**tensors)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"query": torch.zeros(2, 2, 37, 9)},
            r"query and key must have the same shape.*\(2, 2, 37, 9\).*\(2, 2, 37, 8\)",
        ),
        ({"value": torch.zeros(2, 2, 36, 12)}, r"value must share.*\(2, 2, 36, 12\).*\(2, 2, 37, 8\)"),
        (
            {"key": torch.zeros(2, 37, 8), "query": torch.zeros(2, 37, 8)},
            r"query must be a 4-dimensional tensor.*\(2, 37, 8\)",
        ),
        ({"beta": torch.zeros(2, 2, 36)}, r"beta must have shape .* = \(2, 2, 37\), got \(2, 2, 36\)"),
        (
            {"initial_state": torch.zeros(2, 2, 12, 8)},
            r"initial_state must have shape .* = \(2, 2, 8, 12\), got \(2, 2, 12, 8\)",
        ),
        ({"chunk_size": 0}, r"chunk_size must be a positive integer, got 0"),
        ({"chunk_size": 4.0}, r"chunk_size must be a positive integer, got 4.0"),
        (
            {
                "query": torch.zeros(2, 2, 0, 8),
                "key": torch.zeros(2, 2, 0, 8),
                "value": torch.zeros(2, 2, 0, 12),
                "beta": None,
            },
            r"at least one token",
        ),
        ({"value": torch.zeros(2, 2, 37, 12, dtype=torch.long)}, r"value must be a floating-point tensor"),
    ],
)
def test_bad_inputs_raise_value_errors(change, message):
    tensors, _, _ = make_inputs()
    arguments = {**{n: None if t is None else t.detach() for n, t in tensors.items()}, **change}
    with pytest.raises(ValueError, match=message):
        delta_rule(**arguments)
    if "beta" not in change or change.get("beta") is None:
        arguments.pop("beta")
        with pytest.raises(ValueError, match=message):
            sum_rule(**arguments)


@pytest.mark.parametrize("backend", ["torch", "reference", "triton"])
def test_packed_sequences_equal_each_sequence_alone(backend):
    if backend == "triton":
        pytest.importorskip("triton")
        if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("Triton kernels need CUDA or Triton's interpreter")
    generator = torch.Generator().manual_seed(0)
    lengths = [5, 0, 11, 3]
    cu_seqlens = torch.tensor([0, 5, 5, 16, 19])
    query, key, value = (torch.randn(1, 2, 19, 8, generator=generator, requires_grad=True) for _ in range(3))
    beta = torch.rand(1, 2, 19, generator=generator)
    initial = torch.randn(len(lengths), 2, 8, 8, generator=generator)
    output, final = delta_rule(query, key, value, beta, initial_state=initial, output_final_state=True,
                               chunk_size=4, cu_seqlens=cu_seqlens, backend=backend)  # fmt: skip
    # The Triton kernels multiply float32 with TF32 (10-bit mantissa, 2⁻¹¹ relative per rounding; see
    # triton_chunk.py), the others in float32. The keys are not normalised, so the state grows to ~300 and a small
    # output carries the round-off of the large terms summed into it: 2.4e-5 at an output of 1.1 seen under
    # ATEN_CPU_CAPABILITY=default (another processor's order); float64 agrees to 2e-13.
    tolerance = 1e-3 if backend == "triton" else 1e-4
    start = 0
    for index, length in enumerate(lengths):
        pieces = [tensor[:, :, start : start + length] for tensor in (query, key, value, beta)]
        if length == 0:
            torch.testing.assert_close(final[index], initial[index])  # nothing read: the state passes through
            continue
        alone, alone_final = delta_rule_reference(*pieces, initial[index : index + 1], True)
        torch.testing.assert_close(output[:, :, start : start + length], alone, atol=tolerance, rtol=tolerance)
        torch.testing.assert_close(final[index : index + 1], alone_final, atol=tolerance, rtol=tolerance)
        start += length
    output.sum().backward()
    assert all(tensor.grad is not None and tensor.grad.abs().sum() > 0 for tensor in (query, key, value))
    with pytest.raises(ValueError, match="batch size 1 and offsets rising from 0 to the 19 tokens"):
        delta_rule(query, key, value, beta, cu_seqlens=torch.tensor([0, 5, 18]), backend=backend)


class DeviceReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts reads of a tensor's values back to Python, each a GPU→CPU sync on a GPU: `int(tensor)` and `.item()`
    (seen by the dispatcher) and `.tolist()` (not dispatched: counted by wrapping it while the mode is on), except
    on `host`, the caller's own host copy of the offsets."""

    def __init__(self, host=None):
        super().__init__()
        self.count = 0
        self.host = host

    def __enter__(self):
        tolist = torch.Tensor.tolist

        def counted(tensor):
            self.count += tensor is not self.host
            return tolist(tensor)

        self._tolist, torch.Tensor.tolist = tolist, counted
        return super().__enter__()

    def __exit__(self, *exception):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exception)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("backend", ["torch", "reference", "triton"])
@pytest.mark.parametrize("rule", [delta_rule, sum_rule])
def test_host_offsets_spare_every_read_of_cu_seqlens(rule, backend):
    """With `cu_seqlens_cpu` no backend reads the offsets back from `cu_seqlens` (the validation neither); without
    it they are read, and the results are the same."""
    if backend == "triton":
        pytest.importorskip("triton")
        if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("Triton kernels need CUDA or Triton's interpreter")
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(1, 2, 19, 8, generator=generator) for _ in range(3))
    extra = (torch.rand(1, 2, 19, generator=generator),) if rule is delta_rule else ()
    cu_seqlens = torch.tensor([0, 5, 5, 16, 19])
    with torch.no_grad():
        with DeviceReads() as reads_without:
            expected = rule(query, key, value, *extra, cu_seqlens=cu_seqlens, output_final_state=True, backend=backend)
        for host in ([0, 5, 5, 16, 19], torch.tensor([0, 5, 5, 16, 19])):
            with DeviceReads(host) as reads_with:
                output = rule(query, key, value, *extra, cu_seqlens=cu_seqlens, cu_seqlens_cpu=host,
                              output_final_state=True, backend=backend)  # fmt: skip
            assert reads_with.count == 0 < reads_without.count
            assert all(torch.equal(one, other) for one, other in zip(output, expected))
    with pytest.raises(ValueError, match="cu_seqlens_cpu must hold the same offsets as cu_seqlens: got 3 host"):
        rule(query, key, value, *extra, cu_seqlens=cu_seqlens, cu_seqlens_cpu=[0, 5, 19], backend=backend)
    with pytest.raises(ValueError, match="cu_seqlens_cpu is the host copy of cu_seqlens: give cu_seqlens"):
        rule(query, key, value, *extra, cu_seqlens_cpu=[0, 19], backend=backend)
    with pytest.raises(ValueError, match="cu_seqlens_cpu must be a list of ints or an integer CPU tensor"):
        rule(query, key, value, *extra, cu_seqlens=cu_seqlens, cu_seqlens_cpu=[0.0, 5, 5, 16, 19], backend=backend)


def test_runs_under_bfloat16_autocast_with_a_float32_state():
    """Under autocast the kernels keep their own precision (a bfloat16 triangular solve does not exist on CPU)."""
    tensors, _, _ = make_inputs()
    inputs = {name: tensor.to(torch.bfloat16) if name in ("query", "key", "value") else tensor
              for name, tensor in tensors.items()}  # fmt: skip
    expected, expected_state = delta_rule(**inputs, output_final_state=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        output, state = delta_rule(**inputs, output_final_state=True)
        sum_output, _ = sum_rule(inputs["query"], inputs["key"], inputs["value"])
    assert output.dtype == torch.bfloat16 and state.dtype == torch.float32
    assert torch.equal(output, expected) and torch.equal(state, expected_state)
    assert sum_output.dtype == torch.bfloat16


def test_backward_called_inside_autocast_keeps_its_precision():
    tensors, _, _ = make_inputs()
    leaves = {name: tensor.detach().requires_grad_() for name, tensor in tensors.items()}
    expected = torch.autograd.grad(delta_rule(**leaves)[0].sum(), list(leaves.values()))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        gradients = torch.autograd.grad(delta_rule(**leaves)[0].sum(), list(leaves.values()))
    for gradient, reference in zip(gradients, expected):
        assert gradient.dtype == reference.dtype and torch.equal(gradient, reference)


def _nan_inputs(length=20, batch_size=2, num_heads=2, width=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    shape = (batch_size, num_heads, length)
    query = torch.randn(*shape, width, generator=generator)
    key = torch.nn.functional.normalize(torch.randn(*shape, width, generator=generator), dim=-1)
    value = torch.randn(*shape, width, generator=generator)
    beta = torch.rand(shape, generator=generator)
    return query, key, value, beta


@pytest.mark.parametrize("backend", ["torch", "reference", "triton"])
@pytest.mark.parametrize(
    ("rule", "where", "value"),
    [("delta", "key", float("nan")), ("delta", "value", float("inf")), ("delta", "beta", float("nan")),
     ("sum", "key", float("nan")), ("sum", "value", float("inf"))],  # the sum rule takes no β
)  # fmt: skip
def test_a_non_finite_input_at_t_leaves_every_output_before_t_as_it_was(backend, rule, where, value):
    """Causality with non-finite inputs (issue 33): a NaN or inf at position t — which a chunkwise product would
    multiply into the earlier rows of its chunk (0 · NaN = NaN) — leaves the outputs before t, of that row and head,
    equal to the outputs without it; from t on they are NaN, and so is that row's and head's final state."""
    if backend == "triton":
        pytest.importorskip("triton")
    query, key, value_, beta = _nan_inputs()
    run = delta_rule if rule == "delta" else lambda q, k, v, b, **options: sum_rule(q, k, v, **options)
    options = {"chunk_size": 8, "backend": backend, "output_final_state": True}
    clean, clean_state = run(query, key, value_, beta, **options)
    inputs = {"key": key.clone(), "value": value_.clone(), "beta": beta.clone()}
    if where == "beta":
        inputs["beta"][0, 1, 13] = value
    else:
        inputs[where][0, 1, 13, 2] = value
    output, state = run(query, inputs["key"], inputs["value"], inputs["beta"], **options)
    assert torch.equal(output[0, 1, :13], clean[0, 1, :13])
    assert output[0, 1, 13:].isnan().all() and state[0, 1].isnan().all()
    assert torch.equal(output[1], clean[1]) and torch.equal(output[0, 0], clean[0, 0])
    torch.testing.assert_close(state[1], clean_state[1])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_non_finite_input_stays_inside_its_packed_sequence(backend):
    if backend == "triton":
        pytest.importorskip("triton")
    query, key, value, beta = _nan_inputs(batch_size=1)
    cu_seqlens = torch.tensor([0, 9, 20])
    options = {"chunk_size": 8, "backend": backend, "output_final_state": True, "cu_seqlens": cu_seqlens}
    clean, clean_state = delta_rule(query, key, value, beta, **options)
    value = value.clone()
    value[0, 0, 4, 1] = float("nan")  # in the first sequence
    output, state = delta_rule(query, key, value, beta, **options)
    assert torch.equal(output[0, 0, :4], clean[0, 0, :4]) and output[0, 0, 4:9].isnan().all()
    torch.testing.assert_close(output[0, 0, 9:], clean[0, 0, 9:])  # the second sequence never saw it
    assert state[0, 0].isnan().all() and torch.isfinite(state[1]).all()
    torch.testing.assert_close(state[1], clean_state[1])


@pytest.mark.parametrize("size", [1, 2, 3, 7, 8, 33, 64])
def test_the_inverse_from_products_is_the_triangular_solve(size):
    """(I + L)⁻¹ from ⌈log₂ C⌉ products (what an exported graph computes: ONNX has no triangular solve) is
    solve_triangular's, reading only the strictly lower triangle, for chunk sizes that are and are not powers of two."""
    torch.manual_seed(size)
    matrix = torch.randn(3, size, size, dtype=torch.float64) * 0.3
    identity = torch.eye(size, dtype=torch.float64).expand_as(matrix)
    expected = torch.linalg.solve_triangular(matrix, identity, upper=False, unitriangular=True)
    torch.testing.assert_close(unit_lower_triangular_inverse(matrix, size), expected, rtol=1e-12, atol=1e-12)
