"""`memlm export onnx` (issue 41): DeltaNet and the Feedback Transformer as two ONNX graphs over an explicit memory,
run by ONNX Runtime — greedy decoding gives the tokens and the logits of eager PyTorch, for memlm's default layouts
and the papers' (benchmarks/paper_layouts.py's official configurations); the exported folder's runner decodes in a
virtual environment without torch or memlm; what cannot be exported is refused in one line."""

import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import numpy
import pytest
import torch

import memlm
from memlm import DeltaNetConfig, FeedbackTransformerConfig
from memlm.tokenization import byte_level_tokenizer

pytest.importorskip("onnxscript")
pytest.importorskip("onnxruntime")

from memlm.onnx_export import export_onnx, memory_tensors  # noqa: E402
from memlm.onnx_runner import OnnxLanguageModel  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from paper_layouts import deltanet_configs, feedback_configs  # noqa: E402

SIZES = {"vocab_size": 258, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2}
# Logits of ONNX Runtime and eager PyTorch differ by float32 rounding (other kernels, other orders of sums): ~3e-7
# here; the bound is 1e-4.
LOGITS_TOLERANCE = 1e-4
NEW_TOKENS = 64


def layouts() -> dict:
    """memlm's default layout and the papers' official one of each exportable family, tiny; DeltaNet's chunks of 8
    tokens, so that a prefill block of 8 is one chunk and the export stays short."""
    sizes = dict(SIZES, intermediate_size=64)
    deltanet_default, deltanet_official = _papers(deltanet_configs, SIZES)
    feedback_default, feedback_official = _papers(feedback_configs, SIZES)
    for config in (deltanet_default, deltanet_official):
        config.chunk_size = 8
    return {
        "deltanet-default": (memlm.DeltaNetForCausalLM, DeltaNetConfig(**sizes, chunk_size=8)),
        "deltanet-paper": (memlm.DeltaNetForCausalLM, deltanet_default),
        "deltanet-lmtool-fwp": (memlm.DeltaNetForCausalLM, deltanet_official),
        "feedback-default": (memlm.FeedbackTransformerForCausalLM, FeedbackTransformerConfig(**sizes, memory_span=8)),
        "feedback-transformer-sequential": (memlm.FeedbackTransformerForCausalLM, feedback_official),
    }


def _papers(configs, sizes):
    import paper_layouts

    saved = dict(paper_layouts.QUICK_SIZES)
    paper_layouts.QUICK_SIZES.clear()
    paper_layouts.QUICK_SIZES.update(sizes)
    try:
        return configs(quick=True)
    finally:
        paper_layouts.QUICK_SIZES.clear()
        paper_layouts.QUICK_SIZES.update(saved)


LAYOUTS = list(layouts())


def build(layout: str):
    model_class, config = layouts()[layout]
    torch.manual_seed(0)
    return model_class(config).eval()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_allocated_memory_is_a_fresh_memory(layout):
    """The memory an export starts from (every tensor allocated) gives what no cache gives, and so does the memory
    after it, for two rows."""
    model = build(layout)
    input_ids = torch.randint(0, 256, (2, 11))
    with torch.no_grad():
        fresh = model(input_ids, use_cache=True)
        allocated = model(input_ids, cache=model.allocated_memory(2), use_cache=True)
        torch.testing.assert_close(allocated.logits, fresh.logits, rtol=0, atol=0)
        following = input_ids[:, :1]
        torch.testing.assert_close(
            model(following, cache=allocated.cache).logits, model(following, cache=fresh.cache).logits, rtol=0, atol=0
        )


def eager_decoding(model, prompt: torch.Tensor, block_size: int, new_tokens: int):
    """Greedy decoding in eager PyTorch with the calls the ONNX runner makes: the prompt's whole blocks of P tokens,
    its remainder and every new token one at a time."""
    cache, whole = None, prompt.shape[1] // block_size * block_size
    calls = [prompt[:, start : start + block_size] for start in range(0, whole, block_size)]
    calls += [prompt[:, index : index + 1] for index in range(whole, prompt.shape[1])]
    with torch.no_grad():
        for tokens in calls:
            output = model(tokens, cache=cache, use_cache=True)
            cache = output.cache
        chosen, logits = [], []
        for _ in range(new_tokens):
            last = output.logits[:, -1]
            token = last.argmax(-1)
            chosen.append(token)
            logits.append(last)
            output = model(token[:, None], cache=cache, use_cache=True)
            cache = output.cache
    return torch.stack(chosen, 1).numpy(), torch.stack(logits, 1).numpy()


def check_decoding(model, folder: Path, block_size: int):
    """Three rows (the graphs were exported at two: any batch size runs), a prompt of two blocks and three tokens, 64
    greedy tokens through ONNX Runtime from the export in `folder`: the tokens and (to 1e-4) the logits of eager
    PyTorch making the same calls, and of `generate` (which reads the prompt in one call) for every layout whose logits
    do not depend on how calls cut the tokens (all but DeltaNet's sinusoidal positions, which count within each call,
    and the Feedback Transformer's `carry_first_layer_norm`, whose memories carried from an earlier call are normed
    once more: `draft_verification_problem`)."""
    runner = OnnxLanguageModel(folder)
    assert set(runner.initial) == set(memory_tensors(model.allocated_memory(1)))
    prompt = torch.randint(0, 256, (3, 2 * block_size + 3))
    tokens, logits = runner.generate(prompt.numpy(), NEW_TOKENS)
    assert tokens.shape == (3, NEW_TOKENS) and logits.shape == (3, NEW_TOKENS, SIZES["vocab_size"])
    eager_tokens, eager_logits = eager_decoding(model, prompt, block_size, NEW_TOKENS)
    numpy.testing.assert_array_equal(tokens, eager_tokens)
    numpy.testing.assert_allclose(logits, eager_logits, rtol=0, atol=LOGITS_TOLERANCE)
    if model.draft_verification_problem() is not None:  # the logits depend on how the calls cut the tokens
        return
    generated = model.generate(
        prompt, max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True, return_dict_in_generate=True
    )
    numpy.testing.assert_array_equal(tokens, generated.sequences[:, prompt.shape[1] :].numpy())
    numpy.testing.assert_allclose(logits, torch.stack(generated.logits, 1).numpy(), rtol=0, atol=LOGITS_TOLERANCE)


# (memlm's default DeltaNet: through the command, in test_export_command_and_its_runner_without_torch.)
@pytest.mark.parametrize("layout", [layout for layout in LAYOUTS if layout != "deltanet-default"])
def test_onnx_runtime_decodes_as_eager_pytorch(layout, tmp_path):
    model = build(layout)
    block_size = 8 if layout.startswith("deltanet") else 4
    manifest = export_onnx(model, tmp_path / "onnx", block_size=block_size)
    assert manifest["block_size"] == block_size
    check_decoding(model, tmp_path / "onnx", block_size)


def memlm_command(*arguments, cwd=None):
    environment = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "memlm.cli", *arguments], capture_output=True, text=True,
                          cwd=cwd, env=environment)  # fmt: skip


def runner_venv(cache_root: Path) -> Path:
    """A virtual environment with only what the exported runner needs — ONNX Runtime, NumPy, 🤗 tokenizers and their
    dependencies, at the tested versions (constraints/tested.txt) — made once per set of versions
    (~/.cache/memlm/onnx-runner/...)."""
    constraints = ROOT / "constraints" / "tested.txt"
    pins = [line for line in constraints.read_text().splitlines()
            if line.split("==")[0].lower() in ("onnxruntime", "numpy", "tokenizers")]  # fmt: skip
    folder = cache_root / "onnx-runner" / "-".join(pin.replace("==", "") for pin in sorted(pins))
    python = folder / "bin" / "python"
    if not (folder / "complete").exists():
        venv.EnvBuilder(clear=True, with_pip=False).create(folder)
        subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "-c",
                        str(constraints), *pins], check=True)  # fmt: skip
        (folder / "complete").write_text("")
    return python


def test_export_command_and_its_runner_without_torch(tmp_path):
    """`memlm export onnx` on a saved model (a real tokenizer beside it) decodes as eager PyTorch (`check_decoding`);
    the folder's run_onnx.py, in a virtual environment without torch or memlm and from an empty folder, decodes a
    text prompt and token ids as `generate` does."""
    tokenizer = byte_level_tokenizer()
    model = build("deltanet-default")
    with torch.no_grad():  # only lowercase letters come out: printable text
        letters = torch.zeros(SIZES["vocab_size"], dtype=torch.bool)
        letters[ord("a") : ord("z") + 1] = True
        model.lm_head.weight[~letters] = 0.0
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    result = memlm_command("export", "onnx", str(tmp_path / "model"), str(tmp_path / "onnx"), "--block-size", "8")
    assert result.returncode == 0, result.stderr
    assert "prefill.onnx: blocks of 8 tokens" in result.stdout
    exported = sorted(path.name for path in (tmp_path / "onnx").iterdir())
    assert {"prefill.onnx", "step.onnx", "initial_memory.npz", "memlm_onnx.json", "run_onnx.py",
            "tokenizer.json"} <= set(exported)  # fmt: skip
    manifest = json.loads((tmp_path / "onnx" / "memlm_onnx.json").read_text())
    assert manifest["model_type"] == "memlm_deltanet" and manifest["dynamic_batch"]
    check_decoding(model, tmp_path / "onnx", 8)

    python = runner_venv(Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "memlm")
    assert subprocess.run([python, "-c", "import torch"], capture_output=True).returncode != 0
    assert subprocess.run([python, "-c", "import memlm"], capture_output=True, cwd=tmp_path).returncode != 0
    empty = tmp_path / "empty"
    empty.mkdir()
    environment = {"PATH": os.environ["PATH"], "HOME": str(tmp_path)}
    text = "The memory of a delta rule"
    run = subprocess.run([python, str(tmp_path / "onnx" / "run_onnx.py"), "--prompt", text, "--max-new-tokens",
                          str(NEW_TOKENS), "--output", "text.npz"], capture_output=True, text=True, cwd=empty,
                         env=environment)  # fmt: skip
    assert run.returncode == 0, run.stderr
    prompt = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    generated = model.generate(
        prompt, max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True, return_dict_in_generate=True
    )
    new = generated.sequences[0, prompt.shape[1] :]
    with numpy.load(empty / "text.npz") as saved:
        numpy.testing.assert_array_equal(saved["prompt"], prompt[0].numpy())
        numpy.testing.assert_array_equal(saved["tokens"][0], new.numpy())
        numpy.testing.assert_allclose(saved["logits"][0], torch.cat(generated.logits).numpy(), rtol=0,
                                      atol=LOGITS_TOLERANCE)  # fmt: skip
    assert run.stdout == text + tokenizer.decode(new) + "\n"
    ids = subprocess.run([python, str(tmp_path / "onnx" / "run_onnx.py"), "--token-ids", *map(str, prompt[0].tolist()),
                          "--max-new-tokens", "5"], capture_output=True, text=True, cwd=empty,
                         env=environment)  # fmt: skip
    assert ids.returncode == 0, ids.stderr
    assert ids.stdout.split() == [str(token) for token in new[:5].tolist()]


def refusal(capsys, *arguments) -> str:
    """The one line `memlm ARGUMENTS` ends with (status 1)."""
    from memlm.cli import main

    capsys.readouterr()  # (what ran before: saving's progress bars)
    with pytest.raises(SystemExit) as exit_info:
        main(list(arguments))
    assert exit_info.value.code == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and error.startswith("memlm: error: "), error
    return error


def test_export_refusals_are_one_line(tmp_path, capsys, monkeypatch):
    """Expire-Span (a memory whose size depends on the data), a folder that is not empty, a bad block size and a
    missing extra: one line on stderr naming what is wrong and what to do, nothing written."""
    memlm.ExpireSpanForCausalLM(memlm.ExpireSpanConfig(**SIZES, max_span=16, ramp=4, block_size=4)).save_pretrained(
        tmp_path / "expire"
    )
    error = refusal(capsys, "export", "onnx", str(tmp_path / "expire"), str(tmp_path / "out"))
    assert "Expire-Span cannot be exported to ONNX" in error and "fixed shapes" in error
    build("deltanet-default").save_pretrained(tmp_path / "model")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "file").write_text("")
    assert "is not an empty folder" in refusal(
        capsys, "export", "onnx", str(tmp_path / "model"), str(tmp_path / "full")
    )
    error = refusal(capsys, "export", "onnx", str(tmp_path / "model"), str(tmp_path / "out"), "--block-size", "1")
    assert "block_size must be an integer of at least 2" in error
    monkeypatch.setitem(sys.modules, "onnxscript", None)  # the extra's package missing: its import fails
    error = refusal(capsys, "export", "onnx", str(tmp_path / "model"), str(tmp_path / "out"))
    assert 'needs onnxscript, not installed: pip install "memlm[onnx]"' in error
    assert not (tmp_path / "out").exists()
