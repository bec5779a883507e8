"""Load a flash-linear-attention (FLA) DeltaNet checkpoint into memlm's `DeltaNetForCausalLM`.

An FLA checkpoint directory holds FLA's `config.json` (model_type "delta_net") and safetensors weights. The mapping
follows FLA's `fla/models/delta_net` and `fla/layers/delta_net.py`: SiLU (or ELU+1 / identity) features after a short
convolution, L2- or sum-normalised keys and queries, SiLU values, per-head RMSNorm output (gated by silu(g) when
`use_gate`), queries scaled by d_k^-1/2, a SwiGLU MLP. The conversion is strict: every weight of the checkpoint must
be used and every weight of the model filled, with matching shapes; otherwise a ValueError lists what is wrong.

Command line:  python -m memlm.conversion.flash_linear_attention FLA_DIRECTORY OUTPUT_DIRECTORY
"""

import argparse
import json
import re
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from ..configuration.configuration_deltanet import DeltaNetConfig
from ..modeling.modeling_deltanet import DeltaNetForCausalLM

FLA_MODEL_TYPE = "delta_net"
FLA_FEATURE_MAPS = {"silu": "silu", "elu": "elu+1", "identity": "identity"}
# Per-layer FLA names → memlm names (everything under model.layers.{i}.).
LAYER_RENAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.q_proj.weight": "attention.q_proj.weight",
    "attn.k_proj.weight": "attention.k_proj.weight",
    "attn.v_proj.weight": "attention.v_proj.weight",
    "attn.b_proj.weight": "attention.beta_proj.weight",
    "attn.g_proj.weight": "attention.g_proj.weight",
    "attn.o_norm.weight": "attention.output_norm.weight",
    "attn.o_proj.weight": "attention.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.gate_proj.weight": "mlp.gate_proj.weight",
    "mlp.up_proj.weight": "mlp.up_proj.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
}
CONVOLUTIONS = ("attn.q_conv1d.weight", "attn.k_conv1d.weight", "attn.v_conv1d.weight")


def _positive(fla_config: dict, name: str, default, integer: bool = False):
    """The config's `name` (or `default`), refused in words unless it is a number > 0 (an integer if `integer`)."""
    value = fla_config.get(name, default)
    allowed = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, allowed) or not value > 0:
        kind = "a positive integer" if integer else "a positive number"
        raise ValueError(f"The FLA config's {name} must be {kind}, got {value!r}.")
    return value


def convert_config(fla_config: dict) -> DeltaNetConfig:
    """memlm's DeltaNetConfig (FLA preset) equivalent to an FLA DeltaNet config.json."""
    if not isinstance(fla_config, dict):
        raise ValueError(f"An FLA config.json holds a JSON object, got {type(fla_config).__name__}.")
    model_type = fla_config.get("model_type")
    if model_type != FLA_MODEL_TYPE:
        raise ValueError(
            f"Not a flash-linear-attention DeltaNet config: model_type is {model_type!r}, expected {FLA_MODEL_TYPE!r}."
        )
    if fla_config.get("attn"):
        raise ValueError(
            "The checkpoint mixes softmax-attention layers into DeltaNet (config 'attn' = "
            f"{fla_config['attn']!r}); memlm's DeltaNet has fast-weight layers only."
        )
    if fla_config.get("attnres_block_size") is not None:
        raise ValueError(
            f"attnres_block_size={fla_config['attnres_block_size']!r} (FLA's attention residuals) adds learned "
            "residual mixing that memlm's DeltaNet does not have."
        )
    if fla_config.get("allow_neg_eigval"):
        raise ValueError("allow_neg_eigval=True (β in (0, 2)) is not supported by memlm's DeltaNet.")
    activation = fla_config.get("qk_activation", "silu")
    if activation not in FLA_FEATURE_MAPS:
        raise ValueError(
            f"qk_activation={activation!r} has no memlm feature map; supported: {', '.join(FLA_FEATURE_MAPS)}."
        )
    if fla_config.get("hidden_act", "swish") not in ("swish", "silu"):
        raise ValueError(f"hidden_act={fla_config['hidden_act']!r}: FLA's gated MLP only supports 'swish'.")
    hidden_size = _positive(fla_config, "hidden_size", 2048, integer=True)
    num_heads = _positive(fla_config, "num_heads", 16, integer=True)
    key_width = int(hidden_size * _positive(fla_config, "expand_k", 1.0))
    value_width = int(hidden_size * _positive(fla_config, "expand_v", 1.0))
    if key_width % num_heads or value_width % num_heads:
        raise ValueError(
            f"key width {key_width} and value width {value_width} must be multiples of num_heads {num_heads}."
        )
    intermediate_size = fla_config.get("intermediate_size")
    if intermediate_size is None:
        # FLA's GatedMLP: int(hidden * hidden_ratio * 2/3) rounded up to a multiple of 256.
        ratio = _positive(fla_config, "hidden_ratio", 4) if fla_config.get("hidden_ratio") is not None else 4
        intermediate_size = 256 * ((int(hidden_size * ratio * 2 / 3) + 255) // 256)
    return DeltaNetConfig.from_preset(
        "fla",
        vocab_size=fla_config.get("vocab_size", 32000),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=fla_config.get("num_hidden_layers", 24),
        num_attention_heads=num_heads,
        key_head_dim=key_width // num_heads,
        value_head_dim=value_width // num_heads,
        feature_map=FLA_FEATURE_MAPS[activation],
        query_key_normalization=fla_config.get("qk_norm", "l2"),
        use_beta=fla_config.get("use_beta", True),
        short_convolution=fla_config.get("use_short_conv", True),
        convolution_size=fla_config.get("conv_size", 4),
        output_norm=True,  # FLA always builds o_norm, whatever use_output_norm says
        output_gate=fla_config.get("use_gate", False),
        rms_norm_eps=fla_config.get("norm_eps", 1e-6),
        initializer_range=fla_config.get("initializer_range", 0.02),
        tie_word_embeddings=fla_config.get("tie_word_embeddings", False),
        pad_token_id=fla_config.get("pad_token_id"),
        bos_token_id=fla_config.get("bos_token_id"),
        eos_token_id=fla_config.get("eos_token_id"),
    )


def convert_state_dict(fla_state: dict[str, torch.Tensor], config: DeltaNetConfig) -> dict[str, torch.Tensor]:
    """Rename (and, for the short convolutions and old fused MLPs, reshape) FLA weights to memlm's names."""
    state: dict[str, torch.Tensor] = {}
    remaining = dict(fla_state)

    def take(name: str) -> torch.Tensor:
        if name not in remaining:
            raise ValueError(f"The FLA checkpoint lacks {name!r}, which this configuration needs.")
        return remaining.pop(name)

    state["model.embed_tokens.weight"] = take("model.embeddings.weight")
    state["model.norm.weight"] = take("model.norm.weight")
    if "lm_head.weight" in remaining:
        state["lm_head.weight"] = remaining.pop("lm_head.weight")
    elif not config.tie_word_embeddings:
        raise ValueError("The FLA checkpoint has no 'lm_head.weight' but its config does not tie the embeddings.")
    for index in range(config.num_hidden_layers):
        prefix, target = f"model.layers.{index}.", f"model.layers.{index}."
        layer_keys = {key[len(prefix) :] for key in remaining if key.startswith(prefix)}
        # Older FLA releases fused gate and up into one gate_proj of 2I rows (gate first).
        if "mlp.gate_proj.weight" in layer_keys and "mlp.up_proj.weight" not in layer_keys:
            gate, up = take(prefix + "mlp.gate_proj.weight").chunk(2, dim=0)
            state[target + "mlp.gate_proj.weight"], state[target + "mlp.up_proj.weight"] = gate, up
        # Older FLA releases with norm_first kept the pre-norms inside the mixer and the MLP.
        for legacy, current in (("attn.norm.weight", "attn_norm.weight"), ("mlp.norm.weight", "mlp_norm.weight")):
            if legacy in layer_keys and current not in layer_keys:
                remaining[prefix + current] = remaining.pop(prefix + legacy)
        for name, new_name in LAYER_RENAMES.items():
            if target + new_name in state:
                continue
            if name == "attn.b_proj.weight" and not config.use_beta:
                continue
            if name == "attn.g_proj.weight" and not config.output_gate:
                continue
            state[target + new_name] = take(prefix + name)
        if config.short_convolution:
            state[target + "attention.convolution.weight"] = torch.cat([take(prefix + name) for name in CONVOLUTIONS])
    if remaining:
        raise ValueError(
            f"The FLA checkpoint has weights memlm would not use: {sorted(remaining)[:10]}"
            + (f" and {len(remaining) - 10} more" if len(remaining) > 10 else "")
            + "."
        )
    return state


def _read_weights(directory: Path) -> dict[str, torch.Tensor]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        found = ", ".join(sorted(path.name for path in directory.iterdir())) or "nothing"
        raise ValueError(
            f"No *.safetensors weights in {directory} (found: {found}); memlm never loads pickled (.bin) checkpoints."
        )
    state: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            state.update(load_file(path))
        except SafetensorError as error:
            raise ValueError(f"{path} cannot be read ({error}): damaged or cut short.") from error
    return state


def load_fla_deltanet(directory: str | Path, dtype: torch.dtype | None = None) -> DeltaNetForCausalLM:
    """A `DeltaNetForCausalLM` with the weights of the FLA DeltaNet checkpoint in `directory`."""
    directory = Path(directory)
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{directory} has no config.json; expected a flash-linear-attention checkpoint directory.")
    try:
        fla_config = json.loads(config_file.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{config_file} is not valid JSON ({error}).") from error
    config = convert_config(fla_config)
    state = convert_state_dict(_read_weights(directory), config)
    with torch.device("meta"):
        model = DeltaNetForCausalLM(config)
    expected = model.state_dict()
    problems = [
        f"{name}: checkpoint {tuple(tensor.shape)} vs model {tuple(expected[name].shape)}"
        for name, tensor in state.items()
        if name in expected and tuple(tensor.shape) != tuple(expected[name].shape)
    ]
    unknown = sorted(set(state) - set(expected))
    missing = sorted(name for name in set(expected) - set(state) if not _is_tied(name, config))
    if problems or unknown or missing:
        raise ValueError(
            "The FLA checkpoint does not fit memlm's DeltaNet: "
            + "; ".join(
                problems + [f"unexpected {name}" for name in unknown] + [f"missing {name}" for name in missing]
            )
        )
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.tie_weights()
    if dtype is not None:
        model = model.to(dtype)
    return model.eval()


def _is_tied(name: str, config: DeltaNetConfig) -> bool:
    return config.tie_word_embeddings and name == "lm_head.weight"


def check_destination(source: str | Path, destination: str | Path):
    """Refuses a destination that is the source folder or inside it (symlinks resolved): writing there would replace
    the FLA checkpoint's config.json and weights (and, for a sharded checkpoint, delete its shards while its
    model.safetensors.index.json still names them)."""
    source_folder, destination_folder = Path(source).resolve(), Path(destination).resolve()
    if destination_folder == source_folder or source_folder in destination_folder.parents:
        where = "is the source folder" if destination_folder == source_folder else "is inside the source folder"
        raise ValueError(
            f"the destination {str(destination)!r} {where} {str(source)!r} (resolved: {destination_folder}); "
            "converting there would overwrite the FLA checkpoint. Choose a folder outside it."
        )


def convert(source: str | Path, destination: str | Path):
    """Converts the FLA DeltaNet checkpoint folder `source` into a memlm checkpoint folder `destination`, with the
    tokenizer and generation settings that came with it."""
    source, destination = Path(source), Path(destination)
    check_destination(source, destination)
    model = load_fla_deltanet(source)
    model.save_pretrained(destination)
    for extra in source.iterdir():
        # Keep the tokenizer and generation settings that came with the checkpoint.
        if re.match(r"(tokenizer.*|special_tokens_map\.json|generation_config\.json|.*\.model)$", extra.name):
            (destination / extra.name).write_bytes(extra.read_bytes())


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(
        prog="python -m memlm.conversion.flash_linear_attention",
        description="Convert a flash-linear-attention DeltaNet checkpoint to memlm.",
    )
    parser.add_argument("source", type=Path, help="FLA checkpoint directory (config.json + *.safetensors)")
    parser.add_argument("destination", type=Path, help="where to write the memlm checkpoint (outside the source)")
    arguments = parser.parse_args(argv)
    from ..cli import one_line_errors

    with one_line_errors(parser.prog):
        convert(arguments.source, arguments.destination)


if __name__ == "__main__":
    main()
