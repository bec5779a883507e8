"""What every memlm config refuses instead of silently ignoring: other libraries' names for its fields, a saved config
of another model type, and sizes that cannot be built (with `estimated_parameters` checked against built models);
and what must still load: configs and models saved by 🤗 with their standard extra keys."""

import json
import time

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from memlm import (
    DeltaNetConfig,
    DeltaNetForCausalLM,
    ExpireSpanConfig,
    ExpireSpanForCausalLM,
    FeedbackTransformerConfig,
    FeedbackTransformerForCausalLM,
)

CONFIGS = {"deltanet": DeltaNetConfig, "expire_span": ExpireSpanConfig, "feedback": FeedbackTransformerConfig}
MODELS = {
    "deltanet": DeltaNetForCausalLM,
    "expire_span": ExpireSpanForCausalLM,
    "feedback": FeedbackTransformerForCausalLM,
}
SIZES = {
    "vocab_size": 50,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 48,
}
OPTIONS = {"deltanet": {"chunk_size": 8}, "expire_span": {"max_span": 16, "ramp": 4, "block_size": 8},
           "feedback": {"memory_span": 8}}  # fmt: skip


def test_another_librarys_names_do_not_build_the_default_model():
    with pytest.raises(ValueError, match="unknown option 'num_heads' .*did you mean 'num_attention_heads'"):
        DeltaNetConfig(num_heads=4, num_layers=3)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize(
    ("alias", "field"),
    [
        ("num_heads", "num_attention_heads"),
        ("n_head", "num_attention_heads"),
        ("num_layers", "num_hidden_layers"),
        ("n_layer", "num_hidden_layers"),
        ("num_hidden_layer", "num_hidden_layers"),
        ("n_embd", "hidden_size"),
        ("d_model", "hidden_size"),
        ("hidden_dim", "hidden_size"),
        ("d_ff", "intermediate_size"),
        ("ffn_dim", "intermediate_size"),
        ("norm_eps", "rms_norm_eps"),
        ("dropout", "hidden_dropout"),
        ("activation_function", "hidden_act"),
        ("n_vocab", "vocab_size"),
    ],
)
def test_other_libraries_names_are_refused_with_the_memlm_name(name, alias, field):
    with pytest.raises(ValueError, match=f"{CONFIGS[name].__name__} got an unknown option '{alias}'.*'{field}'"):
        CONFIGS[name](**{alias: 4})


@pytest.mark.parametrize(
    ("config_class", "options", "message"),
    [
        (DeltaNetConfig, {"head_dim": 16}, "unknown option 'head_dim' .*did you mean 'key_head_dim'"),
        (DeltaNetConfig, {"use_short_conv": True}, "did you mean 'short_convolution'"),  # flash-linear-attention
        (DeltaNetConfig, {"conv_size": 3}, "did you mean 'convolution_size'"),
        (DeltaNetConfig, {"feature_dim": 8}, r"DeltaNetConfig.feature_dim is computed from the other fields"),
        (ExpireSpanConfig, {"attn_pdrop": 0.1}, "did you mean 'attention_dropout'"),
        (ExpireSpanConfig, {"expire_span_ramp": 8}, "did you mean 'ramp'"),  # the paper's code
        (FeedbackTransformerConfig, {"mem_len": 16}, "did you mean 'memory_span'"),
        (FeedbackTransformerConfig, {"share_kv": False}, "did you mean 'share_key_value'"),
        (FeedbackTransformerConfig, {"rotary_base": 500.0}, "did you mean 'rope_theta'"),
    ],
)
def test_model_specific_names_are_refused(config_class, options, message):
    with pytest.raises(ValueError, match=message):
        config_class(**options)


def test_names_without_a_memlm_field_stay_ordinary_extra_options():
    # DeltaNet has no attention dropout and no memory span: those names are kept as 🤗 keeps unknown options
    config = DeltaNetConfig(attention_dropout=0.1, mem_len=4, my_note="kept")
    assert (config.attention_dropout, config.mem_len, config.my_note) == (0.1, 4, "kept")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_configs_saved_by_transformers_with_their_standard_keys_still_load(name, tmp_path):
    config = CONFIGS[name](**SIZES, **OPTIONS[name], output_hidden_states=True, id2label={0: "a", 1: "b"})
    # every key 🤗 knows, as `to_dict` writes them (not only the differences from the defaults)
    everything = config.to_dict()
    assert {"transformers_version", "model_type", "return_dict", "architectures", "dtype"} <= set(everything)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "config.json").write_text(json.dumps(everything))
    # and the legacy spellings older 🤗 releases saved
    legacy = {**config.to_diff_dict(), "torch_dtype": "float32", "_name_or_path": "somewhere"}
    (tmp_path / "legacy").mkdir()
    (tmp_path / "legacy" / "config.json").write_text(json.dumps(legacy))
    config.save_pretrained(tmp_path / "saved")
    for folder in ("full", "legacy", "saved"):
        for loaded in (
            AutoConfig.from_pretrained(tmp_path / folder),
            CONFIGS[name].from_pretrained(tmp_path / folder),
        ):
            assert type(loaded) is CONFIGS[name]
            assert (loaded.hidden_size, loaded.num_attention_heads, loaded.num_hidden_layers) == (32, 2, 2)
    assert CONFIGS[name].from_dict(everything).to_dict() == everything


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory):
    """One tiny saved model (save_pretrained, with its code bundle and auto_map) of each kind."""
    folder = tmp_path_factory.mktemp("models")
    torch.manual_seed(0)
    for name, model_class in MODELS.items():
        model_class(CONFIGS[name](**SIZES, **OPTIONS[name])).save_pretrained(folder / name)
    return folder


@pytest.mark.parametrize("wrong", list(MODELS))
@pytest.mark.parametrize("saved", list(MODELS))
def test_a_memlm_class_refuses_another_memlm_model_type(saved_models, saved, wrong):
    if saved == wrong:
        model = MODELS[wrong].from_pretrained(saved_models / saved)
        assert type(model) is MODELS[wrong]
        assert type(CONFIGS[wrong].from_pretrained(saved_models / saved)) is CONFIGS[wrong]
        return
    saved_type, wrong_type = CONFIGS[saved].model_type, CONFIGS[wrong].model_type
    message = (
        rf"{CONFIGS[wrong].__name__} \(model_type '{wrong_type}'\) cannot load a config of model_type "
        rf"'{saved_type}'; load it with {CONFIGS[saved].__name__} / {MODELS[saved].__name__}"
    )
    with pytest.raises(ValueError, match=message):
        MODELS[wrong].from_pretrained(saved_models / saved)
    with pytest.raises(ValueError, match=message):
        CONFIGS[wrong].from_pretrained(saved_models / saved)
    with pytest.raises(ValueError, match=message):
        CONFIGS[wrong](**CONFIGS[saved](**SIZES, **OPTIONS[saved]).to_dict())


def test_the_auto_classes_still_pick_the_saved_type(saved_models):
    for name, model_class in MODELS.items():
        assert type(AutoModelForCausalLM.from_pretrained(saved_models / name)) is model_class


def test_a_flash_linear_attention_config_points_to_the_converter(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "delta_net", "hidden_size": 32, "num_heads": 2}))
    with pytest.raises(ValueError, match="model_type 'delta_net'.*python -m memlm.conversion.flash_linear_attention"):
        DeltaNetConfig.from_pretrained(tmp_path)


ESTIMATE_CASES = [
    (DeltaNetForCausalLM, DeltaNetConfig.from_preset("paper", **SIZES)),
    (DeltaNetForCausalLM, DeltaNetConfig.from_preset("fla", output_gate=True, **SIZES)),
    (DeltaNetForCausalLM, DeltaNetConfig.from_preset("fla", tie_word_embeddings=True, use_beta=False, **SIZES)),
    (
        DeltaNetForCausalLM,
        DeltaNetConfig(feature_map="favor+", favor_features=8, key_head_dim=8, value_head_dim=24, **SIZES),
    ),  # fmt: skip
    (
        DeltaNetForCausalLM,
        DeltaNetConfig(
            norm_type="layernorm",
            norm_position="post",
            final_norm=False,
            mlp_type="plain",
            mlp_bias=True,
            attention_output_bias=True,
            lm_head_bias=True,
            tie_word_embeddings=True,
            **SIZES,
        ),
    ),  # fmt: skip
    (DeltaNetForCausalLM, DeltaNetConfig(norm_type="layernorm", mlp_bias=True, **SIZES)),
    (ExpireSpanForCausalLM, ExpireSpanConfig(max_span=16, **SIZES)),
    (ExpireSpanForCausalLM, ExpireSpanConfig(max_span=16, expire_memories=False, tie_word_embeddings=True, **SIZES)),
    (FeedbackTransformerForCausalLM, FeedbackTransformerConfig(memory_span=8, **SIZES)),
    (
        FeedbackTransformerForCausalLM,
        FeedbackTransformerConfig(memory_span=8, share_key_value=False, position_encoding="relative_bias", **SIZES),
    ),  # fmt: skip
    (
        FeedbackTransformerForCausalLM,
        FeedbackTransformerConfig(
            memory_span=8,
            share_key_value=False,
            head_dim=6,
            position_encoding="learned_relative",
            memory_normalization="layer",
            adaptive_span=True,
            norm_type="layernorm",
            mlp_type="plain",
            mlp_bias=True,
            lm_head_bias=True,
            **SIZES,
        ),
    ),  # fmt: skip
    (
        FeedbackTransformerForCausalLM,
        FeedbackTransformerConfig(
            memory_span=8,
            head_dim=10,
            memory_normalization="none",
            norm_position="post",
            final_norm=False,
            attention_output_bias=True,
            mlp_bias=True,
            tie_word_embeddings=True,
            **SIZES,
        ),
    ),  # fmt: skip
]


@pytest.mark.parametrize(("model_class", "config"), ESTIMATE_CASES)
def test_estimated_parameters_match_the_built_model(model_class, config):
    built = model_class(config).num_parameters()  # tied embeddings counted once
    assert config.estimated_parameters() == built


@pytest.mark.parametrize("name", list(CONFIGS))
def test_sizes_that_cannot_be_built_are_refused_at_once(name, tmp_path):
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"describes a model of about [0-9.]+e\+13 parameters .*num_hidden_layers="):
        CONFIGS[name](num_hidden_layers=10**7)
    # the limit is 10^12 parameters: just above it is refused, just below it is a valid description
    with pytest.raises(
        ValueError, match=r"about 1\.09e\+12 parameters \(4\.35 TB .*memlm refuses more than 1e\+12 parameters"
    ):
        CONFIGS[name](hidden_size=2**18, vocab_size=500_000, num_hidden_layers=1, num_attention_heads=2**9)
    below = CONFIGS[name](hidden_size=2**17, vocab_size=500_000, num_hidden_layers=4, num_attention_heads=2**9)
    assert 8e11 < below.estimated_parameters() < 1e12
    # a saved config (default sizes) edited by hand fails as it loads, before any layer is built
    CONFIGS[name]().save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**saved, "num_hidden_layers": 10**7}))
    with pytest.raises(ValueError, match="num_hidden_layers=10000000"):
        AutoModelForCausalLM.from_pretrained(tmp_path)
    assert time.perf_counter() - start < 10


@pytest.mark.parametrize("name", list(CONFIGS))
def test_large_buildable_sizes_are_accepted(name):
    # a 7B-scale layout is only a description until a model is built from it (e.g. on the meta device)
    config = CONFIGS[name](hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, vocab_size=32000)
    assert 4e9 < config.estimated_parameters() < 1e10
    with torch.device("meta"):
        model = MODELS[name](CONFIGS[name](hidden_size=1024, num_hidden_layers=4, num_attention_heads=8))
    assert model.num_parameters() == model.config.estimated_parameters()
