"""torch.compile and torch.export: the models' forward and one decoding step trace without graph breaks where the
recurrence allows (on the PyTorch kernel backend, MEMLM_KERNELS=torch), `generate(compile_config=...)` compiles the
decoding step of the memories of bounded size once, and the clear errors for bad input stay."""

import pytest
import torch
import torch._dynamo
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.debugging import boxed_nop
from torch._dynamo.utils import counters
from transformers import CompileConfig

from tests.modeling.test_common import _model

# The masks the forward is traced with: none, all real tokens (what generate passes) and left padding.
MASKS = {
    "none": None,
    "ones": torch.ones(2, 5, dtype=torch.long),
    "left": torch.tensor([[0] * 2 + [1] * 3, [1] * 5]),
}


def _breaks(model, mask) -> tuple[list[str], list[str]]:
    """Where the graph breaks in a forward over 5 tokens and in one decoding step after it: the file of the innermost
    frame of each break explain() reports, and "?" for each break it counts without a reason."""
    input_ids = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(0))
    step_mask = None if mask is None else torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
    found = []
    with torch.no_grad():
        torch._dynamo.reset()
        forward = torch._dynamo.explain(model)(input_ids=input_ids, attention_mask=mask, use_cache=True)
        cache = model(input_ids, attention_mask=mask, use_cache=True).cache
        torch._dynamo.reset()
        step = torch._dynamo.explain(model)(
            input_ids=input_ids[:, :1], attention_mask=step_mask, cache=cache, use_cache=True
        )
        torch._dynamo.reset()
    for explained in (forward, step):
        assert len(explained.break_reasons) <= explained.graph_break_count
        found.append(
            [reason.user_stack[-1].filename.rsplit("memlm/", 1)[-1] for reason in explained.break_reasons]
            + ["?"] * (explained.graph_break_count - len(explained.break_reasons))
        )
    return found[0], found[1]


# Each trace takes several seconds: the left-padded one (the most paths) runs in the CPU suite, the others are slow.
SLOW_MASKS = [pytest.param(mask, marks=pytest.mark.slow) if mask != "left" else mask for mask in MASKS]


@pytest.mark.parametrize("mask", SLOW_MASKS)
@pytest.mark.parametrize("name", ["deltanet", "feedback"])
def test_forward_and_decoding_step_compile_without_graph_breaks(name, mask, monkeypatch):
    """A decoding step is one graph; so is DeltaNet's forward over a prompt. The Feedback Transformer's breaks where
    the model runs the loop over the prompt's steps outside the graph (unrolled, it took minutes to compile), and
    nowhere else (the rest of that frame, inside the loop's try block, runs as it is: breaks explain() counts
    without a reason)."""
    monkeypatch.setenv("MEMLM_KERNELS", "torch")
    forward, step = _breaks(_model(name), MASKS[mask])
    assert step == []
    located = [where for where in forward if where != "?"]
    assert located == ([] if name == "deltanet" else ["modeling/modeling_feedback_transformer.py"])
    assert len(forward) == len(located) or name == "feedback"


@pytest.mark.slow
@pytest.mark.parametrize("mask", list(MASKS))
def test_expire_span_breaks_only_to_compact_its_memories(mask, monkeypatch):
    """Expire-Span deletes expired memories, so its memory's width is data: compiled, a decoding step's layers mask
    dead memories and the forward compacts them once at its end, the one place its graph breaks (the kernel,
    sdpa.py, has no data-dependent branch under compile). Over a prompt, each layer also runs its blocks outside the
    graph (unrolled, they took a minute to compile)."""
    monkeypatch.setenv("MEMLM_KERNELS", "torch")
    forward, step = _breaks(_model("expire_span"), MASKS[mask])
    located = [where for where in step if where != "?"]
    assert located == ["modeling/modeling_expire_span.py"] and len(step) <= 2, step
    located = [where for where in forward if where != "?"]  # (explain() gives no reason for the blocks' breaks)
    assert set(located) <= {"modeling/modeling_expire_span.py"}, forward


@pytest.mark.parametrize("name", ["deltanet", pytest.param("feedback", marks=pytest.mark.slow)])
def test_export_gives_the_eager_logits(name, monkeypatch):
    """torch.export traces the forward (the ids' range check runs in eager mode only) and gives the same logits."""
    monkeypatch.setenv("MEMLM_KERNELS", "torch")
    model = _model(name)
    input_ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        program = torch.export.export(model, (input_ids,), kwargs={"use_cache": False})
        torch.testing.assert_close(
            program.module()(input_ids, use_cache=False).logits, model(input_ids, use_cache=False).logits
        )
    # ONNX has no triangular solve: an exported chunkwise delta rule inverts its chunks' matrices with products
    # (`chunk.unit_lower_triangular_inverse`), which the logits above check.
    assert "solve_triangular" not in str(program.graph)
    with pytest.raises(ValueError, match=r"input_ids must lie in \[0, vocab_size=258\); got values from 0 to 300"):
        model(torch.tensor([[0, 300]]))


def test_deltanet_layers_are_one_compile_region_except_under_export(monkeypatch):
    """`compile_region`: torch.compile traces DeltaNet's decoder layer as one `invoke_subgraph` shared by the layers;
    torch.export traces it inline (a region there is compiled by Dynamo inside the export, call after call)."""
    monkeypatch.setenv("MEMLM_KERNELS", "torch")
    model = _model("deltanet")
    input_ids = torch.randint(0, 256, (1, 9))
    graphs = []

    def backend(graph_module, example_inputs):
        graphs.append(graph_module.code)
        return graph_module.forward

    torch._dynamo.reset()
    with torch.no_grad():
        compiled = torch.compile(model, backend=backend)(input_ids, use_cache=False).logits
        torch.testing.assert_close(compiled, model(input_ids, use_cache=False).logits)
        counters.clear()
        torch.export.export(model, (input_ids,), kwargs={"use_cache": False})
    assert sum(code.count("invoke_subgraph(") for code in graphs) == model.config.num_hidden_layers
    assert not counters["stats"]["unique_graphs"]  # no graph of Dynamo's inside the export


@pytest.mark.parametrize("use_cache", [False, True])
def test_export_of_expire_span_is_refused_in_words(use_cache, monkeypatch):
    """Its memory's width is data, so an exported graph would answer other inputs wrongly: refused, never wrong."""
    monkeypatch.setenv("MEMLM_KERNELS", "torch")
    model = _model("expire_span")
    input_ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad(), pytest.raises(ValueError, match="torch.export cannot capture Expire-Span: the number of"):
        torch.export.export(model, (input_ids,), kwargs={"use_cache": use_cache})
    with torch.no_grad():  # eager runs as before
        assert model(input_ids, use_cache=use_cache).logits.shape == (2, 9, 258)


class RecordingBackend:
    """A `torch.compile` backend (`backend`) that runs the graphs as they are (no code generation: fast) and records
    them: every graph Dynamo captures (one per compilation), its ATen graph, and how often the compiled code ran."""

    def __init__(self):
        self.graphs, self.aten_graphs, self.calls = [], [], 0

        # A function, not a method: `CompileConfig.to_dict()` deep-copies the backend, which keeps a function as it is.
        def backend(graph, example_inputs):
            self.graphs.append(graph)
            compiled = aot_autograd(fw_compiler=record_aten)(graph, example_inputs)

            def run(*args):
                self.calls += 1
                return compiled(*args)

            return run

        def record_aten(graph, example_inputs):
            self.aten_graphs.append(graph)
            return boxed_nop(graph, example_inputs)

        self.backend = backend

    def aten_ops(self) -> set[str]:
        return {
            str(node.target) for graph in self.aten_graphs for node in graph.graph.nodes if node.op == "call_function"
        }


def compile_config(backend) -> CompileConfig:
    config = CompileConfig(backend=backend, fullgraph=True, mode=None)
    config._compile_all_devices = True  # 🤗 compiles on GPUs only, unless told
    return config


# Left padding of different lengths, and (with 24 new tokens) a Feedback ring of 6 slots that wraps around.
PROMPT_MASK = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1]])
NEW_TOKENS = 24


def _layout_model(name: str):
    """A model of `test_common` ("deltanet") or a Feedback Transformer of a layout of its layouts' tests
    ("feedback/official_pre_norm")."""
    if "/" not in name:
        return _model(name)
    from tests.modeling.test_modeling_feedback_layouts import _model as feedback_layout

    return feedback_layout(name.split("/")[1])


@pytest.mark.parametrize(
    "name",
    ["deltanet", "feedback", "feedback/official_pre_norm", "feedback/adaptive_span_trimmed",
     "feedback/official_post_norm_shared"],
)  # fmt: skip
def test_generate_compiles_the_decoding_step_once_and_decodes_as_eager(name, monkeypatch):
    """The decoding step compiles to one graph (fullgraph) the first time and runs that graph at every later step
    (no recompilation: the memory keeps its shapes and addresses, its token count is a tensor), with no read of a
    tensor's value on the host (Dynamo told to capture `.item()` and data-dependent shapes, none is in the graph),
    and gives the eager logits and tokens. The papers' Feedback layouts too: memories carried as hidden states (a
    compiled step takes the cache's keys and values as made with the weights of now), the adaptive span with its
    window trimmed (on the ring, masked, where eager decoding keeps only the trimmed window), the learned positions
    added to the keys (without the adaptive span)."""
    monkeypatch.setenv("MEMLM_KERNELS", "torch")
    model = _layout_model(name)
    prompt = torch.randint(3, model.config.vocab_size, PROMPT_MASK.shape, generator=torch.Generator().manual_seed(0))
    options = {"attention_mask": PROMPT_MASK, "max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS,
               "do_sample": False, "output_logits": True, "return_dict_in_generate": True}  # fmt: skip
    eager = model.generate(prompt, **options)
    backend = RecordingBackend()
    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True):
        compiled = model.generate(prompt, compile_config=compile_config(backend.backend), **options)
    torch._dynamo.reset()
    assert len(backend.graphs) == 1 and len(backend.aten_graphs) == 1
    assert backend.calls == NEW_TOKENS - 1  # every step after the prompt ran the one compiled graph
    host_reads = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.item.default"}
    assert not backend.aten_ops() & host_reads
    torch.testing.assert_close(torch.stack(compiled.logits), torch.stack(eager.logits), atol=1e-5, rtol=1e-5)
    assert torch.equal(compiled.sequences, eager.sequences)


@pytest.mark.parametrize("name", ["deltanet", "feedback"])
def test_decoding_writes_the_memory_where_it_is(name):
    """After the prompt, decoding steps write the memory's tensors in place: the compiled step reads and writes
    them at the same addresses (`torch._dynamo.mark_static_address`). The Feedback ring takes its τ slots at once."""
    model = _model(name)
    prompt = torch.randint(3, 256, (2, 3), generator=torch.Generator().manual_seed(0))
    cache = model.cache_class(model.config)
    cache.prepare_compiled_decoding()
    with torch.no_grad():
        model(prompt, cache=cache, use_cache=True)
        tensors = [getattr(layer, attribute) for layer in cache.layers for attribute in layer.tensor_names]
        addresses = [tensor.data_ptr() for tensor in tensors if tensor is not None]
        for token in prompt.T:  # more steps than the Feedback ring has slots: it wraps around
            model(token[:, None], cache=cache, use_cache=True)
            model(token[:, None], cache=cache, use_cache=True)
    tensors = [getattr(layer, attribute) for layer in cache.layers for attribute in layer.tensor_names]
    assert [tensor.data_ptr() for tensor in tensors if tensor is not None] == addresses
    assert len(addresses) >= 3 and cache.get_seq_length() == 9
    if name == "feedback":
        assert cache.layers[0].keys.shape[2] == model.config.memory_span


def test_expire_span_decodes_eagerly_and_says_why(monkeypatch, caplog):
    """Expire-Span's memory changes size as memories expire: asked to compile, `generate` says so and decodes
    eagerly (the same tokens)."""
    monkeypatch.setenv("MEMLM_KERNELS", "torch")
    model = _model("expire_span")
    prompt = torch.randint(3, 256, (2, 4), generator=torch.Generator().manual_seed(0))
    backend = RecordingBackend()
    with caplog.at_level("WARNING"):
        compiled = model.generate(
            prompt, compile_config=compile_config(backend.backend), max_new_tokens=4, do_sample=False
        )
    assert "ExpireSpanForCausalLM decodes without compiling the step: An Expire-Span memory changes size" in (
        caplog.text
    )
    assert backend.graphs == []
    assert torch.equal(compiled, model.generate(prompt, max_new_tokens=4, do_sample=False))
