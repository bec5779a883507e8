"""memlm's kernel repository through the real `kernels` package: generated, loaded from a local folder, swapped into
tiny models by `kernels.kernelize`, and equal to the plain models (issue 21)."""

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

kernels = pytest.importorskip("kernels")
pytestmark = pytest.mark.huggingface  # also under the oldest and newest releases (`make test-releases`)

from kernels import Mode, get_local_kernel, kernelize, use_kernel_mapping  # noqa: E402

from memlm import DeltaNetForCausalLM, ExpireSpanConfig, ExpireSpanForCausalLM, FeedbackCache  # noqa: E402
from memlm.kernel_repository import VARIANTS, write_repository  # noqa: E402
from memlm.kernels.delta_rule import delta_rule, sum_rule  # noqa: E402
from memlm.kernels.expire_attention import expire_span_attention  # noqa: E402
from memlm.kernels.feedback import feedback_recurrence  # noqa: E402
from memlm.kernels.hub import HUB_REPOSITORY, kernel_mapping  # noqa: E402
from tests.conftest import DELTANET_VARIANTS  # noqa: E402
from tests.modeling.test_modeling_expire_span import TINY as EXPIRE_SPAN_TINY  # noqa: E402
from tests.modeling.test_modeling_feedback_transformer import _model as feedback_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
# The delta rule and the sum rule, each with and without a short convolution, an output gate and the normaliser.
FAMILIES = ["fla_gated", "favor_conv_gate", "sum_rule_normalised", "identity_sum_rule"]


@pytest.fixture(scope="module")
def repository(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("kernel_repository")
    write_repository(directory)
    return directory


@pytest.fixture(scope="module")
def backend(repository) -> str:
    """The backend ("cpu" or "cuda") of the variant the `kernels` package resolves on this machine: its rule, not
    memlm's (a CUDA build of torch resolves torch-cuda even without a GPU, a CPU build torch-cpu). Both variants hold
    the same code, which dispatches per tensor (Triton on CUDA tensors, PyTorch on CPU ones), so every test below holds
    under either build."""
    return _backend_of(repository)


def test_the_build_resolves_one_of_the_repository_variants(repository, backend):
    kernel = get_local_kernel(repository)
    loaded = {entry.module: entry for entry in kernels.get_loaded_kernels()}[kernel]
    assert loaded.metadata.name.python_name == "memlm_kernels"
    variant = Path(kernel.__file__).parent.parent.name
    assert VARIANTS[variant] == backend
    assert set(VARIANTS) == {path.name for path in (repository / "build").iterdir()}


@pytest.mark.parametrize("operation", ["delta_rule", "sum_rule"])
def test_repository_delta_and_sum_rule_equal_memlm(repository, operation):
    kernel = get_local_kernel(repository)
    query, key, value = (torch.randn(2, 2, 11, 4, dtype=torch.float64) for _ in range(3))
    key = torch.nn.functional.normalize(key, dim=-1)
    arguments = (query, key, value) + (
        (torch.rand(2, 2, 11, dtype=torch.float64),) if operation == "delta_rule" else ()
    )
    memlm_function = {"delta_rule": delta_rule, "sum_rule": sum_rule}[operation]
    expected, expected_state = memlm_function(*arguments, output_final_state=True, chunk_size=4)
    output, state = getattr(kernel, operation)(*arguments, output_final_state=True, chunk_size=4)
    torch.testing.assert_close(output, expected, rtol=0, atol=0)
    torch.testing.assert_close(state, expected_state, rtol=0, atol=0)


def test_repository_expire_span_attention_equals_memlm(repository):
    kernel = get_local_kernel(repository)
    query, key, value = (torch.randn(2, 2, 7, 4, dtype=torch.float64) for _ in range(3))
    spans = torch.rand(2, 7, dtype=torch.float64) * 6
    positions = torch.arange(7).expand(2, 7)
    arguments = (query, key, value, spans, positions, positions)
    expected = expire_span_attention(*arguments, ramp=2)
    torch.testing.assert_close(kernel.expire_span_attention(*arguments, ramp=2), expected, rtol=0, atol=0)


def test_cuda_variant_runs_triton_in_the_interpreter(repository):
    """No GPU here: the torch-cuda variant cannot be resolved on a CPU-only torch, so it is loaded from its own folder
    and its Triton kernels run in Triton's interpreter on CPU tensors (in a subprocess, where TRITON_INTERPRET and
    MEMLM_KERNELS are set before anything is imported)."""
    pytest.importorskip("triton")
    script = f"""
import torch
from pathlib import Path
from kernels import get_local_kernel
from memlm.kernels.delta_rule import delta_rule_reference
kernel = get_local_kernel(Path({str(repository / "build" / "torch-cuda")!r}))
assert Path(kernel.__file__).parent.parent.name == "torch-cuda"
torch.manual_seed(0)
query, key, value = (torch.randn(1, 2, 16, 16) for _ in range(3))
key = torch.nn.functional.normalize(key, dim=-1)
beta = torch.rand(1, 2, 16)
output, _ = kernel.delta_rule(query, key, value, beta, chunk_size=16)
expected, _ = delta_rule_reference(query.double(), key.double(), value.double(), beta.double())
torch.testing.assert_close(output.double(), expected, rtol=1e-4, atol=1e-4)
print("triton ok")
"""
    environment = {**os.environ, "TRITON_INTERPRET": "1", "MEMLM_KERNELS": "triton", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=environment, cwd=ROOT, timeout=600
    )
    assert result.returncode == 0, result.stderr
    assert "triton ok" in result.stdout


def _backend_of(repository) -> str:
    kernel = get_local_kernel(repository)
    loaded = {entry.module: entry for entry in kernels.get_loaded_kernels()}[kernel]
    return str(loaded.metadata.backend.backend_type).rpartition(".")[2].lower()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["deltanet", "expire_span", "feedback"])
def test_cuda_kernelizes_with_the_cuda_variant_and_equals_the_plain_model(repository, family, monkeypatch):
    """On a GPU the `kernels` package resolves the torch-cuda variant, whose layers run the repository's copy of the
    Triton kernels (MEMLM_KERNELS=triton, as the plain model): logits, greedy tokens and gradients as memlm's own
    model gives them on the same GPU (float32; autotuning may pick other tiles for the copy, hence the tolerance)."""
    monkeypatch.setenv("MEMLM_KERNELS", "triton")
    assert Path(get_local_kernel(repository).__file__).parent.parent.name == "torch-cuda"
    model = {
        "deltanet": lambda: DeltaNetForCausalLM(DELTANET_VARIANTS["fla_gated"]()),
        "expire_span": _expire_span_model,
        "feedback": feedback_model,
    }[family]().cuda()
    input_ids = torch.randint(0, 256, (2, 40), device="cuda")
    kernelized = {}
    for mode in (Mode.INFERENCE, Mode.TRAINING):
        kernelized[mode] = copy.deepcopy(model)
        with use_kernel_mapping(kernel_mapping(repository)):
            kernelize(kernelized[mode], mode=mode, device="cuda")
        assert hub_modules(kernelized[mode])
        for module in hub_modules(kernelized[mode]):
            assert module.forward.__func__.__module__.startswith("_memlm_kernels_cuda_"), module
    model.eval()
    with torch.no_grad():
        expected = model(input_ids).logits
        logits = kernelized[Mode.INFERENCE].eval()(input_ids).logits
    assert ((logits - expected).norm() / expected.norm()).item() < 1e-5
    expected_tokens = model.generate(input_ids[:1, :9], max_new_tokens=8, do_sample=False, pad_token_id=257)
    tokens = kernelized[Mode.INFERENCE].generate(
        input_ids[:1, :9], max_new_tokens=8, do_sample=False, pad_token_id=257
    )
    assert torch.equal(tokens, expected_tokens)
    for candidate in (model.train(), kernelized[Mode.TRAINING].train()):
        torch.manual_seed(1)
        candidate(input_ids, labels=input_ids).loss.backward()
    gradients = dict(kernelized[Mode.TRAINING].named_parameters())
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None and gradients[name].grad is not None, name
        difference = (gradients[name].grad - parameter.grad).norm()
        assert difference <= 1e-5 * parameter.grad.norm() + 1e-12, name


def hub_modules(model) -> list:
    """memlm's modules that carry a hub name (🤗's own hub layers, e.g. its SiLU, are not memlm's)."""
    return [
        module
        for module in model.modules()
        if hasattr(type(module), "kernel_layer_name") and type(module).__module__.startswith("memlm.")
    ]


def _kernelized(model, repository, mode):
    backend = _backend_of(repository)
    kernelized = copy.deepcopy(model)
    with use_kernel_mapping(kernel_mapping(repository)):
        # Falling back is allowed for 🤗's own hub layers (e.g. its SiLU where 🤗 accepts the installed `kernels`),
        # which no mapping here names; memlm's layers are checked below.
        kernelize(kernelized, mode=mode, device="cpu")
    assert hub_modules(kernelized)
    for module in hub_modules(kernelized):
        # The forward that runs is the repository's, not memlm's.
        name = module.forward.__func__.__module__
        assert name.startswith(f"_memlm_kernels_{backend}_") and ".layers_" in name, name
    for module in hub_modules(model):
        assert module.forward.__func__.__module__ == type(module).__module__
    return kernelized


@pytest.mark.parametrize("family", FAMILIES)
def test_inference_logits_and_generation_equal(repository, family):
    model = DeltaNetForCausalLM(DELTANET_VARIANTS[family]()).eval()
    kernelized = _kernelized(model, repository, Mode.INFERENCE)
    input_ids = torch.randint(0, 256, (2, 13))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, -4:] = 0  # padding (after the real tokens) writes nothing into the memory
    with torch.no_grad():
        expected = model(input_ids, attention_mask=attention_mask).logits
        logits = kernelized(input_ids, attention_mask=attention_mask).logits
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)
    prompt = input_ids[:1, :5]
    expected_tokens = model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=257)
    tokens = kernelized.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=257)
    assert torch.equal(tokens, expected_tokens)
    assert tokens.shape[1] == 13


def _assert_same_gradients(kernelized, model):
    """Every parameter of `model` has a gradient, bitwise equal to the same parameter's in `kernelized`."""
    gradients = dict(kernelized.named_parameters())
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None, name
        torch.testing.assert_close(gradients[name].grad, parameter.grad, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("family", FAMILIES)
def test_training_gradients_equal(repository, family):
    model = DeltaNetForCausalLM(DELTANET_VARIANTS[family]()).train()
    kernelized = _kernelized(model, repository, Mode.TRAINING)
    input_ids = torch.randint(0, 256, (2, 17))
    for candidate in (model, kernelized):
        torch.manual_seed(1)  # the same random draws in training mode (FAVOR+ features), kernel or not
        candidate(input_ids, labels=input_ids).loss.backward()
    _assert_same_gradients(kernelized, model)


def test_hub_mapping_loads_a_local_override(repository, backend, monkeypatch):
    """The mapping for the Hub repository (`memlm.kernels.hub.HUB_REPOSITORY`), with the `kernels` package's
    LOCAL_KERNELS override pointing that repository id at a folder: nothing is fetched."""
    monkeypatch.setenv("LOCAL_KERNELS", f"{HUB_REPOSITORY}={repository}")
    model = DeltaNetForCausalLM(DELTANET_VARIANTS["fla"]()).eval()
    kernelized = copy.deepcopy(model)
    with use_kernel_mapping(kernel_mapping(HUB_REPOSITORY, revision="main")):
        kernelize(kernelized, mode=Mode.INFERENCE, device="cpu")
    for layer in kernelized.model.layers:
        assert layer.attention.forward.__func__.__module__.startswith(f"_memlm_kernels_{backend}_")
    input_ids = torch.randint(0, 256, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(kernelized(input_ids).logits, model(input_ids).logits, rtol=0, atol=0)


def _expire_span_model() -> ExpireSpanForCausalLM:
    """Spans that differ from token to token, so memories expire while the 40 tokens pass (blocks of 8)."""
    model = ExpireSpanForCausalLM(ExpireSpanConfig(**EXPIRE_SPAN_TINY))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.attention.span_predictor.weight.normal_(0, 0.5)
    return model


def test_expire_span_inference_and_generation_equal(repository):
    model = _expire_span_model().eval()
    kernelized = _kernelized(model, repository, Mode.INFERENCE)
    input_ids = torch.randint(0, 256, (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(kernelized(input_ids).logits, model(input_ids).logits, rtol=0, atol=0)
    prompt = input_ids[:1, :11]
    expected_tokens = model.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=257)
    tokens = kernelized.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=257)
    assert torch.equal(tokens, expected_tokens)


def test_expire_span_training_gradients_equal(repository):
    model = _expire_span_model().train()
    kernelized = _kernelized(model, repository, Mode.TRAINING)
    input_ids = torch.randint(0, 256, (2, 40))
    for candidate in (model, kernelized):
        torch.manual_seed(1)
        candidate(input_ids, labels=input_ids).loss.backward()
    _assert_same_gradients(kernelized, model)
    assert model.model.layers[0].attention.span_predictor.weight.grad.abs().sum() > 0  # the span loss trains


def test_repository_feedback_recurrence_equals_memlm(repository):
    kernel = get_local_kernel(repository)
    model = feedback_model().model
    inputs_embeds = torch.randn(2, 6, 32)
    positions = torch.arange(6).expand(2, 6)
    valid = torch.ones(2, 6, dtype=torch.bool)
    results = []
    for function in (feedback_recurrence, kernel.feedback_recurrence):
        cache = FeedbackCache(model.config)
        cache.next_positions = torch.zeros(2, dtype=torch.long)
        with torch.no_grad():  # the memory goes into the cache's ring, in place
            top, _, _ = function(model, inputs_embeds, positions, valid, cache.layers, cache.next_positions)
        results.append((top, cache.layers[0].keys, cache.layers[0].values))
    for tensor, expected in zip(results[1], results[0]):
        torch.testing.assert_close(tensor, expected, rtol=0, atol=0)


@pytest.mark.parametrize("variant", ["shared_rotary", "unshared_relative_bias"])
def test_feedback_inference_and_generation_equal(repository, variant):
    model = feedback_model(variant)
    kernelized = _kernelized(model, repository, Mode.INFERENCE)
    input_ids = torch.randint(0, 256, (2, 12))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :3] = 0  # left padding writes nothing into the memory
    with torch.no_grad():
        expected = model(input_ids, attention_mask=attention_mask).logits
        torch.testing.assert_close(
            kernelized(input_ids, attention_mask=attention_mask).logits, expected, rtol=0, atol=0
        )
    prompt = input_ids[:1, :4]
    expected_tokens = model.generate(prompt, max_new_tokens=9, do_sample=False, pad_token_id=257)
    tokens = kernelized.generate(prompt, max_new_tokens=9, do_sample=False, pad_token_id=257)
    assert torch.equal(tokens, expected_tokens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_feedback_training_gradients_equal(repository, dtype):
    """float32 runs the hand-written backward through time, bfloat16 autograd through every step: both through the
    repository's loop, with the same gradients as memlm's."""
    model = feedback_model().train().to(dtype)
    kernelized = _kernelized(model, repository, Mode.TRAINING)
    input_ids = torch.randint(0, 256, (2, 11))
    for candidate in (model, kernelized):
        candidate(input_ids, labels=input_ids).loss.backward()
    _assert_same_gradients(kernelized, model)


def test_repr_names_the_kernel_that_runs(repository, backend, tmp_path):
    """A layer's repr says which repository's forward runs, and whether the installed memlm generated it (the
    variant's id ends in a digest of the generated package; an older memlm's has another)."""
    import json
    import shutil

    model = feedback_model()
    assert "hub_kernel" not in repr(model)
    kernelized = _kernelized(model, repository, Mode.INFERENCE)
    # The folder whose code runs: this repository's, or one of the same generation loaded earlier in the process (the
    # `kernels` package imports a variant under its id, which the content decides).
    text = repr(kernelized.model.recurrence)
    prefix, suffix = (
        f"FeedbackRecurrence(hub_kernel=memlm-kernels version 1 ({backend}) from ",
        ", generated from the installed memlm)",
    )
    assert text.startswith(prefix) and text.endswith(suffix), text
    folder = Path(text.removeprefix(prefix).removesuffix(suffix))
    assert folder.parts[-2:] == ("build", f"torch-{backend}")
    assert (folder / "memlm_kernels" / "layers_feedback_transformer.py").read_text() == (
        repository / "build" / f"torch-{backend}" / "memlm_kernels" / "layers_feedback_transformer.py"
    ).read_text()
    older = tmp_path / "older"
    shutil.copytree(repository, older)
    metadata_path = older / "build" / f"torch-{backend}" / "metadata.json"
    metadata = json.loads(metadata_path.read_text())
    metadata["id"] = metadata["id"].rpartition("_")[0] + "_0123456789"
    metadata_path.write_text(json.dumps(metadata))
    deltanet = _kernelized(DeltaNetForCausalLM(DELTANET_VARIANTS["fla"]()), older, Mode.INFERENCE)
    text = repr(deltanet.model.layers[0].attention).splitlines()[1]
    assert text.endswith(
        f"hub_kernel=memlm-kernels version 1 ({backend}) from {older / 'build' / f'torch-{backend}'}, generated from "
        "another "
        "memlm (python -m memlm.kernel_repository build refreshes it)"
    )


def test_memlm_without_kernels_is_unchanged():
    """With `kernels` unimportable, memlm imports and its attention carries no hub name (a real subprocess)."""
    script = """
import sys
sys.modules["kernels"] = None  # as without the package: find_spec("kernels") is None, import kernels fails
from memlm.modeling.modeling_deltanet import DeltaNetAttention
from memlm.modeling.modeling_expire_span import ExpireSpanAttention
from memlm.modeling.modeling_feedback_transformer import FeedbackRecurrence
assert not hasattr(DeltaNetAttention, "kernel_layer_name")
assert not hasattr(ExpireSpanAttention, "kernel_layer_name")
assert not hasattr(FeedbackRecurrence, "kernel_layer_name")
print("plain ok")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "plain ok" in result.stdout


def test_modules_carry_their_hub_names():
    from memlm.modeling.modeling_deltanet import DeltaNetAttention
    from memlm.modeling.modeling_expire_span import ExpireSpanAttention
    from memlm.modeling.modeling_feedback_transformer import FeedbackRecurrence

    assert DeltaNetAttention.kernel_layer_name == "DeltaNetAttention"
    assert ExpireSpanAttention.kernel_layer_name == "ExpireSpanAttention"
    assert FeedbackRecurrence.kernel_layer_name == "FeedbackRecurrence"


@pytest.mark.parametrize("family", ["deltanet", "expire_span", "feedback"])
def test_use_kernels(repository, backend, tmp_path, family):
    """Where the installed 🤗 refuses the installed `kernels` for use_kernels=True (5.24 with kernels 0.17), memlm says
    in one line which versions it needs; where 🤗 accepts it (5.21 with 0.17), `from_pretrained(..., use_kernels=True)`
    swaps in the repository's layers under memlm's mapping, and the logits and gradients stay the same."""
    import transformers
    from transformers import AutoModelForCausalLM
    from transformers.utils import import_utils

    from memlm.kernels.hub import use_kernels_problem

    plain = {
        "deltanet": lambda: DeltaNetForCausalLM(DELTANET_VARIANTS["fla"]()),
        "expire_span": _expire_span_model,
        "feedback": feedback_model,
    }[family]().eval()
    plain.save_pretrained(tmp_path)
    if import_utils.is_kernels_available():
        assert use_kernels_problem() is None
        with use_kernel_mapping(kernel_mapping(repository)):
            model = AutoModelForCausalLM.from_pretrained(tmp_path, use_kernels=True).eval()
        assert model.use_kernels
        assert hub_modules(model)
        for module in hub_modules(model):
            assert module.forward.__func__.__module__.startswith(f"_memlm_kernels_{backend}_")
        input_ids = torch.randint(0, 256, (2, 9))
        with torch.no_grad():
            torch.testing.assert_close(model(input_ids).logits, plain(input_ids).logits, rtol=0, atol=0)
        for candidate in (plain, model):
            candidate(input_ids, labels=input_ids).loss.backward()
        _assert_same_gradients(model, plain)
        return
    with pytest.raises(ValueError) as error:
        AutoModelForCausalLM.from_pretrained(tmp_path, use_kernels=True)
    message = str(error.value)
    assert "\n" not in message
    assert f"transformers {transformers.__version__}" in message
    assert f"kernels {kernels.__version__} installed" in message
    assert f"kernels>={import_utils.KERNELS_MIN_VERSION},<{import_utils.KERNELS_MAX_VERSION}" in message
    assert "kernels.kernelize" in message


def test_register_mapping_serves_every_later_kernelize_and_trust_reaches_the_repositories(repository, backend):
    """`register_mapping` (in a subprocess: it changes the process's global mapping) makes a plain `kernelize` swap
    memlm's layers; `trust_remote_code` is passed to every Hub repository of the mapping."""
    from kernels import LayerRepository

    script = f"""
import torch
from kernels import Mode, kernelize
from memlm import DeltaNetConfig, DeltaNetForCausalLM
from memlm.kernels.hub import register_mapping
model = DeltaNetForCausalLM(DeltaNetConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                           num_attention_heads=2))
register_mapping({str(repository)!r})
kernelize(model, mode=Mode.INFERENCE, device="cpu")
print(model.model.layers[0].attention.forward.__func__.__module__)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1].startswith(f"_memlm_kernels_{backend}_")
    for trust in (False, True):
        mapping = kernel_mapping("someone/memlm-kernels", trust_remote_code=trust)
        assert mapping["FeedbackRecurrence"]["cuda"] == LayerRepository(
            "someone/memlm-kernels", layer_name="FeedbackRecurrence", version=1, trust_remote_code=trust
        )
