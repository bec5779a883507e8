"""The fused recurrent Triton delta and sum rules against the recurrent references and the PyTorch steps.

Without CUDA the kernels run in Triton's interpreter on CPU tensors (tests/conftest.py sets TRITON_INTERPRET=1),
on small shapes; the tests marked ``gpu`` run realistic decoding shapes on CUDA.
"""

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from memlm.kernels.delta_rule import triton_recurrent  # noqa: E402
from memlm.kernels.delta_rule.chunk import delta_rule_step, sum_rule_step  # noqa: E402
from memlm.kernels.delta_rule.reference import delta_rule_reference, sum_rule_reference  # noqa: E402
from memlm.kernels.delta_rule.triton_recurrent import delta_rule_step_triton, sum_rule_step_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (key width, value width): d_k ≠ d_v both ways, d_k = 2·d_v, and non-power-of-two widths.
WIDTHS = [(8, 12), (16, 8), (24, 24)]


def relative_rms_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """RMS of the difference over the RMS of the expected tensor, in float64."""
    expected = expected.double()
    return ((actual.double() - expected).norm() / expected.norm()).item()


def make_inputs(batch_size=2, num_heads=2, length=1, key_dim=8, value_dim=12, *, beta=True, state=True, dtype=None):
    """L2-normalised keys and queries (as the fla preset), random values, β ∈ (0, 1), a random state."""
    generator = torch.Generator().manual_seed(length * 1000 + key_dim * 10 + value_dim)
    shape = (batch_size, num_heads, length)
    tensors = {
        "query": F.normalize(torch.randn(*shape, key_dim, generator=generator), dim=-1),
        "key": F.normalize(torch.randn(*shape, key_dim, generator=generator), dim=-1),
        "value": torch.randn(*shape, value_dim, generator=generator),
        "beta": torch.rand(shape, generator=generator) if beta else None,
        "initial_state": torch.randn(batch_size, num_heads, key_dim, value_dim, generator=generator)
        if state
        else None,
    }
    return {
        name: None
        if tensor is None
        else tensor.to(DEVICE, dtype if dtype is not None and name != "initial_state" else tensor.dtype)
        for name, tensor in tensors.items()
    }


def without_beta(tensors: dict) -> dict:
    return {name: tensor for name, tensor in tensors.items() if name != "beta"}


@pytest.mark.parametrize("key_dim, value_dim", WIDTHS)
@pytest.mark.parametrize("length", [1, 7])
@pytest.mark.parametrize("with_beta", [True, False], ids=["beta", "no_beta"])
@pytest.mark.parametrize("with_state", [True, False], ids=["state", "zero_state"])
def test_delta_rule_matches_reference(key_dim, value_dim, length, with_beta, with_state):
    tensors = make_inputs(length=length, key_dim=key_dim, value_dim=value_dim, beta=with_beta, state=with_state)
    output, final_state = delta_rule_step_triton(**tensors, output_final_state=True)
    expected_output, expected_state = delta_rule_reference(**tensors, output_final_state=True)
    assert output.shape == expected_output.shape and output.dtype == torch.float32
    assert final_state.shape == expected_state.shape and final_state.dtype == torch.float32
    assert relative_rms_error(output, expected_output) < 1e-5
    assert relative_rms_error(final_state, expected_state) < 1e-5
    if length == 1:
        step_output, step_state = delta_rule_step(**tensors, output_final_state=True)
        assert relative_rms_error(output, step_output) < 1e-5
        assert relative_rms_error(final_state, step_state) < 1e-5


@pytest.mark.parametrize("key_dim, value_dim", WIDTHS)
@pytest.mark.parametrize("length", [1, 7])
@pytest.mark.parametrize("with_state", [True, False], ids=["state", "zero_state"])
def test_sum_rule_matches_reference(key_dim, value_dim, length, with_state):
    tensors = without_beta(make_inputs(length=length, key_dim=key_dim, value_dim=value_dim, state=with_state))
    output, final_state = sum_rule_step_triton(**tensors, output_final_state=True)
    expected_output, expected_state = sum_rule_reference(**tensors, output_final_state=True)
    assert output.shape == expected_output.shape and final_state.dtype == torch.float32
    assert relative_rms_error(output, expected_output) < 1e-5
    assert relative_rms_error(final_state, expected_state) < 1e-5
    if length == 1:
        step_output, step_state = sum_rule_step(**tensors, output_final_state=True)
        assert relative_rms_error(output, step_output) < 1e-5
        assert relative_rms_error(final_state, step_state) < 1e-5


def test_final_state_only_on_request():
    tensors = make_inputs(length=3)
    output, final_state = delta_rule_step_triton(**tensors)
    assert final_state is None
    assert relative_rms_error(output, delta_rule_reference(**tensors)[0]) < 1e-5
    output, final_state = sum_rule_step_triton(**without_beta(tensors), output_final_state=False)
    assert final_state is None
    assert relative_rms_error(output, sum_rule_reference(**without_beta(tensors))[0]) < 1e-5


@pytest.mark.parametrize("rule", ["delta", "sum"])
def test_five_single_steps_equal_one_five_token_call(rule):
    tensors = make_inputs(length=5, key_dim=24, value_dim=12)
    run = delta_rule_step_triton if rule == "delta" else sum_rule_step_triton
    if rule == "sum":
        tensors = without_beta(tensors)
    whole_output, whole_state = run(**tensors, output_final_state=True)

    state, outputs = tensors["initial_state"], []
    for token in range(5):
        step = {name: tensor[:, :, token : token + 1] for name, tensor in tensors.items() if name != "initial_state"}
        output, state = run(**step, initial_state=state, output_final_state=True)
        outputs.append(output)
    assert relative_rms_error(torch.cat(outputs, dim=2), whole_output) < 1e-6
    assert relative_rms_error(state, whole_state) < 1e-6


def test_initial_state_is_not_modified():
    tensors = make_inputs(length=4)
    saved = tensors["initial_state"].clone()
    _, final_state = delta_rule_step_triton(**tensors, output_final_state=True)
    assert torch.equal(tensors["initial_state"], saved)
    assert not torch.equal(final_state, saved)  # the state did move, so the check above means something
    sum_rule_step_triton(**without_beta(tensors), output_final_state=True)
    assert torch.equal(tensors["initial_state"], saved)


@pytest.mark.parametrize("rule", ["delta", "sum"])
def test_in_place_updates_the_given_state(rule):
    tensors = make_inputs(length=3, key_dim=16, value_dim=8)
    run, reference = (
        (delta_rule_step_triton, delta_rule_reference)
        if rule == "delta"
        else (sum_rule_step_triton, sum_rule_reference)
    )
    if rule == "sum":
        tensors = without_beta(tensors)
    expected_output, expected_state = reference(**tensors, output_final_state=True)
    state = tensors["initial_state"]
    output, final_state = run(**tensors, output_final_state=True, in_place=True)
    assert final_state is state
    assert relative_rms_error(state, expected_state) < 1e-5
    assert relative_rms_error(output, expected_output) < 1e-5


def test_in_place_needs_a_contiguous_compute_dtype_state():
    tensors = make_inputs()
    with pytest.raises(ValueError, match="initial_state, which must then be given"):
        delta_rule_step_triton(**{**tensors, "initial_state": None}, in_place=True)
    with pytest.raises(ValueError, match="contiguous initial_state of dtype torch.float32"):
        delta_rule_step_triton(**{**tensors, "initial_state": tensors["initial_state"].half()}, in_place=True)
    transposed = tensors["initial_state"].mT.contiguous().mT
    with pytest.raises(ValueError, match="contiguous: False"):
        delta_rule_step_triton(**{**tensors, "initial_state": transposed}, in_place=True)


def test_strided_inputs():
    """Queries, keys and values sliced out of a (B, T, H, d) layout, and a transposed state, are read as is."""
    batch_size, length, num_heads, key_dim, value_dim = 2, 5, 3, 8, 12
    generator = torch.Generator().manual_seed(1)
    packed = torch.randn(batch_size, length, num_heads, 2 * key_dim + value_dim, generator=generator).to(DEVICE)
    query = F.normalize(packed[..., :key_dim], dim=-1).transpose(1, 2)
    key = F.normalize(packed[..., key_dim : 2 * key_dim], dim=-1).transpose(1, 2)
    value = packed[..., 2 * key_dim :].transpose(1, 2)
    beta = torch.rand(batch_size, length, num_heads, generator=generator).to(DEVICE).transpose(1, 2)
    state = torch.randn(batch_size, num_heads, value_dim, key_dim, generator=generator).to(DEVICE).mT
    assert not (value.is_contiguous() or beta.is_contiguous() or state.is_contiguous())
    output, final_state = delta_rule_step_triton(query, key, value, beta, state, True)
    expected_output, expected_state = delta_rule_reference(query, key, value, beta, state, True)
    assert relative_rms_error(output, expected_output) < 1e-5
    assert relative_rms_error(final_state, expected_state) < 1e-5


def test_wide_keys_split_the_value_columns():
    """d_k = 256 makes the programs take blocks of 16 value columns: 40 columns are 3 blocks, the last masked."""
    tensors = make_inputs(batch_size=1, num_heads=2, length=3, key_dim=256, value_dim=40)
    output, final_state = delta_rule_step_triton(**tensors, output_final_state=True)
    expected_output, expected_state = delta_rule_reference(**tensors, output_final_state=True)
    assert relative_rms_error(output, expected_output) < 1e-5
    assert relative_rms_error(final_state, expected_state) < 1e-5


@pytest.mark.parametrize("rule", ["delta", "sum"])
def test_keys_wider_than_the_register_tile(rule):
    """d_k = 1100 (above MAX_REGISTER_KEY_DIM = 1024): the state stays in memory, in slices of 128 rows."""
    tensors = make_inputs(batch_size=1, num_heads=1, length=2, key_dim=1100, value_dim=8)
    run, reference = (
        (delta_rule_step_triton, delta_rule_reference)
        if rule == "delta"
        else (sum_rule_step_triton, sum_rule_reference)
    )
    if rule == "sum":
        tensors = without_beta(tensors)
    output, final_state = run(**tensors, output_final_state=True)
    expected_output, expected_state = reference(**tensors, output_final_state=True)
    assert relative_rms_error(output, expected_output) < 1e-5
    assert relative_rms_error(final_state, expected_state) < 1e-5


@pytest.mark.parametrize("mode", ["final_state", "no_final_state", "in_place", "zero_state"])
def test_state_in_memory_in_several_slices(monkeypatch, mode):
    # Slices of 16 rows over d_k = 40 (the last one partly masked), and every way the state can come and go.
    monkeypatch.setattr(triton_recurrent, "MAX_REGISTER_KEY_DIM", 16)
    monkeypatch.setattr(triton_recurrent, "_WIDE_BLOCK_K", 16)
    tensors = make_inputs(length=5, key_dim=40, value_dim=12, state=mode != "zero_state")
    expected_output, expected_state = delta_rule_reference(**tensors, output_final_state=True)
    saved = None if mode == "zero_state" else tensors["initial_state"].clone()
    output, final_state = delta_rule_step_triton(
        **tensors, output_final_state=mode != "no_final_state", in_place=mode == "in_place"
    )
    assert relative_rms_error(output, expected_output) < 1e-5
    if mode == "no_final_state":
        assert final_state is None
    else:
        assert relative_rms_error(final_state, expected_state) < 1e-5
    if mode == "in_place":
        assert final_state is tensors["initial_state"]
    elif saved is not None:
        assert torch.equal(tensors["initial_state"], saved)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs_compute_in_float32(dtype):
    tensors = make_inputs(length=4, key_dim=24, value_dim=12, dtype=dtype)
    output, final_state = delta_rule_step_triton(**tensors, output_final_state=True)
    assert output.dtype == dtype and final_state.dtype == torch.float32
    # The reference upcasts the same low-precision inputs, so only the rounding of the output differs.
    expected_output, expected_state = delta_rule_reference(**tensors, output_final_state=True)
    assert relative_rms_error(output, expected_output) < 1e-2
    assert relative_rms_error(final_state, expected_state) < 1e-5


def test_float64_inputs_keep_a_float64_state():
    tensors = make_inputs(length=4, dtype=torch.float64)
    tensors["initial_state"] = tensors["initial_state"].double()
    output, final_state = delta_rule_step_triton(**tensors, output_final_state=True)
    expected_output, expected_state = delta_rule_reference(**tensors, output_final_state=True)
    assert output.dtype == final_state.dtype == torch.float64
    assert relative_rms_error(output, expected_output) < 1e-12
    assert relative_rms_error(final_state, expected_state) < 1e-12


@pytest.mark.parametrize("rule", ["delta", "sum"])
def test_refuses_inputs_that_require_grad(rule):
    tensors = make_inputs()
    run = delta_rule_step_triton if rule == "delta" else sum_rule_step_triton
    if rule == "sum":
        tensors = without_beta(tensors)
    tensors["key"].requires_grad_(True)
    with pytest.raises(RuntimeError, match="no backward.*Use the chunkwise kernel"):
        run(**tensors)
    with torch.no_grad():  # inference on the same tensors is fine
        output, _ = run(**tensors)
    reference = delta_rule_reference if rule == "delta" else sum_rule_reference
    assert relative_rms_error(output, reference(**tensors)[0].detach()) < 1e-5


def test_rejects_inputs_that_do_not_fit():
    tensors = make_inputs(length=2)
    with pytest.raises(ValueError, match="query and key"):
        delta_rule_step_triton(**{**tensors, "query": tensors["query"][..., :4]})
    with pytest.raises(ValueError, match="value must have shape"):
        delta_rule_step_triton(**{**tensors, "value": tensors["value"][:, :, :1]})
    with pytest.raises(ValueError, match="beta must have shape"):
        delta_rule_step_triton(**{**tensors, "beta": tensors["beta"][:, :1]})
    with pytest.raises(ValueError, match="initial_state must have shape"):
        delta_rule_step_triton(**{**tensors, "initial_state": tensors["initial_state"].mT})


@pytest.mark.skipif(torch.cuda.is_available(), reason="the compiled kernel runs on CPU tensors only without CUDA")
def test_cpu_tensors_without_the_interpreter_are_refused():
    script = (
        "import torch\n"
        "from memlm.kernels.delta_rule.triton_recurrent import delta_rule_step_triton\n"
        "x = torch.zeros(1, 1, 1, 4)\n"
        "delta_rule_step_triton(x, x, x)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], env={**os.environ, "TRITON_INTERPRET": "0"}, capture_output=True, text=True
    )
    assert result.returncode != 0
    assert "needs CUDA tensors, got cpu; to run it on CPU, set TRITON_INTERPRET=1" in result.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("length", [1, 64])
@pytest.mark.parametrize("key_dim, value_dim", [(128, 128), (256, 128)])
def test_realistic_shapes_on_cuda(dtype, length, key_dim, value_dim):
    tensors = make_inputs(batch_size=8, num_heads=16, length=length, key_dim=key_dim, value_dim=value_dim, dtype=dtype)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    output, final_state = delta_rule_step_triton(**tensors, output_final_state=True)
    expected_output, expected_state = delta_rule_reference(**tensors, output_final_state=True)
    assert output.dtype == dtype and final_state.dtype == torch.float32
    assert relative_rms_error(output, expected_output) < tolerance
    assert relative_rms_error(final_state, expected_state) < 1e-5
    if length == 1:
        step_output, step_state = delta_rule_step(**tensors, output_final_state=True)
        assert relative_rms_error(output, step_output) < tolerance
        assert relative_rms_error(final_state, step_state) < 1e-5

    tensors = without_beta(tensors)
    output, final_state = sum_rule_step_triton(**tensors, output_final_state=True)
    expected_output, expected_state = sum_rule_reference(**tensors, output_final_state=True)
    assert relative_rms_error(output, expected_output) < tolerance
    assert relative_rms_error(final_state, expected_state) < 1e-5
