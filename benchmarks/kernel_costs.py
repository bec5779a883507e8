"""How fast are memlm's Triton kernels on a GPU, next to flash-linear-attention and SDPA?

Prints side-by-side tables measured in one run (medians of CUDA-event timings after a warm-up, peak memory from
`torch.cuda.max_memory_allocated`):

1. chunkwise delta rule, forward + backward, bf16: memlm's Triton kernel vs flash-linear-attention's
   `chunk_delta_rule` vs causal SDPA (flash backend) at (B, T, H, D) ∈ {(8,2048,16,64), (4,4096,16,128),
   (1,16384,16,128)};
2. one decoding step: memlm's fused recurrent step vs flash-linear-attention's `fused_recurrent_delta_rule`;
3. Expire-Span attention, forward + backward, bf16, at T = 4K and 16K with 20 % and 100 % of memories alive:
   memlm's kernel vs SDPA with a materialised float bias (log m) vs plain causal SDPA;
4. a DeltaNet model (preset "fla") on a right-padded batch, forward + backward, bf16: the padding packed away with
   `cu_seqlens` (what the model does on the Triton backend) vs masked, both on the Triton kernels.

    python benchmarks/kernel_costs.py [--json results.json]
    python benchmarks/kernel_costs.py --smoke     # tiny shapes: checks the script end to end (CPU: Triton's interpreter)
    python benchmarks/kernel_costs.py --static    # no GPU needed: the static cost table below
    python benchmarks/kernel_costs.py --static --write-docs --json benchmarks/results/kernel_costs_static_sm_90.json
    python benchmarks/kernel_costs.py --report benchmarks/results/kernel_costs_static_sm_90.json   # docs from a run

flash-linear-attention columns read "n/a" when the package (pip install flash-linear-attention) is not installed.

``--static`` (no GPU, no timing) prints, for the chunkwise delta rule at B=8, T=2048, H=16, bf16, D=64 and D=128
(keys L2-normalised, β in (0, 1), no initial or final state), one row per kernel launched in the forward and in the
backward, memlm's kernels and flash-linear-attention's ``chunk_delta_rule`` side by side:

- shared memory, registers and spilled bytes (ptxas ``-v`` stores / loads) of the kernel compiled for sm_90 (or
  ``--target sm_80``) with the tiles and launch options chosen for that target, and whether its PTX holds tensor-core instructions (``mma`` / ``wgmma``). The launches are
  recorded at the full shape (so that Triton specialises the integer arguments as it would) and compiled with
  ``devtools.gpu_compile``, exactly as the CI check does;
- global-memory bytes read and written: the elements that ``tl.load`` / ``tl.store`` (and atomics) touch, masked
  elements excluded, counted by running the kernels in Triton's interpreter at B = H = 1 and scaled by B·H (exact
  for unpacked batches: every (batch, head) pair does the same work). Cache hits are not modelled: every load
  counts, as if it reached DRAM;
- FLOPs of ``tl.dot`` (2·M·N·K per product on the full tiles, padding included), counted in the interpreter per
  line of the kernel's body, and put on tensor cores or CUDA cores by what the compiler made of the dots of that
  line: in the compiled TTGIR, ``warp_group_dot`` (wgmma) or a ``tt.dot`` with an MMA layout runs on tensor cores,
  a ``tt.dot`` left in a blocked layout (e.g. exact fp32, ``input_precision="ieee"``) on CUDA cores. (The
  interpreter's own view is not used for this: a kernel may take another path there.) A TF32x3 product (three
  TF32 MMAs for float32 accuracy) counts its 2·M·N·K once. Element-wise FLOPs (exp, scaling, masks, reductions)
  are not counted.

flash-linear-attention's kernels are autotuned: the first configuration of each (after its own pruning) is
recorded, and its import-time hardware checks see no GPU (they pick their CPU / non-Hopper choices, e.g. exact
fp32 dots in ``solve_tril`` where a GPU with TF32 would use TF32). The totals give the ratios issue 13 asks for:
memlm's traffic over FLA's, forward and backward, and memlm's share of dot FLOPs on tensor cores.
"""

# ruff: noqa: B023  (every closure below is measured at once, inside its own loop iteration)

import dataclasses
import json
import math
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

# devtools/ (beside the installed package, never in it) from the repository's root.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

try:  # run as a script (python benchmarks/kernel_costs.py) or imported as benchmarks.kernel_costs
    import report
except ImportError:
    from benchmarks import report

DELTA_SHAPES = [(8, 2048, 16, 64), (4, 4096, 16, 128), (1, 16384, 16, 128)]
STEP_SHAPES = [(8, 16, 128), (64, 16, 128)]
EXPIRE_LENGTHS = [4096, 16384]
ALIVE_FRACTIONS = [0.2, 1.0]
# (batch, padded length, shortest real length): real lengths spread evenly from the shortest to the padded length.
PADDED_BATCHES = [(8, 2048, 256), (16, 4096, 512)]
PADDED_MODEL = {
    "vocab_size": 32000,
    "hidden_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "intermediate_size": 2816,
}


def measure(function, repeats: int, device) -> tuple[float, float]:
    """(median milliseconds, peak MiB above the start) of `function()`."""
    function()  # warm-up (and Triton compilation)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
    milliseconds = report.median_seconds(function, 0, repeats, device) * 1e3
    peak = (torch.cuda.max_memory_allocated() - baseline) / 2**20 if cuda else float("nan")
    return milliseconds, peak


def forward_backward(run, inputs):
    def step():
        for tensor in inputs:
            tensor.grad = None
        output = run()
        output.backward(torch.ones_like(output))

    return step


def delta_rule_rows(shapes, device, dtype, repeats):
    from memlm.kernels.delta_rule.triton_chunk import delta_rule_chunk_triton

    try:
        from fla.ops.delta_rule import chunk_delta_rule
    except ImportError:
        chunk_delta_rule = None
    rows = []
    for batch, length, heads, width in shapes:
        generator = torch.Generator(device=device).manual_seed(0)

        def make(*shape):
            return torch.randn(*shape, device=device, dtype=dtype, generator=generator).requires_grad_()

        query, key, value = (make(batch, heads, length, width) for _ in range(3))
        with torch.no_grad():
            key.copy_(F.normalize(key.float(), dim=-1))
        beta = torch.rand(batch, heads, length, device=device, dtype=dtype, generator=generator).requires_grad_()
        ours = measure(forward_backward(lambda: delta_rule_chunk_triton(query, key, value, beta, None, False)[0],
                                        (query, key, value, beta)), repeats, device)  # fmt: skip
        fla = (float("nan"), float("nan"))
        if chunk_delta_rule is not None and device.type == "cuda":
            # flash-linear-attention takes (B, T, H, D).
            q, k, v = (tensor.detach().transpose(1, 2).contiguous().requires_grad_() for tensor in (query, key, value))
            b = beta.detach().transpose(1, 2).contiguous().requires_grad_()
            fla = measure(forward_backward(lambda: chunk_delta_rule(q, k, v, b)[0], (q, k, v, b)), repeats, device)
        sdpa = measure(forward_backward(lambda: F.scaled_dot_product_attention(query, key, value, is_causal=True),
                                        (query, key, value)), repeats, device)  # fmt: skip
        rows.append({"shape": (batch, length, heads, width), "memlm": ours, "fla": fla, "sdpa": sdpa})
    return rows


def step_rows(shapes, device, dtype, repeats):
    from memlm.kernels.delta_rule.triton_recurrent import delta_rule_step_triton

    try:
        from fla.ops.delta_rule import fused_recurrent_delta_rule
    except ImportError:
        fused_recurrent_delta_rule = None
    rows = []
    for batch, heads, width in shapes:
        query, key, value = (torch.randn(batch, heads, 1, width, device=device, dtype=dtype) for _ in range(3))
        beta = torch.rand(batch, heads, 1, device=device, dtype=dtype)
        state = torch.randn(batch, heads, width, width, device=device, dtype=torch.float32)
        with torch.no_grad():
            ours = measure(lambda: delta_rule_step_triton(query, key, value, beta, state, True), repeats, device)
            fla = (float("nan"), float("nan"))
            if fused_recurrent_delta_rule is not None and device.type == "cuda":
                q, k, v = (tensor.transpose(1, 2).contiguous() for tensor in (query, key, value))
                b = beta.transpose(1, 2).contiguous()
                fla = measure(lambda: fused_recurrent_delta_rule(q, k, v, b, initial_state=state,
                                                                 output_final_state=True), repeats, device)  # fmt: skip
        rows.append({"shape": (batch, heads, width), "memlm": ours, "fla": fla})
    return rows


def expire_rows(lengths, fractions, device, dtype, repeats, heads=16, width=64):
    from memlm.kernels.expire_attention.sdpa import expire_span_bias
    from memlm.kernels.expire_attention.triton_attention import expire_span_attention_triton

    rows = []
    for length in lengths:
        for alive in fractions:
            generator = torch.Generator(device=device).manual_seed(0)
            query, key, value = (torch.randn(1, heads, length, width, device=device, dtype=dtype, generator=generator)
                                 .requires_grad_() for _ in range(3))  # fmt: skip
            positions = torch.arange(length, device=device)[None]
            # A fraction `alive` of the memories lives through the whole sequence; the rest expire within 64 tokens.
            long_lived = torch.rand(1, length, device=device, generator=generator) < alive
            spans = torch.where(long_lived, float(length), 32.0).requires_grad_()
            ramp = 32.0
            ours = measure(forward_backward(
                lambda: expire_span_attention_triton(query, key, value, spans, positions, positions, ramp=ramp),
                (query, key, value, spans)), repeats, device)  # fmt: skip

            def biased():
                bias = expire_span_bias(spans, positions, positions, ramp).to(dtype)[:, None]
                return F.scaled_dot_product_attention(query, key, value, attn_mask=bias)

            with_bias = measure(forward_backward(biased, (query, key, value, spans)), repeats, device)
            causal = measure(forward_backward(lambda: F.scaled_dot_product_attention(query, key, value, is_causal=True),
                                              (query, key, value)), repeats, device)  # fmt: skip
            rows.append({"length": length, "alive": alive, "memlm": ours, "sdpa_bias": with_bias, "causal": causal})
    return rows


def padded_rows(batches, sizes, device, dtype, repeats):
    from memlm import DeltaNetConfig, DeltaNetForCausalLM

    model = DeltaNetForCausalLM(DeltaNetConfig.from_preset("fla", **sizes)).to(device, dtype)
    rows = []
    previous_backend = os.environ.get("MEMLM_KERNELS")
    os.environ["MEMLM_KERNELS"] = "triton"
    try:
        for batch, length, shortest in batches:
            lengths = torch.linspace(shortest, length, batch, device=device).long()
            mask = (torch.arange(length, device=device) < lengths[:, None]).long()
            input_ids = torch.randint(0, sizes["vocab_size"], (batch, length), device=device)
            labels = input_ids.masked_fill(mask == 0, -100)

            def train_step():
                model.zero_grad(set_to_none=True)
                model(input_ids, attention_mask=mask, labels=labels).loss.backward()

            packed = measure(train_step, repeats, device)
            model.model.packs_padding = lambda attention_mask: False  # the masked path, on the same kernels
            masked = measure(train_step, repeats, device)
            del model.model.packs_padding
            real = mask.float().mean().item()
            rows.append({"shape": (batch, length), "real": real, "packed": packed, "masked": masked})
    finally:
        if previous_backend is None:
            del os.environ["MEMLM_KERNELS"]
        else:
            os.environ["MEMLM_KERNELS"] = previous_backend
    return rows


STATIC_SHAPE = (8, 2048, 16)  # (B, T, H) of the static cost table; D ∈ STATIC_WIDTHS
STATIC_WIDTHS = (64, 128)


def _static_inputs(batch, length, heads, width, heads_first):
    """bf16 queries, L2-normalised keys, values and β in (0, 1): (B, H, T, D) for memlm, (B, T, H, D) for FLA."""
    generator = torch.Generator().manual_seed(0)
    shape = (batch, heads, length, width) if heads_first else (batch, length, heads, width)
    query, key, value = (torch.randn(*shape, generator=generator) for _ in range(3))
    key = F.normalize(key, dim=-1)
    beta = torch.rand(*shape[:3], generator=generator)
    return [tensor.to(torch.bfloat16).requires_grad_() for tensor in (query, key, value, beta)]


def _record_delta_rule(library, batch, length, heads, width, count, target):
    """The launches of one forward and one backward chosen for `target`, labelled by phase; counted (and run) when
    `count`."""
    from devtools.gpu_compile import backward, on_gpu, record_launches

    if library == "memlm":
        from memlm.kernels.delta_rule import delta_rule

        def run(query, key, value, beta):
            return delta_rule(query, key, value, beta, backend="triton")[0]
    else:
        from fla.ops.delta_rule import chunk_delta_rule

        def run(query, key, value, beta):
            return chunk_delta_rule(query, key, value, beta)[0]

    # FLA enters CUDA device contexts: its tensors stay plain CPU tensors (its tile choices do not read the device).
    as_if_on_gpu = library == "memlm"
    recording = record_launches(
        all_configs=False, count=count, execute=count, as_if_on_gpu=as_if_on_gpu, target=target
    )
    with recording as recorder:
        inputs = _static_inputs(batch, length, heads, width, heads_first=library == "memlm")
        if as_if_on_gpu:
            inputs = [on_gpu(tensor) for tensor in inputs]
        recorder.phase = "forward"
        output = run(*inputs)
        recorder.phase = "backward"
        backward(output.float().sum())
    return recorder.launches


def static_rows(widths, shape, target):
    """One row per launched kernel (see the module docstring), for memlm and flash-linear-attention."""
    from devtools.gpu_compile import compile_launches

    batch, length, heads = shape
    rows = []
    for width in widths:
        for library in ("memlm", "fla"):
            full = _record_delta_rule(library, batch, length, heads, width, count=False, target=target)
            counted = _record_delta_rule(library, 1, length, 1, width, count=True, target=target)
            names = [(launch.phase, launch.name) for launch in full]
            if names != [(launch.phase, launch.name) for launch in counted]:
                raise RuntimeError(
                    f"{library} launches different kernels at B = H = 1 than at B = {batch}, H = {heads}"
                )
            compiled = {result.launch.key: result for result in compile_launches(full, targets=(target,))}
            for launch, count in zip(full, counted):
                result = compiled[launch.key]
                # The counted launch (B = H = 1) and the compiled one (full shape) are the same kernel code.
                tensor_core, cuda_core = dataclasses.replace(result, launch=count).split_flops()
                rows.append({
                    "width": width, "library": library, "phase": launch.phase, "kernel": launch.name,
                    "shared_memory": result.shared_memory, "registers": result.registers,
                    "spill_stores": result.spill_stores, "spill_loads": result.spill_loads,
                    "tensor_core_instructions": result.tensor_core_instructions, "error": result.error,
                    "bytes_read": count.bytes_read * batch * heads, "bytes_written": count.bytes_written * batch * heads,
                    "tensor_core_flops": tensor_core * batch * heads, "cuda_core_flops": cuda_core * batch * heads,
                    "constants": launch.constants,
                })  # fmt: skip
    return rows


def print_static(rows, shape, target):
    batch, length, heads = shape
    header = ["library", "phase", "kernel", "shared KB", "registers", "spills st/ld B", "mma in PTX", "read MB",
              "written MB", "TC GFLOP", "CUDA-core GFLOP"]  # fmt: skip
    for width in sorted({row["width"] for row in rows}):
        selected = [row for row in rows if row["width"] == width]
        table = []
        for row in selected:
            compiled = ["compile error", "", "", ""] if row["error"] else [
                f"{row['shared_memory'] / 1024:.0f}", str(row["registers"]),
                f"{row['spill_stores']}/{row['spill_loads']}", "yes" if row["tensor_core_instructions"] else "no"]  # fmt: skip
            table.append([row["library"], row["phase"], row["kernel"], *compiled,
                          f"{row['bytes_read'] / 1e6:.1f}", f"{row['bytes_written'] / 1e6:.1f}",
                          f"{row['tensor_core_flops'] / 1e9:.2f}", f"{row['cuda_core_flops'] / 1e9:.2f}"])  # fmt: skip
        print_table(f"Static cost, chunkwise delta rule, B={batch} T={length} H={heads} D={width} bf16, {target} "
                    "(dot FLOPs only; element-wise FLOPs not counted)", header, table)  # fmt: skip
        totals = {}
        for row in selected:
            total = totals.setdefault((row["library"], row["phase"]), [0, 0, 0])
            total[0] += row["bytes_read"] + row["bytes_written"]
            total[1] += row["tensor_core_flops"]
            total[2] += row["cuda_core_flops"]
        summary = []
        for phase in ("forward", "backward"):
            ours, theirs = totals.get(("memlm", phase), [0, 0, 0]), totals.get(("fla", phase), [0, 0, 0])
            share = ours[1] / (ours[1] + ours[2]) if ours[1] + ours[2] else float("nan")
            ratio = ours[0] / theirs[0] if theirs[0] else float("nan")
            summary.append([phase, f"{ours[0] / 1e6:.1f}", f"{theirs[0] / 1e6:.1f}", f"{ratio:.2f}", f"{share:.0%}",
                            f"{(ours[1] + ours[2]) / 1e9:.2f}", f"{(theirs[1] + theirs[2]) / 1e9:.2f}"])  # fmt: skip
        print_table(f"Totals, D={width} (targets: traffic ratio ≤ 1, memlm tensor-core share ≥ 90 %)",
                    ["phase", "memlm MB", "FLA MB", "memlm / FLA", "memlm on tensor cores", "memlm dot GFLOP",
                     "FLA dot GFLOP"], summary)  # fmt: skip


def static_totals(rows) -> list[dict]:
    """Per width and phase: memlm's and FLA's traffic and dot FLOPs, memlm's tensor-core share and the spills."""
    totals = []
    for width in sorted({row["width"] for row in rows}):
        for phase in ("forward", "backward"):
            total = {"width": width, "phase": phase}
            for library in ("memlm", "fla"):
                selected = [
                    row for row in rows if (row["width"], row["phase"], row["library"]) == (width, phase, library)
                ]
                total[f"{library}_mb"] = sum(row["bytes_read"] + row["bytes_written"] for row in selected) / 1e6
                tensor_core = sum(row["tensor_core_flops"] for row in selected)
                total[f"{library}_gflop"] = (tensor_core + sum(row["cuda_core_flops"] for row in selected)) / 1e9
                total[f"{library}_tensor_core_share"] = tensor_core / 1e9 / total[f"{library}_gflop"] if total[
                    f"{library}_gflop"] else None  # fmt: skip
                spilled = [row for row in selected if row["spill_stores"] or row["spill_loads"]]
                total[f"{library}_spills"] = (
                    "none"
                    if not spilled
                    else f"{len(spilled)} kernel{'s' if len(spilled) > 1 else ''} "
                    f"({max(row['spill_stores'] for row in spilled)} B stored at most)"
                )
            total["mb_ratio"] = total["memlm_mb"] / total["fla_mb"] if total["fla_mb"] else None
            total["gflop_ratio"] = total["memlm_gflop"] / total["fla_gflop"] if total["fla_gflop"] else None
            totals.append(total)
    return totals


REPORT_SECTION = "kernel_costs_static"


def report_command(target: str) -> str:
    return f"python benchmarks/kernel_costs.py --report benchmarks/results/kernel_costs_static_{target}.json"


def static_section(results: dict) -> str:
    """The static-cost section of docs/performance/speed.md, from one `--static` run's results."""
    settings = results["settings"]
    batch, length, heads = settings["shape"]
    totals = static_totals(results["static"])
    for total in totals:
        total["memlm_flops_cell"] = f"{total['memlm_gflop']:.2f} ({total['memlm_tensor_core_share']:.0%})"
        total["spills_cell"] = f"{total['memlm_spills']} / {total['fla_spills']}"
    table = report.markdown_table(
        [("D", "width", "d"), ("phase", "phase", "s"), ("memlm MB", "memlm_mb", ".1f"), ("FLA MB", "fla_mb", ".1f"),
         ("memlm / FLA", "mb_ratio", ".2f"), ("memlm dot GFLOP (on tensor cores)", "memlm_flops_cell", "s"),
         ("FLA dot GFLOP", "fla_gflop", ".2f"), ("memlm / FLA dot FLOPs", "gflop_ratio", ".2f"),
         ("spills memlm / FLA", "spills_cell", "s")],
        totals,
    )  # fmt: skip
    return (
        f"From `python benchmarks/kernel_costs.py --static --target {settings['target']}` (B={batch}, T={length}, "
        f"H={heads}, bf16, compiled for {settings['target']}; bytes are the unmasked elements every load and store "
        "touches, counted in Triton's interpreter at B=H=1 and scaled by B·H, without cache hits; FLOPs are those of "
        "`tl.dot`, 2·M·N·K per product, on tensor cores when the compiled code uses `mma`/`wgmma` for them; "
        "element-wise FLOPs are not counted; FLA's autotuned kernels take their first configuration, and FLA's "
        "import-time hardware checks see no GPU, so its `solve_tril` compiles with exact fp32 dots). FLA's backward "
        f"includes the forward kernels it recomputes. flash-linear-attention {settings['fla']}, Triton "
        f"{settings['triton']}; computed on {settings['date']} (no GPU: nothing here is timed).\n\n{table}"
    )


def section(target: str) -> report.Section:
    """The speed page's static-cost section of `target`."""
    return report.Section(f"{REPORT_SECTION}_{target}", report_command(target), static_section)


def print_table(title, header, rows):
    print(f"\n{title}")
    print(" | ".join(header))
    for row in rows:
        print(" | ".join(row))


def main(argv=None):
    parser = report.arguments(__doc__, repeats=10, section=section("sm_90"),
                              quick="tiny shapes, to check the script (CPU: interpreter)")  # fmt: skip
    parser.add_argument("--static", action="store_true", help="the static cost table (no GPU needed)")
    parser.add_argument("--target", default="sm_90", choices=["sm_80", "sm_90"], help="GPU target of --static")
    arguments = report.parse(parser, argv)
    if arguments.report:  # the section of the target the saved run was computed for
        with open(arguments.report) as file:
            target = json.load(file)["settings"]["target"]
        return report.saved_run(arguments, section(target))
    report.start(arguments)
    if arguments.static:
        # The launches are recorded and counted in Triton's interpreter, set before any kernel is imported.
        os.environ["TRITON_INTERPRET"] = "1"
        shape = (2, 128, 2) if arguments.quick else STATIC_SHAPE
        widths = (64,) if arguments.quick else STATIC_WIDTHS
        rows = static_rows(widths, shape, arguments.target)
        print_static(rows, shape, arguments.target)
        import triton

        from memlm.kernels import flash_linear_attention_version

        settings = {"target": arguments.target, "shape": list(shape), "widths": list(widths), "quick": arguments.quick,
                    "fla": flash_linear_attention_version(), "triton": triton.__version__} | report.machine()  # fmt: skip
        return report.finish({"settings": settings, "static": rows}, arguments, section(arguments.target))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("No GPU: run on a CUDA machine, or with --smoke and TRITON_INTERPRET=1 to check the script.")
    smoke = arguments.quick
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    repeats = 1 if smoke else arguments.repeats
    print(f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}")
    results = {
        "delta_rule": delta_rule_rows([(1, 32, 2, 16)] if smoke else DELTA_SHAPES, device, dtype, repeats),
        "step": step_rows([(2, 2, 16)] if smoke else STEP_SHAPES, device, dtype, repeats),
        "expire_span": expire_rows(
            [64] if smoke else EXPIRE_LENGTHS,
            ALIVE_FRACTIONS,
            device,
            dtype,
            repeats,
            heads=2 if smoke else 16,
            width=16 if smoke else 64,
        ),  # fmt: skip
        "padded": padded_rows(
            [(2, 24, 5)] if smoke else PADDED_BATCHES,
            {
                "vocab_size": 64,
                "hidden_size": 32,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "intermediate_size": 64,
            }
            if smoke
            else PADDED_MODEL,
            device,
            dtype,
            repeats,
        ),
    }

    def cell(measured, reference=None):
        if math.isnan(measured[0]):
            return "n/a"
        text = f"{measured[0]:.2f} ms" + ("" if math.isnan(measured[1]) else f" / {measured[1]:.0f} MiB")
        return text + (f" ({measured[0] / reference[0]:.2f}×)" if reference is not None else "")

    print_table("Chunkwise delta rule, forward + backward (ratio: time / memlm's)",
                ["(B, T, H, D)", "memlm", "flash-linear-attention", "causal SDPA"],
                [[str(row["shape"]), cell(row["memlm"]), cell(row["fla"], row["memlm"]), cell(row["sdpa"], row["memlm"])]
                 for row in results["delta_rule"]])  # fmt: skip
    print_table(
        "One decoding step of the delta rule",
        ["(B, H, D)", "memlm", "flash-linear-attention"],
        [[str(row["shape"]), cell(row["memlm"]), cell(row["fla"], row["memlm"])] for row in results["step"]],
    )
    print_table("Expire-Span attention, forward + backward (ratio: time / memlm's)",
                ["T", "alive", "memlm", "SDPA + float bias", "causal SDPA"],
                [[str(row["length"]), f"{row['alive']:.0%}", cell(row["memlm"]), cell(row["sdpa_bias"], row["memlm"]),
                  cell(row["causal"], row["memlm"])] for row in results["expire_span"]])  # fmt: skip
    print_table("DeltaNet model on a right-padded batch, forward + backward (ratio: time / packed)",
                ["(B, T)", "real tokens", "packed (cu_seqlens)", "masked"],
                [[str(row["shape"]), f"{row['real']:.0%}", cell(row["packed"]), cell(row["masked"], row["packed"])]
                 for row in results["padded"]])  # fmt: skip
    return report.finish(results, arguments)


if __name__ == "__main__":
    main()
