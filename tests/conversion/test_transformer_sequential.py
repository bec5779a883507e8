"""The official Expire-Span models of Sukhbaatar et al. (facebookresearch/transformer-sequential) converted into
memlm's Expire-Span give what the official code gave: the reference data in
../shared/official-reference/transformer-sequential (produced by running the official code, float64) — per-position
log-probabilities with the memory carried from block to block, the per-block LM and span losses, and the memories
carried (those memlm keeps are the official ones, and those it has dropped besides are expired)."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from memlm import ExpireSpanForCausalLM
from memlm.conversion.transformer_sequential import convert_state_dict, read_checkpoint, read_official_args
from tests.tolerances import OFFICIAL_FLOAT64

REFERENCE = Path(__file__).resolve().parents[2].parent / "shared" / "official-reference" / "transformer-sequential"
CASES = sorted(path.stem for path in REFERENCE.glob("expire_span_*.json")) if REFERENCE.is_dir() else []
TOLERANCE = OFFICIAL_FLOAT64  # absolute, float64, recorded by the official code elsewhere (tests/tolerances.py)

pytestmark = pytest.mark.skipif(not CASES, reason=f"no reference data in {REFERENCE} (../shared beside the repo)")


def load_case(case: str) -> tuple[dict, dict, dict]:
    meta = json.loads((REFERENCE / f"{case}.json").read_text(encoding="utf-8"))
    tensors = load_file(REFERENCE / f"{case}.safetensors")
    official = {
        name.removeprefix("official."): value for name, value in tensors.items() if name.startswith("official.")
    }
    return meta, tensors, official


def blocks(meta: dict, tensors: dict):
    size = meta["official_args"]["mem_sz"]
    for index in range(tensors["input_ids"].shape[1] // size):
        window = slice(index * size, (index + 1) * size)
        yield index, tensors["input_ids"][:, window], tensors["labels"][:, window]


def converted_model(official: dict, meta: dict) -> ExpireSpanForCausalLM:
    config, state_dict = convert_state_dict(official, meta["official_args"])
    model = ExpireSpanForCausalLM(config).to(torch.float64)
    model.load_state_dict(state_dict, strict=True)
    return model


def official_lm_loss(log_probs: torch.Tensor, labels: torch.Tensor, omitted: list[int] | None) -> torch.Tensor:
    """trainer.py's LM loss of a block: the mean of −log p(label), or with omitted labels the sum over the others
    divided by (their count + 1e-6), a denominator the official code forms in float32."""
    nll = -log_probs.gather(-1, labels[..., None])[..., 0]
    if omitted is None:
        return nll.mean()
    kept = 1 - sum(labels.eq(label) for label in omitted).float()
    return (nll * kept).sum() / (kept.sum() + 1e-6)


@pytest.mark.parametrize("case", CASES)
def test_log_probabilities_and_losses_equal_the_official_code(case):
    meta, tensors, official = load_case(case)
    model = converted_model(official, meta).eval()
    omitted = meta["official_args"]["data_omit_label_idx"]
    cache, log_probs, lm_losses, aux_losses = None, [], [], []
    with torch.no_grad():
        for _, input_ids, labels in blocks(meta, tensors):
            # As users feed memlm: the first block without a cache (the official zero memory), then the cache.
            output = model(input_ids=input_ids, cache=cache, use_cache=True)
            cache = output.cache
            log_probs.append(output.logits.log_softmax(-1))
            lm_losses.append(official_lm_loss(log_probs[-1], labels, omitted))
            aux_losses.append(output.aux_loss)
    log_probs = torch.cat(log_probs, dim=1)
    assert log_probs.dtype == torch.float64
    assert (log_probs - tensors["log_probs"]).abs().max() <= TOLERANCE
    assert (torch.stack(lm_losses) - tensors["loss_lm"]).abs().max() <= TOLERANCE
    # The official span loss (negative: remaining spans on the ramp), relative to its size too.
    aux_losses = torch.stack(aux_losses)
    assert (aux_losses < 0).all()
    assert (aux_losses - tensors["loss_aux"]).abs().max() <= 1e-9 * tensors["loss_aux"].abs().max()


@pytest.mark.parametrize("case", CASES)
def test_the_carried_memories_are_the_official_ones_less_expired_ones(case):
    """The official model drops expired memories only in multiples of mem_sz, the same number in every row; memlm
    drops each row's expired ones. What memlm keeps must be official memories (the same keys), and what it has dropped
    besides must be expired for every later query."""
    meta, tensors, official = load_case(case)
    model = converted_model(official, meta).eval()
    config = model.config
    size = config.block_size
    cache, dropped_by_official, dropped_by_memlm = None, False, False
    with torch.no_grad():
        for index, input_ids, _ in blocks(meta, tensors):
            cache = model(input_ids=input_ids, cache=cache, use_cache=True).cache
            next_first = (index + 1) * size  # the next block's first position
            for layer, decoder_layer in enumerate(model.model.layers):
                memory = cache.layers[layer].memory
                hidden = tensors[f"carried.{index}.hidden.{layer}"]
                positions = next_first - tensors[f"carried.{index}.counter.{layer}"].round().long()
                attention = decoder_layer.attention
                attention_input = decoder_layer.input_layernorm(hidden) if config.norm_position == "pre" else hidden
                _, keys, _ = attention.project(attention_input, None, None)
                spans = attention.predict_spans(attention_input)
                for row in range(hidden.shape[0]):
                    ours = memory.positions[row][memory.valid[row]]
                    same = positions[row][:, None] == ours[None]  # (official, memlm) pairs of one position
                    common, only_official = same.any(1), ~same.any(1)
                    only_ours = ~same.any(0)
                    # The memories both keep are the same (keys from the official hidden states).
                    ours_keys = memory.keys[row][:, memory.valid[row]][:, ~only_ours]
                    assert (ours_keys - keys[row][:, common]).abs().max() <= TOLERANCE
                    # Either side's extra memories are expired for the next query: m = 0 ⇔ i + e_i + R <= t (paper
                    # Eq. 5), and m only falls as t grows. (memlm deletes a layer's expired memories as the next
                    # block starts; the official model in multiples of mem_sz, the same number in every row.)
                    expiry = positions[row][only_official] + spans[row][only_official] + config.ramp
                    assert (expiry <= next_first).all()
                    our_spans = memory.spans[row][memory.valid[row]]
                    assert (ours[only_ours] + our_spans[only_ours] + config.ramp <= next_first).all()
                    dropped_by_official |= bool(only_ours.any())
                    dropped_by_memlm |= bool(only_official.any())
    # Both kinds of difference occur in the data, so neither check above is empty.
    assert dropped_by_official and dropped_by_memlm


@pytest.mark.parametrize("case", CASES)
def test_a_checkpoint_file_as_the_official_trainer_writes_it_converts_and_saves(case, tmp_path):
    meta, tensors, official = load_case(case)
    # utils/checkpoint.py save(): the DistributedDataParallel model's state dict (names under `module.`) and more.
    checkpoint = {
        "epoch": 3,
        "model": {f"module.{name}": value for name, value in official.items()},
        "logger": {"loss": {"data": [4.2, 4.1], "type": "line"}},
        "optimizer": {"state": {}, "param_groups": [{"lr": 0.0003, "params": [0, 1]}]},
        "scheduler_epoch": 3,
    }
    torch.save(checkpoint, tmp_path / "checkpoint.pt")
    state_dict, found = read_checkpoint(tmp_path / "checkpoint.pt")
    assert set(state_dict) == set(official)
    arguments = meta["official_args"]
    for name in ("vocab_sz", "hid_sz", "nlayers", "inner_hid_sz", "mem_sz", "pre_norm", "expire_span"):
        assert found[name] == arguments[name], name
    (tmp_path / "args.json").write_text(json.dumps(meta), encoding="utf-8")
    config, converted = convert_state_dict(state_dict, {**found, **read_official_args(tmp_path / "args.json")})
    model = ExpireSpanForCausalLM(config).to(torch.float64).eval()
    model.load_state_dict(converted, strict=True)
    model.save_pretrained(tmp_path / "converted")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "converted", dtype=torch.float64).eval()
    assert type(loaded) is ExpireSpanForCausalLM
    input_ids = tensors["input_ids"][:, : 2 * config.block_size]
    with torch.no_grad():
        first = model(input_ids=input_ids[:, : config.block_size], use_cache=True)
        again = loaded(input_ids=input_ids[:, : config.block_size], use_cache=True)
        second = loaded(input_ids=input_ids[:, config.block_size :], cache=again.cache, use_cache=True)
    assert torch.equal(first.logits, again.logits)
    expected = tensors["log_probs"][:, : 2 * config.block_size]
    log_probs = torch.cat([again.logits, second.logits], dim=1).log_softmax(-1)
    assert (log_probs - expected).abs().max() <= TOLERANCE


def test_what_memlm_cannot_express_is_refused_naming_the_flag():
    meta, _, official = load_case(CASES[0])
    arguments = meta["official_args"]
    for changes, flag in (
        ({"feedback": True}, "--feedback"),
        ({"compress": True}, "--compress"),
        ({"staircase": True}, "--staircase"),
        ({"adapt_span": True}, "--adapt-span"),
    ):
        with pytest.raises(NotImplementedError, match=f"transformer-sequential `{flag}`.*memlm cannot express it"):
            convert_state_dict(official, {**arguments, **changes})
    with pytest.raises(NotImplementedError, match="no place for: extra.weight"):
        convert_state_dict({**official, "extra.weight": torch.zeros(1)}, arguments)


def test_the_training_regularisers_map_onto_their_options():
    meta, _, official = load_case(CASES[0])
    config, _ = convert_state_dict(official, {**meta["official_args"], "expire_span_noisy": True})
    assert config.noisy_spans and config.layer_drop == 0
    config, _ = convert_state_dict(official, {**meta["official_args"], "expire_span_layerdrop": 0.2, "dropout": 0.1})
    assert config.layer_drop == 0.2 and not config.noisy_spans
    assert config.attention_dropout == config.activation_dropout == 0.1 and config.hidden_dropout == 0


def test_arguments_that_do_not_fit_the_state_dict_are_refused():
    meta, _, official = load_case(CASES[0])
    arguments = meta["official_args"]
    with pytest.raises(ValueError, match=r"nheads=3 and head_dim=12 do not fit the state dict"):
        convert_state_dict(official, {**arguments, "nheads": 3, "head_dim": 12})
    with pytest.raises(ValueError, match=r"attn_lim=.* and expire_span_ramp=1 do not fit the state dict"):
        convert_state_dict(official, {**arguments, "expire_span_ramp": 1})
    with pytest.raises(ValueError, match=r"hid_sz=7 does not fit the state dict"):
        convert_state_dict(official, {**arguments, "hid_sz": 7})
    with pytest.raises(ValueError, match=r"pre_norm=.* does not fit the state dict"):
        convert_state_dict(official, {**arguments, "pre_norm": not arguments["pre_norm"]})
    shifted = dict(official)
    shifted["layers.1.attn.attn.key_pe"] = official["layers.1.attn.attn.key_pe"] + 1
    with pytest.raises(ValueError, match="key_pe differs from layers.0's"):
        convert_state_dict(shifted, arguments)


def test_the_conversion_is_differentiable_back_to_the_official_names():
    """torch operations only: a gradient on the converted tensors reaches the official leaves (the shared key_pe
    through layers.0's name, as the official parameter)."""
    meta, _, official = load_case(CASES[0])
    leaves = {name: value.clone().requires_grad_(value.is_floating_point()) for name, value in official.items()}
    for other, first in meta["tied_parameters"].items():
        leaves[other] = leaves[first]
    _, converted = convert_state_dict(leaves, meta["official_args"])
    sum(tensor.sum() * (index + 1) for index, tensor in enumerate(converted.values())).backward()
    for name in meta["parameters"]:
        assert leaves[name].grad is not None and leaves[name].grad.abs().sum() > 0, name


@pytest.mark.parametrize("case", CASES)
def test_gradients_of_the_training_blocks_map_back_onto_the_official_names(case):
    """Training as the official trainer: per block forward, loss_lm + loss_aux, backward (gradients accumulate), the
    memory carried detached; with `recompute_memory` (set by the converter) each block recomputes the carried
    memories' keys, values and spans from their hidden states with the current weights, as the official model."""
    meta, tensors, official = load_case(case)
    # Leaves under the official names; a tied parameter is one leaf under each of its names.
    leaves = {name: value.clone().requires_grad_(value.is_floating_point()) for name, value in official.items()}
    for other, first in meta["tied_parameters"].items():
        leaves[other] = leaves[first]
    config, state_dict = convert_state_dict(leaves, meta["official_args"])
    assert config.recompute_memory
    model = ExpireSpanForCausalLM(config).to(torch.float64).train()  # dropout 0, as the reference
    omitted = meta["official_args"]["data_omit_label_idx"]
    trained = len(tensors["train.loss_lm"])
    cache, lm_losses, aux_losses = None, [], []
    for index, input_ids, labels in blocks(meta, tensors):
        if index == trained:
            break
        output = torch.func.functional_call(
            model, state_dict, args=(), kwargs={"input_ids": input_ids, "cache": cache, "use_cache": True}
        )
        lm_loss = official_lm_loss(output.logits.log_softmax(-1), labels, omitted)
        (lm_loss + output.aux_loss).backward()
        cache = output.cache  # its memories carry no gradient to earlier blocks (the official detach)
        lm_losses.append(lm_loss.detach())
        aux_losses.append(output.aux_loss.detach())
    assert (torch.stack(lm_losses) - tensors["train.loss_lm"]).abs().max() <= TOLERANCE
    assert (torch.stack(aux_losses) - tensors["train.loss_aux"]).abs().max() <= 1e-9 * tensors["loss_aux"].abs().max()
    gradients = {name.removeprefix("grad."): value for name, value in tensors.items() if name.startswith("grad.")}
    assert set(gradients) == set(meta["parameters"])
    for name, expected in gradients.items():
        error = (leaves[name].grad - expected).abs().max().item()
        assert error <= TOLERANCE, f"{name}: {error:.3g}"
