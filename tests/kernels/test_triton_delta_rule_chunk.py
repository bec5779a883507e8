"""The chunkwise Triton delta rule (forward and backward) against the recurrent reference (SPEC §1, §5).

Without CUDA the kernels run in Triton's interpreter on CPU tensors (tests/conftest.py sets TRITON_INTERPRET=1),
on small shapes; the tests marked ``gpu`` run realistic training shapes on CUDA. Errors are measured as
flash-linear-attention's tests do: the RMS of the difference over the RMS of the reference.

Tolerances. The interpreter computes every product in numpy at the operands' dtype, so float32 and float64
inputs are checked tightly (1e-5, 1e-12: summation order only). With bfloat16 / float16 inputs the kernels
multiply bfloat16 / float16 operands and store their per-token intermediates (W, U, V', (I + A)⁻¹, P, dV') and the
chunk states in that dtype, as on the GPU: each rounding costs up to 2⁻⁹ (bfloat16) or 2⁻¹² (float16) relative.
Against the float32 reference on the same rounded inputs the measured errors were at most 5.3e-3 (bfloat16) and
6e-4 (float16) for the output, the final state and every gradient (T = 23 and 130, d = 32 and 64): the tests
allow about twice that. On the GPU, float32 inputs use TF32 products (2⁻¹¹ per rounding), hence 5e-3 there.
"""

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from memlm.kernels.delta_rule import triton_chunk  # noqa: E402
from memlm.kernels.delta_rule.reference import delta_rule_reference  # noqa: E402
from memlm.kernels.delta_rule.triton_chunk import delta_rule_chunk_triton  # noqa: E402

NAMES = ("query", "key", "value", "beta", "initial_state")


def relative_rms_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """RMS of the difference over the RMS of the expected tensor, in float64."""
    expected = expected.double()
    return ((actual.double() - expected).norm() / expected.norm()).item()


def make_inputs(
    batch_size=2,
    num_heads=2,
    length=23,
    key_dim=16,
    value_dim=32,
    *,
    beta=True,
    initial_state=True,
    num_states=None,
    dtype=torch.float32,
    device="cpu",
    seed=0,
):
    """L2-normalised queries and keys (as the fla preset), random values, β ∈ (0, 1) and initial state, all
    requiring gradients, and random gradients for the output and the final state. ``num_states`` overrides the
    number of states (one per packed sequence)."""
    generator = torch.Generator().manual_seed(seed)
    shape = (batch_size, num_heads, length)
    num_states = batch_size if num_states is None else num_states
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    tensors = {
        "query": F.normalize(torch.randn(*shape, key_dim, generator=generator), dim=-1).to(dtype),
        "key": F.normalize(torch.randn(*shape, key_dim, generator=generator), dim=-1).to(dtype),
        "value": torch.randn(*shape, value_dim, generator=generator).to(dtype),
        "beta": torch.rand(shape, generator=generator).to(dtype) if beta else None,
        "initial_state": torch.randn(num_states, num_heads, key_dim, value_dim, generator=generator).to(state_dtype)
        if initial_state
        else None,
    }
    tensors = {name: None if t is None else t.to(device).requires_grad_() for name, t in tensors.items()}
    grad_output = torch.randn(*shape, value_dim, generator=generator).to(device)
    grad_state = torch.randn(num_states, num_heads, key_dim, value_dim, generator=generator).to(device)
    return tensors, grad_output, grad_state


def gradients(output, final_state, tensors, grad_output, grad_state) -> dict:
    """The gradients of ``output·grad_output (+ final_state·grad_state)`` for the tensors that are given."""
    loss = (output.double() * grad_output).sum()
    if final_state is not None:
        loss = loss + (final_state.double() * grad_state).sum()
    given = [name for name in NAMES if tensors[name] is not None]
    return dict(zip(given, torch.autograd.grad(loss, [tensors[name] for name in given])))


def assert_matches_reference(
    tensors, grad_output, grad_state, *, tolerance, state_tolerance=None, output_final_state=True, **kwargs
):
    """Triton output, final state and every gradient against the reference run on the same inputs."""
    output, final_state = delta_rule_chunk_triton(**tensors, output_final_state=output_final_state, **kwargs)
    expected_output, expected_state = delta_rule_reference(**tensors, output_final_state=output_final_state)
    value, state_dtype = tensors["value"], torch.float64 if tensors["value"].dtype == torch.float64 else torch.float32
    assert output.shape == value.shape and output.dtype == value.dtype
    assert relative_rms_error(output, expected_output) < tolerance
    if output_final_state:
        assert final_state.shape == expected_state.shape and final_state.dtype == state_dtype
        assert relative_rms_error(final_state, expected_state) < (state_tolerance or tolerance)
    else:
        assert final_state is None

    grads = gradients(output, final_state, tensors, grad_output, grad_state)
    expected_grads = gradients(expected_output, expected_state, tensors, grad_output, grad_state)
    for name, grad in grads.items():
        assert grad.shape == tensors[name].shape and grad.dtype == tensors[name].dtype, name
        assert expected_grads[name].abs().max() > 0, name  # the comparison below is not 0 against 0
        assert relative_rms_error(grad, expected_grads[name]) < tolerance, name


def reference_per_sequence(tensors, offsets):
    """The reference run on each packed sequence alone: the outputs back to back and the final states."""
    outputs, states = [], []
    for sequence, (start, end) in enumerate(zip(offsets, offsets[1:])):
        pieces = {name: tensors[name][:, :, start:end] for name in ("query", "key", "value", "beta")}
        state = None if tensors["initial_state"] is None else tensors["initial_state"][sequence : sequence + 1]
        sequence_output, sequence_state = delta_rule_reference(**pieces, initial_state=state, output_final_state=True)
        outputs.append(sequence_output)
        states.append(sequence_state)
    return torch.cat(outputs, dim=2), torch.cat(states)


@pytest.mark.parametrize(
    ("length", "key_dim", "value_dim", "chunk_size"),
    [(16, 16, 16, 8), (23, 16, 32, 8), (40, 32, 16, 16), (23, 32, 16, 5)],
    ids=["whole_chunks", "tail_dk_lt_dv", "tail_dk_gt_dv", "chunk_of_5"],
)
def test_matches_reference(length, key_dim, value_dim, chunk_size):
    tensors, grad_output, grad_state = make_inputs(length=length, key_dim=key_dim, value_dim=value_dim)
    assert_matches_reference(tensors, grad_output, grad_state, tolerance=1e-5, chunk_size=chunk_size)


def test_nearly_parallel_keys_in_chunks_of_64():
    # Keys that nearly coincide, with β = 1, make (I + A)⁻¹ far from the identity; chunks of 64 are inverted as four
    # diagonal blocks of 16 and the six blocks below them.
    tensors, grad_output, grad_state = make_inputs(batch_size=1, num_heads=1, length=70, key_dim=16, value_dim=16)
    generator = torch.Generator().manual_seed(1)
    shared_direction = torch.randn(16, generator=generator)
    keys = F.normalize(shared_direction + 0.05 * torch.randn(1, 1, 70, 16, generator=generator), dim=-1)
    tensors["key"] = keys.requires_grad_()
    tensors["beta"] = torch.ones(1, 1, 70, requires_grad=True)
    assert_matches_reference(tensors, grad_output, grad_state, tolerance=1e-5, chunk_size=64)


@pytest.mark.parametrize(
    ("dtype", "chunk_size", "tolerance"),
    [(torch.float64, 64, 1e-12), (torch.float64, 20, 1e-12), (torch.float32, 64, 1e-5)],
    ids=["float64_four_blocks", "float64_two_blocks_with_tail", "float32_four_blocks"],
)
def test_inverse_solves_the_unit_lower_triangular_system(dtype, chunk_size, tolerance):
    # The rows of (I + A)⁻¹ the forward keeps (16 × 16 diagonal blocks by forward substitution, the blocks below
    # merged by block products) against torch's triangular solve, chunk by chunk, on nearly parallel keys (β = 1 on
    # half the tokens) that make (I + A)⁻¹ far from the identity. A tail chunk shorter than its tile keeps zero
    # columns past its last token.
    length = 150
    tensors, _, _ = make_inputs(batch_size=1, num_heads=2, length=length, key_dim=16, value_dim=16, dtype=dtype)
    generator = torch.Generator().manual_seed(2)
    shared_direction = torch.randn(16, generator=generator, dtype=torch.float64)
    keys = F.normalize(
        shared_direction + 0.05 * torch.randn(1, 2, length, 16, generator=generator, dtype=torch.float64), dim=-1
    )
    beta = torch.rand(1, 2, length, generator=generator, dtype=torch.float64)
    beta[..., ::2] = 1
    query, value = tensors["query"].detach(), tensors["value"].detach()
    key, beta = keys.to(dtype), beta.to(dtype)
    layout = triton_chunk._Layout(query, key, value, chunk_size, None, None, dtype)
    with torch.no_grad():
        *_, (inverse, *_) = triton_chunk._forward(query, key, value, beta, None, False, layout)
    assert inverse.shape == (1, 2, length, layout.block_t)
    for start in range(0, length, chunk_size):
        end = min(start + chunk_size, length)
        chunk_keys, chunk_beta = key[0, :, start:end].double(), beta[0, :, start:end].double()
        system = torch.tril(chunk_beta[..., None] * chunk_keys @ chunk_keys.transpose(-1, -2), diagonal=-1)
        identity = torch.eye(end - start, dtype=torch.float64).expand_as(system)
        expected = torch.linalg.solve_triangular(identity + system, identity, upper=False)
        assert (expected - identity).abs().max() > 0.5  # far from the identity
        rows = inverse[0, :, start:end]
        assert relative_rms_error(rows[..., : end - start], expected) < tolerance
        assert torch.all(rows[..., end - start :] == 0)


@pytest.mark.parametrize(
    ("beta", "initial_state", "output_final_state"),
    [(False, True, True), (True, False, True), (True, True, False), (False, False, False)],
    ids=["no_beta", "zero_state", "no_final_state", "bare"],
)
def test_optional_inputs_and_results(beta, initial_state, output_final_state):
    tensors, grad_output, grad_state = make_inputs(length=23, beta=beta, initial_state=initial_state)
    assert_matches_reference(
        tensors, grad_output, grad_state, tolerance=1e-5, output_final_state=output_final_state, chunk_size=16
    )


@pytest.mark.parametrize("register_key_dim", [64, 32], ids=["state_in_registers", "state_in_global_memory"])
def test_float64_in_several_tiles(monkeypatch, register_key_dim):
    # Narrow tiles make every kernel loop over several slices of d_k and d_v (24 and 40 are not powers of two,
    # so the last slices are partly masked), and chunks of 7 tokens sit in tiles of 16 rows. With d_k above
    # MAX_REGISTER_KEY_DIM the recurrences keep their state in global memory, 16 rows at a time.
    monkeypatch.setattr(triton_chunk, "BLOCK_WIDTH", 16)
    monkeypatch.setattr(triton_chunk, "MAX_REGISTER_KEY_DIM", register_key_dim)
    monkeypatch.setattr(triton_chunk, "STATE_TILE", 16 * 16)
    monkeypatch.setattr(triton_chunk, "OUTPUT_BLOCK_WIDTH", 32)
    tensors, grad_output, grad_state = make_inputs(
        batch_size=1, length=21, key_dim=24, value_dim=40, dtype=torch.float64
    )
    layout = triton_chunk._Layout(tensors["query"], tensors["key"], tensors["value"], 7, None, None, torch.float64)
    assert layout.block_k < 24 and layout.block_v < 40 and layout.state_block_v < 40 and layout.output_block_v < 40
    assert layout.state_in_registers == (register_key_dim == 64)  # float64: up to half of MAX_REGISTER_KEY_DIM
    assert_matches_reference(tensors, grad_output, grad_state, tolerance=1e-12, chunk_size=7)


# The largest errors measured against the reference (see the module docstring), about doubled.
LOW_PRECISION_TOLERANCES = {torch.bfloat16: 1e-2, torch.float16: 1.5e-3}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_keep_a_float32_state(dtype):
    # The reference reads the same rounded inputs in float32; the kernels round their operands and intermediates
    # to the input dtype (module docstring), the state they return stays float32.
    tensors, grad_output, grad_state = make_inputs(length=23, key_dim=32, value_dim=16, dtype=dtype)
    layout = triton_chunk._Layout(tensors["query"], tensors["key"], tensors["value"], 16, None, None, torch.float32)
    assert layout.storage_dtype == dtype and layout.state_storage_dtype == dtype
    assert_matches_reference(
        tensors, grad_output, grad_state, tolerance=LOW_PRECISION_TOLERANCES[dtype], chunk_size=16
    )


def test_wide_keys_keep_the_state_in_global_memory():
    # d_k = 768 (DPFP-3 at a key width of 128) does not fit one tile: the recurrences read and write the state in
    # slices of 64 rows. Packed sequences, one of them empty (its final state is its initial state).
    offsets = [0, 9, 9, 20]
    tensors, grad_output, grad_state = make_inputs(
        batch_size=1, num_heads=1, length=20, key_dim=768, value_dim=16, num_states=3
    )
    layout = triton_chunk._Layout(tensors["query"], tensors["key"], tensors["value"], 8, None, None, torch.float32)
    assert not layout.state_in_registers and layout.state_block_k == layout.block_k < 768
    cu_seqlens = torch.tensor(offsets, dtype=torch.int32)
    output, final_state = delta_rule_chunk_triton(
        **tensors, output_final_state=True, chunk_size=8, cu_seqlens=cu_seqlens
    )
    expected_output, expected_state = reference_per_sequence(tensors, offsets)
    assert relative_rms_error(output, expected_output) < 1e-5
    assert relative_rms_error(final_state, expected_state) < 1e-5
    assert torch.equal(final_state[1], tensors["initial_state"][1])
    grads = gradients(output, final_state, tensors, grad_output, grad_state)
    expected_grads = gradients(expected_output, expected_state, tensors, grad_output, grad_state)
    for name, grad in grads.items():
        assert relative_rms_error(grad, expected_grads[name]) < 1e-5, name


def test_wide_keys_in_a_padded_batch_without_final_state():
    # The global-memory state leaves the last chunk through a final state the caller did not ask for.
    tensors, grad_output, grad_state = make_inputs(
        batch_size=2, num_heads=1, length=13, key_dim=200, value_dim=24, initial_state=False
    )
    assert_matches_reference(tensors, grad_output, grad_state, tolerance=1e-5, output_final_state=False, chunk_size=8)


def test_chunk_size_above_the_kernel_chunk_gives_the_same_result():
    # chunk_size = 128 runs in chunks of MAX_CHUNK_SIZE = 64 (the result does not depend on the chunking).
    tensors, grad_output, grad_state = make_inputs(batch_size=1, num_heads=1, length=70, key_dim=16, value_dim=16)
    layout = triton_chunk._Layout(tensors["query"], tensors["key"], tensors["value"], 128, None, None, torch.float32)
    assert layout.chunk_size == triton_chunk.MAX_CHUNK_SIZE == 64 and layout.num_chunks == 2
    assert_matches_reference(tensors, grad_output, grad_state, tolerance=1e-5, chunk_size=128)
    with torch.no_grad():
        at_128, _ = delta_rule_chunk_triton(**tensors, chunk_size=128)
        at_64, _ = delta_rule_chunk_triton(**tensors, chunk_size=64)
    assert torch.equal(at_128, at_64)


def test_grids_launch_for_any_number_of_heads_and_sequences():
    # CUDA limits grid axes 1 and 2 to 65 535 programs: (chunk or sequence) × head runs along axis 0.
    key = torch.empty(5000, 16, 128, 64, device="meta")
    value = torch.empty(5000, 16, 128, 256, device="meta")
    layout = triton_chunk._Layout(key, key, value, 64, None, None, torch.float32)
    grids = [layout.chunk_grid(layout.output_block_v), layout.chunk_grid(), layout.sequence_grid(16)]
    for grid in grids:
        assert grid[0] >= 5000 * 16 and all(size <= 65535 for size in grid[1:]), grid


@pytest.mark.parametrize(
    ("offsets", "initial_state"),
    [([0, 7, 27, 40], True), ([0, 7, 27, 40], False), ([0, 9, 9, 40], True)],
    ids=["three_sequences", "zero_states", "with_an_empty_sequence"],
)
def test_packed_sequences_match_each_sequence_alone(offsets, initial_state):
    num_sequences = len(offsets) - 1
    tensors, grad_output, grad_state = make_inputs(
        batch_size=1, length=offsets[-1], initial_state=initial_state, num_states=num_sequences
    )
    cu_seqlens = torch.tensor(offsets, dtype=torch.int32)
    output, final_state = delta_rule_chunk_triton(
        **tensors, output_final_state=True, chunk_size=16, cu_seqlens=cu_seqlens
    )
    assert output.shape == tensors["value"].shape and final_state.shape == grad_state.shape

    expected_output, expected_state = reference_per_sequence(tensors, offsets)
    assert relative_rms_error(output, expected_output) < 1e-5
    assert relative_rms_error(final_state, expected_state) < 1e-5

    grads = gradients(output, final_state, tensors, grad_output, grad_state)
    expected_grads = gradients(expected_output, expected_state, tensors, grad_output, grad_state)
    for name, grad in grads.items():
        assert expected_grads[name].abs().max() > 0, name
        assert relative_rms_error(grad, expected_grads[name]) < 1e-5, name

    # The sequences really are kept apart: one sequence of 40 tokens gives another output.
    with torch.no_grad():
        unpacked_output, _ = delta_rule_chunk_triton(
            tensors["query"], tensors["key"], tensors["value"], tensors["beta"], chunk_size=16
        )
    assert relative_rms_error(unpacked_output, expected_output) > 1e-2


class DeviceReads(TorchDispatchMode):
    """Counts the reads of a tensor's value back to Python (``int(tensor)``, ``.item()``): a sync on a GPU."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("host", [[0, 7, 27, 40], torch.tensor([0, 7, 27, 40])], ids=["list", "cpu_tensor"])
def test_packed_sequences_with_host_offsets_read_nothing_back(host):
    tensors, _, _ = make_inputs(batch_size=1, length=40, num_states=3)
    cu_seqlens = torch.tensor([0, 7, 27, 40], dtype=torch.int32)
    with torch.no_grad():
        with DeviceReads() as without_host:
            expected, expected_state = delta_rule_chunk_triton(
                **tensors, output_final_state=True, chunk_size=16, cu_seqlens=cu_seqlens
            )
        with DeviceReads() as with_host:
            output, final_state = delta_rule_chunk_triton(
                **tensors, output_final_state=True, chunk_size=16, cu_seqlens=cu_seqlens, cu_seqlens_cpu=host
            )
    assert without_host.count > 0 and with_host.count == 0
    assert torch.equal(output, expected) and torch.equal(final_state, expected_state)


def test_bad_host_offsets():
    tensors, _, _ = make_inputs(batch_size=1, length=10, num_states=2)
    cu_seqlens = torch.tensor([0, 4, 10])
    with pytest.raises(ValueError, match=r"cu_seqlens_cpu must hold the same 3 offsets as cu_seqlens, got 2"):
        delta_rule_chunk_triton(**tensors, cu_seqlens=cu_seqlens, cu_seqlens_cpu=[0, 10])
    with pytest.raises(ValueError, match=r"rise from 0 to the number of tokens 10.*\[0, 4, 9\]"):
        delta_rule_chunk_triton(**tensors, cu_seqlens=cu_seqlens, cu_seqlens_cpu=[0, 4, 9])
    with pytest.raises(ValueError, match=r"cu_seqlens_cpu is a host copy of cu_seqlens; pass cu_seqlens too"):
        delta_rule_chunk_triton(**tensors, cu_seqlens_cpu=[0, 4, 10])
    with pytest.raises(ValueError, match=r"cu_seqlens_cpu must be a CPU tensor or a list of ints"):
        delta_rule_chunk_triton(**tensors, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens.to("meta"))


def test_gradients_when_only_the_final_state_is_used():
    # The output's gradient reaches the backward as None; the query then gets a zero gradient.
    tensors, _, grad_state = make_inputs(length=23)
    _, final_state = delta_rule_chunk_triton(**tensors, output_final_state=True, chunk_size=16)
    _, expected_state = delta_rule_reference(**tensors, output_final_state=True)
    names = ["key", "value", "beta", "initial_state"]
    grads = torch.autograd.grad((final_state * grad_state).sum(), [tensors[name] for name in ["query", *names]])
    expected = torch.autograd.grad((expected_state * grad_state).sum(), [tensors[name] for name in names])
    assert torch.count_nonzero(grads[0]) == 0
    for name, grad, expected_grad in zip(names, grads[1:], expected):
        assert relative_rms_error(grad, expected_grad) < 1e-5, name


def test_backward_keeps_chunk_states_not_token_states():
    # The forward saves per-token rows (query, key, W; value, V'; β; rows of (I + A)⁻¹ and P padded to 16) and
    # one state per chunk. One state per token alone would be T·d_k·d_v = 40·32·32 floats per head, 4x more.
    batch_size, num_heads, length, key_dim, value_dim, chunk_size = 1, 2, 40, 32, 32, 16
    tensors, _, _ = make_inputs(batch_size, num_heads, length, key_dim, value_dim)
    saved_sizes = []

    def count(tensor):
        saved_sizes.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(count, lambda tensor: tensor):
        delta_rule_chunk_triton(**tensors, chunk_size=chunk_size)
    per_token = 3 * key_dim + 2 * value_dim + 1 + 2 * 16
    per_chunk = key_dim * value_dim
    num_chunks = -(-length // chunk_size)
    assert sum(saved_sizes) == batch_size * num_heads * (length * per_token + num_chunks * per_chunk)


def test_bad_packed_sequences():
    tensors, _, _ = make_inputs(batch_size=1, length=10, num_states=2)
    with pytest.raises(ValueError, match=r"rise from 0 to the number of tokens 10.*\[0, 4, 9\]"):
        delta_rule_chunk_triton(**tensors, cu_seqlens=torch.tensor([0, 4, 9]))
    with pytest.raises(ValueError, match=r"rise from 0.*\[0, 6, 4, 10\]"):
        delta_rule_chunk_triton(**{**tensors, "initial_state": None}, cu_seqlens=torch.tensor([0, 6, 4, 10]))
    with pytest.raises(ValueError, match=r"integer tensor"):
        delta_rule_chunk_triton(**tensors, cu_seqlens=torch.tensor([0.0, 4.0, 10.0]))
    with pytest.raises(ValueError, match=r"initial_state must have shape .* = \(3, 2, 16, 32\), got \(2, 2, 16, 32\)"):
        delta_rule_chunk_triton(**tensors, cu_seqlens=torch.tensor([0, 3, 4, 10]))
    batched, _, _ = make_inputs(batch_size=2, length=10, initial_state=False)
    with pytest.raises(ValueError, match=r"batch of one, got key \(2, 2, 10, 16\)"):
        delta_rule_chunk_triton(**batched, cu_seqlens=torch.tensor([0, 4, 10]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the compiled kernels run on CPU tensors only without CUDA")
def test_cpu_tensors_without_the_interpreter_are_refused():
    script = (
        "import torch\n"
        "from memlm.kernels.delta_rule.triton_chunk import delta_rule_chunk_triton\n"
        "x = torch.zeros(1, 1, 4, 16)\n"
        "delta_rule_chunk_triton(x, x, x)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], env={**os.environ, "TRITON_INTERPRET": "0"}, capture_output=True, text=True
    )
    assert result.returncode != 0
    assert "need CUDA tensors, got cpu; to run them on CPU, set TRITON_INTERPRET=1" in result.stderr


# TF32 products for float32 inputs (rounding 2⁻¹¹), bfloat16 operands and intermediates (2⁻⁹); not yet run on a GPU.
GPU_TOLERANCES = {torch.float32: 5e-3, torch.bfloat16: 1e-2}


def reference_in_float64(tensors, **kwargs):
    """The reference on the same (rounded) inputs, computed in float64 with its own leaf tensors."""
    leaves = {name: None if t is None else t.detach().double().requires_grad_() for name, t in tensors.items()}
    return leaves, delta_rule_reference(**leaves, **kwargs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("batch_size", "num_heads", "length", "key_dim", "value_dim"),
    [(2, 4, 1024, 64, 64), (2, 4, 1024, 128, 128), (1, 2, 1000, 128, 64), (1, 2, 300, 256, 256)],
)
def test_realistic_shapes_on_cuda(dtype, batch_size, num_heads, length, key_dim, value_dim):
    tensors, grad_output, grad_state = make_inputs(
        batch_size, num_heads, length, key_dim, value_dim, dtype=dtype, device="cuda"
    )
    tolerance = GPU_TOLERANCES[dtype]
    output, final_state = delta_rule_chunk_triton(**tensors, output_final_state=True, chunk_size=64)
    leaves, (expected_output, expected_state) = reference_in_float64(tensors, output_final_state=True)
    assert output.dtype == dtype and final_state.dtype == torch.float32
    assert relative_rms_error(output, expected_output) < tolerance
    assert relative_rms_error(final_state, expected_state) < tolerance
    grads = gradients(output, final_state, tensors, grad_output, grad_state)
    expected_grads = gradients(expected_output, expected_state, leaves, grad_output, grad_state)
    for name, grad in grads.items():
        assert grad.dtype == tensors[name].dtype, name
        assert relative_rms_error(grad, expected_grads[name]) < tolerance, name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_sequences_on_cuda(dtype):
    offsets = [0, 100, 613, 640, 1500]
    tensors, grad_output, grad_state = make_inputs(
        1, 4, offsets[-1], 128, 128, num_states=len(offsets) - 1, dtype=dtype, device="cuda"
    )
    cu_seqlens = torch.tensor(offsets, device="cuda")
    output, final_state = delta_rule_chunk_triton(**tensors, output_final_state=True, cu_seqlens=cu_seqlens)
    leaves = {name: t.detach().double().requires_grad_() for name, t in tensors.items()}
    outputs, states = [], []
    for sequence, (start, end) in enumerate(zip(offsets, offsets[1:])):
        pieces = {name: leaves[name][:, :, start:end] for name in ("query", "key", "value", "beta")}
        state = leaves["initial_state"][sequence : sequence + 1]
        sequence_output, sequence_state = delta_rule_reference(**pieces, initial_state=state, output_final_state=True)
        outputs.append(sequence_output)
        states.append(sequence_state)
    expected_output, expected_state = torch.cat(outputs, dim=2), torch.cat(states)
    tolerance = GPU_TOLERANCES[dtype]
    assert relative_rms_error(output, expected_output) < tolerance
    assert relative_rms_error(final_state, expected_state) < tolerance
    grads = gradients(output, final_state, tensors, grad_output, grad_state)
    expected_grads = gradients(expected_output, expected_state, leaves, grad_output, grad_state)
    for name, grad in grads.items():
        assert relative_rms_error(grad, expected_grads[name]) < tolerance, name
