"""🤗's quantizers on the three memlm families, with the real packages (torchao, bitsandbytes, optimum-quanto) through
`from_pretrained(..., quantization_config=...)`, as users load a 🤗 Llama quantized. For each family and quantizer:
the projections are quantized and the small ones (`layers.SMALL_PROJECTIONS`) are not; the logits are those of the
float model whose weights are the quantized ones (read off each quantized layer by multiplying it with the unit
vectors), exactly for weight-only schemes and within the activations' rounding for the others (so no model code
reads a weight around its quantized module); `generate` with the memory as the cache gives the logits of a forward
over the same tokens; a model saved by `save_pretrained` loads again with the same logits where the quantizer
serialises (🤗 does not serialise quanto's models, nor a Llama's). Run by tests/installed/check_quantization.py."""

import importlib
import os

import pytest

# The quantizers are the `quantization` extra, installed apart for these tests (tests/installed/check_quantization.py,
# which sets MEMLM_QUANTIZATION_REQUIRED so that they run rather than skip).
for package in ("torchao", "bitsandbytes", "optimum.quanto"):
    if os.environ.get("MEMLM_QUANTIZATION_REQUIRED"):
        importlib.import_module(package)
    else:
        pytest.importorskip(package, reason="the quantization extra: make test runs these with it")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, QuantoConfig, TorchAoConfig  # noqa: E402

from memlm.modeling.layers import SMALL_PROJECTIONS  # noqa: E402
from memlm.modeling.modeling_expire_span import ExpireSpanPredictor  # noqa: E402
from tests.clients.models import FAMILIES, tiny_model  # noqa: E402

pytestmark = pytest.mark.huggingface  # also under the newest and the oldest 🤗 releases allowed
# Every quantized layer takes a multiple of 64 inputs: on a CPU with AVX512-BF16, bitsandbytes' 4-bit layers repack
# their weight at the first forward without gradients by blocks of 64 inputs (bitsandbytes 0.50.2 fails on fewer:
# "shape '[32, 0]' is invalid"), as a user's model of usual widths never meets.
SIZES = {"hidden_size": 64, "intermediate_size": 128}


def torchao(name: str):
    import torchao.quantization as ao

    made = {
        "int8_weight_only": lambda: ao.Int8WeightOnlyConfig(),
        "int8_dynamic_activation_int8_weight": lambda: ao.Int8DynamicActivationInt8WeightConfig(),
        "int4_weight_only": lambda: ao.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=ao.PerGroup(32)),
        "int8_dynamic_activation_int4_weight": lambda: ao.Int8DynamicActivationIntxWeightConfig(
            weight_dtype=torch.int4, weight_granularity=ao.PerGroup(32)
        ),
        "float8_weight_only": lambda: ao.Float8WeightOnlyConfig(),
    }[name]()
    return TorchAoConfig(made)


# name → (quantization config, whether only the weights are rounded, whether 🤗 serialises it)
QUANTIZERS = {
    "torchao-int8": (lambda: torchao("int8_weight_only"), True, True),
    "torchao-int8-dynamic": (lambda: torchao("int8_dynamic_activation_int8_weight"), False, True),
    "torchao-int4": (lambda: torchao("int4_weight_only"), True, True),
    "torchao-int8-dynamic-int4": (lambda: torchao("int8_dynamic_activation_int4_weight"), False, True),
    "torchao-float8": (lambda: torchao("float8_weight_only"), True, True),
    "bitsandbytes-8bit": (lambda: BitsAndBytesConfig(load_in_8bit=True), False, True),
    "bitsandbytes-4bit": (lambda: BitsAndBytesConfig(load_in_4bit=True), True, True),
    "quanto-int8": (lambda: QuantoConfig(weights="int8"), True, False),
    "quanto-int4": (lambda: QuantoConfig(weights="int4"), True, False),
}


def packs_for_bfloat16_kernel() -> bool:
    """Whether bitsandbytes' 4-bit layers repack their weight here (a CPU with AVX512-BF16, at the first forward
    without gradients) for its kernel that computes in bfloat16."""
    from bitsandbytes.functional import has_avx512bf16

    return bool(has_avx512bf16())


def plain(module) -> bool:
    """Whether `module` is one of the models' own float linear layers: not replaced by a quantizer's module
    (bitsandbytes, quanto) and without a quantized weight (torchao)."""
    return type(module) in (torch.nn.Linear, ExpireSpanPredictor) and type(module.weight.data) is torch.Tensor


def effective_weight(module) -> torch.Tensor:
    """The weight a (quantized) linear layer multiplies by: its outputs for the unit vectors, less its bias. A unit
    vector is rounded exactly by the schemes that round activations too (its scale is its one non-zero value)."""
    with torch.no_grad():
        outputs = module(torch.eye(module.in_features))
        return (outputs if module.bias is None else outputs - module.bias.float()).T.float()


def float_twin(family: str, tokenizer, quantized) -> torch.nn.Module:
    """The float model with the quantized model's weights: each quantized layer's weight as it multiplies."""
    twin = tiny_model(family, tokenizer, **SIZES)
    layers = dict(quantized.named_modules())
    with torch.no_grad():
        for name, module in twin.named_modules():
            if isinstance(module, torch.nn.Linear) and not plain(layers[name]):
                module.weight.copy_(effective_weight(layers[name]))
    return twin


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tokenizer):
    """Each family's tiny model saved by `save_pretrained` (float32)."""
    folders = {}
    for family in FAMILIES:
        folders[family] = tmp_path_factory.mktemp(family)
        tiny_model(family, tokenizer, **SIZES).save_pretrained(folders[family])
    return folders


def load(folder, quantizer: str):
    return AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=QUANTIZERS[quantizer][0](), device_map="cpu"
    ).eval()


@pytest.mark.parametrize("quantizer", QUANTIZERS)
@pytest.mark.parametrize("family", FAMILIES)
def test_the_quantized_model_computes_with_its_quantized_weights_and_decodes_with_its_memory(
    family, quantizer, saved, tokenizer, tmp_path
):
    model = load(saved[family], quantizer)
    modules = dict(model.named_modules())
    projections = [name for name in modules if name.endswith(("q_proj", "o_proj", "down_proj"))]
    assert projections and not any(plain(modules[name]) for name in projections), "the projections are quantized"
    small = [name for name in modules if name.rsplit(".", 1)[-1] in SMALL_PROJECTIONS]
    assert len(small) == (0 if family == "feedback_transformer" else 2)
    assert all(plain(modules[name]) and modules[name].weight.dtype == torch.float32 for name in small)

    batch = tokenizer(["the quick brown fox", "a memory"], return_tensors="pt",
                      padding=True, padding_side="left")  # fmt: skip
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        logits = model(**batch).logits
        expected = float_twin(family, tokenizer, model)(**batch).logits
    weights_only, serialised = QUANTIZERS[quantizer][1:]
    repacked = quantizer == "bitsandbytes-4bit" and packs_for_bfloat16_kernel()
    if repacked:
        weights_only = False  # the repacked weight's kernel multiplies the activations in bfloat16
    scale = expected[real].abs().max()
    # Weight-only: the same products in another order. Rounded activations (int8 per token, or bfloat16): a few
    # 1/127ths.
    tolerance = 1e-5 if weights_only else 0.05
    torch.testing.assert_close(logits[real] / scale, expected[real] / scale, rtol=0, atol=tolerance)
    # With autograd on (the path training takes: the Feedback Transformer's hand-written backward stacks weights and
    # must leave quantized ones to their modules), the same logits.
    torch.testing.assert_close(model(**batch).logits[real] / scale, logits[real] / scale, rtol=0, atol=tolerance)

    # The memory as the cache: the logits of each decoded token are those of a forward over everything before it.
    generated = model.generate(**batch, max_new_tokens=5, do_sample=False, output_logits=True,
                               return_dict_in_generate=True)  # fmt: skip
    mask = torch.cat([batch["attention_mask"], torch.ones_like(generated.sequences[:, real.shape[1] :])], dim=1)
    with torch.no_grad():
        full = model(input_ids=generated.sequences, attention_mask=mask).logits
    decoded = torch.stack(generated.logits, dim=1)
    torch.testing.assert_close(decoded / scale, full[:, real.shape[1] - 1 : -1] / scale, rtol=0, atol=tolerance)

    if serialised:
        model.save_pretrained(tmp_path / "quantized")
        again = AutoModelForCausalLM.from_pretrained(tmp_path / "quantized", device_map="cpu").eval()
        with torch.no_grad():
            # Repacked, the weight is saved from its bfloat16 scales (bitsandbytes keeps them when it unpacks): the
            # reloaded model's logits are the first one's to that rounding, else exactly.
            again_logits = again(**batch).logits
        torch.testing.assert_close(again_logits / scale, logits / scale, rtol=0, atol=tolerance if repacked else 0)
