"""How fast are memlm's kernels and models on a GPU, next to flash-linear-attention, SDPA and 🤗 Llama?

`make gpu-check` (devtools/gpu_check.py) runs both parts as stages of its time budget and keeps what they measured in
its report; the speed page's GPU section is written from that report:

    python benchmarks/gpu_speed.py kernels --results kernels.jsonl    # on a GPU: the kernel measurements
    python benchmarks/gpu_speed.py models --results models.jsonl      # on a GPU: the model measurements
    python benchmarks/gpu_speed.py --report benchmarks/results/gpu_check.json   # rewrite the speed page's GPU section

1. Kernels, bfloat16, 32K tokens per call (B = 16, 4, 1 at T = 2K, 8K, 32K), 8 heads of width 128: memlm's chunkwise
   delta rule (``delta_rule(backend="triton")``, keys L2-normalised, β in (0, 1)) next to flash-linear-attention's
   ``chunk_delta_rule`` (on its (B, T, H, D) layout) and causal ``scaled_dot_product_attention``; memlm's Expire-Span
   attention (``expire_span_attention(backend="triton")``; 20 % of the memories live through the sequence, the rest
   expire within 64 tokens, R = 32) next to causal SDPA, and the same with the papers' options (learned relative
   positions for every distance, no attention to the token itself, ε = 1e-8: "expire span attention official").
   Forward alone (no autograd) and forward + backward. Times
   are medians of ``triton.testing.do_bench`` (CUDA events, 25 ms of warm-up, 100 ms of repeats), after one untimed
   call that compiles (and autotunes) the kernels; its seconds are kept as ``first_call_seconds``.
2. Models, bfloat16, hidden 1024, 8 layers, 8 heads, vocabulary 32000, each family next to a 🤗 ``LlamaForCausalLM``
   (SDPA) of the same hidden size, layers, heads, MLP width and embedding tying: a training step (forward + backward
   of the LM loss; no optimizer) in tokens/s at B × T = 8 × 2048 (the Feedback Transformer, one step per token:
   8 × 512), and greedy decoding at batch 1 after a prompt of T tokens (64 steps through the forward with its cache,
   as benchmarks/delta_rule.py decodes), eager and then ``torch.compile``d (training; the Feedback Transformer
   compiles its decoding step with ``compile_step=True`` instead). DeltaNet runs on memlm's Triton kernels and on
   flash-linear-attention's (``MEMLM_KERNELS``). Times are medians of CUDA-event timings after two untimed calls.

Each measurement is a JSON line of ``--results``, written when it finishes; ``--seconds`` stops starting new ones when
that much time has passed (the check's stage budget), and a measurement that fails keeps its error in its line
without stopping the others. ``--smoke`` runs the same code on tiny shapes (on CPU: Triton's interpreter with
TRITON_INTERPRET=1, ``time.perf_counter`` instead of CUDA events, nothing compiled).
"""

import argparse
import functools
import json
import os
import sys
import time
import traceback

try:  # run as a script (python benchmarks/gpu_speed.py) or imported as benchmarks.gpu_speed
    import report
except ImportError:
    from benchmarks import report

KERNEL_LENGTHS = (2048, 8192, 32768)
KERNEL_TOKENS = 32768  # B · T of every call
KERNEL_HEADS, KERNEL_WIDTH = 8, 128
EXPIRE_ALIVE, EXPIRE_RAMP = 0.2, 32.0
OFFICIAL_EPSILON = 1e-8  # the official renormalisation ε (memlm.conversion.transformer_sequential)
MODEL_SIZES = {"vocab_size": 32000, "hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 8}
# (batch, tokens) of a training step, and the prompt before the timed decoding steps.
TRAINING_SHAPES = {"deltanet": (8, 2048), "expire_span": (8, 2048), "feedback": (8, 512)}
DECODE_STEPS = 64
# The models measured: (family, backend), in order; the compiled ones come after all the eager ones.
MODEL_RUNS = (("deltanet", "triton"), ("deltanet", "fla"), ("expire_span", "triton"), ("feedback", "torch"))
COMPILED_RUNS = (("deltanet", "triton"), ("expire_span", "triton"), ("feedback", "torch"))
SMOKE = {
    "kernel_lengths": (16,),
    "kernel_tokens": 16,
    "kernel_heads": 2,
    "kernel_width": 16,
    "model_sizes": {"vocab_size": 258, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2},
    "training_shapes": {"deltanet": (2, 16), "expire_span": (2, 16), "feedback": (2, 8)},
    "decode_steps": 3,
}


# --- Timing ---------------------------------------------------------------------------------------------------------


def median_milliseconds(function, device, repeats: int = 3) -> float:
    """Median milliseconds of ``function()``: ``triton.testing.do_bench`` on CUDA, ``time.perf_counter`` on CPU."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(function, warmup=25, rep=100, return_mode="median"))
    return report.median_seconds(function, 0, repeats) * 1e3


def synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


# --- Kernels --------------------------------------------------------------------------------------------------------


def _delta_rule_inputs(batch, length, heads, width, device, dtype, generator):
    import torch
    import torch.nn.functional as F

    shape = (batch, heads, length, width)
    query = F.normalize(torch.randn(shape, device=device, generator=generator), dim=-1) * width**-0.5
    key = F.normalize(torch.randn(shape, device=device, generator=generator), dim=-1)
    value = torch.randn(shape, device=device, generator=generator)
    beta = torch.rand(shape[:3], device=device, generator=generator)
    return [tensor.to(dtype).requires_grad_() for tensor in (query, key, value, beta)]


def _generator(device):
    import torch

    return torch.Generator(device=device).manual_seed(0)


def kernel_cases(lengths, tokens, heads, width, device, dtype):
    """(description, build) per measurement: ``build()`` makes the inputs and returns (call, leaves), ``call()``
    running the operation once and returning its output, ``leaves`` the inputs that take gradients. Causal SDPA is
    measured once per T, as the operation ``"sdpa"``: both tables of the speed page compare with it."""
    import torch
    import torch.nn.functional as F

    from memlm.kernels.delta_rule import delta_rule
    from memlm.kernels.expire_attention import expire_span_attention

    def memlm_delta_rule(batch, length):
        query, key, value, beta = _delta_rule_inputs(batch, length, heads, width, device, dtype, _generator(device))
        return (lambda: delta_rule(query, key, value, beta, backend="triton")[0]), [query, key, value, beta]

    def fla_delta_rule(batch, length):
        if device.type != "cuda":
            raise RuntimeError("flash-linear-attention's kernels are timed on CUDA only")
        from fla.ops.delta_rule import chunk_delta_rule

        tensors = _delta_rule_inputs(batch, length, heads, width, device, dtype, _generator(device))
        query, key, value, beta = (tensor.detach().transpose(1, 2).contiguous().requires_grad_() for tensor in tensors)
        return (lambda: chunk_delta_rule(query, key, value, beta, scale=1.0)[0]), [query, key, value, beta]

    def sdpa(batch, length):
        query, key, value, _ = _delta_rule_inputs(batch, length, heads, width, device, dtype, _generator(device))
        return (lambda: F.scaled_dot_product_attention(query, key, value, is_causal=True)), [query, key, value]

    def memlm_expire_span(batch, length):
        generator = _generator(device)
        query, key, value = (torch.randn(batch, heads, length, width, device=device, generator=generator)
                             .to(dtype).requires_grad_() for _ in range(3))  # fmt: skip
        positions = torch.arange(length, device=device).expand(batch, length)
        long_lived = torch.rand(batch, length, device=device, generator=generator) < EXPIRE_ALIVE
        spans = torch.where(long_lived, float(length), EXPIRE_RAMP).requires_grad_()

        def call():
            return expire_span_attention(query, key, value, spans, positions, positions, ramp=EXPIRE_RAMP,
                                         backend="triton")  # fmt: skip

        return call, [query, key, value, spans]

    def memlm_expire_span_official(batch, length):
        # The papers' options (transformer-sequential's expire_span): learned relative positions p_1 … p_T (one per
        # distance), no attention to the token itself, the renormalisation ε.
        _, leaves = memlm_expire_span(batch, length)
        query, key, value, spans = leaves
        positions = torch.arange(length, device=device).expand(batch, length)
        table = (0.1 * torch.randn(length, width, device=device, generator=_generator(device))).to(dtype)
        table.requires_grad_()

        def call():
            return expire_span_attention(query, key, value, spans, positions, positions, ramp=EXPIRE_RAMP,
                                         relative_positions=table, attend_to_self=False,
                                         renormalization_epsilon=OFFICIAL_EPSILON, backend="triton")  # fmt: skip

        return call, [*leaves, table]

    # flash-linear-attention's last: its first call autotunes for over a minute on an H200 (seen), and the check's
    # time budget then cuts its rows rather than memlm's.
    cases = (("delta_rule", "memlm", memlm_delta_rule), ("sdpa", "sdpa", sdpa),
             ("expire_span_attention", "memlm", memlm_expire_span),
             ("expire_span_attention_official", "memlm", memlm_expire_span_official),
             ("delta_rule", "fla", fla_delta_rule))  # fmt: skip
    for operation, implementation, build in cases:
        for length in lengths:
            batch = max(1, tokens // length)
            shape = {"batch_size": batch, "tokens": length, "heads": heads, "head_dim": width,
                     "dtype": str(dtype).removeprefix("torch.")}  # fmt: skip
            yield (
                {"operation": operation, "implementation": implementation, **shape},
                functools.partial(build, batch, length),
            )


def measure_kernel(build, device, repeats: int = 3) -> list[dict]:
    """Forward, then forward + backward, of one case: milliseconds and the first (compiling) call's seconds
    (``repeats``: timed calls on CPU)."""
    import torch

    call, leaves = build()
    results = []
    with torch.no_grad():
        began = time.perf_counter()
        call()
        synchronize(device)
        first = time.perf_counter() - began
        results.append({"pass": "forward", "milliseconds": median_milliseconds(call, device, repeats),
                        "first_call_seconds": first})  # fmt: skip
    gradient = torch.randn_like(call())

    def forward_backward():
        for leaf in leaves:
            leaf.grad = None
        call().backward(gradient)

    began = time.perf_counter()
    forward_backward()
    synchronize(device)
    first = time.perf_counter() - began
    results.append({"pass": "forward_backward", "milliseconds": median_milliseconds(forward_backward, device, repeats),
                    "first_call_seconds": first})  # fmt: skip
    return results


# --- Models ---------------------------------------------------------------------------------------------------------


def build_model(family: str, sizes: dict, compile_step: bool = False):
    """A memlm model of ``family`` at ``sizes`` (random weights, seed 0)."""
    import torch

    from memlm import (
        DeltaNetConfig,
        DeltaNetForCausalLM,
        ExpireSpanConfig,
        ExpireSpanForCausalLM,
        FeedbackTransformerConfig,
        FeedbackTransformerForCausalLM,
    )

    torch.manual_seed(0)
    if family == "deltanet":
        return DeltaNetForCausalLM(DeltaNetConfig.from_preset("fla", **sizes))
    if family == "expire_span":
        return ExpireSpanForCausalLM(ExpireSpanConfig(**sizes))
    return FeedbackTransformerForCausalLM(FeedbackTransformerConfig(**sizes, compile_step=compile_step))


def llama_like(model):
    """A 🤗 Llama (SDPA) with ``model``'s vocabulary, hidden size, layers, heads, MLP width and embedding tying."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = model.config
    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_hidden_layers=config.num_hidden_layers,
            num_attention_heads=config.num_attention_heads,
            num_key_value_heads=config.num_attention_heads,
            max_position_embeddings=65536,
            tie_word_embeddings=config.tie_word_embeddings,
            attn_implementation="sdpa",
        )
    )


def training_tokens_per_second(model, batch: int, length: int, device, repeats: int) -> float:
    import torch

    generator = torch.Generator(device=device).manual_seed(0)
    input_ids = torch.randint(0, model.config.vocab_size, (batch, length), device=device, generator=generator)

    def step():
        model(input_ids, labels=input_ids).loss.backward()
        model.zero_grad(set_to_none=True)

    model.train()
    try:
        return batch * length / report.median_seconds(step, 2, repeats, device)
    finally:
        model.eval()


def decoding_tokens_per_second(model, context: int, steps: int, device, repeats: int) -> float:
    """Greedy steps of one token through the forward with the cache, after a prompt of ``context`` tokens (batch 1);
    each timed round continues from where the last one stopped."""
    decoding = report.Decoding(model, context, steps, device=device)
    return steps / report.median_seconds(decoding, 1, repeats, device)


def model_plan(compiled: bool) -> list[tuple[str, str, str, bool, str]]:
    """(family, model, backend, compiled, measure) of every model measurement, in order: each family's runs
    (``MODEL_RUNS``), its Llama once, then the compiled ones."""
    plan = []
    for family, backend in MODEL_RUNS:
        plan += [(family, "memlm", backend, False, measure) for measure in ("training", "decoding")]
        if not any(item[:2] == (family, "llama") for item in plan):
            plan += [(family, "llama", "sdpa", False, measure) for measure in ("training", "decoding")]
    if compiled:
        for family in ("deltanet", "expire_span"):
            plan += [(family, "memlm", "triton", True, "training"), (family, "llama", "sdpa", True, "training")]
        plan.append(("feedback", "memlm", "torch", True, "decoding"))  # its step compiled (compile_step=True)
    return plan


def model_cases(sizes: dict, shapes: dict, decode_steps: int, device, dtype, compiled: bool):
    """(description, measure) per item of :func:`model_plan`; ``measure()`` returns the tokens/s and the parameter
    count. A compiled model is ``torch.compile(model)``, except the Feedback Transformer's, which compiles its step."""
    for family, model_name, backend, compile_model, measure in model_plan(compiled):
        batch, length = shapes[family]
        description = {"family": family, "model": model_name, "backend": backend, "compiled": compile_model,
                       "measure": measure, "batch_size": batch if measure == "training" else 1, "tokens": length,
                       "new_tokens": decode_steps if measure == "decoding" else None,
                       "dtype": str(dtype).removeprefix("torch."), **sizes}  # fmt: skip
        yield (
            description,
            functools.partial(
                _measure_model,
                family,
                model_name,
                backend,
                compile_model,
                measure,
                sizes,
                batch,
                length,
                decode_steps,
                device,
                dtype,
            ),
        )


def _measure_model(family, model_name, backend, compile_model, measure, sizes, batch, length, decode_steps, device,
                   dtype) -> dict:  # fmt: skip
    import torch

    previous = os.environ.get("MEMLM_KERNELS")
    os.environ["MEMLM_KERNELS"] = backend if model_name == "memlm" else "torch"
    try:
        with torch.device(device):  # the weights are made where they run
            model = build_model(family, sizes, compile_step=compile_model and family == "feedback")
            model = (llama_like(model) if model_name == "llama" else model).to(dtype).eval()
        parameters = sum(parameter.numel() for parameter in model.parameters())
        if compile_model and family != "feedback":
            model = torch.compile(model)
        repeats = 3 if device.type == "cpu" else 5
        if measure == "training":
            speed = training_tokens_per_second(model, batch, length, device, repeats)
        else:
            speed = decoding_tokens_per_second(model, length, decode_steps, device, repeats=3)
        return {"tokens_per_second": speed, "parameters": parameters}
    finally:
        if previous is None:
            os.environ.pop("MEMLM_KERNELS", None)
        else:
            os.environ["MEMLM_KERNELS"] = previous
        if device.type == "cuda":
            torch.cuda.empty_cache()


# --- Running --------------------------------------------------------------------------------------------------------


def run_part(part: str, results_path: str | None, seconds: float | None, smoke: bool) -> list[dict]:
    """Measure ``part`` ("kernels" or "models"), one JSON line per measurement into ``results_path``; stop starting
    measurements after ``seconds``. Returns the records."""
    import torch

    began = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not (smoke and os.environ.get("TRITON_INTERPRET") == "1"):
        raise SystemExit("No CUDA device: run on a GPU, or with --smoke and TRITON_INTERPRET=1 to check the script.")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if part == "kernels":
        lengths, tokens = (
            (SMOKE["kernel_lengths"], SMOKE["kernel_tokens"]) if smoke else (KERNEL_LENGTHS, KERNEL_TOKENS)
        )
        heads, width = (SMOKE["kernel_heads"], SMOKE["kernel_width"]) if smoke else (KERNEL_HEADS, KERNEL_WIDTH)
        cases = ((description, lambda build=build: measure_kernel(build, device, 1 if smoke else 3))
                 for description, build in kernel_cases(lengths, tokens, heads, width, device, dtype))  # fmt: skip
    else:
        sizes = SMOKE["model_sizes"] if smoke else MODEL_SIZES
        shapes = SMOKE["training_shapes"] if smoke else TRAINING_SHAPES
        steps = SMOKE["decode_steps"] if smoke else DECODE_STEPS
        cases = ((description, lambda measure=measure: [measure()])
                 for description, measure in model_cases(sizes, shapes, steps, device, dtype, device.type == "cuda"))  # fmt: skip
    records = []
    for description, measure in cases:
        if seconds is not None and time.perf_counter() - began > seconds:
            break
        try:
            found = [{**description, **result, "error": None} for result in measure()]
        except Exception as error:  # the error is the measurement's result; the next one still runs
            message = f"{type(error).__name__}: {error}".strip().splitlines()
            found = [{**description, **({"pass": None} if part == "kernels" else {}),
                      "error": (message[0] if message else type(error).__name__)[:500]}]  # fmt: skip
            traceback.print_exc()
        if device.type == "cuda":  # what a failed measurement held
            torch.cuda.empty_cache()
        for record in found:
            records.append(record)
            print(json.dumps(record), flush=True)
            if results_path:
                with open(results_path, "a", encoding="utf-8") as file:
                    file.write(json.dumps(record) + "\n")
    return records


# --- The speed page -------------------------------------------------------------------------------------------------

REPORT_SECTION = "gpu_check"
REPORT_COMMAND = "python benchmarks/gpu_speed.py --report benchmarks/results/gpu_check.json"
NOT_MEASURED = (
    "Not measured yet: no report of `make gpu-check` on a GPU is kept (`benchmarks/results/gpu_check.json`), so this "
    "page has no GPU figure."
)


def _ratio(numerator, denominator):
    return None if numerator is None or denominator in (None, 0) else numerator / denominator


def kernel_rows(records: list[dict]) -> list[dict]:
    """One row per (operation, T, pass) measured: memlm's, FLA's and causal SDPA's milliseconds (SDPA measured once
    per T serves both operations), and theirs over memlm's."""
    measured = [record for record in records if record.get("error") is None]
    sdpa = {(record["tokens"], record["pass"]): record["milliseconds"] for record in measured
            if record["operation"] == "sdpa"}  # fmt: skip
    rows = {}
    for record in measured:
        if record["operation"] == "sdpa":
            continue
        key = (record["operation"], record["tokens"], record["pass"])
        row = rows.setdefault(key, {"operation": record["operation"].replace("_", " "), "tokens": record["tokens"],
                                    "batch_size": record["batch_size"], "pass": record["pass"].replace("_", " + "),
                                    "sdpa": sdpa.get(key[1:])})  # fmt: skip
        row[record["implementation"]] = record["milliseconds"]
    for row in rows.values():
        row["fla_over_memlm"] = _ratio(row.get("fla"), row.get("memlm"))
        row["sdpa_over_memlm"] = _ratio(row.get("sdpa"), row.get("memlm"))
    return list(rows.values())


def failures(records: list[dict]) -> list[str]:
    """One line per measurement that failed: what it was and its error."""
    lines = []
    for record in records:
        if record.get("error") is not None:
            what = " ".join(str(record[name]) for name in ("operation", "implementation", "family", "model", "backend", "measure")
                            if record.get(name) is not None)  # fmt: skip
            compiled = ", compiled" if record.get("compiled") else ""
            lines.append(f"{what.replace('_', ' ')} at T = {record['tokens']}{compiled}: {record['error']}")
    return lines


def model_rows(records: list[dict]) -> list[dict]:
    """One row per (family, memlm backend, compiled, measure): memlm's and its Llama's tokens/s and their ratio."""
    llama = {(record["family"], record["compiled"], record["measure"]): record.get("tokens_per_second")
             for record in records if record["model"] == "llama" and record.get("error") is None}  # fmt: skip
    rows = []
    for record in records:
        if record["model"] != "memlm":
            continue
        speed = record.get("tokens_per_second") if record.get("error") is None else None
        theirs = llama.get((record["family"], record["compiled"], record["measure"]))
        shape = (f"{record['batch_size']} × {record['tokens']}" if record["measure"] == "training"
                 else f"1, {record['new_tokens']} steps after {record['tokens']}")  # fmt: skip
        rows.append({"family": record["family"].replace("_", "-"), "backend": record["backend"],
                     "compiled": "yes" if record["compiled"] else "no", "measure": record["measure"], "shape": shape,
                     "memlm": speed, "llama": theirs, "ratio": _ratio(speed, theirs)})  # fmt: skip
    return rows


def _commit(git: str | None) -> str:
    """Which sources the check ran, as the report's ``sources.git`` says (nothing without git there)."""
    if not git:
        return ""
    commit, changed = git.removesuffix("+changes"), git.endswith("+changes")
    return f", at commit {commit[:12]}" + (" with changes not committed" if changed else "")


def _names(cases: list[dict]) -> str:
    """The tests that failed or errored, by name, for the sentence counting them."""
    names = [case["test"] for case in cases if case["outcome"] in ("failed", "error")]
    return f" (did not pass: {', '.join(f'`{name}`' for name in names)})" if names else ""


def docs_section(results: dict | None) -> str:
    """The GPU section of docs/performance/speed.md from a `make gpu-check` report (None: not measured yet)."""
    if results is None:
        return NOT_MEASURED
    machine, tests = results["machine"], results["tests"]["counts"]
    installed = results.get("installed", {}).get("versions", {})
    parts = [
        f"From `make gpu-check` (devtools/gpu_check.py) on {results['started'][:10]} on one {machine['gpu']} "
        f"(compute capability {machine['capability']}, {machine['memory_gib']:.0f} GiB), torch {machine['torch']} "
        f"(CUDA {machine['cuda']}), Triton {machine['triton']}, flash-linear-attention "
        f"{installed.get('flash-linear-attention', 'not installed')}, 🤗 Transformers "
        f"{installed.get('transformers', 'unknown')}{_commit(results.get('sources', {}).get('git'))}. The tests "
        f"marked gpu: {tests['passed']} passed, {tests['failed']} failed, {tests['error']} errored, "
        f"{tests['skipped']} skipped{_names(results['tests']['cases'])}."
    ]
    stopped = [stage["name"] for stage in results["stages"] if stage["status"] == "timed_out"]
    if stopped:
        parts[0] += f" Out of time (stopped; their missing figures read —): {', '.join(stopped)}."
    kernels = results["kernels"]
    if kernels:
        first = kernels[0]
        parts.append(
            f"Kernels, {first['dtype']}, {first['batch_size'] * first['tokens']} tokens per call, {first['heads']} heads "
            f"of width {first['head_dim']}; milliseconds (medians of `triton.testing.do_bench`), and the other "
            "implementations' time over memlm's:"
        )
        parts.append(
            report.markdown_table(
                [
                    ("operation", "operation", "s"),
                    ("T", "tokens", "d"),
                    ("B", "batch_size", "d"),
                    ("pass", "pass", "s"),
                    ("memlm ms", "memlm", ".2f"),
                    ("FLA ms", "fla", ".2f"),
                    ("causal SDPA ms", "sdpa", ".2f"),
                    ("FLA / memlm", "fla_over_memlm", ".2f"),
                    ("SDPA / memlm", "sdpa_over_memlm", ".2f"),
                ],
                kernel_rows(kernels),
            )  # fmt: skip
        )
    models = results["models"]
    if models:
        first = models[0]
        parts.append(
            f"Models, {first['dtype']}, hidden {first['hidden_size']}, {first['num_hidden_layers']} layers, "
            f"{first['num_attention_heads']} heads, vocabulary {first['vocab_size']}, each next to a 🤗 Llama (SDPA) of "
            "the same sizes; training = forward + backward of the LM loss on batch × tokens, decoding = greedy steps "
            "at batch 1 with the cache; tokens/s:"
        )
        parts.append(
            report.markdown_table(
                [
                    ("family", "family", "s"),
                    ("backend", "backend", "s"),
                    ("compiled", "compiled", "s"),
                    ("measure", "measure", "s"),
                    ("shape", "shape", "s"),
                    ("memlm tokens/s", "memlm", ".0f"),
                    ("Llama tokens/s", "llama", ".0f"),
                    ("memlm / Llama", "ratio", ".2f"),
                ],
                model_rows(models),
            )  # fmt: skip
        )
    failed = failures(kernels + models)
    if failed:
        parts.append("Failed measurements:\n\n" + "\n".join(f"- {line}" for line in failed))
    return "\n\n".join(parts)


def write_docs(results: dict | None, page: str = report.SPEED_PAGE) -> None:
    report.rewrite_section(page, REPORT_SECTION, REPORT_COMMAND, docs_section(results))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", nargs="?", choices=("kernels", "models"), help="what to measure")
    parser.add_argument("--results", default=None, help="append one JSON line per measurement to this file")
    parser.add_argument("--seconds", type=float, default=None, help="start no measurement after this many seconds")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, to check the script (CPU: interpreter)")
    parser.add_argument("--report", default=None, metavar="GPU_CHECK_JSON",
                        help="measure nothing: rewrite the speed page's GPU section from a gpu-check report "
                             "(a missing file: the section says not measured)")  # fmt: skip
    parser.add_argument("--report-page", default=report.SPEED_PAGE, help=argparse.SUPPRESS)
    parser.add_argument("--show", default=None, metavar="GPU_CHECK_JSON",
                        help="measure nothing: print the section a gpu-check report gives (what make gpu-check ends "
                             "with)")  # fmt: skip
    arguments = parser.parse_args(argv)
    if arguments.show:
        with open(arguments.show, encoding="utf-8") as file:
            results = json.load(file)
        print(docs_section(results))
        return results
    if arguments.report:
        results = None
        if os.path.exists(arguments.report):
            with open(arguments.report, encoding="utf-8") as file:
                results = json.load(file)
        write_docs(results, arguments.report_page)
        return results
    if arguments.part is None:
        parser.error("name a part to measure (kernels or models), or --report")
    return run_part(arguments.part, arguments.results, arguments.seconds, arguments.smoke)


if __name__ == "__main__":
    main()
    sys.exit(0)
