"""The speed scripts' model tables (benchmarks/delta_rule.py, benchmarks/expire_span.py) in a real subprocess with
their shortest settings: the tables that README's figures come from run, and their options do what they say."""

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def run_script(name: str, *arguments: str, output: Path) -> dict:
    environment = os.environ | {"HF_HUB_OFFLINE": "1"}
    command = [sys.executable, str(ROOT / "benchmarks" / name), *arguments, "--json", str(output)]
    finished = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=600)
    assert finished.returncode == 0, finished.stderr[-3000:]
    return json.loads(output.read_text())


def test_deltanet_model_table_compares_same_size_llama_and_mamba(tmp_path):
    results = run_script("delta_rule.py", "--quick", "--tables", "models", output=tmp_path / "results.json")
    assert set(results) == {"settings", "models"}  # --tables models: only the model comparison ran
    models = results["models"]
    counts = models["parameters"]
    assert set(counts) == {"deltanet", "llama", "mamba"}
    assert max(counts.values()) / min(counts.values()) < 1.05  # same size within 5 %
    for row in models["training"]:
        assert row["deltanet_tokens_per_s"] > 0 and row["llama_tokens_per_s"] > 0
        assert row["mamba_tokens_per_s"] is None  # Mamba's training is timed only with --mamba-training
        assert abs(row["deltanet_over_llama"] - row["deltanet_tokens_per_s"] / row["llama_tokens_per_s"]) < 1e-9
    assert [row["context"] for row in models["decode"]] == list(results["settings"]["model_decode_contexts"])
    for row in models["decode"]:
        assert min(row["deltanet_tokens_per_s"], row["llama_tokens_per_s"], row["mamba_tokens_per_s"]) > 0
        assert abs(row["deltanet_over_mamba"] - row["deltanet_tokens_per_s"] / row["mamba_tokens_per_s"]) < 1e-9


def test_expire_span_generation_table_at_the_contexts_asked(tmp_path):
    arguments = ("--tables", "generation", "--contexts", "64", "160", "--decode-steps", "2", "--repeats", "1")
    results = run_script("expire_span.py", *arguments, "--threads", "1", output=tmp_path / "results.json")
    assert not results.get("training")  # --tables generation: the training table did not run
    decode = results["decode"]
    for model in ("expire_span", "fixed"):
        assert [row["context"] for row in decode[model]] == [64, 160]
        assert all(row["ms_per_token"] > 0 and row["memory_entries"] > 0 for row in decode[model])


def test_deltanet_decode_table_times_each_context_it_was_asked(tmp_path):
    arguments = ("--quick", "--tables", "decode", "--repeats", "1", "--decode-steps", "2")
    results = run_script("delta_rule.py", *arguments, output=tmp_path / "results.json")
    rows = results["decode"]
    assert [row["context"] for row in rows] == list(results["settings"]["decode_contexts"])
    assert all(row["ms_per_token"] > 0 for row in rows)
    # One round (--quick): the median of the rounds' ratios is that round's ratio, the figures' ratio.
    assert rows[0]["over_shortest"] == 1
    assert abs(rows[-1]["over_shortest"] / (rows[-1]["ms_per_token"] / rows[0]["ms_per_token"]) - 1) < 1e-9


def test_step_profile_puts_each_op_in_the_region_of_the_memlm_operation_that_ran_it():
    """benchmarks/step_profile.py: ops inside DPFP or the chunkwise delta rule (forward or backward) count for that
    region, the products outside them for the rest of the model."""
    import importlib.util

    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location("step_profile", ROOT / "benchmarks" / "step_profile.py")
        step_profile = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(step_profile)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    from memlm.kernels.delta_rule import delta_rule
    from memlm.kernels.delta_rule.feature_map import dpfp

    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(1, 2, 128, 16, generator=generator, requires_grad=True)
    values = torch.randn(1, 2, 128, 32, generator=generator)
    weight = torch.randn(32, 32, generator=generator, requires_grad=True)

    def step():
        features = dpfp(inputs, 1, "sum")
        output, _ = delta_rule(features, features, values, backend="torch")
        (output @ weight).sum().backward()

    totals, seconds, faults = step_profile.profile_step(step, steps=1)
    regions = {region for region, _ in totals}
    assert {"DPFP", "delta rule", "rest of the model"} <= regions
    assert ("delta rule", "products") in totals and ("rest of the model", "products") in totals
    assert ("DPFP", "products") not in totals  # DPFP is element-wise only
    assert seconds > 0 and faults >= 0 and all(value > 0 for value in totals.values())


def test_step_profile_decode_splits_feedback_decoding_into_attention_and_products():
    """`step_profile.py --decode`: a "step" is feedback.py's decoding of 64 tokens (here after 32, not 2048), where
    the reads of the ring (SDPA) and the batch-1 products both show."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import step_profile

        totals, _, _ = step_profile.profile_step(step_profile.build("feedback", decode=True, context=32), steps=1)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert ("attention (SDPA)", "other") in totals and ("rest of the model", "products") in totals
    assert ("step loop", "products") not in totals  # no training: the hand-written backward's region stays empty


def test_step_profile_generate_ops_counts_every_model_of_the_generate_table(tmp_path):
    results = run_script("step_profile.py", "--generate-ops", "--quick", output=tmp_path / "results.json")
    counts = results["operations_per_token"]
    assert set(counts) == {f"{family}_{layout}" for family in ("deltanet", "expire_span", "feedback")
                           for layout in ("default", "official")} | {"llama"}  # fmt: skip
    assert all(per_token["aten::linear"] > 0 for per_token in counts.values())
    assert results["settings"]["context"] == 16 and results["settings"]["tokens"] == 3
    # --context: after 80 tokens the quick Expire-Span's memories (spans up to 64, ramp 8) are on the ramp and its
    # step builds the soft mask (more operations); 🤗 Llama's step stays the same
    later = run_script(
        "step_profile.py", "--generate-ops", "--quick", "--context", "80", output=tmp_path / "later.json"
    )
    assert later["settings"]["context"] == 80
    later_counts = later["operations_per_token"]
    assert later_counts["llama"] == counts["llama"]
    assert sum(later_counts["expire_span_default"].values()) > sum(counts["expire_span_default"].values())


CALLGRIND = shutil.which("valgrind") is not None and shutil.which("callgrind_control") is not None


@pytest.mark.skipif(not CALLGRIND, reason="needs valgrind's callgrind (valgrind and callgrind_control)")
def test_step_profile_counts_the_instructions_of_a_generated_token_under_callgrind(tmp_path):
    """`step_profile.py --instructions` runs itself under callgrind and reads each model's counts back: every model
    of the generate() table, a count per token that a decoding step of these tiny models can take (a step runs a
    few hundred operations, each thousands of instructions)."""
    results = run_script("step_profile.py", "--instructions", "--quick", output=tmp_path / "results.json")
    counts = results["instructions_per_token"]
    assert list(counts) == [f"{family}_{layout}" for family in ("deltanet", "expire_span", "feedback")
                            for layout in ("default", "official")] + ["llama"]  # fmt: skip
    assert all(1e5 < count < 1e8 for count in counts.values()), counts


def test_step_profile_names_what_instruction_counts_need_when_valgrind_is_missing(tmp_path):
    environment = os.environ | {"HF_HUB_OFFLINE": "1", "PATH": str(tmp_path)}  # (no valgrind there)
    command = [sys.executable, str(ROOT / "benchmarks" / "step_profile.py"), "--instructions", "--quick"]
    finished = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=600)
    assert finished.returncode != 0
    assert "runs under valgrind's callgrind; not found: valgrind, callgrind_control" in finished.stderr


@pytest.mark.parametrize("mode", ["--instructions", "--generate-ops"])
def test_step_profile_counts_refuse_fewer_than_two_tokens(mode, monkeypatch, capsys):
    """A count per token is the difference of a call for `--tokens` new tokens and a call for one: one is refused."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import step_profile

    with pytest.raises(SystemExit):
        step_profile.main([mode, "--tokens", "1"])
    assert "--tokens must be at least 2 and --context positive, got 1 and 128" in capsys.readouterr().err


def test_step_profile_counts_the_operations_of_one_generated_token():
    """`step_profile.py --generate-ops`: the operations of one token of generate(), the prompt's forward cancelled out
    (the same count after a short and a longer prompt for 🤗 Llama, whose step does not depend on it), and all of a
    step's products counted: seven a layer and the head's, each once (linear's inner addmm not again)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import paper_layouts
        import step_profile
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    llama = paper_layouts.generation_models(quick=True)["llama"]
    short, longer = (step_profile.operations_per_token(llama, context, 3) for context in (8, 24))
    assert short == longer
    assert short["aten::linear"] == 7 * llama.config.num_hidden_layers + 1 and "aten::addmm" not in short
    assert short["aten::scaled_dot_product_attention"] == llama.config.num_hidden_layers


def test_expire_span_training_table_measures_the_max_spans_asked(monkeypatch):
    """`--max-spans` sets the training table's rows (each measurement is a subprocess, replaced here by a recorder:
    a real one takes about 20 s even at the smallest sizes): per span, one process timing both models in turns and
    one per model measuring its peak memory."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import expire_span
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    measured = []

    def record(kind, args, memory=False, **values):
        if memory:
            measured.append((values["max_span"], values["expire"]))
            return {"peak_rise_mib": 4.0 if values["expire"] else 8.0, "memory_entries": 8}
        measured.append((values["max_span"], "times"))
        figures = {"step_seconds": 0.5, "memory_entries": 8}
        return {"fixed": dict(figures), "expire_span": dict(figures), "speed_up": 1.25}

    monkeypatch.setattr(expire_span, "run_isolated", record)
    args = expire_span.argument_parser().parse_args(["--tables", "training", "--max-spans", "64", "96"])
    results = {"training": [], "decode": {}}
    expire_span.run_tables(args, results)
    assert [row["max_span"] for row in results["training"]] == [64, 96]
    assert measured == [(span, what) for span in (64, 96) for what in ("times", False, True)]
    rows = expire_span.training_rows(results)
    assert [(row["speed_up"], row["memory_ratio"]) for row in rows] == [(1.25, 2.0), (1.25, 2.0)]


def test_expire_span_training_times_both_models_in_turns_at_their_steady_state(monkeypatch):
    """What the training table's timing subprocess runs (`training_times`), in this process at a small size: both
    models' steps in turns from a memory already at its steady state, and the speed-up as the median of the rounds'
    ratios (checked against the rounds themselves)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import expire_span
    import report

    kept = {}
    interleaved = report.interleaved_times

    def keep_rounds(functions, warmup, repeats, timed_inside=False):
        kept.update(interleaved(functions, warmup, repeats, timed_inside))
        return kept

    monkeypatch.setattr(report, "interleaved_times", keep_rounds)
    args = expire_span.argument_parser().parse_args(["--segment", "64", "--block-size", "32", "--repeats", "3"])
    result = expire_span.training_times(512, args)
    assert set(kept) == {"fixed", "expire_span"} and all(len(rounds) == 3 for rounds in kept.values())
    for name in ("fixed", "expire_span"):
        assert result[name]["step_seconds"] == sorted(kept[name])[1]
    ratios = sorted(fixed / expiring for fixed, expiring in zip(kept["fixed"], kept["expire_span"]))
    assert result["speed_up"] == ratios[1]
    # The fixed span keeps every memory up to L = 512 (+ a block); Expire-Span's spans start at L/8 (+ the ramp, 128).
    assert result["fixed"]["memory_entries"] > result["expire_span"]["memory_entries"] > 0


def test_the_feedback_table_reads_its_time_ratios_from_the_rounds_and_its_cache_ratio_from_the_figures(monkeypatch):
    """feedback.py keeps each timed ratio as the median of the rounds' ratios (`over_llama`); the table and the goal
    line print those, not the ratio of the two medians (here made different on purpose)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import feedback

    figures = {"train_tokens_per_s": 100.0, "decode_512_tokens_per_s": 300.0, "decode_2048_tokens_per_s": 400.0,
               "cache_bytes_per_token": 2048.0}  # fmt: skip
    llama = {key: 200.0 for key in figures} | {"cache_bytes_per_token": 8192.0}
    paired = {"train_tokens_per_s": 0.52, "decode_512_tokens_per_s": 1.4, "decode_2048_tokens_per_s": 2.1}
    results = {
        "settings": {
            "batch_size": 32,
            "length": 256,
            "decode_steps": 64,
            "repeats": 7,
            "date": "2026-12-02",
            "processor": "CPU",
            "cpus": 2,
            "torch": "2",
            "threads": 2,
        },  # fmt: skip
        "results": {"feedback": figures | {"over_llama": paired}, "llama": llama},
    }
    ratios = [row["feedback_over_llama"] for row in feedback.table_rows(results)]
    assert ratios == [0.52, 1.4, 2.1, 0.25]
    assert "training 0.52× (goal ≥ 0.5×: met); decoding at 2K 2.10× (goal ≥ 2.0×: met)" in feedback.docs_section(
        results
    )


def test_paper_layouts_table_times_each_family_s_two_layouts_of_the_same_size(tmp_path):
    results = run_script("paper_layouts.py", "--quick", output=tmp_path / "results.json")
    assert [row["family"] for row in results["rows"]] == [
        "DeltaNet (lmtool-fwp)", "Expire-Span (transformer-sequential)", "Feedback (transformer-sequential)"
    ]  # fmt: skip
    for row in results["rows"]:
        assert abs(row["official_parameters"] / row["default_parameters"] - 1) < 0.05  # same size within 5 %
        for kind in ("training", "decode"):
            official, default = row[f"official_{kind}_tokens_per_s"], row[f"default_{kind}_tokens_per_s"]
            assert official > 0 and default > 0
            assert abs(row[f"{kind}_official_over_default"] - official / default) < 1e-9  # (one round)
        assert row["default_cache_megabytes"] > 0 and row["official_cache_megabytes"] > 0
        peaks = row["official_training_peak_megabytes"], row["default_training_peak_megabytes"]
        assert all(peak > 0 for peak in peaks)  # each step, in its own process, raised the high-water mark
        assert abs(row["training_peak_official_over_default"] - peaks[0] / peaks[1]) < 1e-9
    # The generate() table: a row per context asked, every layout of every family and Llama timed in it.
    assert results["settings"]["generate_contexts"] == [8, 16]
    models = [f"{family}_{layout}" for family in ("deltanet", "expire_span", "feedback")
              for layout in ("default", "official")]  # fmt: skip
    for row, context in zip(results["generation"], (8, 16), strict=True):
        assert row["context"] == context and row["llama_tokens_per_s"] > 0
        for name in models:  # (the ratios are per round: `report.paired_speedup`, tested below)
            assert row[f"{name}_tokens_per_s"] > 0 and row[f"{name}_over_llama"] > 0


def test_functions_timed_in_turns_keep_each_round_and_their_speedup_is_the_median_of_the_rounds_ratios(monkeypatch):
    """`report.interleaved_times`: one run of each function per round, the warm-up runs left out, the rounds in
    order; `report.paired_speedup`: the median of the rounds' ratios, not the ratio of the medians — a phase of the
    machine that slows one round slows both sides of that round's ratio."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import report

    calls = []

    def timed(name, seconds):
        def function():
            calls.append(name)
            return seconds[len([call for call in calls if call == name]) - 1]  # (timed_inside: its own seconds)

        return function

    seconds = {"llama": [9.0, 1.0, 4.0, 4.0], "model": [9.0, 2.0, 2.0, 8.0]}  # (the first run warms up)
    times = report.interleaved_times({name: timed(name, values) for name, values in seconds.items()}, 1, 3, True)
    assert times == {"llama": [1.0, 4.0, 4.0], "model": [2.0, 2.0, 8.0]} and len(calls) == 8
    assert report.paired_speedup(times, "model", "llama") == 0.5  # rounds: 1/2, 4/2, 4/8
    assert report.paired_speedup(times, "llama", "model") == 2.0
    functions = {"a": timed("a", [3.0, 1.0, 2.0]), "b": timed("b", [5.0, 7.0, 6.0])}
    assert report.interleaved_median_times(functions, 0, 3, True) == {"a": 2.0, "b": 6.0}


def test_a_ratio_judged_against_its_goal_never_prints_as_the_goal_it_missed(monkeypatch):
    """`report.judged` (the DeltaNet and Feedback sections' goals) and `report.against`: two decimals, more only where
    two would print a missed ratio as the goal itself (or a met one below it)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import report

    assert report.judged(1.2849, 1.25) == "1.28× (goal ≥ 1.25×: met)"
    assert report.judged(0.499561, 0.5) == "0.4996× (goal ≥ 0.5×: missed)"
    assert report.judged(0.49996, 0.5, " at T = 8") == "0.49996× at T = 8 (goal ≥ 0.5×: missed)"
    assert report.judged(2.5, 2.5) == "2.50× (goal ≥ 2.5×: met)"
    assert report.judged(0.3, 2.0) == "0.30× (goal ≥ 2.0×: missed)"
    # (the papers' layouts' and batched decoding's "lowest" ratios against 1×)
    assert (report.against(0.996, 1), report.against(1.0032, 1)) == ("0.996", "1.00")


def test_the_generation_goals_are_judged_from_the_contexts_each_family_is_held_to(monkeypatch):
    """Issue 40's goal line of benchmarks/paper_layouts.py: DeltaNet and Expire-Span from 64 tokens up, the Feedback
    Transformer from 512 up; a ratio below 1 in a context below a family's threshold does not count against it."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import paper_layouts

    names = [f"{family}_{layout}" for family in ("deltanet", "expire_span", "feedback") for layout in
             ("default", "official")]  # fmt: skip
    rows = [{"context": context, **{f"{name}_over_llama": 1.2 for name in names}} for context in (64, 512)]
    rows[0]["feedback_official_over_llama"] = 0.5  # below 1 only before 512 tokens: still met
    rows[1]["expire_span_official_over_llama"] = 0.9
    line = paper_layouts.generation_goals(rows)
    assert "Feedback, official: met (lowest 1.20× after 512 tokens)" in line
    assert "Expire-Span, official: missed (lowest 0.90× after 512 tokens)" in line
    assert "DeltaNet, default: met (lowest 1.20× after 64 tokens)" in line
    assert "no context of 512 tokens or more" in paper_layouts.generation_goals(rows[:1])


def test_every_model_of_the_generation_table_runs_the_same_generation_processors(monkeypatch):
    """The generate() table compares the models' steps, not generate's settings: no model has an end-of-text token
    (🤗 Llama's config has one by default, which with min_new_tokens adds two processors and a check to its steps)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import paper_layouts

    models = paper_layouts.generation_models(quick=True)
    assert "llama" in models and len(models) == 7
    for name, model in models.items():
        generation = copy.deepcopy(model.generation_config)
        generation.min_new_tokens = 8  # as the table's calls ask
        assert generation.eos_token_id is None and generation.bos_token_id is None, name
        processors = model._get_logits_processor(generation_config=generation, input_ids_seq_length=4,
                                                 encoder_input_ids=None, prefix_allowed_tokens_fn=None,
                                                 logits_processor=None)  # fmt: skip
        assert len(processors) == 0, (name, processors)


def test_a_generate_step_is_timed_from_the_first_new_token_to_the_last(monkeypatch):
    """`report.generation_step_seconds`: the seconds per token between the first new token and the last, so a slow
    prompt forward is left out and every step is in; a tiny 🤗 Llama's forward made slow by a hook that sleeps."""
    import time

    from transformers import LlamaConfig, LlamaForCausalLM

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import report

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2)).eval()  # fmt: skip
    model.register_forward_pre_hook(
        lambda module, args, kwargs: time.sleep(0.5 if kwargs["input_ids"].shape[1] > 1 else 0.05), with_kwargs=True
    )
    seconds = report.generation_step_seconds(model, torch.randint(0, 32, (1, 6)), new_tokens=4)
    assert 0.05 <= seconds < 0.25  # three steps of 0.05 s and more, not the prompt's 0.5 s


def test_a_timed_generate_step_takes_generate_s_options(monkeypatch):
    """`report.generation_step_seconds(..., **options)` hands the options to `generate` (compiled_decoding.py times
    Llama with a static cache and `compile_config` this way): each forward gets the static cache asked for."""
    from transformers import Cache, LlamaConfig, LlamaForCausalLM, StaticCache

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import report

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2)).eval()  # fmt: skip
    caches = []
    model.register_forward_pre_hook(
        lambda module, args, kwargs: caches.extend(
            type(value) for value in kwargs.values() if isinstance(value, Cache)
        ),
        with_kwargs=True,
    )
    options = {"cache_implementation": "static", "max_cache_len": 16}
    assert report.generation_step_seconds(model, torch.randint(0, 32, (1, 6)), 3, **options) > 0
    assert caches == [StaticCache] * 3  # the prompt's forward and two steps


def test_batched_decoding_times_every_batch_and_context_and_a_fixed_memory_does_not_grow(tmp_path, monkeypatch):
    """benchmarks/batched_decoding.py --quick: a row per (batch, context), every model in it but 🤗 Mamba beyond
    --mamba-context, ratios to Llama from the run's own times (one round: the ratio of its two runs); DeltaNet's
    cache keeps its size as the context grows while Llama's keys and values grow with it (and with the batch)."""
    results = run_script("batched_decoding.py", "--quick", "--mamba-context", "8", output=tmp_path / "results.json")
    rows = {(row["batch_size"], row["context"]): row for row in results["rows"]}
    assert list(rows) == [(1, 8), (1, 40), (3, 8), (3, 40)]
    for (_, context), row in rows.items():
        assert ("mamba_tokens_per_s" in row) == (context <= 8)
        for name in ("deltanet", "expire_span", "feedback", "llama"):
            assert row[f"{name}_tokens_per_s"] > 0 and row[f"{name}_cache_megabytes"] > 0
            assert abs(row[f"{name}_over_llama"] - row[f"{name}_tokens_per_s"] / row["llama_tokens_per_s"]) < 1e-9
    for batch_size in (1, 3):
        short, long = rows[batch_size, 8], rows[batch_size, 40]
        assert short["deltanet_cache_megabytes"] == long["deltanet_cache_megabytes"]
        assert (
            long["llama_cache_megabytes"] > 4 * short["llama_cache_megabytes"]
        )  # 40 keys and values per layer, not 8
    assert rows[3, 40]["llama_cache_megabytes"] == pytest.approx(3 * rows[1, 40]["llama_cache_megabytes"], rel=0.05)
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import batched_decoding

    assert batched_decoding.parse_arguments(["--models", "llama", "deltanet"]).models == ["deltanet", "llama"]
    with pytest.raises(SystemExit):
        batched_decoding.parse_arguments(["--contexts", "0"])


def test_compiled_decoding_compares_eager_and_compiled_and_times_first_compiles(tmp_path):
    """benchmarks/compiled_decoding.py --quick (Dynamo only, in one process): both ways of decoding for the three
    models, and the first compiles of each family, Expire-Span's decoding step left out (generate decodes it eagerly)."""
    results = run_script("compiled_decoding.py", "--quick", output=tmp_path / "results.json")
    assert results["settings"]["backend"] == "eager" and results["settings"]["quick"]
    assert [row["model"] for row in results["decoding"]] == ["deltanet", "feedback", "llama"]
    for row in results["decoding"]:  # (one round: its ratio is the ratio of the two runs)
        ratio = row["compiled_tokens_per_s"] / row["eager_tokens_per_s"]
        assert abs(row["compiled_over_eager"] - ratio) < 1e-9
    rows = {row["family"]: row for row in results["first_compile"]}
    assert list(rows) == ["deltanet", "expire_span", "feedback", "llama"]
    assert rows["expire_span"]["step_seconds"] is None and rows["expire_span"]["forward_over_step"] is None
    for family in ("deltanet", "feedback", "llama"):
        row = rows[family]
        assert row["step_seconds"] > 0 and row["forward_seconds"] > 0  # Dynamo's tracing, at least
        assert abs(row["forward_over_step"] - row["forward_seconds"] / row["step_seconds"]) < 1e-9


def test_speculative_decoding_table_times_three_ways_for_each_model_and_keeps_the_tokens(tmp_path):
    """benchmarks/speculative_decoding.py --quick: every model decodes plainly, with prompt lookup and with an
    assistant, the speculative ways give plain decoding's tokens, and the ratios and acceptance shares are the run's."""
    results = run_script("speculative_decoding.py", "--quick", "--threads", "1", output=tmp_path / "results.json")
    assert [row["model"] for row in results["rows"]] == ["DeltaNet", "Expire-Span", "Feedback", "🤗 Llama"]
    new_tokens = results["settings"]["new_tokens"]
    for row in results["rows"]:
        assert row["plain_forwards"] == new_tokens  # one forward per token
        for mode in ("lookup", "assistant"):
            assert row[f"{mode}_identical"] is True
            assert abs(row[f"{mode}_over_plain"] - row[f"{mode}_tokens_per_s"] / row["plain_tokens_per_s"]) < 1e-9
            assert 1 <= row[f"{mode}_forwards"] <= new_tokens
            assert row[f"{mode}_acceptance"] is None or 0 <= row[f"{mode}_acceptance"] <= 1


def test_the_harness_parses_keeps_the_json_and_only_a_full_run_rewrites_its_section(tmp_path, monkeypatch):
    """benchmarks/report.py, what every script shares: the arguments (`--quick` also spelled `--smoke`, the values
    it sets, those left unset, the positive ones), `finish` (`--json`, `--write-docs`) and `saved_run` (`--report`):
    the JSON holds the results, a --quick run never reaches the docs, a full one rewrites its section between the
    markers and nothing else, and the saved JSON rewrites it the same way."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import report

    page = tmp_path / "speed.md"
    section = report.Section("demo", "python demo.py --report demo.json", lambda results: f"rows: {results['rows']}")
    begin, end = report.markers(section.name, section.command)
    page.write_text(f"# Speed\n\n{begin}\nold\n{end}\n\nafter\n", encoding="utf-8")
    parser = report.arguments("Demo.\n\nMore.", repeats=5, threads=2, section=section)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--length", type=int, default=64)

    def parse(*argv):
        return report.parse(parser, [*argv, "--report-page", str(page)], quick={"length": 8, "repeats": 1},
                            unset={"steps": (100, 3)}, positive=("steps", "threads"))  # fmt: skip

    full, quick = parse(), parse("--smoke")
    assert (full.steps, full.length, full.repeats, full.threads, full.quick) == (100, 64, 5, 2, False)
    assert (quick.steps, quick.length, quick.repeats, quick.quick) == (3, 8, 1, True)
    assert parse("--quick", "--steps", "7").steps == 7
    with pytest.raises(SystemExit):
        parse("--threads", "0")
    saved = tmp_path / "demo.json"
    quick_run = {"settings": {"quick": True}, "rows": [1]}
    with pytest.raises(SystemExit, match="full run, not --quick"):
        report.finish(quick_run, parse("--quick", "--json", str(saved), "--write-docs"), section)
    assert json.loads(saved.read_text()) == quick_run and "\nold\n" in page.read_text()
    full_run = {"settings": {"quick": False}, "rows": [2]}
    assert report.finish(full_run, parse("--json", str(saved), "--write-docs"), section) == full_run
    assert page.read_text() == f"# Speed\n\n{begin}\nrows: [2]\n{end}\n\nafter\n"
    page.write_text(f"# Speed\n\n{begin}\nold\n{end}\n\nafter\n", encoding="utf-8")
    assert report.saved_run(parse(), section) is None  # no --report: measure
    assert report.saved_run(parse("--report", str(saved)), section) == full_run
    assert report.section_text(str(page), "demo") == "rows: [2]"
    saved.write_text(json.dumps(quick_run))
    with pytest.raises(SystemExit, match="holds a --quick one"):
        report.saved_run(parse("--report", str(saved)), section)


def test_speculative_decoding_trains_each_model_until_its_target_loss_at_most_the_steps_allowed(monkeypatch):
    """`--target-loss` stops the training as soon as the loss is below it; `--train-steps` bounds it."""
    import argparse

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import speculative_decoding

    from memlm.tokenization import byte_level_tokenizer

    tokenizer = byte_level_tokenizer()
    sequence = torch.randint(0, 256, (1, 24))
    for target, steps in ((100.0, 1), (0.0, 3)):
        model = speculative_decoding.build("deltanet", speculative_decoding.QUICK_SIZES, tokenizer)
        arguments = argparse.Namespace(target_loss=target, train_steps=3, learning_rate=1e-3)
        loss, taken = speculative_decoding.train(model, sequence, arguments)
        assert taken == steps and loss < 100 and not model.training


def test_onnx_decoding_times_three_ways_for_each_model(tmp_path):
    """benchmarks/onnx_decoding.py --quick: eager, compiled (Dynamo only) and ONNX Runtime decoding of DeltaNet, the
    Feedback Transformer and 🤗 Llama after each prompt, the ratios the run's own, and each export's seconds."""
    results = run_script("onnx_decoding.py", "--quick", output=tmp_path / "results.json")
    assert results["settings"]["quick"] and results["settings"]["contexts"] == [8, 32]
    assert [(row["model"], row["context"]) for row in results["decoding"]] == [
        (model, context) for model in ("deltanet", "feedback", "llama") for context in (8, 32)
    ]
    for row in results["decoding"]:
        assert abs(row["onnx_over_eager"] - row["onnx_tokens_per_s"] / row["eager_tokens_per_s"]) < 1e-9
        assert abs(row["onnx_over_compiled"] - row["onnx_tokens_per_s"] / row["compiled_tokens_per_s"]) < 1e-9
    exports = {row["model"]: row for row in results["exports"]}
    assert list(exports) == ["deltanet", "feedback", "llama"]
    assert all(row["export_seconds"] > 0 for row in exports.values())
    assert exports["deltanet"]["block_size"] == "4" and exports["llama"]["block_size"] == "any"
