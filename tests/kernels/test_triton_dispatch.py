"""The "triton" backend through the public entry points and the models: each model's logits and gradients with the
Triton kernels equal those with the PyTorch implementation. Without a GPU the kernels run in Triton's interpreter
(tests/conftest.py sets TRITON_INTERPRET=1); with one, the `gpu` tests repeat this at realistic sizes in bfloat16."""

import os

import pytest
import torch

pytest.importorskip("triton")

from memlm import DeltaNetConfig, DeltaNetForCausalLM, ExpireSpanConfig, ExpireSpanForCausalLM  # noqa: E402
from memlm.kernels.delta_rule import delta_rule, sum_rule  # noqa: E402
from memlm.kernels.expire_attention import expire_span_attention, expire_span_attention_sdpa  # noqa: E402

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels need CUDA or Triton's interpreter",
)
SIZES = {"vocab_size": 258, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 2}  # fmt: skip


def _relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    return ((value.float() - reference.float()).pow(2).mean().sqrt() / reference.float().pow(2).mean().sqrt()).item()


def _perturbed(model):
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    return model


def test_expire_span_attention_dispatches_to_the_kernel_and_keeps_dropout_on_torch(monkeypatch):
    from memlm.kernels.expire_attention.triton_attention import expire_span_attention_triton

    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(2, 2, 8, 16, generator=generator) for _ in range(3))
    positions = torch.arange(8).expand(2, 8)
    spans = torch.rand(2, 8, generator=generator) * 6
    arguments = (query, key, value, spans, positions, positions)
    expected = expire_span_attention_triton(*arguments, ramp=2.0)
    assert torch.equal(expire_span_attention(*arguments, ramp=2.0, backend="triton"), expected)
    monkeypatch.setenv("MEMLM_KERNELS", "triton")
    assert torch.equal(expire_span_attention(*arguments, ramp=2.0), expected)
    assert _relative_error(expected, expire_span_attention_sdpa(*arguments, ramp=2.0)) < 1e-5
    torch.manual_seed(1)
    with_dropout = expire_span_attention(*arguments, ramp=2.0, dropout=0.5)  # the kernel has no dropout: torch runs
    torch.manual_seed(1)
    assert torch.equal(with_dropout, expire_span_attention_sdpa(*arguments, ramp=2.0, dropout=0.5))


def test_delta_rule_dispatches_decoding_steps_to_the_fused_recurrent_kernel(monkeypatch):
    from memlm.kernels.delta_rule.triton_recurrent import delta_rule_step_triton, sum_rule_step_triton

    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(2, 2, 1, 8, generator=generator) for _ in range(3))
    beta = torch.rand(2, 2, 1, generator=generator)
    state = torch.randn(2, 2, 8, 8, generator=generator)
    monkeypatch.setenv("MEMLM_KERNELS", "triton")
    output, final = delta_rule(query, key, value, beta, initial_state=state, output_final_state=True)
    expected_output, expected_final = delta_rule_step_triton(query, key, value, beta, state, True)
    assert torch.equal(output, expected_output) and torch.equal(final, expected_final)
    sum_output, _ = sum_rule(query, key, value, initial_state=state)
    assert torch.equal(sum_output, sum_rule_step_triton(query, key, value, state, False)[0])


def _count_calls(monkeypatch, module, name: str) -> list:
    """Record each call of module.name (the real function still runs), to show which kernel a model used."""
    calls, function = [], getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(name)
        return function(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


# The official code's layout (SPEC §8; memlm.conversion.transformer_sequential), with a larger ε that matters.
OFFICIAL_EXPIRE_SPAN = dict(
    position_encoding="learned_relative", attend_to_self=False, initial_memory="zeros", renormalization_epsilon=1e-3,
    span_loss_form="remaining_span", recompute_memory=True, norm_type="layernorm", norm_position="post",
    final_norm=False, mlp_type="plain", mlp_bias=True, hidden_act="relu", lm_head_bias=True,
)  # fmt: skip


@pytest.mark.parametrize("layout", ["default", "official"])
def test_expire_span_model_with_triton_equals_torch(layout, monkeypatch):
    from memlm.kernels.expire_attention import triton_attention

    calls = _count_calls(monkeypatch, triton_attention, "expire_span_attention_triton")
    torch.manual_seed(0)
    options = OFFICIAL_EXPIRE_SPAN if layout == "official" else {}
    config = ExpireSpanConfig(**SIZES, max_span=16, ramp=4, block_size=8, **options)
    model = _perturbed(ExpireSpanForCausalLM(config)).train()
    input_ids = torch.randint(0, 256, (2, 20))
    results = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("MEMLM_KERNELS", backend)
        model.zero_grad(set_to_none=True)
        output = model(input_ids, labels=input_ids)
        output.loss.backward()
        results[backend] = (output.logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters()})
    assert len(calls) == 2 * 3  # two layers, three blocks of 8, with the triton backend only
    (logits, gradients), (expected_logits, expected_gradients) = results["triton"], results["torch"]
    assert _relative_error(logits, expected_logits) < 1e-5
    for name, expected in expected_gradients.items():
        assert _relative_error(gradients[name], expected) < 1e-4, name


def test_deltanet_generation_with_triton_equals_torch(monkeypatch):
    from memlm.kernels.delta_rule import triton_chunk, triton_recurrent

    chunk_calls = _count_calls(monkeypatch, triton_chunk, "delta_rule_chunk_triton")
    step_calls = _count_calls(monkeypatch, triton_recurrent, "delta_rule_step_triton")
    torch.manual_seed(0)
    model = _perturbed(DeltaNetForCausalLM(DeltaNetConfig.from_preset("fla", **SIZES, chunk_size=8))).eval()
    input_ids = torch.randint(0, 256, (2, 11))
    generated = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("MEMLM_KERNELS", backend)
        generated[backend] = model.generate(input_ids, max_new_tokens=6, do_sample=False, output_logits=True,
                                            return_dict_in_generate=True)  # fmt: skip
    assert len(chunk_calls) == 2 and len(step_calls) == 2 * 5  # prefill per layer; then 5 one-token steps
    assert torch.equal(generated["triton"].sequences, generated["torch"].sequences)
    for logits, expected in zip(generated["triton"].logits, generated["torch"].logits):
        assert _relative_error(logits, expected) < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("model_class", ["deltanet", "expire_span"])
def test_models_on_gpu_in_bfloat16_agree_across_backends(model_class, monkeypatch):
    sizes = {**SIZES, "hidden_size": 256, "num_attention_heads": 4, "intermediate_size": 512, "num_hidden_layers": 4}
    torch.manual_seed(0)
    if model_class == "deltanet":
        model = DeltaNetForCausalLM(DeltaNetConfig.from_preset("fla", **sizes))
    else:
        model = ExpireSpanForCausalLM(ExpireSpanConfig(**sizes, max_span=1024, ramp=32, block_size=256))
    model = _perturbed(model).to("cuda").eval()
    input_ids = torch.randint(0, 256, (4, 1024), device="cuda")
    errors = {}
    with torch.no_grad():
        monkeypatch.setenv("MEMLM_KERNELS", "torch")
        expected = model(input_ids).logits  # float32
        model.to(torch.bfloat16)
        for backend in ("torch", "triton"):
            monkeypatch.setenv("MEMLM_KERNELS", backend)
            errors[backend] = _relative_error(model(input_ids).logits.float(), expected)
    # Each bfloat16 backend against the float32 model. bfloat16 rounds to 3.9e-3; some forty roundings in a row
    # through four layers make about 2.5e-2 (seen on an H200: the two bfloat16 backends 2.2-2.4e-2 apart). A wrong
    # kernel is off by O(1).
    assert max(errors.values()) < 6e-2, errors


def test_the_kernel_benchmark_runs_end_to_end():
    """benchmarks/kernel_costs.py measures on a GPU; --smoke runs every table on tiny shapes (here in the interpreter)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "kernel_costs.py"
    specification = importlib.util.spec_from_file_location("kernel_benchmark", path)
    benchmark = importlib.util.module_from_spec(specification)
    specification.loader.exec_module(benchmark)
    results = benchmark.main(["--smoke"])
    assert len(results["delta_rule"]) == 1 and len(results["step"]) == 1 and len(results["expire_span"]) == 2
    assert len(results["padded"]) == 1 and 0 < results["padded"][0]["real"] < 1
    assert "MEMLM_KERNELS" not in os.environ  # the padded-batch table restores the backend it forced
    assert all(row["memlm"][0] > 0 for name in ("delta_rule", "step", "expire_span") for row in results[name])
    assert results["padded"][0]["packed"][0] > 0 and results["padded"][0]["masked"][0] > 0
