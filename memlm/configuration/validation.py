"""Checks shared by memlm's configs: every bad value raises ValueError naming the field and what is allowed."""

import difflib


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_positive_int(value) -> bool:
    return is_int(value) and value > 0


def default_intermediate_size(hidden_size: int) -> int:
    """Width of the gated MLP when not given: hidden_size · 4 · 2/3 rounded up to a multiple of 256 (the SwiGLU rule
    flash-linear-attention uses)."""
    return 256 * ((int(hidden_size * 4 * 2 / 3) + 255) // 256)


def _name(config, field: str) -> str:
    return f"{type(config).__name__}.{field}"


def check_positive_ints(config, *fields: str):
    for field in fields:
        value = getattr(config, field)
        if not is_positive_int(value):
            raise ValueError(f"{_name(config, field)} must be a positive integer, got {value!r}.")


def check_bools(config, *fields: str):
    for field in fields:
        value = getattr(config, field)
        if not isinstance(value, bool):
            raise ValueError(f"{_name(config, field)} must be True or False, got {value!r}.")


def check_choice(config, field: str, allowed: tuple[str, ...]):
    value = getattr(config, field)
    if value not in allowed:
        raise ValueError(f"{_name(config, field)} must be one of {', '.join(map(repr, allowed))}; got {value!r}.")


def check_number(config, field: str, *, minimum=None, maximum=None, strict_minimum=False, strict_maximum=False):
    """A real number within the given bounds ([minimum, maximum], or open where `strict_*`)."""
    value = getattr(config, field)
    low = "(" if strict_minimum else "["
    high = ")" if strict_maximum else "]"
    allowed = f"{low}{'-inf' if minimum is None else minimum}, {'inf' if maximum is None else maximum}{high}"
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
    if ok and minimum is not None:
        ok = value > minimum if strict_minimum else value >= minimum
    if ok and maximum is not None:
        ok = value < maximum if strict_maximum else value <= maximum
    if not ok:
        raise ValueError(f"{_name(config, field)} must be a number in {allowed}, got {value!r}.")


def check_token_ids(config):
    for field in ("pad_token_id", "bos_token_id"):
        value = getattr(config, field)
        if value is not None and (not is_int(value) or not 0 <= value < config.vocab_size):
            raise ValueError(
                f"{_name(config, field)} must be None or an id in [0, vocab_size={config.vocab_size}), got {value!r}."
            )
    eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    for value in eos:
        if value is not None and (not is_int(value) or not 0 <= value < config.vocab_size):
            raise ValueError(
                f"{_name(config, 'eos_token_id')} must be None, an id or a list of ids in [0, vocab_size="
                f"{config.vocab_size}), got {config.eos_token_id!r}."
            )


# memlm's model types, each with the classes that load it.
MEMLM_MODEL_TYPES = {
    "memlm_deltanet": "DeltaNetConfig / DeltaNetForCausalLM",
    "memlm_expire_span": "ExpireSpanConfig / ExpireSpanForCausalLM",
    "memlm_feedback_transformer": "FeedbackTransformerConfig / FeedbackTransformerForCausalLM",
}
# Other checkpoints memlm can turn into its own, and how.
CONVERTIBLE_MODEL_TYPES = {
    "delta_net": "a flash-linear-attention DeltaNet checkpoint: convert it first with "
    "`python -m memlm.conversion.flash_linear_attention SOURCE DESTINATION`",
}

# What other libraries (🤗 GPT-2 / Llama / BERT, fairseq, flash-linear-attention, the papers' code) call memlm's
# fields. A memlm config keeps unknown options (as 🤗 configs do), so these would be silently ignored:
# DeltaNetConfig(num_heads=4) would build the default 12 heads. Only names whose memlm field exists in the config are
# refused (e.g. `attention_dropout` stays an unknown option of DeltaNetConfig, which has no attention dropout).
OTHER_LIBRARY_NAMES = {
    **dict.fromkeys(
        ("num_heads", "n_head", "n_heads", "nhead", "heads", "num_attention_head", "attention_heads",
         "decoder_attention_heads", "num_q_heads"),
        "num_attention_heads",
    ),
    **dict.fromkeys(
        ("num_layers", "n_layer", "n_layers", "nlayers", "num_hidden_layer", "layers", "depth", "num_blocks",
         "n_blocks", "decoder_layers"),
        "num_hidden_layers",
    ),
    **dict.fromkeys(
        ("n_embd", "n_embed", "d_model", "hidden_dim", "dim", "model_dim", "embed_dim", "embedding_dim", "emb_dim",
         "d_embed", "hidden", "decoder_embed_dim", "width"),
        "hidden_size",
    ),
    **dict.fromkeys(
        ("d_ff", "d_inner", "n_inner", "ffn_dim", "ffn_hidden_size", "mlp_dim", "mlp_hidden_size", "intermediate_dim",
         "dim_feedforward", "inner_dim", "feedforward_dim", "decoder_ffn_embed_dim"),
        "intermediate_size",
    ),
    **dict.fromkeys(("n_vocab", "ntokens", "ntoken", "vocabulary_size", "num_tokens", "vocab"), "vocab_size"),
    **dict.fromkeys(
        ("layer_norm_eps", "layer_norm_epsilon", "norm_eps", "norm_epsilon", "rms_eps", "rms_norm_epsilon", "eps"),
        "rms_norm_eps",
    ),
    **dict.fromkeys(
        ("dropout", "resid_pdrop", "hidden_dropout_prob", "dropout_rate", "residual_dropout", "resid_dropout",
         "dropout_prob"),
        "hidden_dropout",
    ),
    **dict.fromkeys(
        ("attention_probs_dropout_prob", "attn_pdrop", "attn_dropout", "attention_dropout_prob"), "attention_dropout"
    ),
    **dict.fromkeys(
        ("activation_function", "hidden_activation", "activation", "act_fn", "hidden_act_fn", "activation_fn"),
        "hidden_act",
    ),
    **dict.fromkeys(("init_std", "initializer_std", "init_range"), "initializer_range"),
    **dict.fromkeys(("rope_base", "rotary_base", "rotary_emb_base", "rope_freq_base", "rotary_theta"), "rope_theta"),
    **dict.fromkeys(("tie_embeddings", "tie_word_embedding", "tie_weights", "share_embeddings"), "tie_word_embeddings"),
    **dict.fromkeys(("pad_id", "pad_idx", "padding_idx", "pad_token"), "pad_token_id"),
    **dict.fromkeys(("bos_id", "bos_idx", "bos_token"), "bos_token_id"),
    **dict.fromkeys(("eos_id", "eos_idx", "eos_token"), "eos_token_id"),
    # flash-linear-attention's DeltaNet (fla/models/delta_net/configuration_delta_net.py)
    "use_gate": "output_gate",
    "use_short_conv": "short_convolution",
    "conv_size": "convolution_size",
    "qk_activation": "feature_map",
    "qk_norm": "query_key_normalization",
    "use_output_norm": "output_norm",
    "head_dim": "key_head_dim",
    # the Expire-Span paper's code
    "expire_span_loss": "span_loss_coefficient",
    "expire_span_ramp": "ramp",
    "expire_span_pre_div": "span_pre_divisor",
    "expire_span_init_percentage": "initial_span_fraction",
    "attn_lim": "max_span",
    # Feedback / Transformer-XL style memories
    **dict.fromkeys(("mem_len", "memory_length", "mem_span", "attn_span", "memory_size"), "memory_span"),
    "share_kv": "share_key_value",
}  # fmt: skip

# Read-only properties of memlm configs that other libraries make fields, with what they follow from.
DERIVED_FIELDS = {
    "head_dim": "head_dim = hidden_size / num_attention_heads",
    "feature_dim": "the width of φ(k), set by feature_map, dpfp_nu, favor_features and key_head_dim",
}

# The largest model a memlm config may describe: 10^12 parameters, 4 TB of float32 weights before any gradient or
# optimizer state. A slip such as num_hidden_layers=10**7 (7e13 parameters at the default width) would otherwise build
# layers until memory runs out.
MAX_PARAMETERS = 10**12


class _MemlmTypesFirst(dict):
    """🤗 AutoConfig's registered model types, answering for every `memlm_*` type: one memlm does not know is refused
    with memlm's known types (it may come from a newer memlm), instead of 🤗's advice to update Transformers."""

    def __contains__(self, key) -> bool:
        return super().__contains__(key) or (isinstance(key, str) and key.startswith("memlm_"))

    def __getitem__(self, key):
        if not super().__contains__(key) and isinstance(key, str) and key.startswith("memlm_"):
            raise ValueError(
                f"model_type {key!r} is not one of memlm's ({', '.join(MEMLM_MODEL_TYPES)}): a checkpoint of a newer "
                "memlm (pip install -U memlm), or a misspelt model_type in config.json."
            )
        return super().__getitem__(key)


def name_unknown_memlm_types(config_mapping):
    """Make 🤗's `CONFIG_MAPPING` refuse unknown `memlm_*` model types in memlm's words (`_MemlmTypesFirst`). It
    holds registered types in `_extra_content`; where a 🤗 release has no such dict, 🤗's own message stays."""
    registered = getattr(config_mapping, "_extra_content", None)
    if type(registered) is dict:
        config_mapping._extra_content = _MemlmTypesFirst(registered)


def check_model_type(config, extra_options: dict):
    """A config dict of another model type (`model_type` in a loaded config.json) is refused: building a DeltaNet from
    an Expire-Span checkpoint would keep the matching weights and fill the rest at random."""
    model_type = extra_options.get("model_type")
    expected = type(config).model_type
    if model_type is None or model_type == expected:
        return
    if model_type in MEMLM_MODEL_TYPES:
        hint = f"load it with {MEMLM_MODEL_TYPES[model_type]}, or AutoModelForCausalLM, which picks the class"
    elif model_type in CONVERTIBLE_MODEL_TYPES:
        hint = f"it is {CONVERTIBLE_MODEL_TYPES[model_type]}"
    else:
        hint = f"memlm's model types are {', '.join(MEMLM_MODEL_TYPES)}"
    raise ValueError(
        f"{type(config).__name__} (model_type {expected!r}) cannot load a config of model_type {model_type!r}; {hint}."
    )


def reject_misspelled_options(config, extra_options: dict):
    """Extra keyword arguments are kept (as 🤗 configs do, for forward compatibility), except ones that look like a
    misspelled field or are another library's name for a field: those would otherwise be silently ignored. Also
    refuses a config dict of another model type (`check_model_type`)."""
    check_model_type(config, extra_options)
    fields = [name for name in type(config).__dataclass_fields__ if not name.startswith("_")]
    for name in extra_options:
        if isinstance(vars(type(config)).get(name), property):  # memlm's own read-only properties
            raise ValueError(
                f"{type(config).__name__}.{name} is computed from the other fields"
                + (f" ({DERIVED_FIELDS[name]})" if name in DERIVED_FIELDS else "")
                + " and cannot be set."
            )
        if OTHER_LIBRARY_NAMES.get(name) in fields:
            raise ValueError(
                f"{type(config).__name__} got an unknown option {name!r} (another library's name); did you mean "
                f"{OTHER_LIBRARY_NAMES[name]!r}?"
            )
        close = difflib.get_close_matches(name, fields, n=1, cutoff=0.85)
        if close and close[0] != name:
            raise ValueError(f"{type(config).__name__} got an unknown option {name!r}; did you mean {close[0]!r}?")


def check_buildable_size(config):
    """Refuses a config whose model (`config.estimated_parameters()`) exceeds MAX_PARAMETERS."""
    count = config.estimated_parameters()
    if count > MAX_PARAMETERS:
        raise ValueError(
            f"{type(config).__name__} describes a model of about {count:.3g} parameters ({4 * count / 1e12:.3g} TB of "
            f"float32 weights); memlm refuses more than {MAX_PARAMETERS:.0e} parameters (4 TB of float32 weights before "
            "gradients and optimizer state), so that a slip in a size fails here instead of building layers until "
            f"memory runs out. The sizes: vocab_size={config.vocab_size}, hidden_size={config.hidden_size}, "
            f"intermediate_size={config.intermediate_size}, num_hidden_layers={config.num_hidden_layers}, "
            f"num_attention_heads={config.num_attention_heads}."
        )
