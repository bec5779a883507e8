"""Convert the Feedback Transformer of the official code of Fan et al. (2021), facebookresearch/transformer-sequential
(`models/feedback.py` `FeedbackTransformer`, built by `main.py --feedback`), into memlm's Feedback Transformer.

The official model: LayerNorm blocks (eps 1e-5), post-norm by default or pre-norm (`--pre-norm`, then with a final
LayerNorm), a plain biased ReLU feed-forward (`--inner-hid-sz`) with dropout after the ReLU, query/key/value
projections of width `nheads · head_dim` without biases, an output projection without bias, a biased output layer
(not tied), no embedding scale. The memory of Eq. 1 mixes the embedding and every layer's output
(`single_memory_attn_params`); each layer projects it with its own key/value projections (or with layer 0's, shared
by all, with `--share-proj-kv`), after its own `norm1` with `--pre-norm`. The attention of a step reads the last
`attn_lim` memories with the learned relative positions `key_pe` (one vector per distance, shared by the layers):
softmax((q·k + q·p_d)/√head_dim), dropout on the weights, and with `--adapt-span` the adaptive span's mask
(Sukhbaatar et al., 2019) and renormalisation (+1e-8), whose loss the trainer adds, over a window trimmed to the
longest span (`--adapt-span-trim-step`). The memory starts as `attn_lim`
zero hidden states; between blocks the model carries the hidden states (detached) and recomputes keys and values
from them; with `--pre-norm` it stores them after layer 0's `norm1`. In memlm's words (`official_config`):

    norm_type="layernorm", norm_position="pre"/"post", final_norm=pre_norm, mlp_type="plain", mlp_bias=True,
    hidden_act="relu", lm_head_bias=True, head_dim, position_encoding="learned_relative", initial_memory="zeros",
    memory_normalization="layer"/"none", memory_carry="hidden_states", carry_first_layer_norm=pre_norm,
    adaptive_span (+ ramp, loss coefficient, trim step, renormalization_epsilon=1e-8),
    attention_dropout_position="weights".

`convert_state_dict(state_dict, official_args)` maps an official state dict (official names; tied parameters under
each of their names) and the official arguments (`main.py`'s argparse names) to a `FeedbackTransformerConfig` and a
memlm state dict, with torch operations only (views, a transpose and a flip), so that gradients flow back onto the
official tensors. What memlm cannot express raises NotImplementedError naming the official flag.
"""

import torch

from ..configuration.configuration_feedback_transformer import FeedbackTransformerConfig

# main.py's defaults (its argparse parser) for the arguments the conversion reads.
OFFICIAL_DEFAULTS = {
    "nheads": 2,
    "attn_lim": 64,
    "dropout": 0.2,
    "head_dim": 0,
    "pre_norm": False,
    "feedback": False,
    "expire_span": False,
    "compress": False,
    "staircase": False,
    "share_proj_kv": False,
    "adapt_span": False,
    "adapt_span_loss": 0.0,
    "adapt_span_len": 32.0,
    "adapt_span_init": 0.0,
    "adapt_span_cache": False,
    "adapt_span_trim_step": 64,
    "adapt_span_layer": False,
}
OFFICIAL_LAYER_NORM_EPS = 1e-5  # nn.LayerNorm's default, which the official layers use
OFFICIAL_RENORMALIZATION_EPS = 1e-8  # SelfAttnSerial: attn / (attn.sum(-1) + 1e-8) after the adaptive span's mask
# Persistent buffers of the official model that hold nothing memlm needs (a logging copy of the layer weights, the
# adaptive mask's template 1 − d, which memlm computes).
IGNORED_BUFFERS = ("single_memory_attn_buf", "adaptive_span.mask.mask_template")


def _refuse(flag: str, why: str):
    raise NotImplementedError(f"transformer-sequential `{flag}`: {why}; memlm cannot express it.")


def official_arguments(official_args: dict) -> dict:
    """The official arguments the conversion reads, main.py's defaults filled in for the missing ones."""
    if not isinstance(official_args, dict):
        raise ValueError(f"official_args must be a dict of main.py's argument names, got {type(official_args)}.")
    return {**OFFICIAL_DEFAULTS, **official_args}


def sizes_of(state_dict: dict) -> dict:
    """The arguments an official Feedback state dict determines: hid_sz, inner_hid_sz, nlayers, nheads, head_dim and
    attn_lim (`key_pe` is (1, head_dim, attn_lim))."""
    if "in_emb.weight" not in state_dict or "layers.0.attn.attn.key_pe" not in state_dict:
        raise ValueError(
            "The official state dict has no in_emb.weight or layers.0.attn.attn.key_pe; is it a transformer-sequential "
            "FeedbackTransformer state dict?"
        )
    _, head_dim, attn_lim = state_dict["layers.0.attn.attn.key_pe"].shape
    sizes = {"hid_sz": state_dict["in_emb.weight"].shape[1], "head_dim": head_dim, "attn_lim": attn_lim}
    if "layers.0.attn.proj_query.weight" in state_dict:  # (nheads · head_dim, hid_sz)
        sizes["nheads"] = state_dict["layers.0.attn.proj_query.weight"].shape[0] // head_dim
    sizes["nlayers"] = len({int(name.split(".")[1]) for name in state_dict if name.startswith("layers.")})
    if "layers.0.ff.fc1.weight" in state_dict:
        sizes["inner_hid_sz"] = state_dict["layers.0.ff.fc1.weight"].shape[0]
    return sizes


def official_config(state_dict: dict, official_args: dict) -> FeedbackTransformerConfig:
    """The FeedbackTransformerConfig of the official model (sizes read from the state dict where they are there;
    given arguments must agree with them)."""
    sizes = sizes_of(state_dict)
    args = {**sizes, **official_arguments(official_args)}
    for name, found in sizes.items():
        if args[name] != found and not (name == "head_dim" and args[name] == 0):
            raise ValueError(
                f"official_args {name}={args[name]!r} does not fit the state dict, which gives {found!r}."
            )
    if not args["feedback"]:
        _refuse("--feedback (not given)", "a model other than the Feedback Transformer (this converter reads "
                "`--feedback` models; Expire-Span has its own)")  # fmt: skip
    for flag in ("expire_span", "compress", "staircase"):
        if args[flag]:
            _refuse(f"--{flag.replace('_', '-')}", "another model of transformer-sequential beside --feedback")
    if args["adapt_span"]:
        if args["adapt_span_layer"]:
            _refuse("--adapt-span-layer", "one span for all heads of a layer (memlm learns one span per head)")
        if args["adapt_span_cache"]:
            _refuse(
                "--adapt-span-cache", "a cache shortened by the spans (the official Feedback model refuses it too)"
            )
    embedding = state_dict["in_emb.weight"]
    pre_norm = bool(args["pre_norm"])
    head_dim = args["head_dim"] or args["hid_sz"] // args["nheads"]
    return FeedbackTransformerConfig(
        vocab_size=embedding.shape[0],
        hidden_size=args["hid_sz"],
        intermediate_size=args["inner_hid_sz"],
        num_hidden_layers=args["nlayers"],
        num_attention_heads=args["nheads"],
        head_dim=head_dim,
        memory_span=args["attn_lim"],
        share_key_value=bool(args["share_proj_kv"]),
        position_encoding="learned_relative",
        initial_memory="zeros",
        memory_normalization="layer" if pre_norm else "none",
        memory_carry="hidden_states",
        carry_first_layer_norm=pre_norm,
        adaptive_span=bool(args["adapt_span"]),
        adaptive_span_ramp=args["adapt_span_len"],
        adaptive_span_loss_coefficient=args["adapt_span_loss"],
        adaptive_span_initial_ratio=args["adapt_span_init"],
        adaptive_span_trim_step=args["adapt_span_trim_step"] if args["adapt_span"] else None,
        renormalization_epsilon=OFFICIAL_RENORMALIZATION_EPS if args["adapt_span"] else 0.0,
        attention_dropout=args["dropout"],
        attention_dropout_position="weights",
        activation_dropout=args["dropout"],
        hidden_dropout=0.0,
        norm_type="layernorm",
        layer_norm_eps=OFFICIAL_LAYER_NORM_EPS,
        norm_position="pre" if pre_norm else "post",
        final_norm=pre_norm,
        mlp_type="plain",
        mlp_bias=True,
        hidden_act="relu",
        attention_output_bias=False,
        lm_head_bias=True,
        tie_word_embeddings=False,
    )


def convert_state_dict(state_dict: dict, official_args: dict) -> tuple[FeedbackTransformerConfig, dict]:
    """The memlm config and state dict (names of `FeedbackTransformerForCausalLM`) of an official Feedback model.

    Args:
        state_dict: the official model's `state_dict()` under its own names; tied parameters (`key_pe` of every layer,
            with `--share-proj-kv` the key/value projections and with `--pre-norm` also `norm1`) may appear under each
            of their names (the first layer's is read).
        official_args: main.py's arguments (argparse names: `hid_sz`, `nheads`, `head_dim`, `attn_lim`, ...).

    Returns:
        `(config, state_dict)`: the memlm tensors are views of the official ones, so gradients reach them.
    """
    config = official_config(state_dict, official_args)
    layers = config.num_hidden_layers
    pending = dict(state_dict)

    def take(name: str) -> torch.Tensor:
        if name not in pending:
            raise ValueError(f"the official state dict has no {name!r}, which official_args {official_args} need.")
        return pending.pop(name)

    converted = {
        "model.embed_tokens.weight": take("in_emb.weight"),
        # Eq. 1's weights: the official (1, L + 1) row of logits.
        "model.layer_weights": take("single_memory_attn_params").reshape(layers + 1),
        "lm_head.weight": take("out.out_emb.weight"),
        "lm_head.bias": take("out.out_emb.bias"),
    }
    if config.final_norm:
        converted["model.norm.weight"] = take("out_norm.weight")
        converted["model.norm.bias"] = take("out_norm.bias")
    # key_pe (1, head_dim, attn_lim): column j holds the distance attn_lim − j (its window is oldest first); memlm's
    # row d − 1 holds p_d.
    key_pe = take("layers.0.attn.attn.key_pe")
    converted["model.relative_positions"] = key_pe[0].transpose(0, 1).flip(0)
    for index in range(layers):
        official, memlm = f"layers.{index}.", f"model.layers.{index}."
        if index:
            pending.pop(f"{official}attn.attn.key_pe", None)  # tied to layer 0's
        converted[f"{memlm}attention.q_proj.weight"] = take(f"{official}attn.proj_query.weight")
        converted[f"{memlm}attention.o_proj.weight"] = take(f"{official}attn.proj_out.weight")
        keys, values = take(f"{official}attn.proj_key.weight"), take(f"{official}attn.proj_val.weight")
        if not config.share_key_value:
            converted[f"{memlm}attention.k_proj.weight"], converted[f"{memlm}attention.v_proj.weight"] = keys, values
        elif index == 0:  # the other layers' are tied to layer 0's
            converted["model.k_proj.weight"], converted["model.v_proj.weight"] = keys, values
        if config.adaptive_span:
            converted[f"{memlm}attention.span_ratio"] = take(
                f"{official}attn.attn.adaptive_span.mask.size_ratio"
            ).reshape(config.num_attention_heads)
        converted[f"{memlm}mlp.up_proj.weight"] = take(f"{official}ff.fc1.weight")
        converted[f"{memlm}mlp.up_proj.bias"] = take(f"{official}ff.fc1.bias")
        converted[f"{memlm}mlp.down_proj.weight"] = take(f"{official}ff.fc2.weight")
        converted[f"{memlm}mlp.down_proj.bias"] = take(f"{official}ff.fc2.bias")
        # With --share-proj-kv --pre-norm the official norm1 is one parameter of all layers: each memlm layer gets
        # its values (equal forward; training in memlm unties them).
        for part in ("weight", "bias"):
            converted[f"{memlm}input_layernorm.{part}"] = take(f"{official}norm1.{part}")
            converted[f"{memlm}post_attention_layernorm.{part}"] = take(f"{official}norm2.{part}")
    leftover = [name for name in pending if not name.endswith(IGNORED_BUFFERS)]
    if leftover:
        raise NotImplementedError(
            f"transformer-sequential state dict: memlm's Feedback Transformer has no place for: {', '.join(leftover)}."
        )
    return config, converted


__all__ = ["convert_state_dict", "official_config"]
