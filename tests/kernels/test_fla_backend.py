"""The "fla" kernel backend: flash-linear-attention's own kernels behind `delta_rule`, and how a backend is chosen.

Without a GPU, FLA's Triton kernels run here in Triton's interpreter on CPU tensors (tests/conftest.py sets
TRITON_INTERPRET=1). Two things stand in the way, and the `fla_kernels` fixture changes how the interpreter runs
FLA's code, never what it computes:

- FLA's autotuned kernels time their configurations on a GPU driver, which the interpreter has not ("RuntimeError:
  0 active drivers ([]). There should only be one."). The fixture keeps the first configuration of each autotuned
  FLA kernel, so there is nothing to time. A configuration only picks tile sizes and GPU scheduling: every
  configuration computes the same math, up to the order of float additions.
- In compiled Triton the index of a `for ... in range(n)` loop is an int32 tensor, in the interpreter a Python int,
  so FLA's `i_t.to(tl.int64)` in fla/ops/common/chunk_delta_h.py fails there ("InterpreterError:
  AttributeError("'int' object has no attribute 'to'")"). The fixture gives that module a `range` yielding the
  interpreter's int32 tensors, as compiled code has.

What stays out of reach here: FLA's `chunk_delta_rule` refuses float32 ("ChunkDeltaRuleFunction does not support
float32"), and in Triton 3.9's interpreter `tl.dot` on bfloat16 multiplies the raw bits (its bfloat16 is stored as
uint16; a 16×16 product comes out ~1e10 off; triton-lang/triton#11584, "not supported yet"), so the chunk kernel is
checked in float16 here, and bfloat16 only on a GPU. Tolerances are relative RMS errors against the float32
recurrent reference: 3e-3 in float16 (its rounding is 4.9e-4; measured ≈ 6e-4) and 1e-5 in float32.
"""

import builtins
import contextlib
import importlib
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

import memlm.kernels as kernels
from memlm import DeltaNetConfig, DeltaNetForCausalLM
from memlm.kernels import (
    describe_backend,
    flash_linear_attention_available,
    flash_linear_attention_version,
    resolve_backend,
)
from memlm.kernels.delta_rule import delta_rule, sum_rule
from tests.conftest import TINY

CUDA = torch.device("cuda")
CPU = torch.device("cpu")
needs_fla = pytest.mark.skipif(
    not flash_linear_attention_available(), reason="flash-linear-attention >= 0.6 (pip install memlm[fla]) and triton"
)
FLOAT16_TOLERANCE = 3e-3
FLOAT32_TOLERANCE = 1e-5
BFLOAT16_TOLERANCE = 1e-2  # on a GPU, as memlm's own kernels (tests/kernels/test_triton_delta_rule_chunk.py)


def _relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    return ((value.float() - reference.float()).pow(2).mean().sqrt() / reference.float().pow(2).mean().sqrt()).item()


# --- choosing the backend (no FLA kernel runs) ---------------------------------------------------------------------


def test_import_memlm_does_not_import_fla():
    code = "import sys, memlm, memlm.kernels.delta_rule; print(sorted(m for m in sys.modules if m.split('.')[0] == 'fla'))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


@needs_fla
def test_default_order_on_cuda_tensors_is_fla_then_triton_then_torch(monkeypatch):
    monkeypatch.delenv("MEMLM_KERNELS", raising=False)
    assert resolve_backend(None, CUDA, "delta_rule") == "fla"
    assert resolve_backend(None, "cuda:0", "delta_rule") == "fla"
    # FLA has no sum rule and no Expire-Span attention: those (and callers naming no operation) run memlm's Triton.
    assert resolve_backend(None, CUDA, "sum_rule") == "triton"
    assert resolve_backend(None, CUDA, "expire_span_attention") == "triton"
    assert resolve_backend(None, CUDA) == "triton"
    assert resolve_backend(None, CPU, "delta_rule") == "torch"
    assert resolve_backend(None, None, "delta_rule") == "torch"

    # The same machine without FLA (or with an older one), then without Triton either: the version probe and the
    # Triton probe are what resolve_backend consults.
    monkeypatch.setattr(kernels, "flash_linear_attention_version", lambda: None)
    assert resolve_backend(None, CUDA, "delta_rule") == "triton"
    monkeypatch.setattr(kernels, "flash_linear_attention_version", lambda: "0.5.2")
    assert resolve_backend(None, CUDA, "delta_rule") == "triton"
    monkeypatch.setattr(kernels, "triton_available", lambda: False)
    assert resolve_backend(None, CUDA, "delta_rule") == "torch"


@needs_fla
def test_environment_variable_and_argument_choose_fla(monkeypatch):
    monkeypatch.setenv("MEMLM_KERNELS", "fla")
    assert resolve_backend(None, CPU, "delta_rule") == "fla"  # asked for: CPU tensors then need the interpreter
    assert resolve_backend(None, CPU, "sum_rule") == "triton"
    assert resolve_backend("torch", CUDA, "delta_rule") == "torch"  # the argument wins over the variable
    monkeypatch.setenv("MEMLM_KERNELS", "triton")
    assert resolve_backend("fla", CUDA, "delta_rule") == "fla"
    assert resolve_backend(None, CUDA, "delta_rule") == "triton"


def test_fla_asked_for_without_flash_linear_attention_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(kernels, "flash_linear_attention_version", lambda: None)
    with pytest.raises(ValueError, match=r"argument backend='fla' needs flash-linear-attention >= 0\.6, which is not "
                                         r"installed \(pip install 'memlm\[fla\]'\)"):  # fmt: skip
        resolve_backend("fla", CUDA, "delta_rule")
    monkeypatch.setenv("MEMLM_KERNELS", "fla")
    query = torch.randn(1, 1, 3, 4)
    with pytest.raises(ValueError, match=r"environment variable MEMLM_KERNELS='fla' needs flash-linear-attention"):
        delta_rule(query, query, query)
    with pytest.raises(ValueError, match=r"MEMLM_KERNELS='fla' needs flash-linear-attention"):
        sum_rule(query, query, query)  # asked for by name: refused even where it would run memlm's kernels
    monkeypatch.setattr(kernels, "flash_linear_attention_version", lambda: "0.5.2")
    with pytest.raises(ValueError, match=r"needs flash-linear-attention >= 0\.6, found version 0\.5\.2 \(pip install"):
        resolve_backend("fla", CUDA, "delta_rule")


def test_unknown_backend_lists_fla_among_the_allowed_values():
    with pytest.raises(ValueError, match=r"backend='flash'.*allowed values are 'torch', 'triton', 'reference', 'fla'"):
        resolve_backend("flash", CUDA, "delta_rule")


@needs_fla
def test_fla_on_cpu_tensors_outside_the_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    query = torch.randn(1, 1, 3, 4)
    with pytest.raises(ValueError, match=r"The 'fla' kernel backend runs on CUDA tensors.*got tensors on cpu"):
        delta_rule(query, query, query, backend="fla")


@needs_fla
def test_describe_backend_says_what_runs(monkeypatch):
    monkeypatch.delenv("MEMLM_KERNELS", raising=False)
    version = flash_linear_attention_version()
    assert describe_backend("delta_rule", "cuda", torch.bfloat16) == (
        f"fla: flash-linear-attention {version} chunk_delta_rule to train and prefill, fused_recurrent_delta_rule to "
        f"decode (key widths above 256 run memlm's Triton kernels)"
    )
    assert describe_backend("delta_rule", "cuda", torch.float32).startswith(
        f"fla: flash-linear-attention {version} fused_recurrent_delta_rule to decode; memlm's Triton chunkwise kernel "
        f"to train and prefill in float32"
    )
    assert describe_backend("delta_rule", "cuda", torch.float64).startswith(
        "fla (float64 runs PyTorch): memlm's PyTorch"
    )
    assert describe_backend("sum_rule", "cuda", torch.bfloat16).endswith(
        "(flash-linear-attention has no kernel for this operation)"
    )
    assert describe_backend("expire_span_attention", "cuda").startswith("triton: memlm's Triton attention kernel")
    assert describe_backend("delta_rule", "cpu").startswith("torch: memlm's PyTorch chunkwise implementation")
    assert describe_backend("delta_rule", "cuda", backend="triton").startswith("triton: memlm's Triton chunkwise")
    assert describe_backend("delta_rule", "cuda", backend="reference").startswith("reference:")
    assert describe_backend("feedback", "cpu") == (
        "torch: memlm's PyTorch step loop (a ring of τ slots to decode; a tape and a hand-written backward to train)"
    )
    assert describe_backend("feedback", "cuda").endswith("to train) (no Triton kernel for this operation)")
    assert describe_backend("feedback", "cuda", backend="reference").startswith("reference:")
    assert describe_backend("delta_rule", "cuda", "bfloat16") == describe_backend("delta_rule", "cuda", torch.bfloat16)
    assert describe_backend("delta_rule", "cuda", "torch.float16") == describe_backend(
        "delta_rule", "cuda", torch.float16
    )
    with pytest.raises(ValueError, match=r"dtype='brainfloat' is not a torch dtype"):
        describe_backend("delta_rule", "cuda", "brainfloat")
    monkeypatch.setenv("MEMLM_KERNELS", "torch")
    assert describe_backend("delta_rule", "cuda", torch.bfloat16).startswith("torch:")
    with pytest.raises(ValueError, match=r"operation='attention' is not a memlm kernel operation; allowed values are "
                                         r"'delta_rule', 'sum_rule', 'expire_span_attention'"):  # fmt: skip
        describe_backend("attention", "cuda")


# --- FLA's kernels through delta_rule (in Triton's interpreter without a GPU) --------------------------------------


def _first_configuration_only(monkeypatch) -> int:
    """Keep the first configuration of each autotuned kernel of the loaded FLA modules; return how many."""
    from triton.runtime.autotuner import Autotuner

    pinned = set()
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] != "fla" or module is None:
            continue
        for value in list(vars(module).values()):
            for _ in range(4):  # decorators wrap the Autotuner: @triton.heuristics(...) → .fn → Autotuner
                if isinstance(value, Autotuner) or not hasattr(value, "fn"):
                    break
                value = value.fn
            if isinstance(value, Autotuner) and id(value) not in pinned:
                pinned.add(id(value))
                monkeypatch.setattr(value, "configs", value.configs[:1])
    return len(pinned)


def _interpreter_range(*arguments):
    """`range` as compiled Triton runs it: each index an int32 tensor (a Python int in the interpreter)."""
    from triton.runtime.interpreter import interpreter_semantic

    for index in builtins.range(*arguments):
        yield interpreter_semantic.to_tensor(index, False)


@contextlib.contextmanager
def fla_on_this_machine(*module_names: str):
    """Import FLA's `module_names` and make their kernels runnable here (see the module docstring), for the block;
    skip the test where FLA's kernels cannot run."""
    if not flash_linear_attention_available():
        pytest.skip("flash-linear-attention >= 0.6 (pip install memlm[fla]) and triton")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("FLA's kernels need CUDA or Triton's interpreter")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # on CPU: "Triton is not supported on current platform"
        modules = [importlib.import_module(name) for name in module_names]  # before their autotuners are pinned
        from fla.ops.common import chunk_delta_h
    with pytest.MonkeyPatch.context() as monkeypatch:
        if not torch.cuda.is_available():
            assert _first_configuration_only(monkeypatch) > 5
            monkeypatch.setattr(chunk_delta_h, "range", _interpreter_range, raising=False)
        yield modules


@pytest.fixture(scope="module")
def fla_kernels():
    """FLA's delta-rule functions, ready to run on this machine's tensors (see the module docstring)."""
    with fla_on_this_machine("fla.ops.delta_rule") as (delta_rule_module,):
        yield {"chunk": delta_rule_module.chunk_delta_rule, "recurrent": delta_rule_module.fused_recurrent_delta_rule}


def _inputs(length, dtype, *, batch_size=2, num_heads=2, key_dim=16, value_dim=16, states=None, seed=0):
    """L2-normalised keys and queries scaled by d_k^-1/2 (as the fla preset feeds them), values, β in (0, 1), and a
    float32 initial state per sequence (``states`` of them, ``None`` for none)."""
    generator = torch.Generator().manual_seed(seed)
    shape = (batch_size, num_heads, length)
    query = F.normalize(torch.randn(*shape, key_dim, generator=generator), dim=-1) * key_dim**-0.5
    key = F.normalize(torch.randn(*shape, key_dim, generator=generator), dim=-1)
    value = torch.randn(*shape, value_dim, generator=generator)
    beta = torch.rand(shape, generator=generator)
    tensors = [tensor.to(dtype) for tensor in (query, key, value, beta)]
    state = None if states is None else torch.randn(states, num_heads, key_dim, value_dim, generator=generator)
    return tensors, state


def _run(tensors, state, backend, **options):
    """Output, final state and the gradients of query, key, value, β (and the initial state) for a fixed weighting
    of the output and the final state."""
    tensors = [tensor.detach().clone().requires_grad_() for tensor in tensors]
    state = None if state is None else state.detach().clone().requires_grad_()
    output, final = delta_rule(*tensors, initial_state=state, output_final_state=True, backend=backend, **options)
    generator = torch.Generator().manual_seed(1)
    loss = (output.float() * torch.randn(output.shape, generator=generator).to(output.device)).sum()
    loss = loss + (final * torch.randn(final.shape, generator=generator).to(final.device)).sum()
    loss.backward()
    gradients = [tensor.grad for tensor in tensors] + ([] if state is None else [state.grad])
    return output, final, gradients


def _check_against_reference(tensors, state, tolerance, **options):
    output, final, gradients = _run(tensors, state, "fla", **options)
    expected_output, expected_final, expected_gradients = _run(
        [tensor.float() for tensor in tensors], state, "reference", **options
    )
    assert output.dtype == tensors[2].dtype and final.dtype == torch.float32
    assert _relative_error(output, expected_output) < tolerance
    assert _relative_error(final, expected_final) < tolerance
    names = ["query", "key", "value", "beta", "initial_state"]
    for name, gradient, expected in zip(names, gradients, expected_gradients):
        assert gradient.dtype == (torch.float32 if name == "initial_state" else tensors[0].dtype), name
        assert _relative_error(gradient, expected) < tolerance, name
    return output, final


@pytest.mark.parametrize("with_state", [False, True], ids=["zero_state", "initial_state"])
def test_chunk_delta_rule_equals_the_reference_with_gradients(fla_kernels, with_state):
    tensors, state = _inputs(20, torch.float16, states=2 if with_state else None)
    output, final = _check_against_reference(tensors, state, FLOAT16_TOLERANCE)
    # It is FLA's kernel that ran, with memlm's layout mapped onto FLA's (B, T, H, d), scale 1 and β (B, T, H).
    query, key, value, beta = (tensor.transpose(1, 2) for tensor in tensors)
    expected_output, expected_final = fla_kernels["chunk"](
        query, key, value, beta, scale=1.0, initial_state=state, output_final_state=True
    )
    assert torch.equal(output, expected_output.transpose(1, 2)) and torch.equal(final, expected_final)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("length", "with_state"), [(1000, False), (1000, True), (1, True)])
def test_fla_on_cuda_in_bfloat16_equals_the_reference_with_gradients(fla_kernels, length, with_state):
    """What the interpreter cannot check (the module docstring): FLA's kernels in bfloat16, at a training shape
    (chunk_delta_rule) and for one decoding token (fused_recurrent_delta_rule), output, final state and every
    gradient against the float32 reference; bfloat16's rounding is 3.9e-3."""
    tensors, state = _inputs(length, torch.bfloat16, num_heads=4, key_dim=128, value_dim=128,
                             states=2 if with_state else None)  # fmt: skip
    tensors = [tensor.cuda() for tensor in tensors]
    _check_against_reference(tensors, None if state is None else state.cuda(), BFLOAT16_TOLERANCE)


def test_chunk_delta_rule_with_packed_sequences_and_an_empty_one(fla_kernels):
    cu_seqlens = torch.tensor([0, 7, 7, 20], dtype=torch.int32)
    tensors, state = _inputs(20, torch.float16, batch_size=1, states=3)
    output, final = _check_against_reference(tensors, state, FLOAT16_TOLERANCE, cu_seqlens=cu_seqlens)
    assert torch.equal(final[1], state[1])  # the empty sequence passes its memory through unchanged
    # Each sequence alone, from its own initial state, gives the same as the packed call.
    for index, (start, end) in enumerate([(0, 7), (7, 20)]):
        pieces = [tensor[:, :, start:end] for tensor in tensors]
        alone, alone_final = delta_rule(
            *pieces, initial_state=state[2 * index : 2 * index + 1], output_final_state=True, backend="fla"
        )
        assert _relative_error(output[:, :, start:end], alone) < FLOAT16_TOLERANCE
        assert _relative_error(final[2 * index], alone_final[0]) < FLOAT16_TOLERANCE


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decoding_step_runs_fused_recurrent_delta_rule(fla_kernels, dtype):
    tensors, state = _inputs(1, dtype, states=2)
    tolerance = FLOAT32_TOLERANCE if dtype == torch.float32 else FLOAT16_TOLERANCE
    output, final = _check_against_reference(tensors, state, tolerance)
    query, key, value, beta = (tensor.transpose(1, 2) for tensor in tensors)
    expected_output, expected_final = fla_kernels["recurrent"](
        query, key, value, beta, scale=1.0, initial_state=state, output_final_state=True
    )
    assert torch.equal(output, expected_output.transpose(1, 2)) and torch.equal(final, expected_final)
    with torch.no_grad():  # without a state and without β (= 1), as the first decoding step of a fresh memory
        output, final = delta_rule(*tensors[:3], output_final_state=True, backend="fla")
        expected_output, expected_final = delta_rule(*tensors[:3], output_final_state=True, backend="reference")
    assert _relative_error(output, expected_output) < tolerance and _relative_error(final, expected_final) < tolerance


def test_what_fla_does_not_take_runs_memlms_triton_kernels(fla_kernels):
    tensors, state = _inputs(20, torch.float32, states=2)  # FLA's chunk kernel refuses float32
    with torch.no_grad():
        output, final = delta_rule(*tensors, initial_state=state, output_final_state=True, backend="fla")
        expected_output, expected_final = delta_rule(
            *tensors, initial_state=state, output_final_state=True, backend="triton"
        )
        assert torch.equal(output, expected_output) and torch.equal(final, expected_final)
        mixed = [tensors[0], tensors[1], tensors[2].half(), tensors[3]]  # query and key float32, value float16
        assert torch.equal(delta_rule(*mixed, backend="fla")[0], delta_rule(*mixed, backend="triton")[0])
        wide, _ = _inputs(3, torch.float16, key_dim=320, value_dim=4)  # key width above chunk_delta_rule's 256
        assert torch.equal(delta_rule(*wide, backend="fla")[0], delta_rule(*wide, backend="triton")[0])
        double = [tensor.double() for tensor in tensors]  # float64 runs the PyTorch implementation
        assert torch.equal(delta_rule(*double, backend="fla")[0], delta_rule(*double, backend="torch")[0])


def _count_calls(monkeypatch, name: str) -> list:
    """Record each call of FLA's `name` made by memlm's mapping (the real function still runs)."""
    from memlm.kernels.delta_rule import flash_linear_attention as mapping

    calls, function = [], getattr(mapping, name)

    def counted(*args, **kwargs):
        calls.append(name)
        return function(*args, **kwargs)

    monkeypatch.setattr(mapping, name, counted)
    return calls


def _perturbed_model(dtype=torch.float32) -> DeltaNetForCausalLM:
    torch.manual_seed(0)
    model = DeltaNetForCausalLM(DeltaNetConfig.from_preset("fla", **TINY))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    return model.to(dtype).eval()


def test_deltanet_in_float16_with_fla_equals_torch(fla_kernels, monkeypatch):
    calls = _count_calls(monkeypatch, "chunk_delta_rule")
    model = _perturbed_model(torch.float16)
    input_ids = torch.randint(0, 256, (2, 13))
    logits = {}
    with torch.no_grad():
        for backend in ("torch", "fla"):
            monkeypatch.setenv("MEMLM_KERNELS", backend)
            logits[backend] = model(input_ids).logits
    assert len(calls) == TINY["num_hidden_layers"]  # one chunk_delta_rule per layer, with the fla backend only
    assert _relative_error(logits["fla"], logits["torch"]) < FLOAT16_TOLERANCE


def test_deltanet_generation_with_fla_equals_torch(fla_kernels, monkeypatch):
    calls = _count_calls(monkeypatch, "fused_recurrent_delta_rule")
    model = _perturbed_model()
    input_ids = torch.randint(0, 256, (2, 9))
    generated = {}
    for backend in ("torch", "fla"):
        monkeypatch.setenv("MEMLM_KERNELS", backend)
        generated[backend] = model.generate(input_ids, max_new_tokens=4, do_sample=False, output_logits=True,
                                            return_dict_in_generate=True)  # fmt: skip
    assert len(calls) == TINY["num_hidden_layers"] * 3  # float32 prefill runs memlm's Triton; 3 one-token steps FLA's
    assert torch.equal(generated["fla"].sequences, generated["torch"].sequences)
    for logits, expected in zip(generated["fla"].logits, generated["torch"].logits):
        assert _relative_error(logits, expected) < FLOAT32_TOLERANCE


def test_padded_batch_runs_packed_through_flas_varlen_kernel(fla_kernels, monkeypatch):
    """A padded batch runs packed (`cu_seqlens`) on the fla backend, as on triton: each row's real tokens alone."""
    calls = []
    from memlm.kernels.delta_rule import flash_linear_attention as mapping

    chunk = mapping.chunk_delta_rule

    def counted(*args, **kwargs):
        calls.append(kwargs.get("cu_seqlens"))
        return chunk(*args, **kwargs)

    monkeypatch.setattr(mapping, "chunk_delta_rule", counted)
    model = _perturbed_model(torch.float16)
    input_ids = torch.randint(0, 256, (2, 12))
    attention_mask = torch.ones(2, 12, dtype=torch.long)
    attention_mask[1, :5] = 0  # the second row: 5 padding tokens, then 7 real ones
    with torch.no_grad():
        monkeypatch.setenv("MEMLM_KERNELS", "fla")
        logits = model(input_ids, attention_mask=attention_mask).logits
        monkeypatch.setenv("MEMLM_KERNELS", "torch")
        first_alone = model(input_ids[:1]).logits
        second_alone = model(input_ids[1:, 5:]).logits
    assert len(calls) == TINY["num_hidden_layers"] and all(offsets is not None for offsets in calls)
    assert calls[0].tolist() == [0, 12, 19]  # the 12 + 7 real tokens back to back
    assert _relative_error(logits[:1], first_alone) < FLOAT16_TOLERANCE
    assert _relative_error(logits[1:, 5:], second_alone) < FLOAT16_TOLERANCE


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_deltanet_on_gpu_in_bfloat16_fla_agrees_with_triton_and_torch(fla_kernels, monkeypatch):
    sizes = {**TINY, "hidden_size": 256, "num_attention_heads": 4, "intermediate_size": 512, "num_hidden_layers": 4}
    torch.manual_seed(0)
    model = DeltaNetForCausalLM(DeltaNetConfig.from_preset("fla", **{**sizes, "chunk_size": 64}))
    model = model.to("cuda").eval()
    input_ids = torch.randint(0, 256, (4, 1024), device="cuda")
    errors = {}
    with torch.no_grad():
        monkeypatch.setenv("MEMLM_KERNELS", "torch")
        expected = model(input_ids).logits  # float32
        model.to(torch.bfloat16)
        for backend in ("torch", "triton", "fla"):
            monkeypatch.setenv("MEMLM_KERNELS", backend)
            errors[backend] = _relative_error(model(input_ids).logits.float(), expected)
    # Each bfloat16 backend against the float32 model (seen on an H200: FLA's and PyTorch's bfloat16 logits 2.1e-2
    # apart); bfloat16's roundings through four layers make about 2.5e-2, a wrong kernel is off by O(1).
    assert max(errors.values()) < 6e-2, errors


def test_a_non_finite_input_leaves_the_earlier_outputs_of_fla_s_kernel_as_they_were(fla_kernels):
    """FLA's chunk kernel multiplies a chunk's rows together too (0 · NaN = NaN): memlm keeps a NaN where it is."""
    tensors, _ = _inputs(20, torch.float16)
    clean, _ = delta_rule(*tensors, backend="fla")
    tensors[2] = tensors[2].clone()
    tensors[2][0, 1, 13, 3] = float("nan")
    output, _ = delta_rule(*tensors, backend="fla")
    assert torch.equal(output[0, 1, :13], clean[0, 1, :13]) and output[0, 1, 13:].isnan().all()
    assert torch.equal(output[1], clean[1])
