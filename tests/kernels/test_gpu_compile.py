"""Every Triton kernel the dispatch launches compiles for sm_80 and sm_90, fits their shared memory and does not
spill registers (devtools.gpu_compile; no GPU needed).

Each scenario calls the public functions (delta rule, sum rule, Expire-Span attention, forward and backward) on small
CPU tensors that report ``cuda``, records the launches in Triton's interpreter without running them, and compiles
the distinct launches for both targets in subprocesses without the interpreter.

The scenarios in ``CI_SCENARIOS`` run with the suite (a few minutes on 2 cores from an empty Triton cache; set
``TRITON_CACHE_DIR`` to a kept folder to make reruns fast). The full set (every dtype and width, the extreme config
values) is marked slow and runs only when asked for::

    HF_HUB_OFFLINE=1 .venv/bin/python -m pytest -m slow tests/kernels/test_gpu_compile.py
"""

import os

import pytest
import torch

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from devtools.gpu_compile import SHARED_MEMORY_LIMITS, backward, compile_launches, record_launches  # noqa: E402
from memlm.kernels.delta_rule import delta_rule, sum_rule  # noqa: E402
from memlm.kernels.expire_attention import expire_span_attention  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="recording the launches needs Triton's interpreter"
)

# Batch and heads of 2: a size of 1 would be specialised as a constant, which real batches are not.
BATCH, HEADS = 2, 2
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _tensor(*shape, dtype, requires_grad=False):
    return torch.randn(*shape, dtype=dtype, device="cuda").requires_grad_(requires_grad)


def delta_rule_training(dtype, key_dim, value_dim, chunk_size=64, length=None, packed=False, beta=True):
    """Forward and backward of the chunkwise delta rule, with initial and final state (packed: 3 sequences)."""
    length = length or 2 * chunk_size + 16
    batch = 1 if packed else BATCH
    sequences = 3 if packed else batch
    query, key = (_tensor(batch, HEADS, length, key_dim, dtype=dtype, requires_grad=True) for _ in range(2))
    value = _tensor(batch, HEADS, length, value_dim, dtype=dtype, requires_grad=True)
    strengths = torch.rand(batch, HEADS, length, dtype=dtype, device="cuda").requires_grad_() if beta else None
    state = _tensor(sequences, HEADS, key_dim, value_dim, dtype=torch.float32, requires_grad=True)
    cu_seqlens = torch.tensor([0, length // 3, length // 2, length]) if packed else None
    output, final = delta_rule(query, key, value, strengths, initial_state=state, output_final_state=True,
                               chunk_size=chunk_size, cu_seqlens=cu_seqlens, backend="triton")  # fmt: skip
    backward(output.float().sum() + final.sum())


def decoding_step(dtype, key_dim, value_dim):
    """One token of the delta rule and of the sum rule without gradients (generation)."""
    with torch.no_grad():
        query, key = (_tensor(BATCH, HEADS, 1, key_dim, dtype=dtype) for _ in range(2))
        value = _tensor(BATCH, HEADS, 1, value_dim, dtype=dtype)
        state = _tensor(BATCH, HEADS, key_dim, value_dim, dtype=torch.float32)
        strengths = torch.rand(BATCH, HEADS, 1, dtype=dtype, device="cuda")
        delta_rule(query, key, value, strengths, initial_state=state, output_final_state=True, backend="triton")
        sum_rule(query, key, value, initial_state=state, output_final_state=True, backend="triton")


def expire_attention(dtype, dim, spans=True, max_distance=None, length=160, memories=96, official=None):
    """Forward and backward of Expire-Span attention over memories and the current block; `official`: "relative"
    or "pairs", the official code's options (SPEC §8) with the position terms as a table or per pair."""
    keys = memories + length
    query = _tensor(BATCH, HEADS, length, dim, dtype=dtype, requires_grad=True)
    key, value = (_tensor(BATCH, HEADS, keys, dim, dtype=dtype, requires_grad=True) for _ in range(2))
    span = (torch.rand(BATCH, keys, device="cuda") * 64).requires_grad_() if spans else None
    positions = torch.arange(memories, memories + length, device="cuda").expand(BATCH, length)
    key_positions = torch.arange(keys, device="cuda").expand(BATCH, keys)
    options = {}
    if official is not None:
        options = dict(attend_to_self=False, renormalization_epsilon=1e-6)
        if official == "relative":
            options["relative_positions"] = _tensor(keys, dim, dtype=dtype, requires_grad=True)
        else:
            options["position_scores"] = _tensor(BATCH, HEADS, length, keys, dtype=dtype, requires_grad=True)
    output = expire_span_attention(query, key, value, span, positions, key_positions, ramp=16.0,
                                   max_distance=max_distance, backend="triton", **options)  # fmt: skip
    backward(output.float().sum())


def _scenarios():
    scenarios = {}
    for name, dtype in DTYPES.items():
        for width in (64, 128):
            scenarios[f"delta_rule-{name}-d{width}"] = (
                delta_rule_training,
                dict(dtype=dtype, key_dim=width, value_dim=width),
            )
            scenarios[f"decoding-{name}-d{width}"] = (decoding_step, dict(dtype=dtype, key_dim=width, value_dim=width))
            scenarios[f"expire_attention-{name}-d{width}"] = (expire_attention, dict(dtype=dtype, dim=width))
            for official in ("relative", "pairs"):
                scenarios[f"expire_attention-{name}-d{width}-official-{official}"] = (
                    expire_attention, dict(dtype=dtype, dim=width, official=official))  # fmt: skip
        # DeltaNet's widest memory: DPFP with ν = 3 at key_head_dim 128 gives d_k = 2·3·128 = 768.
        scenarios[f"delta_rule-{name}-dpfp3-dk768"] = (
            delta_rule_training,
            dict(dtype=dtype, key_dim=768, value_dim=128),
        )
        scenarios[f"decoding-{name}-dpfp3-dk768"] = (decoding_step, dict(dtype=dtype, key_dim=768, value_dim=128))
        # FAVOR+ with many random features (m = 256) and a narrow value.
        scenarios[f"delta_rule-{name}-favor256"] = (delta_rule_training, dict(dtype=dtype, key_dim=256, value_dim=64))
        scenarios[f"delta_rule-{name}-packed"] = (
            delta_rule_training,
            dict(dtype=dtype, key_dim=64, value_dim=64, packed=True),
        )
        scenarios[f"expire_attention-{name}-d96-no_spans-max_distance"] = (
            expire_attention, dict(dtype=dtype, dim=96, spans=False, max_distance=40.0))  # fmt: skip
    for chunk_size in (128, 1, 3, 7):
        scenarios[f"delta_rule-bf16-chunk{chunk_size}"] = (
            delta_rule_training, dict(dtype=torch.bfloat16, key_dim=64, value_dim=64, chunk_size=chunk_size, length=40 + chunk_size))  # fmt: skip
    scenarios["delta_rule-bf16-no_beta-odd_length"] = (
        delta_rule_training, dict(dtype=torch.bfloat16, key_dim=64, value_dim=64, beta=False, length=77))  # fmt: skip
    return scenarios


SCENARIOS = _scenarios()
# One of each kind and the widest memory: what CI compiles on every run.
CI_SCENARIOS = [
    "delta_rule-bf16-d64",
    "delta_rule-fp32-d128",
    "delta_rule-bf16-dpfp3-dk768",
    "delta_rule-bf16-packed",
    "decoding-bf16-d128",
    "expire_attention-bf16-d128",
    "expire_attention-fp32-d64",
    "expire_attention-bf16-d128-official-relative",
    "expire_attention-fp32-d64-official-relative",
]
SLOW_SCENARIOS = [name for name in SCENARIOS if name not in CI_SCENARIOS]
# Scenarios whose kernels do not fit the GPUs yet, each with the defect (strict: the test fails once they fit, so
# that the entry is removed).
KNOWN_DEFECTS = {}


def _cases(names):
    return [pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=KNOWN_DEFECTS[name]))
            if name in KNOWN_DEFECTS else name for name in names]  # fmt: skip


def _record(names):
    """The launches of each scenario as chosen for each target (the launch options differ per target)."""
    launches = {}
    for name in names:
        function, arguments = SCENARIOS[name]
        launches[name] = []
        for target in SHARED_MEMORY_LIMITS:
            with record_launches(execute=False, target=target) as recorder:
                function(**arguments)
            launches[name] += recorder.launches
    return launches


def _compile(launches_by_scenario):
    everything = [launch for launches in launches_by_scenario.values() for launch in launches]
    results = compile_launches(everything, jobs=2)
    return {name: [result for result in results if result.launch.key in {launch.key for launch in launches}]
            for name, launches in launches_by_scenario.items()}  # fmt: skip


def _check(name, results):
    assert results, f"{name} launched no Triton kernel"
    assert {result.target for result in results} == set(SHARED_MEMORY_LIMITS)
    problems = [f"{result.launch.name} {result.launch.constants} on {result.target}: {problem}"
                for result in results for problem in result.problems]  # fmt: skip
    assert not problems, f"{name}:\n" + "\n".join(problems)


@pytest.fixture(scope="module")
def ci_results():
    return _compile(_record(CI_SCENARIOS))


@pytest.fixture(scope="module")
def slow_results(request):
    return _compile(_record(SLOW_SCENARIOS))


@pytest.mark.parametrize("name", _cases(CI_SCENARIOS))
def test_kernels_compile_for_sm80_and_sm90_without_spills(name, ci_results):
    _check(name, ci_results[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", _cases(SLOW_SCENARIOS))
def test_every_scenario_compiles_for_sm80_and_sm90_without_spills(name, request):
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("the full set runs with -m slow (see the module docstring)")
    _check(name, request.getfixturevalue("slow_results")[name])


def test_delta_rule_launch_options_follow_the_target():
    # The chunk kernels take their warps and stages from LAUNCH_OPTIONS for the target they are recorded for, and
    # the wide output kernel (64 × 128 accumulator at d_v = 128) its own entry.
    from memlm.kernels.delta_rule.triton_chunk import LAUNCH_OPTIONS

    kernels = {"_prepare_chunk_kernel": "prepare", "_state_forward_kernel": "state", "_output_kernel": "output_wide",
               "_state_backward_kernel": "state", "_chunk_backward_kernel": "chunk_backward"}  # fmt: skip
    for target in SHARED_MEMORY_LIMITS:
        with record_launches(execute=False, target=target) as recorder:
            delta_rule_training(torch.bfloat16, key_dim=128, value_dim=128)
        chosen = {launch.name: (launch.keywords["num_warps"], launch.keywords["num_stages"])
                  for launch in recorder.launches if launch.name in kernels}  # fmt: skip
        assert chosen == {name: LAUNCH_OPTIONS[target][2][entry] for name, entry in kernels.items()}
        assert {launch.target for launch in recorder.launches} == {target}
    assert LAUNCH_OPTIONS["sm_80"] != LAUNCH_OPTIONS["sm_90"]


@triton.jit
def _product_kernel(left, right, output, rows, ROWS: tl.constexpr, INNER: tl.constexpr, COLUMNS: tl.constexpr):
    """``output = left @ right`` for the first ``rows`` rows of ``left`` (the rest masked): one tile, one program."""
    row = tl.arange(0, ROWS)
    inner = tl.arange(0, INNER)
    column = tl.arange(0, COLUMNS)
    valid = row < rows
    left_tile = tl.load(left + row[:, None] * INNER + inner[None, :], mask=valid[:, None], other=0)
    right_tile = tl.load(right + inner[:, None] * COLUMNS + column[None, :])
    product = tl.dot(left_tile, right_tile)
    tl.store(
        output + row[:, None] * COLUMNS + column[None, :], product.to(output.dtype.element_ty), mask=valid[:, None]
    )


def _product(size, rows, dtype=torch.float16, inner=None):
    """A (size × inner) @ (inner × size) product in one tile (inner: size when None)."""
    inner = size if inner is None else inner
    left = torch.randn(size, inner, dtype=dtype, device="cuda")
    right = torch.randn(inner, size, dtype=dtype, device="cuda")
    output = torch.zeros(size, size, dtype=dtype, device="cuda")
    _product_kernel[(1,)](left, right, output, rows, ROWS=size, INNER=inner, COLUMNS=size, num_warps=4)
    return left, right, output


def test_recording_counts_unmasked_bytes_and_dot_flops():
    with record_launches(count=True) as recorder:
        left, right, output = _product(32, rows=20)
    (launch,) = recorder.launches
    assert launch.name == "_product_kernel" and launch.constants["ROWS"] == "32"
    assert launch.bytes_read == (20 * 32 + 32 * 32) * 2  # masked rows of `left` are not read
    assert launch.bytes_written == 20 * 32 * 2
    assert launch.tensor_core_flops == 2 * 32 * 32 * 32 and launch.cuda_core_flops == 0  # fp16 operands
    assert launch.dot_flops_by_line == {"product = tl.dot(left_tile, right_tile)": 2 * 32 * 32 * 32}
    expected = (left.float() @ right.float())[:20]
    assert torch.allclose(output[:20].float(), expected, atol=1e-1) and not output[20:].any()  # it ran


def test_compiling_reports_shared_memory_over_the_limit_and_finds_tensor_cores():
    launches = {}
    for target in SHARED_MEMORY_LIMITS:
        with record_launches(execute=False, target=target) as recorder:
            _product(64, rows=64)
            # fp16 operand tiles of 64 × 1024 and 1024 × 64: 256 KB of shared memory (a small accumulator, so that
            # ptxas compiles it in seconds)
            _product(64, rows=64, inner=1024)
        launches[target] = recorder.launches
    everything = [launch for recorded in launches.values() for launch in recorded]
    results = compile_launches(everything, jobs=2)
    assert len(results) == len(everything)  # each launch compiled for its own target only
    results = {(result.launch.key, result.target): result for result in results}
    for target in SHARED_MEMORY_LIMITS:
        small, large = launches[target]
        fitting, overflowing = results[small.key, target], results[large.key, target]
        assert fitting.problems == [] and fitting.tensor_core_instructions and 0 < fitting.shared_memory
        assert fitting.dots_by_line == {"product = tl.dot(left_tile, right_tile)": [1, 1]}, fitting.dots_by_line
        assert overflowing.error or overflowing.shared_memory > SHARED_MEMORY_LIMITS[target], overflowing
        assert overflowing.problems, overflowing
