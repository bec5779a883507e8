"""Decode with a memlm model exported to ONNX (`memlm export onnx`), by ONNX Runtime and NumPy alone — no PyTorch,
no memlm; 🤗 tokenizers for text. `memlm export onnx` copies this file into the export as `run_onnx.py`:

    python run_onnx.py EXPORT_DIR --prompt "The memory" --max-new-tokens 64          text in, text out
    python run_onnx.py EXPORT_DIR --token-ids 5 17 42 --max-new-tokens 64 --output out.npz   ids in; tokens, logits

or, from Python: `OnnxLanguageModel(EXPORT_DIR).generate(prompt_ids, max_new_tokens=64)`.

The memory is explicit: every call of a graph takes it (`past.NAME`) and returns the next (`present.NAME`), starting
from `initial_memory.npz`. A prompt runs as blocks of P tokens (`prefill.onnx`), its remainder and every new token
one at a time (`step.onnx`). Decoding is greedy (the first largest logit, as `torch.argmax`) unless a temperature
is given.
"""

import argparse
import json
import sys
from pathlib import Path

import numpy

MANIFEST = "memlm_onnx.json"
SUPPORTED_FORMAT = 1


class OnnxLanguageModel:
    """The two graphs of an export (`prefill.onnx`, `step.onnx`) and its initial memory. `threads`: ONNX Runtime's
    intra-op threads (None: its default, one per core)."""

    def __init__(self, folder, threads: int | None = None):
        self.folder = Path(folder)
        manifest_path = self.folder / MANIFEST
        if not manifest_path.is_file():
            raise ValueError(f"{folder}: no {MANIFEST}; give a folder written by `memlm export onnx`.")
        self.manifest = json.loads(manifest_path.read_text())
        if self.manifest.get("format_version") != SUPPORTED_FORMAT:
            raise ValueError(
                f"{folder}: export format {self.manifest.get('format_version')!r}, this runner reads "
                f"{SUPPORTED_FORMAT}; export again with the memlm that wrote this runner."
            )
        self.block_size = self.manifest["block_size"]
        try:
            import onnxruntime
        except ImportError as error:
            raise ValueError(
                "Running an ONNX export needs ONNX Runtime, not installed: pip install onnxruntime (or, with memlm, "
                'pip install "memlm[onnx]").'
            ) from error
        options = onnxruntime.SessionOptions()
        if threads is not None:
            options.intra_op_num_threads = threads
        providers = ["CPUExecutionProvider"]
        self.prefill = onnxruntime.InferenceSession(str(self.folder / "prefill.onnx"), options, providers=providers)
        self.step = onnxruntime.InferenceSession(str(self.folder / "step.onnx"), options, providers=providers)
        with numpy.load(self.folder / "initial_memory.npz") as arrays:
            self.initial = {name: arrays[name] for name in arrays.files}

    def initial_memory(self, batch_size: int = 1) -> dict:
        """The memory before any token, for `batch_size` rows."""
        if batch_size != 1 and not self.manifest["dynamic_batch"]:
            raise ValueError("This export runs one row at a time (exported without a batch axis).")
        memory = {}
        for name, array in self.initial.items():
            axis = self.manifest["memory"][name]["batch_axis"]
            memory[name] = array if axis is None else numpy.repeat(array, batch_size, axis=axis)
        return memory

    def _call(self, session, input_ids: numpy.ndarray, memory: dict) -> tuple:
        feeds = {"input_ids": input_ids.astype(numpy.int64)}
        for node in session.get_inputs():
            if node.name.startswith("past."):
                feeds[node.name] = memory[node.name[len("past.") :]]
        names = [node.name for node in session.get_outputs()]
        outputs = session.run(names, feeds)
        following = dict(memory)
        for name, array in zip(names[1:], outputs[1:]):
            following[name[len("present.") :]] = array
        return outputs[0], following

    def forward(self, input_ids, memory: dict | None = None) -> tuple:
        """Read `input_ids` (B, T) into `memory` (default: the initial memory): the last token's logits (B, V) and
        the memory after it. Whole blocks of P tokens run through the prefill graph, the rest token by token."""
        input_ids = numpy.asarray(input_ids, dtype=numpy.int64)
        if input_ids.ndim != 2 or input_ids.shape[1] == 0:
            raise ValueError(
                f"input_ids must be (batch, tokens) with at least one token, got shape {input_ids.shape}."
            )
        memory = self.initial_memory(input_ids.shape[0]) if memory is None else memory
        logits, start = None, 0
        while input_ids.shape[1] - start >= self.block_size:
            logits, memory = self._call(self.prefill, input_ids[:, start : start + self.block_size], memory)
            start += self.block_size
        for position in range(start, input_ids.shape[1]):
            logits, memory = self._call(self.step, input_ids[:, position : position + 1], memory)
        return logits, memory

    def generate(self, input_ids, max_new_tokens: int = 64, eos_token_id=None, temperature: float = 0.0,
                 seed: int | None = None) -> tuple:  # fmt: skip
        """New tokens (B, N) after the prompt `input_ids` (B, T), and the logits each was chosen from (B, N, V): the
        first largest logit (`temperature` 0), else a draw from softmax(logits / temperature). Stops early when every
        row has produced `eos_token_id`."""
        generator = numpy.random.default_rng(seed)
        logits, memory = self.forward(input_ids)
        tokens, chosen_from = [], []
        finished = numpy.zeros(logits.shape[0], dtype=bool)
        for index in range(max_new_tokens):
            if temperature > 0:
                scaled = logits.astype(numpy.float64) / temperature
                probabilities = numpy.exp(scaled - scaled.max(-1, keepdims=True))
                probabilities /= probabilities.sum(-1, keepdims=True)
                token = numpy.array([generator.choice(len(row), p=row) for row in probabilities])
            else:
                token = logits.argmax(-1)
            tokens.append(token)
            chosen_from.append(logits)
            if eos_token_id is not None:
                finished |= numpy.isin(token, numpy.atleast_1d(eos_token_id))
                if finished.all():
                    break
            if index + 1 < max_new_tokens:
                logits, memory = self._call(self.step, token[:, None], memory)
        return numpy.stack(tokens, 1), numpy.stack(chosen_from, 1)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Decode with a memlm model exported to ONNX.")
    parser.add_argument("folder", nargs="?", default=str(Path(__file__).resolve().parent))
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="text, tokenized with the export's tokenizer.json (needs 🤗 tokenizers)")
    source.add_argument("--token-ids", type=int, nargs="+", help="the prompt's token ids")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None, help="ONNX Runtime's intra-op threads")
    parser.add_argument("--output", help="write the tokens and their logits to this .npz file")
    arguments = parser.parse_args(argv)
    try:
        model = OnnxLanguageModel(arguments.folder, arguments.threads)
        tokenizer = None
        if arguments.prompt is not None:
            from tokenizers import Tokenizer

            path = Path(arguments.folder) / "tokenizer.json"
            if not path.is_file():
                raise ValueError(f"{arguments.folder} has no tokenizer.json: give the prompt as --token-ids.")
            tokenizer = Tokenizer.from_file(str(path))
            prompt = tokenizer.encode(arguments.prompt, add_special_tokens=False).ids
        else:
            prompt = arguments.token_ids
        tokens, logits = model.generate(
            numpy.array([prompt]), arguments.max_new_tokens, model.manifest.get("eos_token_id"),
            arguments.temperature, arguments.seed,
        )  # fmt: skip
    except (ValueError, OSError) as error:
        print(f"run_onnx: error: {error}", file=sys.stderr)
        raise SystemExit(1) from None
    if arguments.output:
        numpy.savez(arguments.output, prompt=numpy.array(prompt), tokens=tokens, logits=logits)
    if tokenizer is not None:
        print(arguments.prompt + tokenizer.decode(tokens[0].tolist()))
    else:
        print(" ".join(str(token) for token in tokens[0].tolist()))


if __name__ == "__main__":
    main()
