"""Convert the fast-weight language models of the official code of Schlag, Irie & Schmidhuber (2021),
IDSIA/lmtool-fwp (`src/model_main.py` `MemTransformerLM`, built by `src/train.py`), into memlm's DeltaNet.

The official model is a Transformer-XL code base: post-norm blocks with LayerNorm (eps 1e-5), a plain biased ReLU
feed-forward, word embeddings scaled by √d_model, sinusoidal positions counting down within each segment (unless
`--no_pos`), the fast-weight layer's output scaled by 1/√d_head before its output projection (no bias), and a biased
output layer (tied to the embedding unless `--not_tied`). Its fast-weight layers (`--attn_type`):

- 24: delta rule, φ = ELU+1, φ(k) and φ(q) sum-normalised (paper Eqs. 23-25, 29-30);
- 26: the same with DPFP-ν (ν = `--dpfp_n_roll`, paper Eq. 37);
- 34: the sum rule (linear attention, Eqs. 17-19) with ELU+1 and no sum normalisation, no β;

each with the attention normaliser (Eqs. 26-28: the output divided by z_tᵀφ(q_t) + 1e-5) unless
`--skip_attn_normalization`. Feeding: with `--carry_over_fast_weight` the fast weights (and the normaliser's key
sum) pass from segment to segment — memlm's cache, `model(input_ids=segment, cache=cache, use_cache=True)`;
without it every segment starts from zero fast weights — call the model with `cache=None` for each segment.

`convert_state_dict(state_dict, official_args)` maps an official state dict (official names) and the official
`train.py` arguments to a `DeltaNetConfig` and a memlm state dict, with torch operations only (views and slices), so
that gradients flow back onto the official tensors. What memlm cannot express raises NotImplementedError naming the
official flag.

Command line:  memlm convert lmtool-fwp CHECKPOINT OUT --official-args ARGS.json
"""

import math
from pathlib import Path

import torch

from ..configuration.configuration_deltanet import LMTOOL_FWP_LAYOUT, DeltaNetConfig
from .official_arguments import read_arguments_file

# train.py's defaults (its argparse parser) for the arguments the conversion reads.
OFFICIAL_DEFAULTS = {
    "n_head": 10,
    "d_head": 50,
    "d_embed": -1,
    "d_res": None,
    "dropout": 0.0,
    "dropatt": 0.0,
    "mem_len": 0,
    "div_val": 1,
    "attn_type": 0,
    "clamp_len": -1,
    "sample_softmax": -1,
    "dpfp_n_roll": 2,
    "fast_net_depth": 1,
    "adaptive": False,
    "not_tied": False,
    "pre_lnorm": False,
    "no_pos": False,
    "skip_attn_normalization": False,
    "carry_over_fast_weight": False,
    "remove_ff": False,
    "remove_lnorm": False,
    "remove_res": False,
    "remove_out_proj": False,
    "use_slow_base_weights": False,
}
# attn_type → (feature map, update rule, whether φ(k), φ(q) are sum-normalised, whether β is learned).
ATTENTION_TYPES = {
    24: ("elu+1", "delta", True, True),
    26: ("dpfp", "delta", True, True),
    34: ("elu+1", "sum", False, False),
}
OTHER_ATTENTION_TYPES = {
    0: "Transformer-XL softmax attention with relative positions",
    2: "softmax attention",
    4: "linear attention (causal product)",
    5: "Performer attention",
    6: "DPFP linear attention (causal product)",
    25: "delta rule with FAVOR+ (a random projection redrawn per forward; memlm's favor+ draws its own)",
    35: "sum rule with FAVOR+ (a random projection redrawn per forward; memlm's favor+ draws its own)",
    44: "delta rule with the attention normaliser inside the update (key divided by z_{t-1}ᵀk_t)",
    45: "FAVOR+ delta rule with the attention normaliser inside the update",
    46: "DPFP delta rule with the attention normaliser inside the update (key divided by z_{t-1}ᵀk_t)",
}
# train.py's adaptive softmax cutoffs per dataset (`--adaptive`).
DATASET_CUTOFFS = {"wt103": [20000, 40000, 200000], "lm1b": [60000, 100000, 640000]}


def _refuse(flag: str, value, why: str):
    raise NotImplementedError(f"lmtool-fwp `--{flag} {value}`: {why}; memlm cannot express it.")


def official_arguments(official_args: dict) -> dict:
    """The official arguments the conversion reads, train.py's defaults filled in for the missing ones."""
    if not isinstance(official_args, dict):
        raise ValueError(f"official_args must be a dict of train.py's argument names, got {type(official_args)}.")
    return {**OFFICIAL_DEFAULTS, **official_args}


def convert_config(state_dict: dict, official_args: dict) -> DeltaNetConfig:
    """The DeltaNetConfig of the official model (sizes read from the state dict where they are there)."""
    args = official_arguments(official_args)
    attn_type = args["attn_type"]
    if attn_type not in ATTENTION_TYPES:
        what = OTHER_ATTENTION_TYPES.get(attn_type, "not a fast-weight layer memlm knows")
        _refuse("attn_type", attn_type, f"{what}; memlm converts attn_type 24, 26 and 34")
    for flag, why in (
        ("pre_lnorm", "Transformer-XL's pre-norm, whose fast-weight layers add their output to the *normed* input"),
        ("remove_ff", "blocks without feed-forward"),
        ("remove_lnorm", "blocks without LayerNorm"),
        ("remove_res", "blocks without residual connections"),
        ("remove_out_proj", "layers without output projection"),
        ("use_slow_base_weights", "slow base weights beside the fast weights"),
    ):
        if args[flag]:
            _refuse(flag, "(set)", why)
    for flag, default, why in (
        ("div_val", 1, "embeddings of several widths"),
        ("clamp_len", -1, "positions clamped to a maximum"),
        ("sample_softmax", -1, "a sampled softmax"),
        ("fast_net_depth", 1, "deep fast networks"),
        ("mem_len", 0, "a Transformer-XL memory of hidden states (the fast-weight layers refuse it too)"),
        ("d_res", None, "a residual width other than d_model"),
    ):
        if args[flag] != default and not (flag == "clamp_len" and args[flag] <= 0):
            _refuse(flag, args[flag], why)
    feature_map, update_rule, sum_normalised, use_beta = ATTENTION_TYPES[attn_type]
    dpfp_nu = args["dpfp_n_roll"]
    if feature_map == "dpfp" and dpfp_nu not in (1, 2, 3):
        _refuse("dpfp_n_roll", dpfp_nu, "memlm's DPFP takes ν = 1, 2 or 3")

    embedding = _tensor(state_dict, "word_emb.emb_layers.0.weight")
    vocab_size, hidden_size = embedding.shape
    if args["d_embed"] not in (-1, None, hidden_size) or "word_emb.emb_projs.0" in state_dict:
        _refuse("d_embed", args["d_embed"], "an embedding width other than d_model (projected embeddings)")
    layers = sorted({int(name.split(".")[1]) for name in state_dict if name.startswith("layers.")})
    if layers != list(range(len(layers))) or not layers:
        raise ValueError(f"The official state dict's layers are numbered {layers}; expected 0, 1, ..., n_layer-1.")
    output = _tensor(state_dict, "layers.0.dec_attn.o_net.weight")
    heads, head_dim = args["n_head"], args["d_head"]
    if output.shape[1] != heads * head_dim:
        raise ValueError(
            f"official_args n_head={heads} and d_head={head_dim} do not fit the state dict: "
            f"layers.0.dec_attn.o_net.weight has {output.shape[1]} = n_head·d_head input features."
        )
    intermediate_size = _tensor(state_dict, "layers.0.pos_ff.CoreNet.0.weight").shape[0]
    cutoffs = _adaptive_cutoffs(state_dict, args, vocab_size) if args["adaptive"] else None
    dropout = args["dropout"]
    fields = {
        **LMTOOL_FWP_LAYOUT,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": len(layers),
        "num_attention_heads": heads,
        "key_head_dim": head_dim,
        "value_head_dim": head_dim,
        "feature_map": feature_map,
        "dpfp_nu": dpfp_nu if feature_map == "dpfp" else 1,
        "query_key_normalization": "sum" if sum_normalised else "none",
        "update_rule": update_rule,
        "use_beta": use_beta,
        "attention_normalizer": not args["skip_attn_normalization"],
        "position_encoding": "none" if args["no_pos"] else "sinusoidal",
        "embedding_scale": math.sqrt(hidden_size),
        "tie_word_embeddings": not args["not_tied"],
        "adaptive_softmax_cutoffs": cutoffs,
        **dict.fromkeys(("hidden_dropout", "embedding_dropout", "activation_dropout", "output_dropout"), dropout),
    }
    return DeltaNetConfig(**fields)


def _adaptive_cutoffs(state_dict: dict, args: dict, vocab_size: int) -> list[int]:
    """The adaptive softmax's cutoffs: `official_args["cutoffs"]`, else what train.py sets for the dataset."""
    cutoffs = args.get("cutoffs")
    if cutoffs is None:
        cutoffs = DATASET_CUTOFFS.get(args.get("dataset"))
        if cutoffs is None or cutoffs[-1] >= vocab_size:
            raise ValueError(
                f"--adaptive: train.py's cutoffs for dataset {args.get('dataset')!r} are {cutoffs}, which do not "
                f"fit this vocabulary of {vocab_size} tokens; give the cutoffs as official_args['cutoffs']."
            )
    cutoffs = list(cutoffs)
    clusters = _tensor(state_dict, "crit.cluster_weight").shape[0]
    if clusters != len(cutoffs):
        raise ValueError(f"--adaptive: {len(cutoffs)} cutoffs {cutoffs} but crit.cluster_weight has {clusters} rows.")
    if any(name.startswith(("crit.out_projs.", "word_emb.emb_projs.")) for name in state_dict):
        _refuse("d_embed", args["d_embed"], "projected adaptive embeddings and softmax (d_embed != d_model)")
    return cutoffs


def _tensor(state_dict: dict, name: str) -> torch.Tensor:
    if name not in state_dict:
        raise ValueError(f"The official state dict has no {name!r}; is it an lmtool-fwp MemTransformerLM state dict?")
    return state_dict[name]


def convert_state_dict(state_dict: dict, official_args: dict) -> tuple[DeltaNetConfig, dict]:
    """(config, memlm state dict) of the official model with `state_dict` (official names, tied parameters under
    each of their names) and `official_args` (train.py's argument names and values). Every official tensor is used
    (the positions' `inv_freq` is recomputed by memlm); torch operations only, so gradients flow back."""
    config = convert_config(state_dict, official_args)
    heads, head_dim = config.num_attention_heads, config.key_head_dim
    converted = {"model.embed_tokens.weight": state_dict["word_emb.emb_layers.0.weight"]}
    output_weight = "word_emb.emb_layers.0.weight" if config.tie_word_embeddings else "crit.out_layers.0.weight"
    converted["lm_head.weight"] = _tensor(state_dict, output_weight)
    converted["lm_head.bias"] = _tensor(state_dict, "crit.out_layers.0.bias")
    used = {"word_emb.emb_layers.0.weight", "crit.out_layers.0.weight", "crit.out_layers.0.bias", "pos_emb.inv_freq"}
    if config.adaptive_softmax_cutoffs:
        converted["lm_head.cluster_weight"] = _tensor(state_dict, "crit.cluster_weight")
        converted["lm_head.cluster_bias"] = _tensor(state_dict, "crit.cluster_bias")
        used |= {"crit.cluster_weight", "crit.cluster_bias"}
    for layer in range(config.num_hidden_layers):
        official, memlm = f"layers.{layer}.", f"model.layers.{layer}."
        # The projection's rows, per head: [q (d_head), k (d_head), v (d_head), β (1, delta rule only)].
        name = official + ("dec_attn.qkvb_net.weight" if config.use_beta else "dec_attn.qkv_net.weight")
        rows = 3 * head_dim + (1 if config.use_beta else 0)
        projection = _tensor(state_dict, name)
        if projection.shape[0] != heads * rows:
            raise ValueError(f"{name} has {projection.shape[0]} rows; n_head·({rows}) = {heads * rows} expected.")
        per_head = projection.view(heads, rows, -1)
        for index, target in enumerate(("q_proj", "k_proj", "v_proj")):
            part = per_head[:, index * head_dim : (index + 1) * head_dim]
            converted[f"{memlm}attention.{target}.weight"] = part.reshape(heads * head_dim, -1)
        if config.use_beta:
            converted[f"{memlm}attention.beta_proj.weight"] = per_head[:, 3 * head_dim]
        renames = {
            "dec_attn.o_net.weight": "attention.o_proj.weight",
            "dec_attn.layer_norm.weight": "input_layernorm.weight",
            "dec_attn.layer_norm.bias": "input_layernorm.bias",
            "pos_ff.CoreNet.0.weight": "mlp.up_proj.weight",
            "pos_ff.CoreNet.0.bias": "mlp.up_proj.bias",
            "pos_ff.CoreNet.3.weight": "mlp.down_proj.weight",
            "pos_ff.CoreNet.3.bias": "mlp.down_proj.bias",
            "pos_ff.layer_norm.weight": "post_attention_layernorm.weight",
            "pos_ff.layer_norm.bias": "post_attention_layernorm.bias",
        }
        for source, target in renames.items():
            converted[memlm + target] = _tensor(state_dict, official + source)
        used |= {name} | {official + source for source in renames}
    unused = sorted(set(state_dict) - used)
    if unused:
        raise NotImplementedError(
            f"The official state dict holds tensors memlm's DeltaNet has no place for: {', '.join(unused[:8])}"
            + (" ..." if len(unused) > 8 else "")
        )
    return config, converted


def read_checkpoint(path: str | Path) -> dict:
    """An official state dict from `path`, read with `torch.load(weights_only=True)` (nothing is unpickled beyond
    tensors and plain containers). train.py saves the whole pickled `MemTransformerLM` (best_model.pt), which only
    the official code can load: save its `state_dict()` there first."""
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as error:  # an unpickling error for a whole-model file
        raise ValueError(
            f"{path} cannot be read as a state dict with torch.load(weights_only=True) ({type(error).__name__}). "
            "lmtool-fwp's train.py saves the whole pickled model (best_model.pt); in the official environment run "
            "`torch.save(torch.load('best_model.pt').state_dict(), 'state_dict.pt')` and convert that file."
        ) from error
    if isinstance(loaded, dict) and isinstance(loaded.get("model_state_dict"), dict):
        loaded = loaded["model_state_dict"]
    if not isinstance(loaded, dict) or not all(torch.is_tensor(value) for value in loaded.values()):
        raise ValueError(f"{path} does not hold a state dict (a dict of names to tensors).")
    return loaded


def read_official_args(path: str | Path) -> dict:
    """train.py's arguments from a JSON file: a dict of argument names and values (the reference data's
    `official_args`), or a dict holding one under "official_args"."""
    return read_arguments_file(path, "train.py")


__all__ = ["convert_config", "convert_state_dict", "read_checkpoint", "read_official_args"]
