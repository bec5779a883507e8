"""One code base for every 🤗 Transformers release memlm allows (memlm/compat.py).

🤗 5.24 renamed the memory argument of `forward` and `generate`, and the output field, `past_key_values` → `cache`.
These tests run under whichever release is installed (`make test` the tested one, `make test-releases` the newest and
the oldest allowed) and check that memlm speaks the installed release's language and accepts both names.
"""

import re
import warnings
from pathlib import Path

import numpy
import pytest
import torch
from datasets import Dataset
from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments, modeling_outputs

import memlm
from memlm.compat import CACHE_NAME, cache_keyword, output_cache
from tests.modeling.test_transformers_contract import (
    DeltaNetModelTester,
    ExpireSpanModelTester,
    FeedbackTransformerModelTester,
)

# 🤗-facing: also run under the newest and the oldest 🤗 releases allowed (`make test-releases`).
pytestmark = pytest.mark.huggingface

TESTERS = {
    "deltanet": DeltaNetModelTester(),
    "expire_span": ExpireSpanModelTester(),
    "feedback": FeedbackTransformerModelTester(),
}
RENAMED_IN_THIS_RELEASE = CACHE_NAME == "cache"
ROOT = Path(__file__).resolve().parents[1]


def _model(name, base=False):
    tester = TESTERS[name]
    config, _ = tester.prepare_config_and_inputs_for_common()
    model_class = tester.base_model_class if base else tester.causal_lm_class
    torch.manual_seed(0)
    return model_class(config).eval()


def _prompt(name, length=6):
    generator = torch.Generator().manual_seed(1)
    return torch.randint(3, TESTERS[name].vocab_size, (2, length), generator=generator)


def test_the_cache_name_is_the_installed_release_s():
    fields = modeling_outputs.CausalLMOutputWithPast.__dataclass_fields__
    assert CACHE_NAME in fields
    assert ("cache" in fields) == RENAMED_IN_THIS_RELEASE


@pytest.mark.parametrize("name", list(TESTERS))
@pytest.mark.parametrize("base", [False, True], ids=["causal_lm", "base_model"])
def test_outputs_carry_the_cache_under_the_installed_name_and_as_cache(name, base):
    model = _model(name, base)
    with torch.no_grad():
        outputs = model(_prompt(name), use_cache=True)
    cache = outputs.cache
    assert isinstance(cache, memlm.modeling.memory.MemoryCache)
    # What 🤗's generate and Trainer read: the field by the installed name, as key and as attribute.
    assert CACHE_NAME in outputs and outputs[CACHE_NAME] is cache and getattr(outputs, CACHE_NAME) is cache
    assert output_cache(outputs) is cache
    assert outputs.to_tuple()[1] is cache  # after the hidden state or the logits (no loss without labels)


OUTPUT_CLASSES = [
    memlm.compat.BaseModelOutputWithPast,
    memlm.compat.CausalLMOutputWithPast,
    memlm.modeling.modeling_expire_span.ExpireSpanModelOutput,
    memlm.modeling.modeling_expire_span.ExpireSpanCausalLMOutput,
    memlm.modeling.modeling_feedback_transformer.FeedbackModelOutput,
    memlm.modeling.modeling_feedback_transformer.FeedbackCausalLMOutput,
]


@pytest.mark.parametrize("output_class", OUTPUT_CLASSES, ids=lambda output_class: output_class.__name__)
def test_outputs_built_without_the_constructor_s_checks_are_the_constructor_s(output_class):
    """`compat.model_output`, which the models' forwards build their outputs with, gives what the installed 🤗's
    constructor gives: the same items in the same order, every field an attribute (the same objects), the same tuple,
    equal, picklable back to an equal output, the same pytree leaves; it leaves to the constructor a name that is not
    a field and an output with only its first field set."""
    import pickle

    import torch.utils._pytree as pytree

    names = list(output_class.__dataclass_fields__)
    tensors = [torch.full((2,), float(index)) for index in range(len(names))]
    for chosen in ([1], [0, 1], [1, 2, len(names) - 1], list(range(len(names)))):  # (tensors, None elsewhere)
        values = {name: tensors[index] if index in chosen else None for index, name in enumerate(names)}
        built, expected = memlm.compat.model_output(output_class, **values), output_class(**values)
        assert type(built) is output_class and list(built.keys()) == list(expected.keys()) == [
            names[index] for index in chosen
        ]
        assert all(getattr(built, name) is getattr(expected, name) for name in names)
        assert vars(built).keys() == vars(expected).keys()
        assert all(left is right for left, right in zip(built.to_tuple(), expected.to_tuple(), strict=True))
        assert built == expected and built[names[chosen[0]]] is tensors[chosen[0]]
        copied = pickle.loads(pickle.dumps(built))
        assert list(copied.keys()) == list(built.keys()) and all(copied[key].equal(built[key]) for key in built)
        assert pytree.tree_flatten(built)[0] == pytree.tree_flatten(expected)[0]
    pairs = {names[0]: [(names[1], tensors[1])]}  # only the first field: 🤗 reads it as (name, value) pairs
    assert list(memlm.compat.model_output(output_class, **pairs).items()) == [(names[1], tensors[1])]
    with pytest.raises(TypeError, match="not_a_field"):
        memlm.compat.model_output(output_class, not_a_field=tensors[0])


@pytest.mark.parametrize("name", list(TESTERS))
def test_forward_takes_cache_and_past_key_values_alike(name):
    model = _model(name)
    prompt, following = _prompt(name), _prompt(name, 2)
    with torch.no_grad():
        expected = model(following, cache=model(prompt, use_cache=True).cache).logits
        positional = model(following, None, None, model(prompt, use_cache=True).cache).logits  # 4th: the cache
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            old_name = model(following, past_key_values=model(prompt, use_cache=True).cache).logits
    torch.testing.assert_close(positional, expected, atol=0, rtol=0)
    torch.testing.assert_close(old_name, expected, atol=0, rtol=0)
    # As 🤗's own models: the old name warns (FutureWarning) where 🤗 has renamed it, and is plain before.
    renamed = [warning for warning in caught if "past_key_values is deprecated" in str(warning.message)]
    assert len(renamed) == (1 if RENAMED_IN_THIS_RELEASE else 0), [str(warning.message) for warning in caught]
    assert all(warning.category is FutureWarning for warning in renamed)


@pytest.mark.parametrize("name", list(TESTERS))
def test_two_different_memories_under_both_names_are_refused(name):
    model = _model(name)
    prompt = _prompt(name)
    with torch.no_grad():
        first, second = model(prompt, use_cache=True).cache, model(prompt, use_cache=True).cache
        with pytest.raises(ValueError, match="got both cache and past_key_values"):
            model(prompt[:, :1], cache=first, past_key_values=second)


@pytest.mark.parametrize("name", list(TESTERS))
def test_an_unknown_keyword_is_still_refused(name):
    """Refusing what it does not know is what made 🤗's rename loud instead of a silently ignored memory."""
    model = _model(name)
    with pytest.raises(TypeError, match="unexpected keyword argument.*cache_params"):
        model(_prompt(name), cache_params=None)


@pytest.mark.parametrize("name", list(TESTERS))
def test_generate_continues_from_a_cache_under_either_name(name):
    model = _model(name)
    prompt = _prompt(name)
    whole = model.generate(prompt, max_new_tokens=6, min_new_tokens=6, do_sample=False)  # no end of text midway
    for keyword in ("cache", "past_key_values"):
        first = model.generate(prompt, max_new_tokens=3, min_new_tokens=3, do_sample=False,
                               return_dict_in_generate=True)  # fmt: skip
        with warnings.catch_warnings():
            # 🤗 5.24's generate announces the old name's removal itself: this call is the deliberate use of it.
            warnings.filterwarnings("ignore", message=".*past_key_values.*", category=FutureWarning)
            continued = model.generate(first.sequences, max_new_tokens=3, min_new_tokens=3, do_sample=False,
                                       **{keyword: output_cache(first)})  # fmt: skip
        assert torch.equal(continued, whole), keyword


@pytest.mark.parametrize("name", list(TESTERS))
def test_cache_keyword_names_what_forward_takes(name):
    assert cache_keyword(_model(name)) == "cache"


def test_the_models_declare_both_names_for_trainer_and_device_maps():
    for tester in TESTERS.values():
        config, _ = tester.prepare_config_and_inputs_for_common()
        assert {"cache", "past_key_values"} <= set(config.keys_to_ignore_at_inference)
        assert {"cache", "past_key_values"} <= set(tester.causal_lm_class._skip_keys_device_placement)


@pytest.mark.parametrize("name", list(TESTERS))
def test_trainer_predictions_are_the_logits_alone(tmp_path, tokenizer, name):
    """Trainer.prediction_step drops the keys of `keys_to_ignore_at_inference`: under 5.24 the memory is `cache`,
    and a cache left among the predictions breaks `predict` and metrics."""
    tester = TESTERS[name]
    config, _ = tester.prepare_config_and_inputs_for_common()
    config.vocab_size = len(tokenizer)
    model = tester.causal_lm_class(config)
    ids = tokenizer("the memory expires; the fast weights remember. " * 4)["input_ids"][:24]
    dataset = Dataset.from_dict({"input_ids": [ids] * 4})
    arguments = TrainingArguments(
        output_dir=str(tmp_path / "run"), per_device_eval_batch_size=2, report_to=[], use_cpu=True,
        dataloader_num_workers=0, disable_tqdm=True,
    )  # fmt: skip
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    trainer = Trainer(model=model, args=arguments, data_collator=collator)
    predictions = trainer.predict(dataset).predictions
    assert isinstance(predictions, numpy.ndarray), type(predictions)
    assert predictions.shape == (4, len(ids), config.vocab_size)


# Reading or passing the memory under an old name: `.past_key_values`, `past_key_values=`, `cache_params=`.
OLD_NAME_USE = re.compile(r"\.past_key_values\b|\bpast_key_values\s*=(?!=)|\bcache_params\s*=(?!=)")


def test_only_compat_speaks_the_old_names():
    """memlm, its scripts and its benchmarks use `cache`; the old names appear only in memlm/compat.py (a warning
    today is an error when 🤗 drops the aliases, announced for 5.40, and under 5.23 nothing warns at all)."""
    offenders = []
    for folder in ("memlm", "training", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name == "compat.py":
                continue
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if OLD_NAME_USE.search(line):
                    offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def _lower_bounds() -> dict[str, str]:
    """Package → the `>=` bound setup.cfg declares for it (install_requires and every extra)."""
    import configparser

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    lines = setup["options"]["install_requires"].splitlines()
    for extra in setup["options.extras_require"].values():
        lines += extra.splitlines()
    bounds = {}
    for line in filter(None, (line.strip() for line in lines)):
        requirement = Requirement(line)
        for specifier in requirement.specifier:
            if specifier.operator == ">=":
                bounds[canonicalize_name(requirement.name)] = specifier.version
    return bounds


def test_the_declared_lower_bounds_are_the_oldest_releases_tested():
    """constraints/oldest.txt (what `make test-releases` runs as the oldest) pins setup.cfg's lower bounds, and pins
    every 🤗 package memlm depends on."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import Version

    bounds = _lower_bounds()
    pinned = {}
    for line in (ROOT / "constraints" / "oldest.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            requirement = Requirement(line)
            (specifier,) = requirement.specifier
            assert specifier.operator == "==", line
            pinned[canonicalize_name(requirement.name)] = specifier.version
    for package in ("torch", "transformers", "accelerate", "datasets", "tokenizers", "huggingface-hub", "safetensors"):
        assert package in pinned, f"constraints/oldest.txt does not pin {package}"
    as_versions = {package: Version(version) for package, version in pinned.items()}
    assert {package: bounds.get(package) and Version(bounds[package]) for package in pinned} == as_versions


def test_the_tested_set_pins_every_package_it_names():
    lines = [line for line in (ROOT / "constraints" / "tested.txt").read_text().splitlines() if line.strip()]
    requirements = [line for line in lines if not line.startswith("#")]
    assert all(re.fullmatch(r"[A-Za-z0-9_.\-]+==[A-Za-z0-9_.+\-]+", line) for line in requirements), requirements
    names = {line.split("==")[0].lower().replace("_", "-") for line in requirements}
    assert {"torch", "transformers", "accelerate", "datasets", "tokenizers", "huggingface-hub", "peft"} <= names
    assert "torch==2.13.0" in requirements


def test_an_unknown_memlm_model_type_is_named_by_memlm(tmp_path):
    """With memlm imported, a config.json whose memlm_* type memlm does not know gets memlm's words (its known types,
    a newer memlm?) from 🤗's own Auto classes, instead of 🤗's advice to update Transformers; other types, memlm's
    own and 🤗's, load as before."""
    import json

    from transformers import AutoConfig, AutoModelForCausalLM

    import memlm  # noqa: F401

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "memlm_nonsense", "hidden_size": 8}))
    for loader in (AutoConfig, AutoModelForCausalLM):
        with pytest.raises(ValueError) as error:
            loader.from_pretrained(tmp_path)
        assert str(error.value) == (
            "model_type 'memlm_nonsense' is not one of memlm's (memlm_deltanet, memlm_expire_span, "
            "memlm_feedback_transformer): a checkpoint of a newer memlm (pip install -U memlm), or a misspelt "
            "model_type in config.json."
        )
    assert type(AutoConfig.for_model("memlm_feedback_transformer")).__name__ == "FeedbackTransformerConfig"
    assert type(AutoConfig.for_model("llama")).__name__ == "LlamaConfig"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "not_a_model_type_anywhere"}))
    with pytest.raises(ValueError, match="does not recognize this architecture"):  # 🤗's words for the rest
        AutoConfig.from_pretrained(tmp_path)


def test_make_refuses_in_one_line_a_python_the_tested_set_cannot_install():
    """devtools/check_python.py (what `make` runs before building .venv) asks for a Python every pinned release of
    the tested set accepts, and names the interpreter and what to do; run for real, it passes here."""
    import importlib.metadata
    import subprocess
    import sys

    from packaging.specifiers import SpecifierSet

    sys.path.insert(0, str(ROOT / "devtools"))
    try:
        import check_python
    finally:
        sys.path.remove(str(ROOT / "devtools"))
    from packaging.utils import canonicalize_name

    minimum = ".".join(map(str, check_python.MINIMUM))
    pins = dict(
        line.split("==", 1)
        for line in (ROOT / "constraints" / "tested.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    )
    pins = {canonicalize_name(name): version for name, version in pins.items()}
    needing_more = sorted(
        f"{distribution.metadata['Name']} ({distribution.metadata['Requires-Python']})"
        for distribution in importlib.metadata.distributions()
        # Only the releases tested.txt pins: the release environments of `make test-releases` hold others.
        if pins.get(canonicalize_name(distribution.metadata["Name"])) == distribution.version
        and distribution.metadata["Requires-Python"]
        and minimum not in SpecifierSet(distribution.metadata["Requires-Python"])
    )
    assert not needing_more, f"the tested set needs more than Python {minimum}: {needing_more}"
    message = check_python.problem((3, 10, 12))
    assert message.startswith("make: Python 3.10.12 is too old") and "make PYTHON=" in message and "\n" not in message
    assert check_python.problem(check_python.MINIMUM) is None
    run = subprocess.run([sys.executable, str(ROOT / "devtools" / "check_python.py")], capture_output=True, text=True)
    assert run.returncode == 0 and run.stderr == ""


@pytest.mark.huggingface
def test_the_declared_python_is_one_the_installed_transformers_accepts():
    """setup.cfg's python_requires lower bound is a Python the installed 🤗 Transformers accepts (run under the oldest
    and the newest releases allowed by `make test-releases`): 🤗 Transformers 5 needs 3.11."""
    import configparser
    import importlib.metadata

    from packaging.specifiers import SpecifierSet

    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    (declared,) = SpecifierSet(setup["options"]["python_requires"])
    assert declared.operator == ">="
    needed = importlib.metadata.metadata("transformers")["Requires-Python"]
    assert declared.version in SpecifierSet(needed), (declared, needed)
