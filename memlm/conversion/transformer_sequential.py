"""Convert the Expire-Span models of the official code of Sukhbaatar et al. (2021), facebookresearch/
transformer-sequential (`models/expire_span.py` `ExpireSpan`, built by `main.py`, trained by `trainer.py`), into
memlm's Expire-Span.

The official model: token embeddings (no scale, no positions), then `nlayers` blocks, post-norm (`norm1(h + attn)`,
`norm2(h2 + ff)`) or with `--pre-norm` pre-norm with a final LayerNorm (`out_norm`); LayerNorm eps 1e-5; a plain biased
ReLU feed-forward with dropout after the ReLU; attention projections without biases, `nheads` heads of `head_dim`;
learned relative positions `key_pe` (one vector per distance 1..min(attn_lim, mem_sz), shared by the layers) added
to q·k before the 1/√head_dim scale; no attention to the token itself; spans e_i = attn_lim · σ(w·h_i / pre_div + b)
of the attention input h_i, the soft mask with ramp R, the masked attention renormalised by Σ m a + 1e-8 (softmax
over the memories with m > 0); a biased output layer. Memories start as min(attn_lim, mem_sz) zero hidden states
with counters mem_sz..1; memories whose mask is 0 for the next block are dropped. Its span loss sums the remaining
spans e_i − (t − i) of the (query, memory) pairs on the ramp (coefficient · Σ / R / mem_sz per sample). In training
it carries the layers' input hidden states and recomputes the memories' keys, values and spans with the current
weights every block; `--expire-span-noisy` clamps the spans the mask sees at u·attn_lim (u ~ U(0, 1) per block),
`--expire-span-layerdrop` skips layers at random.

memlm's options for each of these: `norm_type="layernorm"`, `norm_position`, `final_norm`, `mlp_type="plain"`,
`mlp_bias`, `hidden_act="relu"`, `lm_head_bias`, `head_dim`, `position_encoding="learned_relative"`,
`attend_to_self=False`, `initial_memory="zeros"`, `span_loss_form="remaining_span"`,
`renormalization_epsilon=1e-8`, `recompute_memory=True`, `noisy_spans`, `layer_drop`, `block_size` = mem_sz (the
regularisers draw their random numbers from torch's generator, the official code from Python's `random`). Fed as
memlm is fed — `model(input_ids=block, cache=cache, use_cache=True)` block after block, the first with `cache=None`
(which starts from the official zero memory) — the converted model gives the official log-probabilities and, in
training, the official gradients; `aux_loss` on the output is the official span loss.

`convert_state_dict(state_dict, official_args)` maps an official state dict (official names) and the official
`main.py` arguments (argparse names, e.g. `hid_sz`, `attn_lim`, `expire_span_ramp`) to an `ExpireSpanConfig` and a
memlm state dict, with torch operations only (views, transposes, flips), so that gradients flow back onto the official
tensors. What memlm cannot express raises NotImplementedError naming the official flag.

Command line:  memlm convert transformer-sequential CHECKPOINT OUT [--official-args ARGS.json]
"""

from pathlib import Path

import torch

from ..configuration.configuration_expire_span import ExpireSpanConfig
from .official_arguments import read_arguments_file

# main.py's defaults (its argparse parser) for the arguments the conversion reads.
OFFICIAL_DEFAULTS = {
    "nheads": 2,
    "head_dim": 0,
    "attn_lim": 64,
    "dropout": 0.2,
    "pre_norm": False,
    "feedback": False,
    "expire_span": False,
    "compress": False,
    "staircase": False,
    "adapt_span": False,
    "expire_span_loss": 0.0,
    "expire_span_ramp": 32,
    "expire_span_init_percentage": 0.1,
    "expire_span_noisy": False,
    "expire_span_pre_div": 1.0,
    "expire_span_layerdrop": 0.0,
}
OFFICIAL_LAYER_NORM_EPS = 1e-5  # nn.LayerNorm's default, which the official blocks use
OFFICIAL_RENORMALIZATION_EPSILON = 1e-8  # SeqAttention: attn / (attn.sum(-1) + 1e-8)
# What main.py builds instead of Expire-Span, by flag.
OTHER_MODELS = {
    "feedback": "the Feedback Transformer (models/feedback.py)",
    "compress": "the Compressive Transformer (models/compressive.py)",
    "staircase": "the Staircase Transformer (models/staircase.py)",
}


def _refuse(flag: str, why: str, value=None):
    written = f"--{flag.replace('_', '-')}" + ("" if value is None else f" {value}")
    raise NotImplementedError(f"transformer-sequential `{written}`: {why}; memlm cannot express it.")


def official_arguments(official_args: dict) -> dict:
    """The official arguments the conversion reads, main.py's defaults filled in for the missing ones."""
    if not isinstance(official_args, dict):
        raise ValueError(f"official_args must be a dict of main.py's argument names, got {type(official_args)}.")
    return {**OFFICIAL_DEFAULTS, **official_args}


def _tensor(state_dict: dict, name: str) -> torch.Tensor:
    if name not in state_dict:
        raise ValueError(
            f"The official state dict has no {name!r}; is it a transformer-sequential ExpireSpan state dict?"
        )
    return state_dict[name]


def _check(args: dict, name: str, found, where: str):
    if name in args and args[name] != found:
        raise ValueError(f"official_args {name}={args[name]!r} does not fit the state dict: {where} gives {found!r}.")


def convert_config(state_dict: dict, official_args: dict) -> ExpireSpanConfig:
    """The ExpireSpanConfig of the official model (sizes read from the state dict, checked against the arguments)."""
    given = dict(official_args) if isinstance(official_args, dict) else official_args
    args = official_arguments(given)
    for flag, model in OTHER_MODELS.items():
        if args[flag]:
            _refuse(flag, f"{model} is another model; this converter reads Expire-Span models")
    if not args["expire_span"] and "layers.0.attn.attn.expire_span.span_predictor.weight" not in state_dict:
        _refuse(
            "expire_span",
            "not set: the plain TransformerSeq (attention over exactly the last attn_lim tokens, itself included) is "
            "another model; this converter reads Expire-Span models",
        )
    if args["adapt_span"]:
        _refuse("adapt_span", "adaptive span with Expire-Span (the official trainer adds a loss the model lacks)")

    embedding = _tensor(state_dict, "in_emb.weight")
    vocab_size, hidden_size = embedding.shape
    _check(given, "vocab_sz", vocab_size, "in_emb.weight")
    _check(given, "hid_sz", hidden_size, "in_emb.weight")
    layers = sorted({int(name.split(".")[1]) for name in state_dict if name.startswith("layers.")})
    if not layers or layers != list(range(len(layers))):
        raise ValueError(f"The official state dict's layers are numbered {layers}; expected 0, 1, ..., nlayers-1.")
    _check(given, "nlayers", len(layers), "the layers.<l> names")
    width = _tensor(state_dict, "layers.0.attn.proj_query.weight").shape[0]
    heads = args["nheads"]
    head_dim = args["head_dim"] or (hidden_size // heads if hidden_size % heads == 0 else 0)
    if heads * head_dim != width:
        raise ValueError(
            f"official_args nheads={heads} and head_dim={args['head_dim']} do not fit the state dict: "
            f"layers.0.attn.proj_query.weight has {width} = nheads·head_dim rows."
        )
    key_pe = _tensor(state_dict, "layers.0.attn.attn.key_pe")  # (1, head_dim, min(attn_lim, mem_sz))
    block_size = key_pe.shape[-1]
    mask_causal = _tensor(state_dict, "layers.0.attn.attn.mask_causal")  # (mem_sz, attn_lim + mem_sz + ramp)
    _check(given, "mem_sz", mask_causal.shape[0], "layers.0.attn.attn.mask_causal")
    if mask_causal.shape[0] != block_size:
        raise NotImplementedError(
            "transformer-sequential `--attn-lim` smaller than `--mem-sz` (the official model asserts attn_lim >= "
            "mem_sz); memlm cannot express it."
        )
    attention_limit, ramp = args["attn_lim"], args["expire_span_ramp"]
    if mask_causal.shape[1] != attention_limit + block_size + ramp:
        raise ValueError(
            f"official_args attn_lim={attention_limit} and expire_span_ramp={ramp} do not fit the state dict: "
            f"layers.0.attn.attn.mask_causal has {mask_causal.shape[1]} = attn_lim + mem_sz + ramp columns "
            f"(mem_sz = {block_size})."
        )
    pre_norm = "out_norm.weight" in state_dict
    _check(given, "pre_norm", pre_norm, "the presence of out_norm")
    dropout = args["dropout"]
    return ExpireSpanConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=_tensor(state_dict, "layers.0.ff.fc1.weight").shape[0],
        num_hidden_layers=len(layers),
        num_attention_heads=heads,
        head_dim=head_dim,
        max_span=attention_limit,
        ramp=ramp,
        span_loss_coefficient=args["expire_span_loss"],
        span_pre_divisor=args["expire_span_pre_div"],
        initial_span_fraction=args["expire_span_init_percentage"],
        block_size=block_size,
        position_encoding="learned_relative",
        attend_to_self=False,
        initial_memory="zeros",
        span_loss_form="remaining_span",
        renormalization_epsilon=OFFICIAL_RENORMALIZATION_EPSILON,
        recompute_memory=True,
        noisy_spans=bool(args["expire_span_noisy"]),
        layer_drop=args["expire_span_layerdrop"],
        attention_dropout=dropout,
        activation_dropout=dropout,
        hidden_act="relu",
        norm_type="layernorm",
        layer_norm_eps=OFFICIAL_LAYER_NORM_EPS,
        norm_position="pre" if pre_norm else "post",
        final_norm=pre_norm,
        mlp_type="plain",
        mlp_bias=True,
        lm_head_bias=True,
        tie_word_embeddings=False,
    )


def convert_state_dict(state_dict: dict, official_args: dict) -> tuple[ExpireSpanConfig, dict]:
    """(config, memlm state dict) of the official model with `state_dict` (official names, tied parameters under
    each of their names) and `official_args` (main.py's argument names and values). Every official tensor is used (the
    causal masks are checked, memlm builds its own); torch operations only, so gradients flow back. A Feedback
    Transformer's state dict (`--feedback`: it holds `single_memory_attn_params`) converts through
    `memlm.conversion.transformer_sequential_feedback`."""
    if "single_memory_attn_params" in state_dict:  # a Feedback Transformer's weights (its layer mix, Eq. 1)
        from .transformer_sequential_feedback import convert_state_dict as convert_feedback

        return convert_feedback(state_dict, official_args)
    config = convert_config(state_dict, official_args)
    converted = {
        "model.embed_tokens.weight": state_dict["in_emb.weight"],
        "lm_head.weight": _tensor(state_dict, "out.out_emb.weight"),
        "lm_head.bias": _tensor(state_dict, "out.out_emb.bias"),
    }
    used = {"in_emb.weight", "out.out_emb.weight", "out.out_emb.bias"}
    if config.final_norm:
        converted["model.norm.weight"] = _tensor(state_dict, "out_norm.weight")
        converted["model.norm.bias"] = _tensor(state_dict, "out_norm.bias")
        used |= {"out_norm.weight", "out_norm.bias"}
    # key_pe (1, head_dim, M): column c scores the key M − c steps before the query (the official skew of the last 2M
    # columns); memlm's row d − 1 is distance d.
    key_pe = state_dict["layers.0.attn.attn.key_pe"]
    converted["model.relative_positions.weight"] = key_pe[0].transpose(0, 1).flip(0)
    block_size = config.block_size
    expected_mask = torch.ones(block_size, block_size + config.max_span + int(config.ramp), dtype=torch.bool)
    expected_mask = expected_mask.tril(diagonal=expected_mask.shape[1] - block_size - 1)
    renames = {
        "attn.proj_query.weight": "attention.q_proj.weight",
        "attn.proj_key.weight": "attention.k_proj.weight",
        "attn.proj_val.weight": "attention.v_proj.weight",
        "attn.proj_out.weight": "attention.o_proj.weight",
        "attn.attn.expire_span.span_predictor.weight": "attention.span_predictor.weight",
        "attn.attn.expire_span.span_predictor.bias": "attention.span_predictor.bias",
        "ff.fc1.weight": "mlp.up_proj.weight",
        "ff.fc1.bias": "mlp.up_proj.bias",
        "ff.fc2.weight": "mlp.down_proj.weight",
        "ff.fc2.bias": "mlp.down_proj.bias",
        "norm1.weight": "input_layernorm.weight",
        "norm1.bias": "input_layernorm.bias",
        "norm2.weight": "post_attention_layernorm.weight",
        "norm2.bias": "post_attention_layernorm.bias",
    }
    for layer in range(config.num_hidden_layers):
        official, memlm = f"layers.{layer}.", f"model.layers.{layer}."
        for source, target in renames.items():
            converted[memlm + target] = _tensor(state_dict, official + source)
        shared = _tensor(state_dict, official + "attn.attn.key_pe")
        if shared.shape != key_pe.shape or not torch.equal(shared, key_pe):
            raise ValueError(f"{official}attn.attn.key_pe differs from layers.0's: the official model shares one.")
        mask = _tensor(state_dict, official + "attn.attn.mask_causal")
        if mask.shape != expected_mask.shape or not torch.equal(mask.bool(), expected_mask):
            raise ValueError(
                f"{official}attn.attn.mask_causal is not the official causal mask for mem_sz={block_size}, "
                f"attn_lim={config.max_span}, ramp={config.ramp:g}."
            )
        used |= {official + source for source in renames} | {
            official + "attn.attn.key_pe",
            official + "attn.attn.mask_causal",
        }
    unused = sorted(set(state_dict) - used)
    if unused:
        raise NotImplementedError(
            f"The official state dict holds tensors memlm's Expire-Span has no place for: {', '.join(unused[:8])}"
            + (" ..." if len(unused) > 8 else "")
        )
    return config, converted


def read_checkpoint(path: str | Path) -> tuple[dict, dict]:
    """(state dict, official arguments) of a checkpoint the official trainer saved (`utils/checkpoint.py` `save`:
    `torch.save({"epoch", "model": model.state_dict(), "logger", "optimizer", "scheduler_epoch"})`, the model wrapped in
    DistributedDataParallel, hence the names' `module.` prefix, removed here), read with `torch.load(weights_only=True)`.

    The file holds no arguments: the ones returned are those the state dict determines (sizes, `pre_norm`,
    `expire_span`, `feedback`, `adapt_span`); pass the others (`nheads`, `attn_lim`, `expire_span_ramp`, ... as the training command set them) to
    `convert_state_dict` (the CLI: `--official-args ARGS.json`), else main.py's defaults are taken and checked
    against the state dict where it can tell."""
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as error:
        raise ValueError(
            f"{path} cannot be read with torch.load(weights_only=True) ({type(error).__name__}: {error})."
        ) from error
    if isinstance(loaded, dict) and isinstance(loaded.get("model"), dict):
        loaded = loaded["model"]
    if not isinstance(loaded, dict) or not loaded or not all(torch.is_tensor(value) for value in loaded.values()):
        raise ValueError(
            f"{path} holds neither an official checkpoint ({{'model': state_dict, ...}}) nor a state dict."
        )
    state_dict = {name.removeprefix("module."): tensor for name, tensor in loaded.items()}
    official_args = {}
    if "in_emb.weight" in state_dict:
        official_args["vocab_sz"], official_args["hid_sz"] = state_dict["in_emb.weight"].shape
    layers = {int(name.split(".")[1]) for name in state_dict if name.startswith("layers.")}
    if layers:
        official_args["nlayers"] = max(layers) + 1
    if "layers.0.ff.fc1.weight" in state_dict:
        official_args["inner_hid_sz"] = state_dict["layers.0.ff.fc1.weight"].shape[0]
    if "layers.0.attn.attn.mask_causal" in state_dict:
        official_args["mem_sz"] = state_dict["layers.0.attn.attn.mask_causal"].shape[0]
    official_args["pre_norm"] = "out_norm.weight" in state_dict
    official_args["expire_span"] = "layers.0.attn.attn.expire_span.span_predictor.weight" in state_dict
    if "single_memory_attn_params" in state_dict:  # the Feedback Transformer's layer weights (Eq. 1)
        from .transformer_sequential_feedback import sizes_of

        official_args = {**official_args, **sizes_of(state_dict), "feedback": True}
        official_args.pop("mem_sz", None)
        official_args["adapt_span"] = "layers.0.attn.attn.adaptive_span.mask.size_ratio" in state_dict
    return state_dict, official_args


def read_official_args(path: str | Path) -> dict:
    """main.py's arguments from a JSON file: a dict of argument names and values (the reference data's
    `official_args`), or a dict holding one under "official_args"."""
    return read_arguments_file(path, "main.py")


__all__ = ["convert_config", "convert_state_dict", "read_checkpoint", "read_official_args"]
