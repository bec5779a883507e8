import math

import pytest
from transformers import AutoConfig

from memlm import ExpireSpanConfig


def test_defaults_and_derived_values():
    config = ExpireSpanConfig()
    assert config.head_dim == config.hidden_size // config.num_attention_heads
    assert config.expire_memories and not config.memory_shortening
    assert math.isclose(1 / (1 + math.exp(-config.initial_span_bias)), config.initial_span_fraction)
    assert config.intermediate_size % 256 == 0


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"ramp": 0}, r"ramp must be a number in \(0, inf\]"),
        ({"ramp": -3}, r"ramp must be a number in \(0, inf\]"),
        ({"max_span": 0}, "max_span must be a positive integer"),
        ({"max_span": 2.5}, "max_span must be a positive integer"),
        ({"block_size": 0}, "block_size must be a positive integer"),
        ({"span_loss_coefficient": -1e-6}, r"span_loss_coefficient must be a number in \[0, inf\]"),
        ({"span_pre_divisor": 0}, r"span_pre_divisor must be a number in \(0, inf\]"),
        ({"initial_span_fraction": 1.0}, r"initial_span_fraction must be a number in \(0, 1\)"),
        ({"initial_span_fraction": 0}, r"initial_span_fraction must be a number in \(0, 1\)"),
        ({"rope_theta": 0}, "rope_theta must be a number"),
        ({"hidden_dropout": 1}, r"hidden_dropout must be a number in \[0, 1\)"),
        ({"attention_dropout": -0.1}, "attention_dropout must be a number"),
        ({"memory_shortening": 1}, "memory_shortening must be True or False"),
        ({"expire_memories": "no"}, "expire_memories must be True or False"),
        ({"hidden_act": "tanh"}, "hidden_act must be one of"),
        ({"hidden_size": 30, "num_attention_heads": 4}, "must be a multiple of num_attention_heads"),
        ({"hidden_size": 36, "num_attention_heads": 4}, "head_dim \\(9\\) must be even for rotary"),
        ({"head_dim": 7}, "head_dim \\(7\\) must be even for rotary"),
        ({"head_dim": 0}, "head_dim must be a positive integer"),
        ({"position_encoding": "relative"}, "position_encoding must be one of 'rotary', 'learned_relative'"),
        ({"attend_to_self": "no"}, "attend_to_self must be True or False"),
        ({"initial_memory": "zero"}, "initial_memory must be one of 'empty', 'zeros'"),
        ({"span_loss_form": "paper"}, "span_loss_form must be one of 'span', 'remaining_span'"),
        ({"renormalization_epsilon": -1e-8}, r"renormalization_epsilon must be a number in \[0, inf\]"),
        ({"norm_type": "batchnorm"}, "norm_type must be one of 'rmsnorm', 'layernorm'"),
        ({"norm_position": "sandwich"}, "norm_position must be one of 'pre', 'post'"),
        ({"mlp_type": "moe"}, "mlp_type must be one of 'gated', 'plain'"),
        ({"lm_head_bias": 1}, "lm_head_bias must be True or False"),
        ({"embedding_scale": 0}, r"embedding_scale must be a number in \(0, inf\]"),
        ({"activation_dropout": 1.0}, r"activation_dropout must be a number in \[0, 1\)"),
        ({"recompute_memory": "yes"}, "recompute_memory must be True or False"),
        ({"noisy_spans": 1}, "noisy_spans must be True or False"),
        ({"layer_drop": 1.0}, r"layer_drop must be a number in \[0, 1\)"),
        ({"eos_token_id": 10**6}, "eos_token_id must be None"),
        ({"max_spam": 10}, "did you mean 'max_span'"),
    ],
)
def test_bad_values_raise_value_errors_naming_the_field(options, message):
    with pytest.raises(ValueError, match=message):
        ExpireSpanConfig(**options)


def test_a_block_larger_than_the_span_is_allowed():
    config = ExpireSpanConfig(max_span=16, ramp=4, block_size=64)
    assert config.block_size > config.max_span + config.ramp


def test_round_trip(tmp_path):
    config = ExpireSpanConfig(hidden_size=64, num_attention_heads=4, max_span=100, ramp=8, memory_shortening=True)
    config.save_pretrained(tmp_path)
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert type(loaded) is ExpireSpanConfig
    assert (loaded.max_span, loaded.ramp, loaded.memory_shortening) == (100, 8, True)


def test_describe():
    text = "\n".join(ExpireSpanConfig(max_span=1000, ramp=16, memory_shortening=True).describe())
    assert "L = 1000" in text and "R = 16" in text and "shortening" in text
    assert "fixed span of 1000" in "\n".join(ExpireSpanConfig(max_span=1000, expire_memories=False).describe())


def test_head_dim_is_free_and_the_learned_positions_take_odd_widths():
    config = ExpireSpanConfig(hidden_size=48, num_attention_heads=4, head_dim=9, position_encoding="learned_relative")
    assert config.head_dim == 9 and config.num_relative_positions == min(config.max_span, config.block_size)
    assert ExpireSpanConfig(hidden_size=48, num_attention_heads=4).head_dim == 12


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"tie_word_embeddings": True, "expire_memories": False},
        {"head_dim": 10, "position_encoding": "learned_relative", "lm_head_bias": True, "attention_output_bias": True},
        {
            "norm_type": "layernorm",
            "norm_position": "post",
            "final_norm": False,
            "mlp_type": "plain",
            "mlp_bias": True,
        },
        {"norm_type": "layernorm", "mlp_bias": True, "head_dim": 6, "tie_word_embeddings": True, "lm_head_bias": True},
    ],
)
def test_estimated_parameters_equal_the_built_model(options):
    from memlm import ExpireSpanForCausalLM

    config = ExpireSpanConfig(
        vocab_size=50, hidden_size=24, intermediate_size=40, num_hidden_layers=2, num_attention_heads=2, max_span=16,
        block_size=8, **options,
    )  # fmt: skip
    assert ExpireSpanForCausalLM(config).num_parameters() == config.estimated_parameters()


def test_describe_names_the_official_options():
    config = ExpireSpanConfig(
        head_dim=10, position_encoding="learned_relative", attend_to_self=False, initial_memory="zeros",
        span_loss_form="remaining_span", norm_type="layernorm", norm_position="post", mlp_type="plain",
        block_size=8, max_span=32,
    )  # fmt: skip
    text = "\n".join(config.describe())
    for words in ("heads of width 10", "Learned relative positions", "not to itself", "8 zero memories",
                  "remaining spans", "post-norm LayerNorm", "plain MLP"):  # fmt: skip
        assert words in text, words
