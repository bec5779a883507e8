"""DeltaNet's delta rule on a kernel that `kernels.kernelize` swaps in under 🤗's name `chunk_gated_delta_rule`
(issue 21): the way 🤗 5.24 gives Qwen3-Next flash-linear-attention's Hub kernel (`kernels-community/fla`).

No network here: the Hub repository is played by a local kernel repository whose `chunk_gated_delta_rule` layer calls
the installed FLA's `chunk_gated_delta_rule`, and no GPU: FLA's kernels run in Triton's interpreter on CPU tensors
(with the first configuration of each autotuned kernel, as `test_fla_backend.py` explains), in float16 (the
interpreter's bfloat16 products are wrong, triton-lang/triton#11584). The model is kernelized for device "cpu" with
a mapping that names the stand-in for "cpu"; what runs on a GPU is the same call on CUDA tensors.
"""

import json
import textwrap
from pathlib import Path

import pytest
import torch

kernels = pytest.importorskip("kernels")

from kernels import LocalLayerRepository, Mode, kernelize, use_kernel_mapping  # noqa: E402

from memlm import DeltaNetForCausalLM  # noqa: E402
from memlm.kernels.delta_rule import delta_rule  # noqa: E402
from memlm.kernels.delta_rule.hub_function import (  # noqa: E402
    HUB_FUNCTION_NAME,
    chunk_gated_delta_rule,
    swapped_kernel,
)
from tests.conftest import DELTANET_VARIANTS  # noqa: E402
from tests.kernels.test_fla_backend import fla_on_this_machine  # noqa: E402

FLOAT16_TOLERANCE = 3e-3  # relative RMS error against float32, as in test_fla_backend.py

STAND_IN_LAYER = '''
    """A stand-in for flash-linear-attention's Hub kernel repository: its `chunk_gated_delta_rule` layer."""

    import torch
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk_gated_delta_rule

    CALLS = []


    class chunk_gated_delta_rule(torch.nn.Module):
        def forward(self, query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                    use_qk_l2norm_in_kernel=False, **kwargs):
            CALLS.append(sorted(kwargs))
            return fla_chunk_gated_delta_rule(query, key, value, g=g, beta=beta, initial_state=initial_state,
                                              output_final_state=output_final_state,
                                              use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kwargs)
'''


@pytest.fixture(scope="module")
def fla_repository(tmp_path_factory) -> Path:
    """A local kernel repository with FLA's gated delta rule as its `chunk_gated_delta_rule` layer, and FLA's gated
    kernels ready for the interpreter."""
    directory = tmp_path_factory.mktemp("fla_standin")
    # Both noarch variants, as the Hub repository has them: which one a torch build resolves is the `kernels`
    # package's rule (a CUDA build of torch takes torch-cuda even for kernelize(device="cpu")).
    for backend in ("cpu", "cuda"):
        variant = directory / "build" / f"torch-{backend}"
        package = variant / "fla_standin"
        package.mkdir(parents=True)
        metadata = {"id": f"_fla_standin_{backend}", "name": "fla-standin", "version": 2, "license": "MIT",
                    "python-depends": [], "backend": {"type": backend}}  # fmt: skip
        (variant / "metadata.json").write_text(json.dumps(metadata))
        (package / "__init__.py").write_text("from . import layers\n")
        (package / "layers.py").write_text(textwrap.dedent(STAND_IN_LAYER))
    with fla_on_this_machine("fla.ops.gated_delta_rule"):
        yield directory


def _mapping(directory: Path) -> dict:
    return {HUB_FUNCTION_NAME: {"cpu": LocalLayerRepository(directory, layer_name=HUB_FUNCTION_NAME)}}


def _model(dtype=torch.float16) -> DeltaNetForCausalLM:
    torch.manual_seed(0)
    config = DELTANET_VARIANTS["fla_gated"]()
    return DeltaNetForCausalLM(config).to(dtype).eval()


def _stand_in_calls() -> list:
    loaded = [entry.module for entry in kernels.get_loaded_kernels() if str(entry.metadata.name) == "fla-standin"]
    assert len(loaded) == 1
    return loaded[0].layers.CALLS


def _relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    return ((value.float() - reference.float()).pow(2).mean().sqrt() / reference.float().pow(2).mean().sqrt()).item()


def test_the_function_runs_memlm_delta_rule_in_the_gated_convention():
    """Until something is swapped in, `chunk_gated_delta_rule` is memlm's delta rule in 🤗's layout (B, T, H, d),
    with its default scale d_k^-1/2 and optional L2 normalisation; a nonzero gate is refused in words."""
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(2, 9, 3, 4, generator=generator, dtype=torch.float64) for _ in range(3))
    beta = torch.rand(2, 9, 3, generator=generator, dtype=torch.float64)
    gate = torch.zeros(2, 9, 3, dtype=torch.float64)
    output, state = chunk_gated_delta_rule(query, key, value, gate, beta, use_qk_l2norm_in_kernel=True,
                                           output_final_state=True)  # fmt: skip
    normalised_query, normalised_key = (torch.nn.functional.normalize(tensor, dim=-1) for tensor in (query, key))
    expected, expected_state = delta_rule(
        *(tensor.transpose(1, 2) for tensor in (normalised_query * 0.5, normalised_key, value, beta)),
        output_final_state=True, backend="reference",
    )  # fmt: skip
    torch.testing.assert_close(output, expected.transpose(1, 2))
    torch.testing.assert_close(state, expected_state)
    with pytest.raises(ValueError, match=r"g must be 0 everywhere .* kernelize a gated kernel"):
        chunk_gated_delta_rule(query, key, value, gate + 0.1, beta)


def test_without_kernelize_nothing_is_swapped():
    model = _model(torch.float32)
    assert all(swapped_kernel(layer.attention) is None for layer in model.model.layers)
    assert "chunk_gated_delta_rule=" not in repr(model)


def test_kernelized_hub_kernel_runs_the_rule_and_matches_the_fla_backend(fla_repository, monkeypatch):
    """Kernelized, every layer's prefill runs the stand-in's FLA kernel (with scale 1 and g = 0), and the logits,
    greedy generation and gradients match the same model on memlm's "fla" backend (FLA's ungated chunk_delta_rule)
    and, within float16 rounding, memlm's float32 model."""
    tokens = torch.randint(3, 250, (2, 24), generator=torch.Generator().manual_seed(1))
    monkeypatch.setenv("MEMLM_KERNELS", "fla")
    plain = _model()
    expected = plain(tokens).logits
    expected_generation = plain.generate(tokens[:1, :12], max_new_tokens=4, do_sample=False)
    monkeypatch.delenv("MEMLM_KERNELS")
    reference = _model(torch.float32)(tokens).logits

    model = _model()
    with use_kernel_mapping(_mapping(fla_repository)):
        kernelize(model, mode=Mode.TRAINING, device="cpu")
    assert all(swapped_kernel(layer.attention) is not None for layer in model.model.layers)
    # The variant this torch build resolves (`kernels`' rule: torch-cuda for a CUDA build, torch-cpu for a CPU one).
    (loaded,) = [entry for entry in kernels.get_loaded_kernels() if str(entry.metadata.name) == "fla-standin"]
    backend = str(loaded.metadata.backend.backend_type).rpartition(".")[2].lower()
    text = f"chunk_gated_delta_rule=fla-standin version 2 ({backend}) from {fla_repository / 'build' / f'torch-{backend}'}"
    assert text in repr(model.model.layers[0].attention)
    # Each layer carries its own copy of the function: the other models of the process keep memlm's.
    for other in (plain, _model()):
        assert all(swapped_kernel(layer.attention) is None for layer in other.model.layers)
    calls = _stand_in_calls()
    calls.clear()
    logits = model(tokens).logits  # on CPU without MEMLM_KERNELS: the rest of memlm runs PyTorch
    assert calls == [["scale"]] * len(model.model.layers)
    assert _relative_error(logits, expected) < FLOAT16_TOLERANCE
    assert _relative_error(logits, reference) < 2 * FLOAT16_TOLERANCE
    generation = model.generate(tokens[:1, :12], max_new_tokens=4, do_sample=False)
    torch.testing.assert_close(generation, expected_generation, rtol=0, atol=0)

    model.train()
    model.zero_grad()
    model(tokens, labels=tokens).loss.backward()
    monkeypatch.setenv("MEMLM_KERNELS", "fla")
    plain.train()
    plain.zero_grad()
    plain(tokens, labels=tokens).loss.backward()
    for (name, parameter), expected_parameter in zip(model.named_parameters(), plain.parameters(), strict=True):
        assert _relative_error(parameter.grad, expected_parameter.grad) < 2 * FLOAT16_TOLERANCE, name


def test_inputs_the_hub_kernel_does_not_cover_run_memlm_kernels(fla_repository):
    """float32 (FLA's chunk kernels refuse it) runs memlm's own kernels, untouched by the swapped function."""
    model = _model(torch.float32)
    with use_kernel_mapping(_mapping(fla_repository)):
        kernelize(model, mode=Mode.INFERENCE, device="cpu")
    calls = _stand_in_calls()
    calls.clear()
    tokens = torch.randint(3, 250, (1, 12), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(model(tokens).logits, _model(torch.float32)(tokens).logits, rtol=0, atol=0)
    assert calls == []
