"""Feedback Transformer: the block layouts and the official model's options (SPEC §8) against a plain per-step loop
written from the papers (Fan et al., 2021, Eq. 1; Sukhbaatar et al., 2019: the adaptive span's soft mask), the
default layout unchanged (checkpoints saved by main before the options existed give the same logits, the fast paths
still run), the memory carried as hidden states, the adaptive span and its loss."""

import copy
import gc
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import memlm.kernels.feedback as feedback_kernels
from memlm import FeedbackTransformerConfig, FeedbackTransformerForCausalLM
from memlm.compat import activation_checkpointing_enable
from memlm.kernels.feedback import through_time
from memlm.kernels.feedback.through_time import DeferredWeightGradients, compiled_step_applies, covers
from memlm.modeling.memory import weights_version
from tests.modeling.padding import LAYOUTS as PADDING_LAYOUTS
from tests.modeling.padding import check_rows_alone, padding_mask
from tests.modeling.weight_changes import assert_generate_walks_once_and_sees_a_change
from tests.tolerances import RECORDED_FLOAT32_LOGITS

DATA = Path(__file__).parent / "data"
TINY = {
    "vocab_size": 40,
    "hidden_size": 24,
    "intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 2,
    "memory_span": 5,
}
OFFICIAL_BLOCK = {
    "norm_type": "layernorm",
    "mlp_type": "plain",
    "mlp_bias": True,
    "hidden_act": "relu",
    "lm_head_bias": True,
}
LAYOUTS = {
    "post_norm_layernorm_plain": {
        **OFFICIAL_BLOCK,
        "norm_position": "post",
        "final_norm": False,
        "position_encoding": "relative_bias",
    },
    "biases_scale_no_final_norm": {
        "mlp_bias": True,
        "attention_output_bias": True,
        "lm_head_bias": True,
        "embedding_scale": 2.5,
        "final_norm": False,
        "position_encoding": "relative_bias",
    },
    "head_dim_learned_relative_raw_memory": {
        **OFFICIAL_BLOCK,
        "head_dim": 7,
        "position_encoding": "learned_relative",
        "memory_normalization": "none",
    },
    "official_pre_norm": {
        **OFFICIAL_BLOCK,
        "head_dim": 8,
        "share_key_value": False,
        "position_encoding": "learned_relative",
        "initial_memory": "zeros",
        "memory_normalization": "layer",
        "memory_carry": "hidden_states",
        "carry_first_layer_norm": True,
        "adaptive_span": True,
        "adaptive_span_ramp": 2,
        "adaptive_span_loss_coefficient": 1e-2,
        "renormalization_epsilon": 1e-8,
        "attention_dropout_position": "weights",
    },
    "official_post_norm_shared": {
        **OFFICIAL_BLOCK,
        "norm_position": "post",
        "final_norm": False,
        "position_encoding": "learned_relative",
        "initial_memory": "zeros",
        "memory_normalization": "none",
        "memory_carry": "hidden_states",
        "attention_dropout_position": "weights",
    },
    "adaptive_span_trimmed": {
        **OFFICIAL_BLOCK,
        "memory_span": 9,
        "share_key_value": False,
        "position_encoding": "learned_relative",
        "initial_memory": "zeros",
        "memory_normalization": "layer",
        "memory_carry": "hidden_states",
        "adaptive_span": True,
        "adaptive_span_ramp": 2,
        "adaptive_span_trim_step": 2,
        "renormalization_epsilon": 1e-3,  # large enough that the softmax over a trimmed window shows
    },
    "shared_projections_layer_norms": {
        **OFFICIAL_BLOCK,
        "position_encoding": "learned_relative",
        "initial_memory": "zeros",
        "memory_normalization": "layer",
        "adaptive_span": True,
        "adaptive_span_ramp": 3,
    },
}


def _model(layout: str, seed: int = 0, **overrides) -> FeedbackTransformerForCausalLM:
    torch.manual_seed(seed)
    config = FeedbackTransformerConfig(**{**TINY, **LAYOUTS[layout], **overrides})
    model = FeedbackTransformerForCausalLM(config).to(torch.float64)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("span_ratio"):
                parameter.copy_(torch.rand_like(parameter) * 0.6 + 0.1)  # spans of 0.5 to 3.5 steps (τ = 5)
            else:
                parameter.add_(torch.randn_like(parameter) * 0.3)
    return model.eval()


def naive_forward(model: FeedbackTransformerForCausalLM, input_ids: torch.Tensor) -> torch.Tensor:
    """One forward from an empty cache as the plainest loop: every memory's hidden state kept in a list, its keys and
    values projected again at every step it is read; the block as the official code writes it (pre-norm
    x + f(norm(x)), post-norm norm(x + f(x))); Eq. 1's mix; the learned relative positions q·p_d; the adaptive span's
    mask m(d) = clamp((1 − d + z·τ)/R + 1, 0, 1) and renormalisation."""
    config, body = model.config, model.model
    assert config.position_encoding != "rotary"  # the rotary layouts: test_modeling_feedback_transformer.py
    batch, length = input_ids.shape
    heads, width, span = config.num_attention_heads, config.head_dim, config.memory_span
    pre = config.norm_position == "pre"
    embeddings = body.embed_tokens(input_ids) * config.embedding_scale
    memories = []  # (position, hidden state (B, D))
    if config.initial_memory == "zeros":
        memories = [(position, embeddings.new_zeros(batch, config.hidden_size)) for position in range(-span, 0)]

    def keys_values(index, memory):
        layer = body.layers[index]
        source = layer.input_layernorm(memory) if config.memory_normalization == "layer" else memory
        projections = body if config.share_key_value else layer.attention
        return projections.k_proj(source).view(batch, heads, width), projections.v_proj(source).view(
            batch, heads, width
        )

    outputs = []
    for t in range(length):
        x = embeddings[:, t]
        states = [x]
        for index, layer in enumerate(body.layers):
            attention = layer.attention
            query = attention.q_proj(layer.input_layernorm(x) if pre else x).view(batch, heads, width)
            reach = span
            if config.adaptive_span_trim_step:  # the official trim: whole steps of memories beyond every head's span
                step = config.adaptive_span_trim_step
                longest = min(span, math.ceil(attention.span_ratio.max().item() * span + config.adaptive_span_ramp))
                reach = span - (min(span - 1, span - longest) // step) * step
            window = [(position, memory) for position, memory in memories if 1 <= t - position <= reach]
            context = torch.zeros_like(query)
            if window:
                pairs = [keys_values(index, memory) for _, memory in window]
                keys = torch.stack([key for key, _ in pairs], 2)  # (B, H, W, d)
                values = torch.stack([value for _, value in pairs], 2)
                distances = torch.tensor([t - position for position, _ in window], dtype=torch.float64)
                scores = torch.einsum("bhd,bhwd->bhw", query, keys)
                if config.position_encoding == "learned_relative":
                    vectors = body.relative_positions[[int(d) - 1 for d in distances]]  # (W, d): p_d
                    scores = scores + torch.einsum("bhd,wd->bhw", query, vectors)
                scores = scores / math.sqrt(width)
                if config.position_encoding == "relative_bias":
                    scores = scores + attention.relative_bias[:, [int(d) - 1 for d in distances]][None]
                weights = scores.softmax(-1)
                if config.adaptive_span:
                    ratio = attention.span_ratio[None, :, None]
                    mask = ((1 - distances) + ratio * span) / config.adaptive_span_ramp + 1
                    weights = weights * mask.clamp(0, 1)
                    weights = weights / (weights.sum(-1, keepdim=True) + config.renormalization_epsilon)
                context = torch.einsum("bhw,bhwd->bhd", weights, values)
            attended = attention.o_proj(context.reshape(batch, -1))
            if pre:
                x = x + attended
                x = x + layer.mlp(layer.post_attention_layernorm(x))
            else:
                x = layer.input_layernorm(x + attended)
                x = layer.post_attention_layernorm(x + layer.mlp(x))
            states.append(x)
        mixture = sum(w * state for w, state in zip(torch.softmax(body.layer_weights, 0), states))
        memories.append((t, body.memory_norm(mixture) if config.memory_normalization == "mixture" else mixture))
        outputs.append(x)
    return model.lm_head(body.norm(torch.stack(outputs, 1)))


@pytest.mark.parametrize("name", ["shared_rotary", "unshared_relative_bias"])
def test_a_checkpoint_saved_by_main_before_the_options_gives_the_same_logits(name):
    folder = DATA / f"feedback_{name}_main_d2993f4"  # saved by main at d2993f4, with its logits
    model = FeedbackTransformerForCausalLM.from_pretrained(folder).eval()
    expected = load_file(folder / "expected_logits.safetensors")
    assert model.config.default_step and model.config.head_dim == 8
    with torch.no_grad():
        logits = model(expected["input_ids"]).logits
    torch.testing.assert_close(logits, expected["logits"], **RECORDED_FLOAT32_LOGITS)  # recorded on another processor


def test_the_hand_written_backward_covers_every_layout():
    """Training runs the hand-written backward for every layout, the adaptive span and dropout on the attention
    weights included (but half precision, hooks, adapters or per-step outputs: see `through_time.covers`). Only the
    default layout's step compiles (`compile_step`)."""
    default = FeedbackTransformerForCausalLM(FeedbackTransformerConfig(**TINY)).model
    embeddings = torch.zeros(1, 3, TINY["hidden_size"])
    assert covers(default, embeddings, keep_states=False) and not default.needs_tape
    for layout in LAYOUTS:
        body = _model(layout, attention_dropout=0.1).model.float().train()
        assert not body.config.default_step
        assert covers(body, embeddings, keep_states=False), layout
        assert not covers(body, embeddings, keep_states=True), layout
        assert not covers(body, embeddings.to(torch.bfloat16), keep_states=False), layout  # float32 and float64
        body.config.compile_step = True
        assert not compiled_step_applies(body, embeddings), layout


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_match_the_naive_loop_with_their_gradients(layout):
    model = _model(layout)
    input_ids = torch.randint(0, 40, (2, 11))
    logits = model(input_ids).logits
    expected = naive_forward(model, input_ids)
    assert (logits - expected).abs().max() < 1e-12
    weights = torch.randn_like(expected)
    parameters = [parameter for _, parameter in model.named_parameters()]
    gradients = torch.autograd.grad((logits * weights).sum(), parameters)
    expected_gradients = torch.autograd.grad((expected * weights).sum(), parameters)
    for (name, _), gradient, reference in zip(model.named_parameters(), gradients, expected_gradients):
        assert (gradient - reference).abs().max() <= 1e-12 * max(1.0, reference.abs().max()), name
        assert gradient.abs().sum() > 0, name


def test_a_float64_model_computes_in_float64():
    model = _model("official_pre_norm")
    input_ids = torch.randint(0, 40, (1, 6))
    with torch.no_grad():
        output = model(input_ids, use_cache=True)
    assert output.logits.dtype == torch.float64 and output.aux_loss.dtype == torch.float64
    assert output.cache.layers[0].hidden.dtype == torch.float64 and output.cache.layers[0].keys.dtype == torch.float64


def test_the_zero_initial_memory_is_attended():
    zeros, empty = _model("official_pre_norm"), _model("official_pre_norm", initial_memory="empty")
    input_ids = torch.randint(0, 40, (1, 4))
    with torch.no_grad():
        # LayerNorm(0) = its bias: the zero memories have keys and values, and the first token reads them.
        assert (zeros(input_ids).logits[:, 0] - empty(input_ids).logits[:, 0]).abs().max() > 1e-3
        cache = zeros(input_ids, use_cache=True).cache
    layer = cache.layers[0]  # (a ring: slot = position mod τ)
    assert sorted(layer.positions[0][layer.valid[0]].tolist()) == [-1, 0, 1, 2, 3]  # the last zero memory in reach


def test_the_adaptive_span_mask_its_loss_and_where_the_loss_goes():
    model = _model("official_pre_norm", adaptive_span_ramp=2.0)
    layer_ratios = [layer.attention.span_ratio for layer in model.model.layers]
    with torch.no_grad():
        layer_ratios[0].copy_(torch.tensor([0.0, 0.5]))
    # m(d) = clamp((1 − d + z·τ)/R + 1, 0, 1): z = 0 sees d = 1 fully and d = 2 at one half; z = 0.5 (span 2.5)
    from memlm.kernels.feedback.reference import adaptive_span_mask

    mask = adaptive_span_mask(layer_ratios[0], torch.tensor([[1, 2, 3, 4, 5]]), 5, 2.0)
    torch.testing.assert_close(mask[0], torch.tensor([[1, 0.5, 0, 0, 0], [1, 1, 1, 0.75, 0.25]], dtype=torch.float64))
    input_ids = torch.randint(0, 40, (2, 6))
    expected = sum(ratio.mean() * 1e-2 * 5 for ratio in layer_ratios)
    output = model(input_ids, labels=input_ids)
    torch.testing.assert_close(output.aux_loss, expected, rtol=0, atol=1e-15)
    assert output.loss is output.lm_loss  # eval: the language-model loss only
    model.train()
    output = model(input_ids, labels=input_ids)
    assert output.lm_loss.dtype == torch.float64  # a float64 model's loss too
    expected_lm = F.cross_entropy(output.logits[:, :-1].reshape(-1, 40), input_ids[:, 1:].reshape(-1))
    torch.testing.assert_close(output.lm_loss, expected_lm, rtol=0, atol=1e-14)
    torch.testing.assert_close(output.loss, output.lm_loss + output.aux_loss, rtol=0, atol=0)
    output.loss.backward()
    assert all(ratio.grad.abs().min() > 0 for ratio in layer_ratios)  # through the mask and the loss


def test_no_auxiliary_loss_without_adaptive_span():
    model = _model("official_post_norm_shared").train()
    input_ids = torch.randint(0, 40, (2, 6))
    output = model(input_ids, labels=input_ids)
    assert output.aux_loss is None and output.loss is output.lm_loss


@pytest.mark.parametrize("carry", ["hidden_states", "keys_values"])
def test_a_carried_memory_gives_gradients_to_the_projections_only_as_hidden_states(carry):
    """The next block's first token reads only carried memories: their keys and values reach the projections' weights
    when they are recomputed from hidden states (Transformer-XL; the official code), not when carried as keys."""
    model = _model("official_post_norm_shared", memory_carry=carry, initial_memory="empty").train()
    cache = model(torch.randint(0, 40, (2, 6)), use_cache=True).cache
    output = model(torch.randint(0, 40, (2, 1)), cache=cache)
    output.logits.sum().backward()
    key_gradient = model.model.k_proj.weight.grad
    if carry == "hidden_states":
        assert key_gradient.abs().sum() > 0 and cache.layers[0].hidden.requires_grad is False
    else:
        assert key_gradient is None or key_gradient.abs().sum() == 0


def test_hidden_states_carried_use_the_current_weights():
    model = _model("official_post_norm_shared")
    first, second = torch.randint(0, 40, (2, 2, 6))
    with torch.no_grad():
        cache = model(first, use_cache=True).cache
        values_then = cache.layers[0].values  # computed in that forward, with the weights of then
        before = model(second, cache=copy.deepcopy(cache)).logits
        model.model.v_proj.weight.mul_(1.5)  # as an optimizer step would change them
        after = model(second, cache=copy.deepcopy(cache)).logits
        like = first.new_zeros(2, 1, 1, dtype=torch.float64)
        values_now = model.model._starting_memory(cache, False, like, weights_version(model.model))
    assert (before - after).abs().max() > 1e-3
    # the next forward reads values recomputed from the carried hidden states with the current weights
    torch.testing.assert_close(values_now[0].values, 1.5 * values_then, atol=1e-13, rtol=0)


@pytest.mark.parametrize("layout", ["official_post_norm_shared", "shared_projections_layer_norms"])
def test_prefill_then_decoding_equals_the_full_forward(layout):
    model = _model(layout)
    input_ids = torch.randint(0, 40, (2, 13))
    with torch.no_grad():
        full = model(input_ids).logits
        output = model(input_ids[:, :4], use_cache=True)
        cache, pieces = output.cache, [output.logits]
        for t in range(4, 13):
            output = model(input_ids[:, t : t + 1], cache=cache)
            pieces.append(output.logits)
        generated = model.generate(input_ids[:, :4], max_new_tokens=4, do_sample=False, num_beams=2)
    assert (torch.cat(pieces, 1) - full).abs().max() < 1e-12
    assert generated.shape == (2, 8)


@pytest.mark.parametrize("layout", ["official_post_norm_shared", "shared_projections_layer_norms"])
def test_a_decoding_step_adds_the_positions_to_its_keys(layout):
    """A decoding step (the ring, no gradients) of a layout with learned relative positions and nothing done to its
    softmax weights adds each memory's row p_{t−i} to its key, q·k_i + q·p_{t−i} = q·(k_i + p_{t−i}), and reads the
    memory with one fused attention per layer (`scores.keys_take_positions`), writing out no position scores: no
    product with the table (`mv`), no gather, in evaluation and in training without dropout alike. With the adaptive
    span (a mask on the weights) it scores the positions as a forward does (in evaluation one matrix-vector product
    per head at batch 1). The logits are the full forward's either way."""
    from tests.operations import CountOperations

    model = _model(layout)
    adds = layout == "official_post_norm_shared"
    layers = model.config.num_hidden_layers
    input_ids = torch.randint(0, 40, (1, 6))
    with torch.no_grad():
        full = model(input_ids).logits[:, -1]
        for training in (False, True):
            cache = model.eval()(input_ids[:, :5], use_cache=True).cache
            model.train(training)
            with CountOperations() as operations:
                step = model(input_ids[:, 5:], cache=cache).logits[:, -1]
            counts = operations.by_name
            heads = 0 if adds or training else model.config.num_attention_heads * layers  # (a training step: one mm)
            assert (counts["mv"], counts["gather"]) == (heads, 0 if adds else layers), counts
            fused = sum(count for name, count in counts.items() if "scaled_dot_product" in name)  # (any backend's)
            assert fused == (layers if adds else 0), counts
            assert (step - full).abs().max() < 1e-12
    model.eval()


def test_generate_walks_the_weights_once_a_call_and_the_next_call_sees_a_change(monkeypatch):
    """The official layout carries hidden states whose keys and values a step takes as they are while the weights stay:
    checked once per `generate` call, and the next call sees an optimizer step between them (`weight_changes`)."""
    model = _model("official_pre_norm")
    assert_generate_walks_once_and_sees_a_change(
        model, torch.randint(0, TINY["vocab_size"], (2, 10), generator=torch.Generator().manual_seed(1)), monkeypatch
    )


def test_a_copy_or_a_pickle_of_the_model_leaves_the_padded_positions_behind():
    """The padded positions' table a decoding step keeps (`layers.PaddedPositions`) is not copied or pickled with the
    model; the copy pads its own at its first step and decodes as the original (float64, to 1e-12)."""
    import copy
    import pickle

    model = _model("official_post_norm_shared")
    input_ids = torch.randint(0, 40, (1, 6))
    with torch.no_grad():
        cache = model(input_ids[:, :5], use_cache=True).cache
        expected = model(input_ids[:, 5:], cache=copy.deepcopy(cache)).logits
        assert model.model._padded.table is not None  # kept for the next step
        for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
            assert twin.model._padded.table is None
            # (the copy's weights are other tensors: it makes the cache's keys and values again from its hidden states)
            assert (twin(input_ids[:, 5:], cache=copy.deepcopy(cache)).logits - expected).abs().max() < 1e-12
            assert twin.model._padded.table is not None


def test_generate_leaves_out_the_adaptive_span_loss_it_does_not_read():
    """Inside `generate`, which reads of its forwards only the logits and the cache, the adaptive span's loss is left
    out (None: a few operations per layer and token); a forward called outside it has it, also after `generate`."""
    from memlm.modeling.memory import auxiliary_outputs_read

    model = _model("shared_projections_layer_norms", adaptive_span_loss_coefficient=1e-2)
    input_ids = torch.randint(0, 40, (2, 4))
    outputs = []
    handle = model.model.register_forward_hook(lambda module, arguments, output: outputs.append(output))
    with torch.no_grad():
        model.generate(input_ids, max_new_tokens=3, min_new_tokens=3, do_sample=False)
        handle.remove()
        after = model(input_ids)
    assert len(outputs) == 3 and all(output.aux_loss is None for output in outputs)
    assert auxiliary_outputs_read() and after.aux_loss is not None and float(after.aux_loss) > 0


def test_carrying_memories_after_the_first_layer_norm_changes_them_at_each_call():
    """The official pre-norm model stores its memories after layer 0's norm and normalises them again in the next
    block: a model with `carry_first_layer_norm` depends on where the calls split the sequence (documented)."""
    model = _model("official_pre_norm")
    input_ids = torch.randint(0, 40, (1, 10))
    with torch.no_grad():
        full = model(input_ids).logits
        cache = model(input_ids[:, :5], use_cache=True).cache
        split = model(input_ids[:, 5:], cache=cache).logits
        stored = cache.layers[0].hidden
    assert (split - full[:, 5:]).abs().max() > 1e-6
    # what is carried is normalised by the first layer's LayerNorm: its rows have the norm's mean, its bias' mean
    bias = model.model.layers[0].input_layernorm.bias
    weight = model.model.layers[0].input_layernorm.weight
    rows = stored[0, -5:]  # the memories of this call
    torch.testing.assert_close(
        ((rows - bias) / weight).mean(-1), torch.zeros(5, dtype=torch.float64), atol=1e-12, rtol=0
    )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"head_dim": 0}, "head_dim must be a positive integer"),
        ({"hidden_size": 30, "num_attention_heads": 4}, "must be a multiple of num_attention_heads"),
        ({"head_dim": 7}, "head_dim = 7 must be even for position_encoding='rotary'"),
        ({"position_encoding": "sinusoidal"}, "position_encoding must be one of .*'learned_relative'"),
        ({"initial_memory": "random"}, "initial_memory must be one of 'empty', 'zeros'"),
        ({"memory_normalization": "rms"}, "memory_normalization must be one of 'mixture', 'layer', 'none'"),
        ({"memory_carry": "keys"}, "memory_carry must be one of 'keys_values', 'hidden_states'"),
        ({"carry_first_layer_norm": True}, "carry_first_layer_norm=True needs memory_carry='hidden_states'"),
        ({"adaptive_span": 1}, "adaptive_span must be True or False"),
        ({"adaptive_span_ramp": 0}, r"adaptive_span_ramp must be a number in \(0, inf\]"),
        ({"adaptive_span_loss_coefficient": -1.0}, "adaptive_span_loss_coefficient must be a number in"),
        ({"adaptive_span_initial_ratio": 1.5}, r"adaptive_span_initial_ratio must be a number in \[0, 1\]"),
        ({"renormalization_epsilon": -1e-8}, "renormalization_epsilon must be a number in"),
        ({"attention_dropout_position": "output"}, "attention_dropout_position must be one of 'context', 'weights'"),
        ({"norm_position": "middle"}, "norm_position must be one of 'pre', 'post'"),
        ({"mlp_type": "moe"}, "mlp_type must be one of 'gated', 'plain'"),
    ],
)
def test_bad_options_are_refused_naming_the_field(options, message):
    with pytest.raises(ValueError, match=message):
        FeedbackTransformerConfig(**options)


def test_the_options_round_trip_and_are_described(tmp_path):
    model = _model("official_pre_norm")
    model.save_pretrained(tmp_path)
    loaded = FeedbackTransformerForCausalLM.from_pretrained(tmp_path).eval()
    saved, built = loaded.config.to_dict(), model.config.to_dict()
    assert {**saved, "_name_or_path": ""} == {**built, "_name_or_path": ""}
    input_ids = torch.randint(0, 40, (1, 5))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids).logits, model(input_ids).logits)
    lines = "\n".join(model.config.describe())
    for words in ("pre-norm LayerNorm", "heads of width 8", "zero memories", "recomputed", "Adaptive attention span"):
        assert words in lines, words


def test_the_trimmed_adaptive_span_bounds_the_cache_without_gradients():
    model = _model("adaptive_span_trimmed", adaptive_span_trim_step=1)
    with torch.no_grad():
        for layer, ratio in zip(model.model.layers, (0.1, 0.3, 0.2)):
            layer.attention.span_ratio.fill_(ratio)  # longest spans ⌈0.9 + 2⌉ = 3, ⌈2.7 + 2⌉ = 5, ⌈1.8 + 2⌉ = 4
        input_ids = torch.randint(0, 40, (2, 12))
        cache = model(input_ids, use_cache=True).cache
    assert model.model.read_windows == [3, 5, 4]
    assert cache.layers[0].hidden.shape[1] == 5 and cache.layers[0].positions[0].tolist() == [7, 8, 9, 10, 11]
    assert (model(input_ids).logits - naive_forward(model, input_ids)).abs().max() < 1e-12
    model.train()  # with gradients the spans may grow before the next forward: all τ memories are carried
    assert model(input_ids, use_cache=True).cache.layers[0].hidden.shape[1] == 9


PADDING_CASES = [("official_pre_norm", "inference", padding) for padding in PADDING_LAYOUTS] + [
    ("official_pre_norm", "training", "between"),
    ("official_post_norm_shared", "training", "between"),  # the hand-written backward
    ("adaptive_span_trimmed", "inference", "between"),
    ("adaptive_span_trimmed", "training", "empty_row"),
]


@pytest.mark.parametrize(("layout", "mode", "padding"), PADDING_CASES)
def test_padding_anywhere_gives_each_row_alone(layout, mode, padding):
    """The zero initial memory, the carried hidden states and the trimmed windows count positions, not steps."""
    model = _model(layout, vocab_size=258, pad_token_id=257)
    if mode == "training":
        model.train()  # dropout 0: the same numbers, with gradients
    check_rows_alone(model, padding_mask(padding, (9, 5, 3), width=12), 257, prefix_length=6, following_length=3,
                     training=mode == "training")  # fmt: skip


def test_the_cache_counts_the_carried_hidden_states():
    model = _model("official_post_norm_shared")
    with torch.no_grad():
        cache = model(torch.randint(0, 40, (2, 7)), use_cache=True).cache
    keys, hidden = cache.layers[0].keys, cache.layers[0].hidden
    assert cache.memory_bytes() == 2 * keys.numel() * keys.element_size() + hidden.numel() * hidden.element_size()


def test_a_float64_model_s_loss_is_float64_with_every_way_of_passing_labels():
    model = _model("official_post_norm_shared")
    input_ids = torch.randint(0, 40, (2, 7))
    labels = input_ids.masked_fill(torch.rand(2, 7) < 0.3, -100)
    with torch.no_grad():
        logits = model(input_ids).logits
        shifted = labels[:, 1:].reshape(-1)
        per_token = F.cross_entropy(logits[:, :-1].reshape(-1, 40), shifted, ignore_index=-100, reduction="sum")
        by_labels = model(input_ids, labels=labels).loss
        by_shift = model(input_ids, shift_labels=F.pad(labels, (0, 1), value=-100)[:, 1:], num_items_in_batch=9).loss
    assert by_labels.dtype == by_shift.dtype == torch.float64
    torch.testing.assert_close(by_labels, per_token / (shifted != -100).sum(), rtol=0, atol=1e-14)
    torch.testing.assert_close(by_shift, per_token / 9, rtol=0, atol=1e-14)


def test_gradient_checkpointing_gives_the_same_gradients_in_an_official_layout():
    model = _model("official_pre_norm").train()
    input_ids = torch.randint(0, 40, (2, 9))

    def gradients():
        model.zero_grad()
        model(input_ids, labels=input_ids).loss.backward()
        return {name: parameter.grad.clone() for name, parameter in model.named_parameters()}

    plain = gradients()
    activation_checkpointing_enable(model)
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
    checkpointed = gradients()
    for name, gradient in plain.items():
        torch.testing.assert_close(checkpointed[name], gradient, rtol=0, atol=1e-13)


# The papers' options the ring does not hold run on the tape (`needs_tape`), with and without gradients.
TAPE_LAYOUTS = ["official_pre_norm", "official_post_norm_shared", "adaptive_span_trimmed",
                "shared_projections_layer_norms"]  # fmt: skip


def _blocks_through(model, backend: str, monkeypatch, blocks: list, gradients: bool):
    """Every block's logits and auxiliary loss, the cache after each block, and with `gradients` the gradient of
    every parameter of the blocks' summed losses (truncated at block boundaries, as the official trainer does)."""
    monkeypatch.setenv("MEMLM_KERNELS", backend)
    torch.manual_seed(7)  # the same dropout masks in both runs
    model.zero_grad()
    cache, logits, aux_losses, caches, total = None, [], [], [], 0
    with torch.enable_grad() if gradients else torch.no_grad():
        for block in blocks:
            output = model(block, labels=block, cache=cache, use_cache=True)
            cache = output.cache
            logits.append(output.logits.detach())
            aux_losses.append(output.aux_loss.detach() if output.aux_loss is not None else None)
            layer = cache.layers[-1]
            memory = (layer.keys, layer.values, layer.positions, layer.valid, cache.layers[0].hidden)
            caches.append(tuple(None if tensor is None else tensor.clone() for tensor in memory))  # (a ring changes)
            total = total + output.loss
    if gradients:
        total.backward()
    grads = {name: parameter.grad for name, parameter in model.named_parameters() if gradients}
    return logits, aux_losses, caches, grads


def _assert_blocks_equal(ours, reference, training: bool, carries_hidden_states: bool, tolerance: float = 1e-12):
    """`_blocks_through`'s results of a fast path equal the reference's."""
    for mine, theirs in zip(ours[0], reference[0]):
        assert (mine - theirs).abs().max() < tolerance
    for mine, theirs in zip(ours[1], reference[1]):
        assert (mine is None) == (theirs is None) and (mine is None or (mine - theirs).abs().max() < 1e-14)
    for mine, theirs in zip(ours[2], reference[2]):
        # The same memories, oldest first (the tape lays a carried window out with its live slots first).
        mine_order = torch.argsort(mine[2].masked_fill(~mine[3], -(10**6)), dim=1, stable=True)
        theirs_order = torch.argsort(theirs[2].masked_fill(~theirs[3], -(10**6)), dim=1, stable=True)
        assert torch.equal(mine[2].gather(1, mine_order)[mine[3]], theirs[2].gather(1, theirs_order)[theirs[3]])
        for index, (tensor, expected) in enumerate(zip(mine[:2], theirs[:2])):
            # Training carries hidden states alone: the next forward projects them again.
            assert (tensor is None) == (expected is None) == (training and carries_hidden_states)
            if tensor is None:
                continue
            seen = tensor.gather(2, mine_order[:, None, :, None].expand_as(tensor))
            seen_expected = expected.gather(2, theirs_order[:, None, :, None].expand_as(expected))
            assert (seen[..., -3:, :] - seen_expected[..., -3:, :]).abs().max() < tolerance, index
        if mine[4] is not None or theirs[4] is not None:
            hidden = mine[4].gather(1, mine_order[..., None].expand_as(mine[4]))
            expected = theirs[4].gather(1, theirs_order[..., None].expand_as(theirs[4]))
            assert (hidden[:, -3:] - expected[:, -3:]).abs().max() < tolerance
    assert ours[3].keys() == reference[3].keys()
    for name, gradient in ours[3].items():
        expected = reference[3][name]
        assert (gradient is None) == (expected is None), name
        if gradient is not None:
            assert (gradient - expected).abs().max() <= tolerance * max(1.0, expected.abs().max()), name
            assert expected.abs().sum() > 0, name


@pytest.mark.parametrize("layout", TAPE_LAYOUTS)
@pytest.mark.parametrize("mode", ["inference", "training"])
def test_the_tape_equals_the_step_loop_reference_over_carried_blocks(layout, mode, monkeypatch):
    """Logits, auxiliary losses, the carried memories (keys, values, hidden states, positions) and every gradient,
    in float64, over three blocks whose memories carry into the next. Training draws dropout (on the attention
    weights and after the ReLU): blocks no longer than τ read every memory so far on both paths, so both draw the
    same masks."""
    model = _model(layout, attention_dropout=0.3, activation_dropout=0.2)
    assert model.model.needs_tape
    if mode == "training":
        model.train()
    # With autograd through every step (what hooks, adapters or per-step outputs run), not the hand-written backward.
    monkeypatch.setattr(feedback_kernels, "covers", lambda *args: False)
    blocks = list(torch.randint(0, 40, (2, 12)).split(4, dim=1))
    tape = _blocks_through(model, "torch", monkeypatch, blocks, gradients=mode == "training")
    reference = _blocks_through(model, "reference", monkeypatch, blocks, gradients=mode == "training")
    _assert_blocks_equal(tape, reference, mode == "training", model.model.carries_hidden_states)


# Dropout everywhere: on the attention weights (the official layouts) or their context (the others), after the ReLU
# and on the blocks' outputs.
BY_HAND = {"attention_dropout": 0.3, "activation_dropout": 0.2, "hidden_dropout": 0.1}
# RMSNorm blocks with rotary positions and hidden states carried (the projection's backward rotates and norms).
ROTARY_HIDDEN_STATES = {"position_encoding": "rotary", "memory_carry": "hidden_states"}
BY_HAND_CASES = [(layout, {}) for layout in LAYOUTS] + [
    ("official_pre_norm", {"attention_dropout_position": "context"}),
    ("biases_scale_no_final_norm", ROTARY_HIDDEN_STATES),
    (
        "biases_scale_no_final_norm",
        {**ROTARY_HIDDEN_STATES, "memory_normalization": "layer", "initial_memory": "zeros"},
    ),
]


@pytest.mark.parametrize("checkpointing", [False, True], ids=["kept", "checkpointing_weights_rebuilt"])
@pytest.mark.parametrize(("layout", "overrides"), BY_HAND_CASES)
def test_the_hand_written_backward_equals_the_step_loop_reference_over_carried_blocks(layout, overrides, checkpointing,
                                                                                      monkeypatch):  # fmt: skip
    """The papers' layouts (LayerNorm pre- and post-norm, plain biased MLPs, output biases, learned relative
    positions, memories normed per layer, carried as hidden states, the zero initial memory, the adaptive span, its
    trimmed window, dropout on the attention weights) on the hand-written backward: logits, auxiliary losses, carried
    memories and every gradient equal the reference's in float64, over three carried blocks (no longer than τ, so that
    both paths read windows of one width and draw the same dropout masks); reads add to the tape's slots in blocks of
    three steps. The dropout masks on the attention weights are drawn again from their seeds by the backward, not
    kept (B·H·W per layer and step). With gradient checkpointing, the MLP's projections and the softmax weights (as over long windows) are
    built again in the backward."""
    monkeypatch.setattr(through_time._TapeGradients, "most_block_steps", 3)
    runs = []
    counting = through_time._backward_through_time
    # (args[2]: the forward's `Recording`; a seeded dropout mask on the attention weights is drawn again, not kept)
    monkeypatch.setattr(
        through_time, "_backward_through_time", lambda *args: runs.append(args[2].kept) or counting(*args)
    )
    model = _model(layout, **{**BY_HAND, **overrides}).train()
    if checkpointing:
        activation_checkpointing_enable(model)
        monkeypatch.setattr(through_time.Recording, "keeps_weights", lambda *args: False)
    assert covers(model.model, torch.zeros(2, 3, TINY["hidden_size"], dtype=torch.float64), keep_states=False)
    blocks = list(torch.randint(0, 40, (2, 12)).split(4, dim=1))
    ours = _blocks_through(model, "torch", monkeypatch, blocks, gradients=True)
    assert len(runs) == len(blocks) and not any(runs)
    reference = _blocks_through(model, "reference", monkeypatch, blocks, gradients=True)
    # Without a memory norm, the raw memories grow through the layers: their gradients cancel more.
    tolerance = 1e-12 if model.config.memory_normalization != "none" or layout.startswith("official") else 1e-9
    _assert_blocks_equal(ours, reference, True, model.model.carries_hidden_states, tolerance)


def test_the_step_loop_defers_its_weight_gradients_only_for_plain_linear_layers(monkeypatch):
    """On the tape with autograd, the steps' linear layers gather their weight gradients and multiply them many steps
    at a time (`DeferredWeightGradients`); a hook on a layer (or an adapter) keeps autograd's own, with the same
    gradients."""
    model = _model("official_pre_norm").train()
    body = model.model
    monkeypatch.setattr(feedback_kernels, "covers", lambda *args: False)  # the tape with autograd, not by hand
    embeddings = torch.zeros(2, 3, TINY["hidden_size"], dtype=torch.float64)
    assert DeferredWeightGradients.applies(body, embeddings)
    assert not DeferredWeightGradients.applies(body, embeddings.float().to(torch.bfloat16))
    input_ids = torch.randint(0, 40, (2, 9))

    def gradients():
        model.zero_grad()
        torch.manual_seed(3)
        model(input_ids, labels=input_ids).loss.backward()
        return {name: parameter.grad.clone() for name, parameter in model.named_parameters()}

    deferred = gradients()
    handle = body.layers[1].attention.q_proj.register_forward_hook(lambda module, inputs, output: output)
    assert not DeferredWeightGradients.applies(body, embeddings)
    plain = gradients()
    handle.remove()
    for name, gradient in plain.items():
        assert (deferred[name] - gradient).abs().max() <= 1e-12 * max(1.0, gradient.abs().max()), name


@pytest.mark.parametrize("layout", ["official_pre_norm", "official_post_norm_shared"])
def test_decoding_projects_again_only_what_the_weights_changed(layout, monkeypatch):
    """Without gradients the cache's keys and values stay the projections of its carried hidden states with the weights
    of its `weights_version`: with `carry_first_layer_norm` (hidden states normed once more than what the steps
    project) a prompt's forward projects its memories so at its end and a one-token forward's step projects its memory
    so at once; a forward under the same weights takes them as they are. The logits are those of recomputing every
    carried memory; after an in-place change of a weight, or its replacement by another tensor of the same version
    count (as `load_state_dict(assign=True)` may leave it), every memory is projected again."""
    model = _model(layout)
    body = model.model
    prompt, following = torch.randint(0, 40, (2, 7)), torch.randint(0, 40, (2, 6))
    projected = []
    project = body._project_hidden
    monkeypatch.setattr(body, "_project_hidden", lambda hidden, positions: (
        projected.append(hidden.shape[1]) or project(hidden, positions)))  # fmt: skip

    def decode(everything: bool, change_at: int | None = None, replace: bool = False):
        torch.manual_seed(0)
        weights = copy.deepcopy(model.state_dict())
        logits, widths = [], []
        with torch.no_grad():
            projected.clear()
            cache = model(prompt, use_cache=True).cache
            widths.append(list(projected))
            for index in range(following.shape[1]):
                if index == change_at and replace:
                    norm = body.layers[0].input_layernorm
                    replacement = torch.nn.Parameter(norm.weight.detach() + 0.25)
                    while replacement._version < norm.weight._version:
                        replacement.mul_(1.0)  # (under no_grad: counts as a write, changes nothing)
                    assert replacement._version == norm.weight._version
                    norm.weight = replacement
                elif index == change_at:
                    body.layers[0].input_layernorm.weight.add_(0.25)
                if everything:
                    cache.weights_version = None  # unknown: every carried memory is projected again
                projected.clear()
                output = model(following[:, index : index + 1], cache=cache, use_cache=True)
                cache = output.cache
                logits.append(output.logits)
                widths.append(list(projected))
        model.load_state_dict(weights)
        return torch.cat(logits, 1), widths

    reused, widths = decode(everything=False)
    recomputed, full_widths = decode(everything=True)
    assert (reused - recomputed).abs().max() < 1e-12
    carried = model.config.memory_span
    once = model.config.carry_first_layer_norm
    # The prompt's forward projects its zero initial memories, and with `carry_first_layer_norm` its own again.
    assert widths[0] == full_widths[0] == [carried] + ([carried] if once else []), widths
    assert widths[1:] == [[]] * following.shape[1] and full_widths[1:] == [[carried]] * following.shape[1]
    changed, changed_widths = decode(everything=False, change_at=3)
    expected, _ = decode(everything=True, change_at=3)
    assert (changed - expected).abs().max() < 1e-12 and (changed[:, :3] - reused[:, :3]).abs().max() == 0
    assert changed_widths[4] == [carried] and changed_widths[5] == []
    replaced, replaced_widths = decode(everything=False, change_at=3, replace=True)
    assert (replaced - expected).abs().max() < 1e-12 and replaced_widths[4] == [carried]


@pytest.mark.parametrize("layout", ["official_pre_norm", "official_post_norm_shared", "adaptive_span_trimmed"])
def test_decoding_the_official_layouts_writes_the_ring_in_place(layout, monkeypatch):
    """Without gradients the official layouts decode on the cache's ring (one slot written per token, with its hidden
    state), giving the step-loop reference's logits token by token; a trimmed adaptive span keeps its shorter
    window instead."""
    model = _model(layout)
    prompt, following = torch.randint(0, 40, (2, 7)), torch.randint(0, 40, (2, 6))

    def decode(backend: str):
        monkeypatch.setenv("MEMLM_KERNELS", backend)
        with torch.no_grad():
            output = model(prompt, use_cache=True)
            cache, logits = output.cache, [output.logits]
            for index in range(following.shape[1]):
                keys = cache.layers[0].keys
                output = model(following[:, index : index + 1], cache=cache, use_cache=True)
                cache, logits = output.cache, logits + [output.logits]
        return torch.cat(logits, 1), cache, keys

    ours, cache, keys = decode("torch")
    expected, _, _ = decode("reference")
    assert (ours - expected).abs().max() < 1e-12
    trimmed = layout == "adaptive_span_trimmed"
    assert cache.layers[0].ring is not trimmed
    if not trimmed:  # the ring's own tensors, written in place; the hidden states kept once, by the first layer
        assert cache.layers[0].keys is keys and cache.layers[0].hidden.shape[1] == model.config.memory_span
        assert all(layer.hidden is None for layer in cache.layers[1:])


def _live_tensors() -> int:
    gc.collect()
    return sum(
        1 for thing in gc.get_objects() if issubclass(type(thing), torch.Tensor)
    )  # type(): no __class__ lookups


@pytest.mark.parametrize("layout", [None, "official_pre_norm", "official_post_norm_shared"])
def test_training_with_a_carried_memory_keeps_no_earlier_forward_alive(layout):
    """Each training forward's tape (and through it, its autograd graph) is freed once its outputs are: the tape's
    last write and the step loop's deferred weight gradients hold autograd nodes whose contexts hold them back, a
    cycle the garbage collector cannot see, so they are let go when the loop ends (before, every forward of a
    training run stayed alive and the memory grew with every step)."""
    model = (_model(layout) if layout else FeedbackTransformerForCausalLM(FeedbackTransformerConfig(**TINY))).train()
    input_ids = torch.randint(0, TINY["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(0))
    cache, counts = None, []
    for _ in range(4):
        output = model(input_ids, labels=input_ids, cache=cache, use_cache=True)
        cache = output.cache
        output.loss.backward()
        del output
        counts.append(_live_tensors())
    assert counts[1:] == counts[1:2] * 3, counts
