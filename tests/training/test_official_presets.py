"""The `memlm train` presets named after the papers' official scripts build the architecture the converters build
from those scripts' flags (the converter is checked against the official code's own numbers in tests/conversion):
same layout, same sizes, same options; only dropout placement and vocabulary are the preset's own."""

import pytest
import torch

from memlm.conversion import lmtool_fwp, transformer_sequential
from memlm.tokenization import byte_level_tokenizer
from memlm.training import pretrain

# Fields that depend on the tokenizer or the run rather than on the architecture.
RUN_FIELDS = {"vocab_size", "bos_token_id", "eos_token_id", "pad_token_id", "transformers_version", "_name_or_path"}


def meta(shape) -> torch.Tensor:
    return torch.empty(shape, device="meta")


def transformer_sequential_state_dict(arguments: dict, vocab: int) -> dict:
    """The names and shapes of an official transformer-sequential state dict (on the meta device: no memory)."""
    hidden, inner, layers = arguments["hid_sz"], arguments["inner_hid_sz"], arguments["nlayers"]
    heads, head_dim = arguments["nheads"], arguments["head_dim"]
    state = {"in_emb.weight": meta((vocab, hidden)), "out.out_emb.weight": meta((vocab, hidden)),
             "out.out_emb.bias": meta((vocab,))}  # fmt: skip
    if arguments["pre_norm"]:
        state |= {"out_norm.weight": meta((hidden,)), "out_norm.bias": meta((hidden,))}
    for layer in range(layers):
        prefix = f"layers.{layer}."
        for name in ("proj_query", "proj_key", "proj_val"):
            state[f"{prefix}attn.{name}.weight"] = meta((heads * head_dim, hidden))
        state[f"{prefix}attn.proj_out.weight"] = meta((hidden, heads * head_dim))
        state |= {f"{prefix}ff.fc1.weight": meta((inner, hidden)), f"{prefix}ff.fc1.bias": meta((inner,)),
                  f"{prefix}ff.fc2.weight": meta((hidden, inner)), f"{prefix}ff.fc2.bias": meta((hidden,))}  # fmt: skip
        for norm in ("norm1", "norm2"):
            state |= {f"{prefix}{norm}.weight": meta((hidden,)), f"{prefix}{norm}.bias": meta((hidden,))}
        if arguments.get("feedback"):
            state[f"{prefix}attn.attn.key_pe"] = meta((1, head_dim, arguments["attn_lim"]))
            if arguments.get("adapt_span"):
                state[f"{prefix}attn.attn.adaptive_span.mask.size_ratio"] = meta((heads, 1, 1))
        else:
            memory = arguments["mem_sz"]
            state[f"{prefix}attn.attn.key_pe"] = meta((1, head_dim, min(arguments["attn_lim"], memory)))
            state[f"{prefix}attn.attn.expire_span.span_predictor.weight"] = meta((1, hidden))
            state[f"{prefix}attn.attn.expire_span.span_predictor.bias"] = meta((1,))
    if arguments.get("feedback"):
        state["single_memory_attn_params"] = meta((1, layers + 1))
    return state


# The scripts' model flags (experiments/*/*.sh), under main.py's argument names.
TRANSFORMER_SEQUENTIAL_SCRIPTS = {
    "transformer-sequential-expire-span-enwik8-small": {
        "hid_sz": 256, "inner_hid_sz": 1024, "mem_sz": 256, "nlayers": 8, "attn_lim": 4096, "nheads": 4,
        "head_dim": 64, "expire_span": True, "expire_span_loss": 1e-6, "expire_span_ramp": 64,
        "expire_span_pre_div": 64, "dropout": 0.0, "pre_norm": False,
    },
    "transformer-sequential-expire-span-object-collision-16k": {
        "hid_sz": 512, "inner_hid_sz": 1024, "mem_sz": 256, "nlayers": 6, "attn_lim": 16384, "nheads": 4,
        "head_dim": 128, "expire_span": True, "expire_span_loss": 2e-6, "expire_span_init_percentage": 0.01,
        "expire_span_ramp": 128, "dropout": 0.1, "pre_norm": True,
    },
    "transformer-sequential-feedback-enwik8": {
        "hid_sz": 512, "inner_hid_sz": 4096, "mem_sz": 128, "nlayers": 12, "attn_lim": 8192, "nheads": 8,
        "head_dim": 128, "feedback": True, "adapt_span": True, "adapt_span_loss": 5e-7, "dropout": 0.5,
        "pre_norm": True,
    },
    "transformer-sequential-feedback-algorithmic-3var": {
        "hid_sz": 256, "inner_hid_sz": 1024, "mem_sz": 64, "nlayers": 4, "attn_lim": 100, "nheads": 4,
        "head_dim": 64, "feedback": True, "dropout": 0.2, "pre_norm": True,
    },
}  # fmt: skip


def preset_config(name: str):
    return pretrain.build_config(pretrain.load_preset(name), byte_level_tokenizer())


def same_architecture(preset, converted) -> None:
    mine, theirs = preset.to_dict(), converted.to_dict()
    different = {
        key: (mine.get(key), theirs.get(key))
        for key in set(mine) | set(theirs)
        if key not in RUN_FIELDS and mine.get(key) != theirs.get(key)
    }
    assert not different, different


@pytest.mark.parametrize("name", sorted(TRANSFORMER_SEQUENTIAL_SCRIPTS))
def test_transformer_sequential_presets_are_the_scripts_architecture(name):
    arguments = TRANSFORMER_SEQUENTIAL_SCRIPTS[name]
    preset = preset_config(name)
    state_dict = transformer_sequential_state_dict(arguments, preset.vocab_size)
    if not arguments.get("feedback"):  # Expire-Span checks the official causal mask's shape
        memory, width = (
            arguments["mem_sz"],
            arguments["attn_lim"] + arguments["mem_sz"] + arguments["expire_span_ramp"],
        )
        mask = torch.ones(memory, width, dtype=torch.bool).tril(diagonal=width - memory - 1)
        for layer in range(arguments["nlayers"]):
            state_dict[f"layers.{layer}.attn.attn.mask_causal"] = mask
    config = transformer_sequential.convert_config if not arguments.get("feedback") else None
    if config is not None:
        converted = config(state_dict, arguments)
    else:
        from memlm.conversion.transformer_sequential_feedback import official_config

        converted = official_config(state_dict, arguments)
    same_architecture(preset, converted)


@pytest.mark.parametrize(
    ("name", "width", "head_dim", "carry_over"),
    [
        ("small-linear-fast-weight-memory", 128, 16, False),
        ("medium-linear-fast-weight-memory", 256, 32, False),
        ("medium-linear-fast-weight-memory-carry-over-context", 256, 32, True),
    ],
)
def test_lmtool_fwp_presets_are_the_scripts_architecture(name, width, head_dim, carry_over):
    preset = preset_config(name)
    vocab = preset.vocab_size
    state_dict = {"word_emb.emb_layers.0.weight": meta((vocab, width)), "crit.out_layers.0.weight": meta((vocab, width)),
                  "crit.out_layers.0.bias": meta((vocab,))}  # fmt: skip
    for layer in range(16):
        prefix = f"layers.{layer}."
        state_dict |= {
            f"{prefix}dec_attn.qkvb_net.weight": meta((8 * (3 * head_dim + 1), width)),
            f"{prefix}dec_attn.o_net.weight": meta((width, 8 * head_dim)),
            f"{prefix}pos_ff.CoreNet.0.weight": meta((2048, width)),
            f"{prefix}pos_ff.CoreNet.0.bias": meta((2048,)),
        }
    flags = {"n_head": 8, "d_head": head_dim, "attn_type": 24, "dropout": 0.1, "no_pos": carry_over,
             "carry_over_fast_weight": carry_over}  # fmt: skip
    same_architecture(preset, lmtool_fwp.convert_config(state_dict, flags))
