"""The official fast-weight models of Schlag et al. (IDSIA/lmtool-fwp) converted into memlm's DeltaNet give what the
official code gave: the reference data in ../shared/official-reference/lmtool-fwp (produced by running the official
code, float64) — per-position log-probabilities with fast weights carried or not, segment losses, the carried fast
weights and key sums, and the gradients of two training segments mapped back onto the official names through
`convert_state_dict`."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from memlm import DeltaNetForCausalLM
from memlm.conversion.lmtool_fwp import convert_state_dict
from tests.tolerances import OFFICIAL_FLOAT64

REFERENCE = Path(__file__).resolve().parents[2].parent / "shared" / "official-reference" / "lmtool-fwp"
CASES = sorted(path.stem for path in REFERENCE.glob("*.json")) if REFERENCE.is_dir() else []
TOLERANCE = OFFICIAL_FLOAT64  # absolute, float64, recorded by the official code elsewhere (tests/tolerances.py)

pytestmark = pytest.mark.skipif(not CASES, reason=f"no reference data in {REFERENCE} (../shared beside the repo)")


def load_case(case: str) -> tuple[dict, dict, dict]:
    meta = json.loads((REFERENCE / f"{case}.json").read_text(encoding="utf-8"))
    tensors = load_file(REFERENCE / f"{case}.safetensors")
    official = {
        name.removeprefix("official."): value for name, value in tensors.items() if name.startswith("official.")
    }
    return meta, tensors, official


def segments(meta: dict, tensors: dict):
    length = meta["shape"]["segment_length"]
    for index in range(meta["shape"]["segments"]):
        window = slice(index * length, (index + 1) * length)
        yield index, tensors["input_ids"][:, window], tensors["labels"][:, window]


def official_args(meta: dict) -> dict:
    """The official arguments, with the adaptive softmax's cutoffs, which train.py derives from the dataset (the
    reference scales them down to its vocabulary: the json's `constructor`)."""
    cutoffs = meta["constructor"]["cutoffs"]
    return {**meta["official_args"], **({"cutoffs": cutoffs} if cutoffs else {})}


def converted_model(official: dict, meta: dict) -> DeltaNetForCausalLM:
    config, state_dict = convert_state_dict(official, official_args(meta))
    model = DeltaNetForCausalLM(config).to(torch.float64)
    model.load_state_dict(state_dict, strict=True)
    return model


def adaptive(case: str) -> bool:
    return json.loads((REFERENCE / f"{case}.json").read_text(encoding="utf-8"))["official_args"]["adaptive"]


@pytest.mark.parametrize("case", CASES)
def test_log_probabilities_losses_and_carried_memory_equal_the_official_code(case):
    meta, tensors, official = load_case(case)
    model = converted_model(official, meta).eval()
    carry = meta["official_args"]["carry_over_fast_weight"]
    cache, log_probs, losses = None, [], []
    with torch.no_grad():
        for index, input_ids, labels in segments(meta, tensors):
            # As users feed memlm: the cache of the previous segment, or (no carry-over) a fresh memory each segment.
            output = model(input_ids=input_ids, cache=cache if carry else None, use_cache=True)
            cache = output.cache
            log_probs.append(output.logits.log_softmax(-1))
            losses.append(-log_probs[-1].gather(-1, labels[..., None]).mean())
            if carry:
                for layer, memory in enumerate(cache.layers):
                    prefix = f"carried.layer{layer}."
                    fast_weights = tensors[f"{prefix}fast_weight.after_segment{index}"]
                    assert (memory.fast_weights - fast_weights).abs().max() <= TOLERANCE
                    if model.config.attention_normalizer:
                        key_sum = tensors[f"{prefix}key_accumulator.after_segment{index}"][:, :, 0]
                        assert (memory.key_sum - key_sum).abs().max() <= TOLERANCE
    log_probs = torch.cat(log_probs, dim=1)
    assert (log_probs - tensors["log_probs"]).abs().max() <= TOLERANCE
    nll = -log_probs.gather(-1, tensors["labels"][..., None])[..., 0]
    assert (nll - tensors["nll"]).abs().max() <= TOLERANCE
    assert (torch.stack(losses) - tensors["segment_losses"]).abs().max() <= TOLERANCE


@pytest.mark.parametrize("case", CASES)
def test_gradients_of_two_training_segments_map_back_onto_the_official_names(case):
    meta, tensors, official = load_case(case)
    # Leaves under the official names; a tied parameter is one leaf under each of its names.
    leaves = {name: value.clone().requires_grad_(True) for name, value in official.items()}
    for first, *others in meta["tied_parameters"]:
        for other in others:
            leaves[other] = leaves[first]
    config, state_dict = convert_state_dict(leaves, official_args(meta))
    model = DeltaNetForCausalLM(config).to(torch.float64).train()  # dropout 0, as the reference
    carry = meta["official_args"]["carry_over_fast_weight"]
    cache, losses = None, []
    for index, input_ids, labels in segments(meta, tensors):
        if index == len(tensors["train_segment_losses"]):
            break
        output = torch.func.functional_call(
            model, state_dict, args=(), kwargs={"input_ids": input_ids, "cache": cache, "use_cache": carry}
        )
        nll = -output.logits.log_softmax(-1).gather(-1, labels[..., None])[..., 0].T.contiguous()  # (M, B)
        loss = nll.float().mean().type_as(nll)  # train.py's loss: the mean taken in float32, time-major
        loss.backward()  # per segment, as train.py; the carried memory is detached, as the official code does
        losses.append(loss.detach())
        if carry:
            cache = output.cache
            for memory in cache.layers:
                memory.map(torch.Tensor.detach)
    assert (torch.stack(losses) - tensors["train_segment_losses"]).abs().max() <= TOLERANCE
    gradients = {name.removeprefix("grad."): value for name, value in tensors.items() if name.startswith("grad.")}
    assert gradients
    for name, expected in gradients.items():
        error = (leaves[name].grad - expected).abs().max().item()
        assert error <= TOLERANCE, f"{name}: {error:.3g}"


@pytest.mark.parametrize("case", [case for case in CASES if adaptive(case)])
def test_the_adaptive_softmax_takes_its_cutoffs_from_the_dataset_or_the_arguments(case):
    meta, tensors, official = load_case(case)
    # train.py's wt103 cutoffs do not fit the reference's 64 tokens: the converter says so instead of guessing.
    with pytest.raises(ValueError, match=r"cutoffs for dataset 'wt103' are \[20000, 40000, 200000\]"):
        convert_state_dict(official, meta["official_args"])
    model = converted_model(official, meta).eval()
    assert model.config.adaptive_softmax_cutoffs == meta["constructor"]["cutoffs"]
    with torch.no_grad():
        logits = model(input_ids=tensors["input_ids"][:, :16]).logits
    # The logits are the log-probabilities: they normalise, and generate()/the loss take them as they are.
    torch.testing.assert_close(logits.exp().sum(-1), torch.ones(logits.shape[:2], dtype=torch.float64))
    with pytest.raises(ValueError, match="adaptive softmax with cutoffs"):
        model.resize_token_embeddings(80)


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        ({"attn_type": 44}, "--attn_type 44"),
        ({"attn_type": 0}, "--attn_type 0"),
        ({"pre_lnorm": True}, "--pre_lnorm"),
        ({"dpfp_n_roll": 4, "attn_type": 26}, "--dpfp_n_roll 4"),
        ({"clamp_len": 100}, "--clamp_len 100"),
        ({"div_val": 4}, "--div_val 4"),
        ({"remove_ff": True}, "--remove_ff"),
        ({"mem_len": 32}, "--mem_len 32"),
    ],
)
def test_what_memlm_cannot_express_is_refused_naming_the_official_flag(flags, named):
    meta, _, official = load_case("D2_small_script_as_written")
    with pytest.raises(NotImplementedError, match=named):
        convert_state_dict(official, {**meta["official_args"], **flags})


def test_a_state_dict_that_does_not_fit_the_arguments_is_refused():
    meta, _, official = load_case("D2_small_script_as_written")
    with pytest.raises(ValueError, match="n_head=4 and d_head=16 do not fit"):
        convert_state_dict(official, {**meta["official_args"], "n_head": 4})
    with pytest.raises(NotImplementedError, match="no place for: extra.weight"):
        convert_state_dict({**official, "extra.weight": torch.zeros(1)}, meta["official_args"])


def memlm_command(*arguments: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "memlm.cli", *arguments], cwd=cwd, capture_output=True, text=True, timeout=300
    )


def test_memlm_convert_writes_a_folder_the_auto_classes_load_with_the_official_log_probabilities(tmp_path):
    case = "D3_carry_over_script_as_written"
    meta, tensors, official = load_case(case)
    torch.save(official, tmp_path / "state_dict.pt")  # what the official model's state_dict() gives
    (tmp_path / "args.json").write_text(json.dumps(meta["official_args"]), encoding="utf-8")
    result = memlm_command(
        "convert", "lmtool-fwp", "state_dict.pt", "converted", "--official-args", "args.json", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "converted" / "model.safetensors").is_file()
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "converted").eval()
    assert model.dtype == torch.float64 and model.config.position_encoding == "none"
    cache, log_probs = None, []
    with torch.no_grad():
        for _, input_ids, _ in segments(meta, tensors):
            output = model(input_ids=input_ids, cache=cache, use_cache=True)
            cache = output.cache
            log_probs.append(output.logits.log_softmax(-1))
    assert (torch.cat(log_probs, 1) - tensors["log_probs"]).abs().max() <= TOLERANCE


class WholeModel(torch.nn.Module):
    """Stands for train.py's best_model.pt: a pickled module, which weights_only loading refuses."""


def test_memlm_convert_refuses_in_words(tmp_path):
    meta, _, official = load_case("D2_small_script_as_written")
    torch.save(official, tmp_path / "state_dict.pt")
    (tmp_path / "args.json").write_text(json.dumps({**meta["official_args"], "pre_lnorm": True}), encoding="utf-8")
    refused = memlm_command(
        "convert", "lmtool-fwp", "state_dict.pt", "out", "--official-args", "args.json", cwd=tmp_path
    )
    assert refused.returncode == 1 and "--pre_lnorm" in refused.stderr and "Traceback" not in refused.stderr
    assert not (tmp_path / "out").exists()
    no_args = memlm_command("convert", "lmtool-fwp", "state_dict.pt", "out", cwd=tmp_path)
    assert no_args.returncode == 1 and "--official-args" in no_args.stderr
    torch.save(WholeModel(), tmp_path / "best_model.pt")
    pickled = memlm_command(
        "convert", "lmtool-fwp", "best_model.pt", "out", "--official-args", "args.json", cwd=tmp_path
    )
    assert pickled.returncode == 1 and "state_dict()" in pickled.stderr
