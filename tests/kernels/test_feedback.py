"""memlm.kernels.feedback: the fast path (ring, tape, hand-written backward) against the reference loop.

The recurrence runs the model's step function, so the tests run it through a tiny Feedback Transformer, switching
the backend with MEMLM_KERNELS. float64 where the two may differ only by the order of float operations.
"""

import copy

import pytest
import torch

from memlm import FeedbackTransformerConfig, FeedbackTransformerForCausalLM
from memlm.compat import activation_checkpointing_enable
from memlm.kernels.feedback import feedback_recurrence, through_time
from memlm.kernels.feedback.tape import _RingStore, allocate_ring
from memlm.kernels.feedback.through_time import compiled_step_applies
from memlm.modeling.modeling_feedback_transformer import FeedbackCacheLayer
from tests.modeling.padding import padding_mask
from tests.modeling.test_modeling_feedback_transformer import TINY, VARIANTS

SETTINGS = {
    "plain": {},
    "dropout": {"hidden_dropout": 0.2, "attention_dropout": 0.1},
    "gelu": {"hidden_act": "gelu"},
    "relu": {"hidden_act": "relu"},
    "span_beyond_length": {"memory_span": 40},
}


def _model(variant="shared_rotary", **overrides) -> FeedbackTransformerForCausalLM:
    torch.manual_seed(0)
    model = FeedbackTransformerForCausalLM(FeedbackTransformerConfig(**{**TINY, **VARIANTS[variant], **overrides}))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.2)
    return model.eval()


def _runs_the_hand_written_backward(output: torch.Tensor) -> bool:
    """Whether the autograd graph behind `output` holds the one `_ThroughTime` node of the hand-written backward."""
    seen, frontier = set(), [output.grad_fn]
    while frontier:
        node = frontier.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "_ThroughTimeBackward":
            return True
        frontier.extend(next_node for next_node, _ in node.next_functions)
    return False


def _loss_and_gradients(model, backend, monkeypatch, by_hand=None, seed=0, **inputs):
    """Loss and every gradient (parameters, and the input embeddings) of one training step under a kernel backend.
    `by_hand`: whether the hand-written backward must run (default: under "torch")."""
    monkeypatch.setenv("MEMLM_KERNELS", backend)
    model.zero_grad(set_to_none=True)
    embeddings = model.model.embed_tokens(inputs.pop("input_ids")).detach().requires_grad_()
    torch.manual_seed(seed)  # the same dropout masks under both backends
    output = model(inputs_embeds=embeddings, **inputs)
    assert _runs_the_hand_written_backward(output.loss) == (backend == "torch" if by_hand is None else by_hand)
    output.loss.backward()
    gradients = {name: parameter.grad for name, parameter in model.named_parameters() if parameter.grad is not None}
    return output.loss.detach(), {**gradients, "inputs_embeds": embeddings.grad}


def _assert_same(result, expected, tolerance):
    (loss, gradients), (expected_loss, expected_gradients) = result, expected
    torch.testing.assert_close(loss, expected_loss, atol=tolerance, rtol=tolerance)
    assert gradients.keys() == expected_gradients.keys()
    for name, reference in expected_gradients.items():
        assert (gradients[name] - reference).norm() <= tolerance * reference.norm(), name
        assert reference.abs().sum() > 0, name


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_hand_written_backward_equals_the_reference(variant, setting, monkeypatch):
    # Blocks of 3 steps: reads add to slots inside their block at once and to earlier slots when the block ends.
    monkeypatch.setattr(through_time._TapeGradients, "most_block_steps", 3)
    # float64: the two differ only by the order of float operations, so any real difference would show far above it.
    model = _model(variant, **SETTINGS[setting]).train().double()
    input_ids = torch.randint(0, 256, (3, 11))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :3] = 0  # left padding writes no memory
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": input_ids}
    result = _loss_and_gradients(model, "torch", monkeypatch, **dict(inputs))
    _assert_same(result, _loss_and_gradients(model, "reference", monkeypatch, **dict(inputs)), 1e-10)


@pytest.mark.parametrize("variant", ["shared_rotary", "unshared_relative_bias"])
@pytest.mark.parametrize("keep_states", [False, True])
def test_padded_training_with_a_carried_memory_equals_the_reference(variant, keep_states, monkeypatch):
    """Right padding and holes, after a carried memory, float64: the hand-written backward, and autograd through the
    tape (which `output_hidden_states` runs), equal the reference."""
    monkeypatch.setattr(through_time._TapeGradients, "most_block_steps", 3)
    model = _model(variant, memory_span=3).train().double()
    mask = torch.cat([padding_mask("right", (9, 5, 3), 12)[:2], padding_mask("between", (9, 5, 3), 12)[2:]])
    input_ids = torch.randint(0, 256, mask.shape).masked_fill(mask == 0, 257)
    with torch.no_grad():
        carried = model(torch.randint(0, 256, (3, 4)), use_cache=True).cache
    results = {}
    for backend in ("torch", "reference"):
        inputs = {"input_ids": input_ids, "attention_mask": torch.cat([torch.ones(3, 4, dtype=torch.long), mask], 1),
                  "labels": input_ids.masked_fill(mask == 0, -100), "cache": copy.deepcopy(carried),
                  "output_hidden_states": keep_states}  # fmt: skip
        by_hand = backend == "torch" and not keep_states
        results[backend] = _loss_and_gradients(model, backend, monkeypatch, by_hand, **inputs)
    _assert_same(results["torch"], results["reference"], 1e-10)


@pytest.mark.parametrize("variant", ["shared_rotary", "unshared_relative_bias"])
def test_hand_written_backward_with_checkpointing_a_carried_memory_and_frozen_weights(variant, monkeypatch):
    """…and the softmax weights built again in the backward, as over long windows (`Recording.keeps_weights`)."""
    monkeypatch.setattr(through_time._TapeGradients, "most_block_steps", 4)
    monkeypatch.setattr(through_time.Recording, "keeps_weights", lambda *args: False)
    model = _model(variant).train()
    activation_checkpointing_enable(model)
    model.model.layers[1].mlp.up_proj.weight.requires_grad_(False)
    first, second = torch.randint(0, 256, (2, 7)), torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        carried = model(first, use_cache=True).cache  # a training forward leaves its window in the cache
    results = {}
    for backend in ("torch", "reference"):
        cache = copy.deepcopy(carried)
        results[backend] = _loss_and_gradients(model, backend, monkeypatch, input_ids=second, labels=second,
                                               cache=cache)  # fmt: skip
        assert cache.get_seq_length() == 16
    assert "model.layers.1.mlp.up_proj.weight" not in results["torch"][1]
    torch.testing.assert_close(results["torch"][0], results["reference"][0], atol=1e-6, rtol=1e-6)
    for name, reference in results["reference"][1].items():
        assert (results["torch"][1][name] - reference).norm() <= 1e-5 * reference.norm(), name


@pytest.mark.parametrize("variant", ["shared_rotary", "unshared_relative_bias"])
def test_ring_equals_the_reference_in_prefill_and_decoding(variant, monkeypatch):
    """Without gradients the fast path writes the cache's ring in place, the reference leaves a window; a padded
    prefill and decoding after it, with either backend continuing from the other's cache, give the same logits."""
    model = _model(variant).double()
    mask = padding_mask("between", (9, 5, 3), 12)
    input_ids = torch.randint(0, 256, mask.shape).masked_fill(mask == 0, 257)
    following = torch.randint(0, 256, (3, 4))

    def run(first, then):
        monkeypatch.setenv("MEMLM_KERNELS", first)
        with torch.no_grad():
            output = model(input_ids, attention_mask=mask, use_cache=True)
            logits, cache, attention_mask = [output.logits * mask[..., None]], output.cache, mask
            monkeypatch.setenv("MEMLM_KERNELS", then)
            for t in range(following.shape[1]):
                attention_mask = torch.cat([attention_mask, torch.ones(3, 1, dtype=torch.long)], 1)
                output = model(following[:, t : t + 1], attention_mask=attention_mask, cache=cache)
                logits.append(output.logits)
        return torch.cat(logits, 1)

    expected = run("reference", "reference")
    for first, then in (("torch", "torch"), ("torch", "reference"), ("reference", "torch")):
        torch.testing.assert_close(run(first, then), expected, atol=1e-10, rtol=0, msg=f"{first} then {then}")


def test_autograd_through_the_steps_where_the_backward_cannot_know_the_forward(monkeypatch):
    """Hooks, adapters or other precisions change what the forward computes: those runs keep autograd."""
    monkeypatch.setenv("MEMLM_KERNELS", "torch")
    model = _model().train()
    input_ids = torch.randint(0, 256, (2, 6))
    assert _runs_the_hand_written_backward(model(input_ids, labels=input_ids).loss)
    assert not _runs_the_hand_written_backward(model(input_ids, labels=input_ids, output_hidden_states=True).loss)
    handle = model.model.layers[0].attention.q_proj.register_forward_hook(lambda module, inputs, output: output * 2)
    assert not _runs_the_hand_written_backward(model(input_ids, labels=input_ids).loss)
    handle.remove()

    class ScaledLinear(torch.nn.Linear):  # stands for an adapter: a different forward under the same weight
        def forward(self, inputs):
            return 2 * super().forward(inputs)

    plain = model.model.layers[0].mlp.down_proj
    model.model.layers[0].mlp.down_proj = ScaledLinear(plain.in_features, plain.out_features, bias=False)
    assert not _runs_the_hand_written_backward(model(input_ids, labels=input_ids).loss)
    model.model.layers[0].mlp.down_proj = plain
    assert not _runs_the_hand_written_backward(model.to(torch.bfloat16)(input_ids, labels=input_ids).loss)


@pytest.mark.parametrize("variant", ["shared_rotary", "unshared_relative_bias"])
def test_hand_written_backward_under_functional_call_uses_the_weights_given(variant, monkeypatch):
    """`torch.func.functional_call` swaps the weights for the forward only: the backward, which runs after it,
    differentiates with the weights the forward saw (as a model holding them would), not the module's own."""
    monkeypatch.setenv("MEMLM_KERNELS", "torch")
    model = _model(variant).train().double()
    torch.manual_seed(1)
    given = {name: (parameter.detach() * 1.5 + 0.1 * torch.randn_like(parameter)).requires_grad_()
             for name, parameter in model.named_parameters()}  # fmt: skip
    input_ids = torch.randint(0, 256, (2, 7))
    loss = torch.func.functional_call(model, given, args=(input_ids,), kwargs={"labels": input_ids}).loss
    assert _runs_the_hand_written_backward(loss)
    loss.backward()
    holding = copy.deepcopy(model)
    with torch.no_grad():
        for name, parameter in holding.named_parameters():
            parameter.copy_(given[name])
    holding(input_ids, labels=input_ids).loss.backward()
    for name, parameter in holding.named_parameters():
        assert (given[name].grad - parameter.grad).abs().max() <= 1e-12 * max(1.0, parameter.grad.abs().max()), name


def test_bad_inputs_raise_value_errors():
    body = _model().model
    embeddings = torch.zeros(2, 3, 32)
    positions, valid = torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.bool)
    cache_layers, next_positions = [type("Empty", (), {"keys": None})()], torch.zeros(2, dtype=torch.long)
    cases = {
        "inputs_embeds must be a floating-point tensor": (embeddings[0], positions, valid, cache_layers, {}),
        "at least one token": (embeddings[:, :0], positions[:, :0], valid[:, :0], cache_layers, {}),
        "positions must have shape": (embeddings, positions[:, :2], valid, cache_layers, {}),
        "valid must have shape": (embeddings, positions, valid[:1], cache_layers, {}),
        "one key/value set per memory group": (embeddings, positions, valid, cache_layers * 2, {}),
        "padding_steps must be a non-negative integer": (
            embeddings,
            positions,
            valid,
            cache_layers,
            {"padding_steps": -1},
        ),  # fmt: skip
        "not a known kernel backend": (embeddings, positions, valid, cache_layers, {"backend": "cuda"}),
    }
    for message, (inputs, step_positions, step_valid, layers, options) in cases.items():
        with pytest.raises(ValueError, match=message):
            feedback_recurrence(body, inputs, step_positions, step_valid, layers, next_positions, **options)


def test_ring_read_is_softmax_attention_and_zero_where_nothing_is_visible():
    """The ring's fused read equals softmax(q·Kᵀ/√d + bias)·V written out (float64); a (row, head) whose bias is −inf
    everywhere reads a zero attention term (the paper's "no attention term"), whatever the fused op gives."""
    config = FeedbackTransformerConfig(**{**TINY, "memory_span": 5})
    layer = FeedbackCacheLayer()
    allocate_ring(layer, 2, config, torch.float64, "cpu")
    layer.keys.normal_()
    layer.values.normal_()
    store = _RingStore([layer], torch.full((2,), 5), config, layer.keys)
    heads, head_dim = config.num_attention_heads, config.head_dim
    query = torch.randn(2 * heads, head_dim, dtype=torch.float64)
    bias = torch.randn(2 * heads, 5, dtype=torch.float64)
    bias[0, 1:] = float("-inf")  # sees one memory
    bias[heads] = float("-inf")  # row 1, head 0 sees nothing
    keys, values = layer.keys.flatten(0, 1), layer.values.flatten(0, 1)
    weights = torch.softmax(torch.einsum("nd,nwd->nw", query, keys) * head_dim**-0.5 + bias, dim=-1)
    expected = torch.einsum("nw,nwd->nd", weights.nan_to_num(0.0), values)
    read = store.read(0, 0, query, bias)
    torch.testing.assert_close(read, expected, atol=1e-12, rtol=0)
    assert read[heads].abs().sum() == 0 and read[0].abs().sum() > 0


@pytest.mark.parametrize("variant", ["shared_rotary", "unshared_relative_bias"])
def test_compiled_step_equals_the_reference(variant, monkeypatch):
    """compile_step=True: the training forward of the hand-written backward and the ring's prefill and decoding run
    the step's functions through torch.compile, and equal the reference loop (float64), padding and all."""
    monkeypatch.setattr(through_time._TapeGradients, "most_block_steps", 3)
    model = _model(variant, compile_step=True).train().double()
    torch._dynamo.reset()  # compile here, whatever earlier tests compiled
    frames = torch._dynamo.utils.counters["frames"]["ok"]
    input_ids = torch.randint(0, 256, (3, 11))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :3] = 0
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": input_ids}
    result = _loss_and_gradients(model, "torch", monkeypatch, **dict(inputs))
    assert torch._dynamo.utils.counters["frames"]["ok"] > frames  # the step's functions were compiled
    _assert_same(result, _loss_and_gradients(model, "reference", monkeypatch, **dict(inputs)), 1e-10)

    model.eval()
    following = torch.randint(0, 256, (3, 4))

    def run(backend):
        monkeypatch.setenv("MEMLM_KERNELS", backend)
        with torch.no_grad():
            output = model(input_ids, attention_mask=attention_mask, use_cache=True)
            logits, cache, mask = [output.logits * attention_mask[..., None]], output.cache, attention_mask
            for t in range(following.shape[1]):
                mask = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], 1)
                output = model(following[:, t : t + 1], attention_mask=mask, cache=cache)
                logits.append(output.logits)
        return torch.cat(logits, 1)

    torch.testing.assert_close(run("torch"), run("reference"), atol=1e-10, rtol=0)


def test_compiled_step_with_checkpointing_equals_the_reference(monkeypatch):
    """Under gradient checkpointing the compiled forward keeps no MLP projections and the compiled backward
    recomputes them (float64)."""
    monkeypatch.setattr(through_time._TapeGradients, "most_block_steps", 4)
    model = _model(compile_step=True).train().double()
    activation_checkpointing_enable(model)
    input_ids = torch.randint(0, 256, (2, 9))
    results = [
        _loss_and_gradients(model, backend, monkeypatch, input_ids=input_ids, labels=input_ids)
        for backend in ("torch", "reference")
    ]
    _assert_same(*results, 1e-10)


def test_compiled_step_only_where_it_computes_what_the_eager_step_does(monkeypatch, caplog):
    """The compiled step runs without autograd, dropout or hooks, and only when asked; without a compiler it warns
    and the eager step runs."""
    model = _model(compile_step=True).model
    embeddings = torch.zeros(1, 2, 32)
    with torch.no_grad():
        assert compiled_step_applies(model, embeddings)
        model.config.compile_step = False
        assert not compiled_step_applies(model, embeddings)
        model.config.compile_step = True
        handle = model.layers[0].mlp.register_forward_hook(lambda module, inputs, output: output)
        assert not compiled_step_applies(model, embeddings)
        handle.remove()
        model.layers[1].dropout.p = 0.1
        assert compiled_step_applies(model, embeddings)  # dropout is off in eval
        assert not compiled_step_applies(model.train(), embeddings)
        model.layers[1].dropout.p = 0.0
        assert compiled_step_applies(model, embeddings)
        monkeypatch.setattr(through_time, "compiler_available", lambda device_type: False)
        with caplog.at_level("WARNING"):
            assert not compiled_step_applies(model, embeddings)
        assert "has no compiler for cpu" in caplog.text
    assert not compiled_step_applies(model, embeddings)  # autograd: the eager step
