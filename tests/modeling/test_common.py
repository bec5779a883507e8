"""What every memlm model owes a 🤗 user (SPEC §4), checked the same way for all three."""

import copy

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM

import memlm
from tests.conftest import DELTANET_VARIANTS

TINY = {"vocab_size": 258, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 2, "pad_token_id": 257}  # fmt: skip
CONFIGS = {
    "deltanet": lambda **extra: DELTANET_VARIANTS["fla"](**extra),
    "expire_span": lambda **extra: memlm.ExpireSpanConfig(
        **{**TINY, "max_span": 8, "ramp": 2, "block_size": 4, **extra}
    ),  # fmt: skip
    "feedback": lambda **extra: memlm.FeedbackTransformerConfig(**{**TINY, "memory_span": 6, **extra}),
}
CLASSES = {
    "deltanet": (memlm.DeltaNetModel, memlm.DeltaNetForCausalLM),
    "expire_span": (memlm.ExpireSpanModel, memlm.ExpireSpanForCausalLM),
    "feedback": (memlm.FeedbackTransformerModel, memlm.FeedbackTransformerForCausalLM),
}


def _model(name, **extra):
    model = CLASSES[name][1](CONFIGS[name](**extra)).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    return model


@pytest.mark.parametrize("name", list(CONFIGS))
def test_auto_classes(name):
    config = CONFIGS[name]()
    assert type(AutoModel.from_config(config)) is CLASSES[name][0]
    assert type(AutoModelForCausalLM.from_config(config)) is CLASSES[name][1]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_inputs_embeds_tuples_hidden_states_and_logits_to_keep(name):
    model = _model(name)
    input_ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        by_ids = model(input_ids, output_hidden_states=True)
        by_embeds = model(inputs_embeds=model.get_input_embeddings()(input_ids))
        as_tuple = model(input_ids, return_dict=False)
        last_two = model(input_ids, logits_to_keep=2).logits
    torch.testing.assert_close(by_embeds.logits, by_ids.logits)
    assert len(by_ids.hidden_states) == model.config.num_hidden_layers + 1
    assert isinstance(as_tuple, tuple)
    torch.testing.assert_close(as_tuple[0], by_ids.logits)
    torch.testing.assert_close(last_two, by_ids.logits[:, -2:])


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_is_close_to_float32(name, dtype):
    model = _model(name)
    input_ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        reference = model(input_ids).logits
        half = copy.deepcopy(model).to(dtype)
        logits = half(input_ids).logits
        prefill = half(input_ids[:, :6], use_cache=True)
        step = half(input_ids[:, 6:7], past_key_values=prefill.past_key_values)
    assert logits.dtype == dtype and step.logits.dtype == dtype
    assert (logits.float() - reference).norm() / reference.norm() < 0.05
    assert torch.isfinite(step.logits).all()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_tied_embeddings_survive_saving(tmp_path, name):
    model = CLASSES[name][1](CONFIGS[name](tie_word_embeddings=True))
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.lm_head.weight.data_ptr() == loaded.get_input_embeddings().weight.data_ptr()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_resize_token_embeddings(name):
    model = _model(name)
    model.resize_token_embeddings(300)
    assert model.config.vocab_size == 300 and model.lm_head.weight.shape[0] == 300
    assert model(torch.tensor([[299, 5, 7]])).logits.shape == (1, 3, 300)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_meta_device_initialisation(name):
    with torch.device("meta"):
        model = CLASSES[name][1](CONFIGS[name]())
    assert all(parameter.is_meta for parameter in model.parameters())
    model.to_empty(device="cpu")
    model.init_weights()
    assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_dtype_argument_of_from_pretrained(tmp_path, name):
    _model(name).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    assert model(torch.tensor([[1, 2, 3]])).logits.dtype == torch.bfloat16
