"""A model whose weights cannot fit in the memory left is refused before its layers are built, in words, with an
override; empty-weight (meta) building is not checked."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from memlm import DeltaNetConfig, ExpireSpanConfig, FeedbackTransformerConfig
from memlm.modeling import memory

HUGE = {"num_hidden_layers": 20_000}  # hundreds of GB of float32 weights at the default width, under the 10¹² cap
TINY = {"vocab_size": 40, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2}
CONFIGS = {"deltanet": DeltaNetConfig, "expire_span": ExpireSpanConfig, "feedback": FeedbackTransformerConfig}


@pytest.mark.parametrize("family", CONFIGS)
def test_a_model_larger_than_the_memory_left_is_refused_before_building(family, monkeypatch):
    monkeypatch.delenv(memory.ALLOW_LARGE_MODELS, raising=False)
    available = memory.memory_available()
    if available is None:
        pytest.skip("this system does not say how much memory is left")
    config = CONFIGS[family](**HUGE)
    with pytest.raises(ValueError) as error:
        AutoModelForCausalLM.from_config(config)
    message = str(error.value)
    needed = config.estimated_parameters() * 4 / 2**30
    assert (
        f"{type(config).__name__} describes a model of about {config.estimated_parameters():.3g} parameters" in message
    )
    assert f"torch.float32 weights alone need about {needed:.3g} GiB; this machine has " in message
    assert "num_hidden_layers=20000" in message and "MEMLM_ALLOW_LARGE_MODELS=1" in message


@pytest.mark.parametrize("family", CONFIGS)
def test_the_override_and_empty_weight_building_skip_the_check(family, monkeypatch):
    monkeypatch.setattr(memory, "memory_available", lambda: 1)  # as if a single byte were left
    monkeypatch.delenv(memory.ALLOW_LARGE_MODELS, raising=False)
    config = CONFIGS[family](**TINY)
    with pytest.raises(ValueError, match="GiB of memory left"):
        AutoModelForCausalLM.from_config(config)
    with torch.device("meta"):  # nothing is allocated
        assert AutoModelForCausalLM.from_config(config).lm_head.weight.device.type == "meta"
    monkeypatch.setenv(memory.ALLOW_LARGE_MODELS, "1")
    assert AutoModelForCausalLM.from_config(config).lm_head.weight.device.type == "cpu"
