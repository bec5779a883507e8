"""benchmarks/lm_compare.py: its --smoke run end to end in a real subprocess (every model, JSON, plot, memory
subprocess), and the pieces its numbers rest on."""

import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "lm_compare.py"


def load_benchmark():
    spec = importlib.util.spec_from_file_location("lm_compare", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lm_compare")
    output, picture = folder / "results.json", folder / "curves.png"
    command = [sys.executable, str(SCRIPT), "--smoke", "--threads", "1", "--json", str(output), "--plot", str(picture)]
    environment = dict(os.environ, HF_HUB_OFFLINE="1")
    finished = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=environment, timeout=600)
    assert finished.returncode == 0, finished.stderr[-3000:]
    return finished.stdout, json.loads(output.read_text()), picture


def test_smoke_run_covers_every_model_on_both_corpora(smoke_run):
    stdout, results, picture = smoke_run
    benchmark = load_benchmark()
    models = [name for name, _, _ in benchmark.MODELS]
    assert list(results["models"]) == models
    assert list(results["summary"]) == ["stdlib", "pydoc"]
    for corpus in ("stdlib", "pydoc"):
        for name in models:
            run = results["runs"][corpus]["0"][name]
            assert all(math.isfinite(point["bits_per_byte"]) and point["bits_per_byte"] > 0 for point in run["curve"])
            assert [point["tokens"] for point in run["curve"]] == [0, 64, 96]  # 2 rows × 16 tokens per step
            assert run["tokens_per_second"] > 0 and math.isfinite(run["at_equal_seconds"])
            assert ("final_segments_alone" in run) == (name not in ("llama", "mamba"))
    assert picture.is_file() and picture.stat().st_size > 10_000
    assert "/ Llama" in stdout and "Mamba" in stdout


def test_smoke_models_have_the_same_parameter_count(smoke_run):
    _, results, _ = smoke_run
    parameters = results["parameters"]
    reference = parameters["llama"]
    assert len(parameters) == 8
    for name, count in parameters.items():
        assert abs(count / reference - 1) <= 0.05, (name, count, reference)
    assert results["configs"]["mamba"]["num_hidden_layers"] >= 1


def test_smoke_speed_cache_and_memory_of_every_model(smoke_run):
    _, results, _ = smoke_run
    for name in results["models"]:
        decode = results["speed"][name]["decode"]
        assert [row["context"] for row in decode] == [64, 256]
        assert all(row["decode_tokens_per_second"] > 0 and row["cache_bytes"] > 0 for row in decode)
        memory = results["memory"][name]
        assert memory["peak_resident_bytes"] > 0 and memory["peak_rise_bytes"] >= 0
    # Llama's key/value cache grows with the context; DeltaNet's fast-weight memory does not.
    llama = [row["cache_bytes"] for row in results["speed"]["llama"]["decode"]]
    deltanet = [row["cache_bytes"] for row in results["speed"]["deltanet"]["decode"]]
    assert llama[1] > 2 * llama[0] and deltanet[1] == deltanet[0]


def test_segments_alone_equals_carried_evaluation_when_each_stream_is_one_segment():
    """With one segment per stream there is nothing to carry: the benchmark's evaluation without memory must give
    exactly what memlm train's `evaluate` gives (same streams, targets and bytes)."""
    from memlm import DeltaNetConfig, DeltaNetForCausalLM
    from memlm.tokenization import byte_level_tokenizer
    from memlm.training.pretrain import evaluate, token_byte_lengths

    benchmark = load_benchmark()
    torch.manual_seed(0)
    model = DeltaNetForCausalLM(DeltaNetConfig.from_preset("paper", vocab_size=258, hidden_size=16,
                                                           num_hidden_layers=1, num_attention_heads=2))  # fmt: skip
    byte_lengths = token_byte_lengths(byte_level_tokenizer())
    tokens = torch.randint(0, 256, (99,))
    carried = evaluate(model, tokens, 32, 3, byte_lengths, "cpu")
    alone = benchmark.evaluate_segments_alone(model, tokens, 32, 3, byte_lengths)
    assert alone["bits_per_byte"] == pytest.approx(carried["bits_per_byte"], rel=1e-6)
    assert alone["tokens"] == carried["tokens"] == 96
    # With several segments per stream the two differ: the carried memory is used.
    longer = benchmark.evaluate_segments_alone(model, tokens, 8, 3, byte_lengths)
    assert longer["bits_per_byte"] != pytest.approx(
        evaluate(model, tokens, 8, 3, byte_lengths, "cpu")["bits_per_byte"]
    )


def test_bits_per_byte_at_equal_seconds_interpolates_the_curve():
    benchmark = load_benchmark()
    curve = [{"seconds": 0.0, "bits_per_byte": 8.0}, {"seconds": 2.0, "bits_per_byte": 4.0},
             {"seconds": 4.0, "bits_per_byte": 3.0}]  # fmt: skip
    assert benchmark.at_seconds(curve, 1.0) == pytest.approx(6.0)
    assert benchmark.at_seconds(curve, 3.0) == pytest.approx(3.5)
    assert benchmark.at_seconds(curve, 9.0) == 3.0


def test_cache_bytes_counts_each_storage_once():
    benchmark = load_benchmark()
    shared = torch.zeros(4, 8)

    class Layer:
        def __init__(self):
            self.keys, self.view, self.other = shared, shared[:2], [torch.zeros(3, dtype=torch.float64)]

    assert benchmark.report.cache_bytes([Layer(), Layer()]) == 4 * 8 * 4 + 2 * 3 * 8


def test_unknown_corpus_and_bad_options_are_refused():
    benchmark = load_benchmark()
    with pytest.raises(ValueError, match="--corpus must be one of"):
        benchmark.corpus_documents("enwik8", 1000)
    for arguments in (["--steps", "0"], ["--seeds", "1", "1"], ["--warmup-steps", "5", "--steps", "5"]):
        with pytest.raises(SystemExit):
            benchmark.parse_arguments(["--smoke", *arguments])


def test_report_writes_the_docs_and_hub_cards_from_the_json(smoke_run, tmp_path, monkeypatch):
    """--report renders the performance page's section, each model page's and each hub card's from a run's JSON: a
    number or a verdict changed in the JSON changes the text, the rest of each file is kept, a second report replaces
    the section, and a saved model's card (hub_card.render_model_card) still renders with it."""
    from memlm import DeltaNetConfig, DeltaNetForCausalLM, hub_card

    _, results, _ = smoke_run
    benchmark = load_benchmark()
    cards = tmp_path / "hub_cards"
    cards.mkdir()
    for card in (ROOT / "hub_cards").glob("*.md"):
        (cards / card.name).write_text(card.read_text(encoding="utf-8"), encoding="utf-8")
    readme = tmp_path / "performance" / "language-modelling.md"
    readme.parent.mkdir()
    readme.write_text("# Benchmarks\n\nKept as it is.\n", encoding="utf-8")
    pages = tmp_path / "models"
    pages.mkdir()
    (pages / "deltanet.md").write_text("# DeltaNet\n\nKept.\n", encoding="utf-8")
    # Set bits per byte so that the delta rule wins on stdlib in every seed and loses on pydoc in every seed.
    summary = results["summary"]
    summary["stdlib"]["deltanet"]["final"] = {"mean": 1.2345, "low": 1.2, "high": 1.3, "values": [1.2, 1.3]}
    summary["stdlib"]["linear_transformer"]["final"] = {"mean": 1.5, "low": 1.4, "high": 1.6, "values": [1.4, 1.6]}
    summary["pydoc"]["deltanet"]["final"] = {"mean": 2.5, "low": 2.4, "high": 2.6, "values": [2.4, 2.6]}
    summary["pydoc"]["linear_transformer"]["final"] = {"mean": 2.0, "low": 1.9, "high": 2.1, "values": [1.9, 2.1]}
    results["seconds"] = 4321.0
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results), encoding="utf-8")
    arguments = ["--report", str(path), "--report-page", str(readme), "--hub-cards", str(cards), "--plot", "",
                 "--model-pages", str(pages)]  # fmt: skip
    benchmark.main(arguments)
    text = readme.read_text(encoding="utf-8")
    assert text.startswith("# Benchmarks\n\nKept as it is.\n") and text.count(benchmark.BEGIN) == 1
    section = text[text.index(benchmark.BEGIN) : text.index(benchmark.END)]
    assert "1.234 (1.200–1.300)" in section and "72 min 1 s" in section
    delta_rule = next(line for line in section.splitlines() if line.startswith("- the delta rule"))
    assert "stdlib **reproduced**" in delta_rule and "pydoc **not reproduced**" in delta_rule
    assert results["machine"]["torch"] in section
    for name in results["models"]:
        assert benchmark.LABELS[name] in section
    deltanet_card = (cards / "deltanet.md").read_text(encoding="utf-8")
    assert deltanet_card.count("## Measured comparison") == 1 and "1.234 (1.200–1.300)" in deltanet_card
    assert deltanet_card.index(benchmark.END) < deltanet_card.index("## Citation")  # the citation stays last
    assert "Feedback Transformer |" not in deltanet_card  # each card shows its own models
    assert "Feedback Transformer |" in (cards / "feedback_transformer.md").read_text(encoding="utf-8")
    # The model page: the card's table, without "not this checkpoint", linking to the whole comparison.
    page = (pages / "deltanet.md").read_text(encoding="utf-8")
    assert page.startswith("# DeltaNet\n\nKept.\n") and "1.234 (1.200–1.300)" in page
    assert "not this checkpoint" not in page and "](../performance/language-modelling.md)" in page
    assert not (pages / "expire_span.md").exists()  # only the pages that exist are written
    # Within the spread when the seeds' ranges overlap; a second report replaces the section.
    summary["stdlib"]["linear_transformer"]["final"] = {"mean": 1.25, "low": 1.1, "high": 1.4, "values": [1.1, 1.4]}
    path.write_text(json.dumps(results), encoding="utf-8")
    benchmark.main(arguments)
    text = readme.read_text(encoding="utf-8")
    assert text.count(benchmark.BEGIN) == text.count(benchmark.END) == 1 and "stdlib **within the spread**" in text
    # A saved model's card is rendered from the template with its generated section.
    monkeypatch.setattr(hub_card, "_template_text", lambda name: (cards / name).read_text(encoding="utf-8"))
    model = DeltaNetForCausalLM(DeltaNetConfig.from_preset("paper", vocab_size=258, hidden_size=16,
                                                           num_hidden_layers=1, num_attention_heads=2))  # fmt: skip
    rendered = hub_card.render_model_card(model, "deltanet.md", model_id="someone/deltanet")
    assert "## Measured comparison" in rendered and "1.234 (1.200–1.300)" in rendered and "$" not in rendered


def test_summary_of_a_model_trained_with_the_first_seed_only():
    """--one-seed-models: such a model is summarised over its one seed, and the equal-time budget of every seed is
    the fastest of the models trained with every seed (here Llama, though the one-seed model is faster)."""
    benchmark = load_benchmark()

    def run(seconds, final):
        curve = [{"step": 0, "tokens": 0, "seconds": 0.0, "bits_per_byte": 8.0},
                 {"step": 2, "tokens": 64, "seconds": seconds, "bits_per_byte": final}]  # fmt: skip
        return {"curve": curve, "training_seconds": seconds, "tokens_per_second": 64 / seconds, "final": final}

    runs = {"stdlib": {0: {"llama": run(2.0, 4.0), "mamba": run(1.0, 6.0)}, 1: {"llama": run(4.0, 5.0)}}}
    summary = benchmark.summarise(runs, ["stdlib"], ["llama", "mamba"])["stdlib"]
    assert summary["llama"]["final"]["values"] == [4.0, 5.0] and summary["mamba"]["final"]["values"] == [6.0]
    assert runs["stdlib"][0]["mamba"]["at_equal_seconds"] == 6.0  # read at Llama's 2 s: past its end
    assert runs["stdlib"][1]["llama"]["equal_seconds_budget"] == 4.0
    arguments = benchmark.parse_arguments(["--smoke", "--seeds", "0", "1"])
    assert [benchmark.trains(name, 1, arguments) for name in ("llama", "mamba")] == [True, False]
    with pytest.raises(SystemExit):
        benchmark.parse_arguments(["--smoke", "--one-seed-models", "llama"])


def test_a_smoke_run_does_not_draw_over_the_measured_picture(tmp_path):
    """Without --plot, a smoke run's meaningless curves go to the temporary folder, and parsing its arguments creates
    nothing there; a full run's go to the committed PNG."""
    benchmark = load_benchmark()
    before = set(os.listdir(tempfile.gettempdir()))
    smoke = benchmark.parse_arguments(["--smoke"]).plot
    created = set(os.listdir(tempfile.gettempdir())) - before  # (a folder per parse once piled up there)
    assert not [name for name in created if "lm_compare" in name]
    assert smoke != benchmark.DEFAULT_PLOT
    assert os.path.realpath(smoke).startswith(os.path.realpath(tempfile.gettempdir()))
    assert benchmark.parse_arguments([]).plot == benchmark.DEFAULT_PLOT
    assert benchmark.parse_arguments(["--smoke", "--plot", str(tmp_path / "x.png")]).plot == str(tmp_path / "x.png")
