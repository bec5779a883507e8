"""Saved checkpoints: safetensors only, identical logits after loading, self-contained remote code, model card."""

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from transformers import AutoModelForCausalLM

from memlm import (
    DeltaNetForCausalLM,
    ExpireSpanConfig,
    ExpireSpanForCausalLM,
    FeedbackTransformerConfig,
    FeedbackTransformerForCausalLM,
)
from memlm.export import GENERATED_CARD_MARK, bundle_sources, flat_module_name
from tests.conftest import DELTANET_VARIANTS

# 🤗-facing: also run under the newest and the oldest 🤗 releases allowed (`make test-releases`).
pytestmark = pytest.mark.huggingface

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [[3, 14, 15, 92, 65, 35, 89, 79]]


def _expire_span(**overrides):
    config = ExpireSpanConfig(vocab_size=258, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, max_span=6, ramp=2, block_size=4, **overrides)  # fmt: skip
    return ExpireSpanForCausalLM(config)


MODELS = {
    **{name: lambda factory=factory: DeltaNetForCausalLM(factory()) for name, factory in DELTANET_VARIANTS.items()},
    "expire_span": _expire_span,
    "fixed_span": lambda: _expire_span(expire_memories=False),
    # The official model's options (transformer-sequential), memories recomputed from hidden states.
    "expire_span_official": lambda: _expire_span(
        head_dim=12,
        position_encoding="learned_relative",
        attend_to_self=False,
        initial_memory="zeros",
        span_loss_form="remaining_span",
        renormalization_epsilon=1e-8,
        recompute_memory=True,
        norm_type="layernorm",
        norm_position="post",
        final_norm=False,
        mlp_type="plain",
        mlp_bias=True,
        hidden_act="relu",
        lm_head_bias=True,
    ),  # fmt: skip
    "feedback": lambda: FeedbackTransformerForCausalLM(
        FeedbackTransformerConfig(
            vocab_size=258,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            memory_span=4,
        )
    ),
    "feedback_unshared": lambda: FeedbackTransformerForCausalLM(
        FeedbackTransformerConfig(
            vocab_size=258,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            memory_span=4,
            share_key_value=False,
            position_encoding="relative_bias",
        )
    ),
    # The official model's options (transformer-sequential --feedback --pre-norm --adapt-span).
    "feedback_official": lambda: FeedbackTransformerForCausalLM(
        FeedbackTransformerConfig(
            vocab_size=258,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            head_dim=12,
            memory_span=4,
            share_key_value=False,
            position_encoding="learned_relative",
            initial_memory="zeros",
            memory_normalization="layer",
            memory_carry="hidden_states",
            carry_first_layer_norm=True,
            adaptive_span=True,
            adaptive_span_initial_ratio=0.5,
            adaptive_span_ramp=2,
            renormalization_epsilon=1e-8,
            attention_dropout_position="weights",
            norm_type="layernorm",
            mlp_type="plain",
            mlp_bias=True,
            hidden_act="relu",
            lm_head_bias=True,
        )
    ),
}


def _saved(tmp_path, name="fla", tokenizer=None, folder="checkpoint"):
    model = MODELS[name]().eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    directory = tmp_path / folder
    model.save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    return model, directory


@pytest.mark.parametrize(
    "name",
    [
        "paper",
        "fla",
        "favor_conv_gate",
        "official_block",
        "expire_span",
        "fixed_span",
        "feedback",
        "feedback_unshared",
        "feedback_official",
        "expire_span_official",
    ],
)
def test_round_trip_is_exact_and_uses_safetensors(tmp_path, name):
    model, directory = _saved(tmp_path, name)
    files = sorted(path.name for path in directory.iterdir())
    assert "model.safetensors" in files
    assert not any(file.endswith((".bin", ".pt", ".pkl")) for file in files)
    loaded = AutoModelForCausalLM.from_pretrained(directory).eval()
    assert type(loaded) is type(model)
    with torch.no_grad():
        # Same weights, same code: equal up to float32 GEMM rounding, which can depend on memory alignment.
        torch.testing.assert_close(loaded(torch.tensor(PROMPT)).logits, model(torch.tensor(PROMPT)).logits,
                                   atol=1e-6, rtol=1e-6)  # fmt: skip


def test_bundle_is_flat_and_names_only_its_own_files(tmp_path):
    _, directory = _saved(tmp_path)
    config = json.loads((directory / "config.json").read_text())
    assert config["auto_map"] == {
        "AutoConfig": "configuration_deltanet.DeltaNetConfig",
        "AutoModel": "modeling_deltanet.DeltaNetModel",
        "AutoModelForCausalLM": "modeling_deltanet.DeltaNetForCausalLM",
    }
    python_files = {path.name for path in directory.glob("*.py")}
    assert {"modeling_deltanet.py", "configuration_deltanet.py", "memlm_delta_rule.py"} <= python_files
    for path in directory.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert node.level or (node.module or "").split(".")[0] != "memlm", (path.name, node.module)
                if node.level:
                    assert node.level == 1 and f"{node.module}.py" in python_files, (path.name, node.module)
            if isinstance(node, ast.Import):
                assert not any(alias.name.split(".")[0] == "memlm" for alias in node.names), path.name


def test_flat_names():
    assert flat_module_name("memlm.modeling.modeling_deltanet") == "modeling_deltanet"
    assert flat_module_name("memlm.configuration.configuration_deltanet") == "configuration_deltanet"
    assert flat_module_name("memlm.kernels.delta_rule.chunk") == "memlm_delta_rule_chunk"
    assert flat_module_name("memlm.kernels") == "memlm_kernels"  # never shadows the 🤗 `kernels` package
    sources = bundle_sources(["memlm.kernels.delta_rule"])
    assert set(sources) == {
        "memlm_delta_rule.py",
        "memlm_delta_rule_chunk.py",
        "memlm_delta_rule_fla_convention.py",
        "memlm_delta_rule_flash_linear_attention.py",
        "memlm_delta_rule_hub_function.py",
        "memlm_delta_rule_reference.py",
        "memlm_delta_rule_triton_chunk.py",
        "memlm_delta_rule_triton_recurrent.py",
        "memlm_hub.py",
        "memlm_kernels.py",
    }


def test_the_bundle_does_not_require_triton(tmp_path):
    """🤗 refuses remote code whose imports are missing; the Triton kernels import triton inside try/except, which
    its check skips, so a machine without Triton loads the model and runs the torch backend."""
    from transformers.dynamic_module_utils import get_imports

    sources = bundle_sources(["memlm.kernels.delta_rule", "memlm.kernels.expire_attention"])
    assert {"memlm_delta_rule_triton_chunk.py", "memlm_expire_attention_triton_attention.py"} <= set(sources)
    for name, source in sources.items():
        path = tmp_path / name
        path.write_text(source)
        assert "triton" not in get_imports(str(path)), name


REMOTE_SCRIPT = textwrap.dedent(
    """
    import sys
    sys.modules["memlm"] = None  # memlm is not installed here: importing it fails
    try:
        import memlm  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("memlm should not be importable")
    import json
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    results = []
    for directory, resaved in zip(sys.argv[1::2], sys.argv[2::2]):  # (one process for every checkpoint: CI's time)
        model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True).eval()
        assert not type(model).__module__.startswith("memlm"), type(model).__module__
        prompt = torch.tensor({prompt})
        with torch.no_grad():
            logits = model(prompt).logits
        generated = model.generate(prompt, max_new_tokens=5, min_new_tokens=5, do_sample=False)
        generator = pipeline("text-generation", model=directory, trust_remote_code=True, device="cpu")
        text = generator("abc", max_new_tokens=3, do_sample=False)[0]["generated_text"]
        model.save_pretrained(resaved)  # saving a remote-code model keeps its code
        again = AutoModelForCausalLM.from_pretrained(resaved, trust_remote_code=True).eval()
        with torch.no_grad():
            torch.testing.assert_close(again(prompt).logits, logits, atol=1e-6, rtol=1e-6)
        results.append({{"logits": logits.tolist(), "generated": generated.tolist(), "text": text}})
    print(json.dumps(results))
    """
).format(prompt=PROMPT)


REMOTE_CODE_MODELS = ("fla", "official_block", "expire_span", "expire_span_official", "feedback", "feedback_official")


def test_remote_code_loads_without_memlm_and_gives_identical_logits(tmp_path, tokenizer):
    saved = {name: _saved(tmp_path, name, tokenizer, folder=name) for name in REMOTE_CODE_MODELS}
    remote = _remote_run(sys.executable, [directory for _, directory in saved.values()], tmp_path, "here")
    for (name, (model, _)), there in zip(saved.items(), remote, strict=True):
        with torch.no_grad():
            expected = model(torch.tensor(PROMPT)).logits
        torch.testing.assert_close(torch.tensor(there["logits"]), expected, atol=1e-6, rtol=1e-6, msg=name)
        generated = model.generate(torch.tensor(PROMPT), max_new_tokens=5, min_new_tokens=5, do_sample=False)
        assert there["generated"] == generated.tolist(), name
        assert there["text"].startswith("abc"), name


def _remote_run(python: str, directories: list, tmp_path: Path, label: str) -> list[dict]:
    """REMOTE_SCRIPT run by `python` (where memlm is made unimportable) over the checkpoints in `directories`, in one
    process: for each, logits, greedy tokens and pipeline text."""
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / f"modules_{label}"),
                   "PYTHONPATH": ""}  # fmt: skip
    arguments = [str(part) for index, directory in enumerate(directories)
                 for part in (directory, tmp_path / f"resaved_{label}_{index}")]  # fmt: skip
    result = subprocess.run([python, "-c", REMOTE_SCRIPT, *arguments], cwd=tmp_path, env=environment,
                            capture_output=True, text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


# Saves checkpoints with memlm under the other release (pairs of model name and folder) and prints, for each, its
# logits and greedy tokens.
SAVE_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    import transformers
    from tests.test_export import MODELS, PROMPT

    results = []
    for name, directory in zip(sys.argv[1::2], sys.argv[2::2]):
        torch.manual_seed(0)
        model = MODELS[name]().eval()
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(torch.randn_like(parameter) * 0.1)
            logits = model(torch.tensor(PROMPT)).logits
        model.save_pretrained(directory)
        generated = model.generate(torch.tensor(PROMPT), max_new_tokens=5, min_new_tokens=5, do_sample=False)
        results.append({"logits": logits.tolist(), "generated": generated.tolist(),
                        "release": transformers.__version__})
    print(json.dumps(results))
    """
)
# Loads checkpoints with memlm (the Auto classes, no remote code) and prints each one's greedy tokens.
GENERATE_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import memlm, torch
    from transformers import AutoModelForCausalLM

    tokens = []
    for directory in sys.argv[1:]:
        model = AutoModelForCausalLM.from_pretrained(directory).eval()
        generated = model.generate(torch.tensor({prompt}), max_new_tokens=5, min_new_tokens=5, do_sample=False)
        tokens.append(generated.tolist())
    print(json.dumps(tokens))
    """
).format(prompt=PROMPT)
OTHER_RELEASE_PYTHON = os.environ.get("MEMLM_OTHER_RELEASE_PYTHON")
needs_other_release = pytest.mark.skipif(
    not OTHER_RELEASE_PYTHON,
    reason="needs MEMLM_OTHER_RELEASE_PYTHON, the interpreter of an environment with another 🤗 release and memlm "
    "(make test-releases sets it: the oldest release's, for the run under the newest)",
)
# One model of each family (each checkpoint of a test in the same process of the other release: CI's time).
RELEASE_MODELS = ("fla", "expire_span", "feedback")


@needs_other_release
def test_a_checkpoint_saved_under_this_release_loads_and_generates_under_the_other(tmp_path, tokenizer):
    saved = {name: _saved(tmp_path, name, tokenizer, folder=name) for name in RELEASE_MODELS}
    directories = [directory for _, directory in saved.values()]
    remote = _remote_run(OTHER_RELEASE_PYTHON, directories, tmp_path, "other")  # the bundles, without memlm
    with_memlm = subprocess.run([OTHER_RELEASE_PYTHON, "-c", GENERATE_SCRIPT, *map(str, directories)], cwd=ROOT,
                                env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True,
                                timeout=600)  # fmt: skip
    assert with_memlm.returncode == 0, with_memlm.stderr[-3000:]
    generated_there = json.loads(with_memlm.stdout.strip().splitlines()[-1])
    for (name, (model, _)), there, tokens_there in zip(saved.items(), remote, generated_there, strict=True):
        with torch.no_grad():
            expected = model(torch.tensor(PROMPT)).logits
        generated = model.generate(torch.tensor(PROMPT), max_new_tokens=5, min_new_tokens=5, do_sample=False)
        torch.testing.assert_close(torch.tensor(there["logits"]), expected, atol=1e-6, rtol=1e-6, msg=name)
        assert there["generated"] == generated.tolist(), name
        assert tokens_there == generated.tolist(), name


@needs_other_release
def test_a_checkpoint_saved_under_the_other_release_loads_and_generates_under_this_one(tmp_path, tokenizer):
    directories = [tmp_path / name for name in RELEASE_MODELS]
    arguments = [str(part) for name, directory in zip(RELEASE_MODELS, directories) for part in (name, directory)]
    saved = subprocess.run([OTHER_RELEASE_PYTHON, "-c", SAVE_SCRIPT, *arguments], cwd=ROOT,
                           env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)},
                           capture_output=True, text=True, timeout=600)  # fmt: skip
    assert saved.returncode == 0, saved.stderr[-3000:]
    saved_there = json.loads(saved.stdout.strip().splitlines()[-1])
    import transformers

    assert saved_there[0]["release"] != transformers.__version__, "the other environment runs this very release"
    for directory in directories:
        tokenizer.save_pretrained(directory)
    here = _remote_run(sys.executable, directories, tmp_path, "here")  # their bundles, without memlm
    for name, directory, there, bundle_here in zip(RELEASE_MODELS, directories, saved_there, here, strict=True):
        loaded = AutoModelForCausalLM.from_pretrained(directory).eval()  # with memlm
        with torch.no_grad():
            torch.testing.assert_close(loaded(torch.tensor(PROMPT)).logits, torch.tensor(there["logits"]), atol=1e-6,
                                       rtol=1e-6, msg=name)  # fmt: skip
        generated = loaded.generate(torch.tensor(PROMPT), max_new_tokens=5, min_new_tokens=5, do_sample=False)
        assert generated.tolist() == there["generated"], name
        assert bundle_here["generated"] == there["generated"], name


def test_model_card_is_rendered_with_valid_metadata(tmp_path):
    model, directory = _saved(tmp_path, "paper")
    card = ModelCard.load(directory / "README.md")
    assert card.data.library_name == "transformers"
    assert card.data.pipeline_tag == "text-generation"
    assert card.data.license == "apache-2.0"
    assert {"memlm", "deltanet"} <= set(card.data.tags)
    parameters = sum(parameter.numel() for parameter in model.parameters())
    assert f"({parameters / 1e3:.1f}K parameters)" in card.text
    assert "DPFP-1" in card.text and "delta rule" in card.text
    assert "@inproceedings{schlag2021linear" in card.text
    assert str(directory.resolve()) in card.text  # how to load it names this checkpoint
    assert GENERATED_CARD_MARK in card.text


def test_a_readme_written_by_the_user_is_kept(tmp_path):
    model, directory = _saved(tmp_path)
    (directory / "README.md").write_text("# my notes\n")
    model.save_pretrained(directory)
    assert (directory / "README.md").read_text() == "# my notes\n"
    (directory / "README.md").unlink()
    model.save_pretrained(directory)
    assert GENERATED_CARD_MARK in (directory / "README.md").read_text()


def test_templates_ship_inside_the_package():
    setup = (Path(__file__).resolve().parents[1] / "setup.cfg").read_text()
    assert "memlm.hub_cards = hub_cards" in setup and "memlm.hub_cards = *.md" in setup


def test_expire_span_card(tmp_path):
    model, directory = _saved(tmp_path, "expire_span")
    card = ModelCard.load(directory / "README.md")
    assert {"memlm", "expire-span"} <= set(card.data.tags) and card.data.library_name == "transformers"
    assert "ramp R = 2" in card.text and "@inproceedings{sukhbaatar2021expire" in card.text
    assert json.loads((directory / "config.json").read_text())["auto_map"]["AutoModelForCausalLM"] == (
        "modeling_expire_span.ExpireSpanForCausalLM"
    )


def test_feedback_card(tmp_path):
    _, directory = _saved(tmp_path, "feedback")
    card = ModelCard.load(directory / "README.md")
    assert {"memlm", "feedback-transformer"} <= set(card.data.tags) and card.data.pipeline_tag == "text-generation"
    assert "τ = 4" in card.text and "@inproceedings{fan2021addressing" in card.text


def test_every_package_of_the_tree_is_in_setup_cfg():
    """setup.cfg lists the packages by hand (hub_cards/ ships as memlm.hub_cards): a folder left out is missing
    from the wheel, as memlm.training.tasks was."""
    import configparser

    from setuptools import find_packages

    root = Path(__file__).resolve().parents[1]
    setup = configparser.ConfigParser()
    setup.read(root / "setup.cfg", encoding="utf-8")
    listed = set(setup["options"]["packages"].split())
    data_folders = {"memlm.hub_cards", "memlm.training.presets"}  # templates and presets: data, no __init__.py
    assert listed == {*find_packages(root, include=["memlm", "memlm.*"]), *data_folders}


SAVE_WITHOUT_TRITON = textwrap.dedent(
    """
    import sys
    sys.modules["triton"] = None  # as on a machine without Triton (macOS, a plain CPU install): importing it fails
    try:
        import triton  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("triton should not be importable")
    import memlm
    from tests.test_export import MODELS

    for name, directory in zip(sys.argv[1::2], sys.argv[2::2]):
        MODELS[name]().save_pretrained(directory)
    print(sorted(name for name in sys.modules if name.startswith("memlm.") and "triton" in name))
    """
)


def test_save_pretrained_without_triton_writes_the_whole_bundle(tmp_path):
    """Without Triton, saving still writes every file of the bundle, the Triton kernels included (they refuse to
    import there, so the bundle is read from the source files, never imported). One model of each family, saved in
    one process."""
    names = ("fla", "expire_span", "feedback")
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "MEMLM_KERNELS": "torch"}
    environment.pop("TRITON_INTERPRET", None)
    arguments = [str(part) for name in names for part in (name, tmp_path / name)]
    result = subprocess.run(
        [sys.executable, "-c", SAVE_WITHOUT_TRITON, *arguments],
        cwd=Path(__file__).resolve().parents[1],
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"  # no memlm Triton module was imported
    for name in names:
        model = MODELS[name]()
        expected = bundle_sources([type(model).__module__, type(model.config).__module__])
        written = {path.name: path.read_text(encoding="utf-8") for path in (tmp_path / name).glob("*.py")}
        assert written == expected, name
        assert GENERATED_CARD_MARK in (tmp_path / name / "README.md").read_text(encoding="utf-8"), name
        if name != "feedback":
            assert any("triton" in file for file in written), (name, sorted(written))


TOKENIZER_WITHOUT_MEMLM = textwrap.dedent(
    """
    import sys
    sys.modules["memlm"] = None  # memlm is not installed here
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    directory = sys.argv[1]
    for tokenizer in (AutoTokenizer.from_pretrained(directory, trust_remote_code=False),
                      PreTrainedTokenizerFast.from_pretrained(directory)):
        assert isinstance(tokenizer, PreTrainedTokenizerFast), type(tokenizer)
        assert not type(tokenizer).__module__.startswith("transformers_modules"), type(tokenizer).__module__
        print(type(tokenizer).__name__, tokenizer("ab é").input_ids, tokenizer.eos_token, tokenizer.pad_token_id)
    """
)


def test_the_tokenizer_is_plain_and_loads_without_memlm_or_remote_code(tmp_path, tokenizer):
    """The byte-level tokenizer saves as 🤗's own fast tokenizer: no auto_map, no code. Without memlm it loads with
    trust_remote_code=False (AutoTokenizer reads the model's config.json first, whose auto_map would otherwise ask
    whether to run the model's code) or through PreTrainedTokenizerFast, and never asks."""
    _, directory = _saved(tmp_path, "fla", tokenizer)
    saved = json.loads((directory / "tokenizer_config.json").read_text())
    assert "auto_map" not in saved and saved["tokenizer_class"] in ("TokenizersBackend", "PreTrainedTokenizerFast")
    assert not [path for path in directory.glob("*.py") if "token" in path.name]
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    result = subprocess.run(
        [sys.executable, "-c", TOKENIZER_WITHOUT_MEMLM, str(directory)],
        cwd=tmp_path,
        env=environment,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "custom code" not in result.stdout + result.stderr
    expected = f"{tokenizer('ab é').input_ids} {tokenizer.eos_token} {tokenizer.pad_token_id}"
    lines = result.stdout.strip().splitlines()[-2:]
    assert lines == [f"TokenizersBackend {expected}"] * 2, lines
