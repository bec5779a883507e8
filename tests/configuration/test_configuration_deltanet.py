import pytest
import torch
from transformers import AutoConfig

from memlm import DeltaNetConfig
from memlm.configuration.configuration_deltanet import PRESETS


def test_defaults_are_the_paper_layout():
    config = DeltaNetConfig()
    assert (config.feature_map, config.dpfp_nu, config.query_key_normalization, config.update_rule) == (
        "dpfp",
        1,
        "sum",
        "delta",
    )
    assert config.key_head_dim == config.value_head_dim == config.hidden_size // config.num_attention_heads
    assert config.feature_dim == 2 * config.key_head_dim  # DPFP-1 doubles the width


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_are_one_line(name):
    overrides = {"hidden_size": 64, "num_attention_heads": 4, "key_head_dim": 16, "value_head_dim": 16}
    config = DeltaNetConfig.from_preset(name, **overrides)
    for field, value in {**PRESETS[name], **overrides}.items():
        assert getattr(config, field) == value
    assert config.hidden_size == 64 and config.key_head_dim == 16


def test_fla_preset_layout():
    config = DeltaNetConfig.from_preset("fla")
    assert config.feature_map == "silu" and config.query_key_normalization == "l2"
    assert config.short_convolution and config.output_norm and config.scale_queries
    assert config.value_activation == "silu"


def test_unknown_preset():
    with pytest.raises(ValueError, match="Unknown DeltaNet preset 'flash'.*paper, fla"):
        DeltaNetConfig.from_preset("flash")


def test_feature_dim_follows_the_feature_map():
    assert DeltaNetConfig(hidden_size=32, num_attention_heads=2, dpfp_nu=3).feature_dim == 2 * 3 * 16
    assert DeltaNetConfig(feature_map="favor+", favor_features=40, query_key_normalization="l2").feature_dim == 40
    assert DeltaNetConfig(feature_map="silu", query_key_normalization="l2", key_head_dim=24).feature_dim == 24


def test_intermediate_size_rule():
    # flash-linear-attention's GatedMLP: int(hidden * 4 * 2/3) rounded up to a multiple of 256.
    assert DeltaNetConfig(hidden_size=2048, num_attention_heads=16).intermediate_size == 5632
    assert DeltaNetConfig(hidden_size=1024, num_attention_heads=8).intermediate_size == 2816


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"feature_map": "relu"}, r"feature_map must be one of 'dpfp', 'elu\+1', 'favor\+', 'silu', 'identity'"),
        ({"query_key_normalization": "max"}, "query_key_normalization must be one of 'sum', 'l2', 'none'"),
        ({"update_rule": "hebb"}, "update_rule must be one of 'delta', 'sum'"),
        ({"value_activation": "gelu"}, "value_activation must be one of"),
        ({"hidden_act": "tanh"}, "hidden_act must be one of"),
        ({"dpfp_nu": 4}, "dpfp_nu must be 1, 2 or 3"),
        ({"dpfp_nu": True}, "dpfp_nu must be 1, 2 or 3"),
        ({"hidden_size": 0}, "hidden_size must be a positive integer"),
        ({"hidden_size": 30, "num_attention_heads": 4}, "not a multiple of num_attention_heads"),
        ({"num_attention_heads": -1}, "num_attention_heads must be a positive integer"),
        ({"favor_features": 0}, "favor_features must be a positive integer"),
        ({"chunk_size": 0}, "chunk_size must be a positive integer"),
        ({"convolution_size": 1}, "convolution_size must be an integer >= 2"),
        ({"use_beta": "yes"}, "use_beta must be True or False"),
        ({"hidden_dropout": 1.5}, r"hidden_dropout must be a number in \[0, 1\)"),
        ({"rms_norm_eps": 0}, r"rms_norm_eps must be a number in \(0, inf\]"),
        ({"initializer_range": -0.1}, r"initializer_range must be a number in \[0, inf\]"),
        ({"pad_token_id": 40000}, "pad_token_id must be None or an id"),
        ({"eos_token_id": [1, -2]}, "eos_token_id must be None"),
        # Combinations that make no sense.
        ({"feature_map": "silu", "query_key_normalization": "sum"}, "needs a non-negative feature map"),
        ({"feature_map": "identity"}, "needs a non-negative feature map"),
        ({"position_encoding": "rotary"}, "position_encoding must be one of 'none', 'sinusoidal'"),
        (
            {"position_encoding": "sinusoidal", "hidden_size": 31, "key_head_dim": 15, "value_head_dim": 15},
            "needs an even hidden_size",
        ),
        ({"attention_normalizer_eps": -1e-5}, r"attention_normalizer_eps must be a number in \[0, inf\]"),
        ({"scale_output": 1}, "scale_output must be True or False"),
        # The block layout (BlockLayout, shared by the configs).
        ({"norm_type": "batchnorm"}, "norm_type must be one of 'rmsnorm', 'layernorm'"),
        ({"norm_position": "sandwich"}, "norm_position must be one of 'pre', 'post'"),
        ({"mlp_type": "moe"}, "mlp_type must be one of 'gated', 'plain'"),
        ({"final_norm": None}, "final_norm must be True or False"),
        ({"lm_head_bias": "no"}, "lm_head_bias must be True or False"),
        ({"layer_norm_eps": 0}, r"layer_norm_eps must be a number in \(0, inf\]"),
        ({"embedding_scale": 0}, r"embedding_scale must be a number in \(0, inf\]"),
        ({"embedding_dropout": 1}, r"embedding_dropout must be a number in \[0, 1\)"),
        ({"activation_dropout": -0.1}, r"activation_dropout must be a number in \[0, 1\)"),
        ({"output_dropout": 2}, r"output_dropout must be a number in \[0, 1\)"),
        (
            {
                "update_rule": "sum",
                "attention_normalizer": True,
                "feature_map": "silu",
                "query_key_normalization": "l2",
            },
            "divides by z_tᵀq_t, which needs a non-negative feature map",
        ),
        ({"feture_map": "dpfp"}, "unknown option 'feture_map'; did you mean 'feature_map'"),
    ],
)
def test_bad_values_name_the_field_and_the_allowed_values(options, message):
    with pytest.raises(ValueError, match=message):
        DeltaNetConfig(**options)


def test_round_trip_through_json(tmp_path):
    config = DeltaNetConfig.from_preset("fla", hidden_size=48, num_attention_heads=3, output_gate=True)
    config.save_pretrained(tmp_path)
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert type(loaded) is DeltaNetConfig
    loaded_fields, fields = loaded.to_dict(), config.to_dict()
    loaded_fields.pop("_name_or_path"), fields.pop("_name_or_path")
    assert loaded_fields == fields


def test_model_type_does_not_collide_with_flash_linear_attention():
    assert DeltaNetConfig.model_type != "delta_net"


def test_describe_mentions_every_choice():
    text = "\n".join(DeltaNetConfig.from_preset("fla", output_gate=True).describe())
    for words in ("delta rule", "SiLU", "l2", "convolution of width 4", "RMSNorm and SiLU gate", "d_k^-1/2: yes"):
        assert words in text


@pytest.mark.parametrize(
    "name",
    ["small_linear_fast_weight_memory", "medium_linear_fast_weight_memory",
     "medium_linear_fast_weight_memory_carry_over_context"],
)  # fmt: skip
def test_the_official_scripts_presets_build_the_official_architecture(name):
    from memlm import DeltaNetForCausalLM

    config = DeltaNetConfig.from_preset(name)
    assert (config.norm_type, config.norm_position, config.final_norm, config.mlp_type) == (
        "layernorm", "post", False, "plain",
    )  # fmt: skip
    assert config.adaptive_softmax_cutoffs == [20000, 40000, 200000] and config.vocab_size == 267735
    assert config.position_encoding == ("none" if name.endswith("carry_over_context") else "sinusoidal")
    width = 256 if name.startswith("medium") else 128
    assert config.embedding_scale == width**0.5 and config.key_head_dim == width // 8
    with torch.device("meta"):
        model = DeltaNetForCausalLM(config)
    # Schlag et al. (2021), Table 2: β adds 16 K (small) and 33 K (medium) parameters; the medium model has 90 M.
    beta = sum(parameter.numel() for key, parameter in model.named_parameters() if "beta_proj" in key)
    assert beta == 16 * 8 * width
    assert model.num_parameters() == config.estimated_parameters()
    if width == 256:
        assert 89.5e6 < model.num_parameters() < 90.5e6
