"""The documentation's contracts besides its examples (tests/docs/test_examples.py): a short README that still holds
what the wheel check runs, config references that cover every field, measured sections that are the script's output
for the JSON in the repository, and model cards whose examples run and which link to the model pages."""

import importlib.util
import json
import os
import re
from pathlib import Path

import pytest
import torch

import memlm
from memlm import hub_card
from memlm.tokenization import byte_level_tokenizer

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
# Each model: its config class, its model class, its model page and card (docs/models/<page>, hub_cards/<page>).
MODELS = {
    "deltanet.md": (memlm.DeltaNetConfig, memlm.DeltaNetForCausalLM),
    "expire_span.md": (memlm.ExpireSpanConfig, memlm.ExpireSpanForCausalLM),
    "feedback_transformer.md": (memlm.FeedbackTransformerConfig, memlm.FeedbackTransformerForCausalLM),
}
TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2}


def load_lm_compare():
    spec = importlib.util.spec_from_file_location("lm_compare", ROOT / "benchmarks" / "lm_compare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def marked_section(text: str, begin: str, end: str) -> str:
    assert text.count(begin) == 1 and text.count(end) == 1, "the generated section's markers are not there once"
    return text[text.index(begin) + len(begin) : text.index(end)].strip("\n")


def test_the_readme_fits_on_a_screen_or_two_and_keeps_what_the_wheel_check_runs():
    text = README.read_text(encoding="utf-8")
    assert len(text) < 8000, f"README.md has {len(text)} characters; move detail into docs/"
    usage = text.split("\n## Usage\n", 1)[1].split("\n## ", 1)[0]  # tests/installed/check_wheel.py: readme_block
    block = re.search(r"```python\n(.*?)```", usage, flags=re.DOTALL).group(1)
    assert (
        'save_pretrained("my-deltanet")' in block and "tokenizer.save_pretrained" in block and "import torch" in block
    )


def test_the_readme_s_links_lead_to_files_that_exist():
    text = README.read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    assert links
    missing = [link for link in links if "://" not in link and not (ROOT / link).exists()]
    assert not missing, f"README.md links to {missing}"


@pytest.mark.parametrize("page", list(MODELS))
def test_every_config_field_is_documented_in_the_config_s_docstring(page):
    """The configuration reference of each model page is generated from these docstrings (mkdocstrings): a field
    added without its line would be missing there, and a line of a removed field would describe nothing."""
    config_class, _ = MODELS[page]
    fields = set(config_class.__annotations__)  # the class's own fields, as 🤗's dataclass takes them
    arguments = config_class.__doc__.split("\n    Args:\n", 1)[1].split("\n\n", 1)[0]
    documented = set(re.findall(r"^        (\w+):", arguments, flags=re.MULTILINE))
    assert documented == fields, (
        f"undocumented: {sorted(fields - documented)}; not fields: {sorted(documented - fields)}"
    )


@pytest.mark.parametrize("page", list(MODELS))
def test_each_model_page_generates_its_configuration_reference_from_the_code(page):
    config_class, model_class = MODELS[page]
    text = (ROOT / "docs" / "models" / page).read_text(encoding="utf-8")
    configuration = text.split("\n## Configuration\n", 1)[1].split("\n## ", 1)[0]
    assert f"::: memlm.{config_class.__name__}" in configuration
    assert f"::: memlm.{model_class.__name__}" in text
    assert "| field" not in configuration  # no hand-written copy of the reference beside the generated one


def test_the_measured_sections_are_what_lm_compare_writes_from_its_json():
    """docs/performance/language-modelling.md, each model page and each hub card hold the sections `python
    benchmarks/lm_compare.py --report benchmarks/lm_compare.json` writes: no number was typed in by hand."""
    lm_compare = load_lm_compare()
    results = json.loads((ROOT / "benchmarks" / "lm_compare.json").read_text(encoding="utf-8"))
    page = Path(lm_compare.REPORT_PAGE)
    text = page.read_text(encoding="utf-8")
    expected = lm_compare.report_section(results, os.path.relpath(lm_compare.DEFAULT_PLOT, page.parent))
    assert marked_section(text, lm_compare.BEGIN, lm_compare.END) == expected
    for name in MODELS:
        model_page = ROOT / "docs" / "models" / name
        link = os.path.relpath(page, model_page.parent)
        section = marked_section(model_page.read_text(encoding="utf-8"), lm_compare.BEGIN, lm_compare.END)
        assert section == lm_compare.card_section(results, name, link), name
        card = marked_section(
            (ROOT / "hub_cards" / name).read_text(encoding="utf-8"), lm_compare.BEGIN, lm_compare.END
        )
        assert card == lm_compare.card_section(results, name), name


# Each measured section of the speed page: the script that writes it, its JSON under benchmarks/results/, and the
# function of the script that turns that JSON into the section.
SPEED_SECTIONS = {
    "delta_rule": ("delta_rule.py", "delta_rule.json", "docs_section"),
    "expire_span": ("expire_span.py", "expire_span.json", "docs_section"),
    "feedback": ("feedback.py", "feedback.json", "docs_section"),
    "paper_layouts": ("paper_layouts.py", "paper_layouts.json", "docs_section"),
    "speculative_decoding": ("speculative_decoding.py", "speculative_decoding.json", "docs_section"),
    "compiled_decoding": ("compiled_decoding.py", "compiled_decoding.json", "docs_section"),
    "batched_decoding": ("batched_decoding.py", "batched_decoding.json", "docs_section"),
    "onnx_decoding": ("onnx_decoding.py", "onnx_decoding.json", "docs_section"),
    # The report of a `make gpu-check` run on a GPU; until one is kept the section says it is not measured.
    "gpu_check": ("gpu_speed.py", "gpu_check.json", "docs_section"),
    "kernel_costs_static_sm_90": ("kernel_costs.py", "kernel_costs_static_sm_90.json", "static_section"),
    "kernel_costs_static_sm_80": ("kernel_costs.py", "kernel_costs_static_sm_80.json", "static_section"),
}


def test_every_measured_section_of_the_speed_page_is_checked_against_its_json():
    page = (ROOT / "docs" / "performance" / "speed.md").read_text(encoding="utf-8")
    assert sorted(re.findall(r"<!-- (\w+): begin;", page)) == sorted(SPEED_SECTIONS)


@pytest.mark.parametrize("section", sorted(SPEED_SECTIONS))
def test_the_speed_page_s_measured_sections_are_what_the_scripts_write_from_their_json(section, monkeypatch):
    """Every figure of docs/performance/speed.md between a section's markers is what `python benchmarks/SCRIPT
    --report benchmarks/results/JSON` writes: measured by the script in one run, never typed in."""
    script, results, function = SPEED_SECTIONS[section]
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # the scripts import their sibling report.py
    spec = importlib.util.spec_from_file_location(script.removesuffix(".py"), ROOT / "benchmarks" / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    path = ROOT / "benchmarks" / "results" / results
    # Only the GPU section may have no JSON yet: then its function is given None.
    results = None if section == "gpu_check" and not path.is_file() else json.loads(path.read_text(encoding="utf-8"))
    import report

    assert report.section_text(report.SPEED_PAGE, section) == getattr(module, function)(results)


def test_the_quantization_guide_s_table_is_what_its_script_writes_from_its_json(monkeypatch):
    """The table of docs/guides/quantization.md is `python benchmarks/quantization.py --report
    benchmarks/results/quantization.json`: one run's measurements."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("quantization", ROOT / "benchmarks" / "quantization.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    results = json.loads((ROOT / "benchmarks" / "results" / "quantization.json").read_text(encoding="utf-8"))
    import report

    assert not results["settings"]["quick"]
    assert report.section_text(module.GUIDE, module.SECTION.name) == module.docs_section(results)


def test_the_cards_link_to_the_model_pages_where_the_site_is_meant_to_be():
    site_url = re.search(r"^site_url: (\S+)$", (ROOT / "mkdocs.yml").read_text(encoding="utf-8"), re.MULTILINE)
    assert site_url.group(1) == hub_card.DOCUMENTATION_URL and hub_card.DOCUMENTATION_URL.endswith("/")
    for name in MODELS:
        template = (ROOT / "hub_cards" / name).read_text(encoding="utf-8")
        assert f"${{documentation_url}}models/{name.removesuffix('.md')}/" in template, name
        assert (ROOT / "docs" / "models" / name).is_file()


@pytest.mark.huggingface
@pytest.mark.parametrize("name", list(MODELS))
def test_the_card_s_examples_run_on_a_saved_model(name, tmp_path, monkeypatch):
    """A saved checkpoint's README.md is the rendered card: its examples, with the card's model id pointing at the
    checkpoint's folder, run (with memlm and, through the bundled code, as remote code)."""
    config_class, model_class = MODELS[name]
    tokenizer = byte_level_tokenizer()
    torch.manual_seed(0)
    model = model_class(config_class(vocab_size=len(tokenizer), **TINY))
    folder = tmp_path / "checkpoint"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    card = hub_card.render_model_card(model, name, model_id=str(folder))
    assert f"{hub_card.DOCUMENTATION_URL}models/{name.removesuffix('.md')}/" in card
    blocks = re.findall(r"^```python\n(.*?)^```", card, flags=re.MULTILINE | re.DOTALL)
    assert len(blocks) >= 2
    monkeypatch.chdir(tmp_path)
    namespace = {}
    for block in blocks:
        exec(compile(block, f"hub_cards/{name}", "exec"), namespace)
    assert isinstance(namespace["model"], torch.nn.Module)
