"""Feedback Transformer: exact against a naive per-step loop (outputs and gradients), cache and decoding, padding,
the feedback path itself, generation."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, DynamicCache, pipeline

from memlm import FeedbackCache, FeedbackTransformerConfig, FeedbackTransformerForCausalLM
from memlm.compat import activation_checkpointing_enable
from memlm.kernels.feedback.scores import memory_bias
from tests.modeling.padding import LAYOUTS, check_rows_alone, padding_mask

TINY = {
    "vocab_size": 258,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 2,
    "memory_span": 5,
    "eos_token_id": 256,
    "bos_token_id": 256,
    "pad_token_id": 257,
}
VARIANTS = {
    "shared_rotary": {},
    "unshared_rotary": {"share_key_value": False},
    "shared_relative_bias": {"position_encoding": "relative_bias"},
    "unshared_relative_bias": {"share_key_value": False, "position_encoding": "relative_bias"},
}


def _model(variant="shared_rotary", **overrides) -> FeedbackTransformerForCausalLM:
    model = FeedbackTransformerForCausalLM(FeedbackTransformerConfig(**{**TINY, **VARIANTS[variant], **overrides}))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.2)
    return model.eval()


def naive_forward(model: FeedbackTransformerForCausalLM, input_ids: torch.Tensor) -> torch.Tensor:
    """Paper Eq. 1 and the attention over {m_{t−τ}, …, m_{t−1}} written as the plainest loop: keys and values of every
    memory kept in Python lists and stacked at each step, plain autograd, no buffers."""
    config, body = model.config, model.model
    batch, length = input_ids.shape
    heads, width, span = config.num_attention_heads, config.head_dim, config.memory_span
    embeddings = body.embed_tokens(input_ids)
    keys, values, outputs = [], [], []

    def rotate(x, position):  # rotary embedding at an absolute position, x (..., width)
        frequencies = 1.0 / config.rope_theta ** (torch.arange(0, width, 2).float() / width)
        angles = torch.cat([position * frequencies, position * frequencies])
        return x * angles.cos() + torch.cat([-x[..., width // 2 :], x[..., : width // 2]], -1) * angles.sin()

    for t in range(length):
        x = embeddings[:, t]
        states = [x]
        for index, layer in enumerate(body.layers):
            query = layer.attention.q_proj(layer.input_layernorm(x)).view(batch, heads, width)
            if config.position_encoding == "rotary":
                query = rotate(query, t)
            group = 0 if config.share_key_value else index
            window = list(range(max(0, t - span), t))
            if window:
                k = torch.stack([keys[s][group] for s in window], 2)  # (B, H, W, width)
                v = torch.stack([values[s][group] for s in window], 2)
                scores = torch.einsum("bhd,bhwd->bhw", query, k) / math.sqrt(width)
                if config.position_encoding == "relative_bias":
                    scores = scores + layer.attention.relative_bias[:, [t - s - 1 for s in window]][None]
                context = torch.einsum("bhw,bhwd->bhd", scores.softmax(-1), v)
            else:
                context = torch.zeros_like(query)  # no memory yet: the attention term is zero
            x = x + layer.attention.o_proj(context.reshape(batch, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            states.append(x)
        memory = sum(w * state for w, state in zip(torch.softmax(body.layer_weights, 0), states))
        memory = body.memory_norm(memory)
        projections = (
            [(body.k_proj, body.v_proj)]
            if config.share_key_value
            else [(layer.attention.k_proj, layer.attention.v_proj) for layer in body.layers]
        )
        step_keys = [k_proj(memory).view(batch, heads, width) for k_proj, _ in projections]
        if config.position_encoding == "rotary":
            step_keys = [rotate(k, t) for k in step_keys]
        keys.append(step_keys)
        values.append([v_proj(memory).view(batch, heads, width) for _, v_proj in projections])
        outputs.append(x)
    return model.lm_head(body.norm(torch.stack(outputs, 1)))


@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_forward_and_gradients_match_the_naive_loop(variant, backend, monkeypatch):
    monkeypatch.setenv("MEMLM_KERNELS", backend)  # the hand-written backward, and the kernel's reference loop
    model = _model(variant)
    input_ids = torch.randint(0, 256, (2, 13))
    logits = model(input_ids).logits
    expected = naive_forward(model, input_ids)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)

    weights = torch.randn_like(expected)
    gradients = torch.autograd.grad((logits * weights).sum(), list(model.parameters()))
    expected_gradients = torch.autograd.grad((expected * weights).sum(), list(model.parameters()))
    for (name, _), gradient, reference in zip(model.named_parameters(), gradients, expected_gradients):
        assert (gradient - reference).norm() <= 1e-5 * reference.norm(), name  # float32 rounding only
        assert gradient.abs().sum() > 0, name


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_full_forward_equals_prefill_then_token_by_token_decoding(variant):
    model = _model(variant)
    input_ids = torch.randint(0, 256, (2, 17))
    with torch.no_grad():
        full = model(input_ids).logits
        output = model(input_ids[:, :6], use_cache=True)
        cache, pieces = output.cache, [output.logits]
        for t in range(6, 17):
            output = model(input_ids[:, t : t + 1], cache=cache)
            pieces.append(output.logits)
    torch.testing.assert_close(torch.cat(pieces, 1), full, atol=1e-4, rtol=0)
    assert isinstance(cache, FeedbackCache) and cache.get_seq_length() == 17


def test_training_forward_carries_its_memory_into_the_cache():
    model = _model("shared_relative_bias").train()
    first, second = torch.randint(0, 256, (2, 2, 9))
    cache = model(first, use_cache=True).cache  # built by the training (tape) path
    with_cache = model(second, cache=copy.deepcopy(cache)).logits
    with torch.no_grad():
        model.eval()
        expected = model(torch.cat([first, second], 1)).logits[:, 9:]
    torch.testing.assert_close(with_cache, expected, atol=1e-4, rtol=0)


def _padding_mask(layout: str) -> torch.Tensor:
    return padding_mask(layout, (9, 5, 3), width=12)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", ["inference", "training"])
@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_padding_anywhere_gives_each_row_alone(layout, mode, backend, monkeypatch):
    """Training runs the tape (and carries its window), inference the ring; the reference its lists. τ = 5 < the
    padding, so a window counted in steps rather than positions would lose memories."""
    monkeypatch.setenv("MEMLM_KERNELS", backend)
    model = _model("unshared_rotary")
    if mode == "training":
        model.train()  # no dropout in TINY: the same numbers, through the training path
    # Each step feeds the last (21 steps here) and the weights are perturbed: round-off grows ~200 ulp of the logits
    # (≈ 4) along the way, as float64 shows (1.7e-13 between a row in the batch and alone); in float32 that is ~1e-4,
    # 1.3e-4 seen under ATEN_CPU_CAPABILITY=default.
    check_rows_alone(model, _padding_mask(layout), 257, prefix_length=6, following_length=3,
                     training=mode == "training", atol=5e-4)  # fmt: skip


def test_the_top_layer_at_t_minus_1_reaches_the_first_layer_at_t():
    model = _model(num_hidden_layers=3)
    input_ids = torch.randint(0, 256, (1, 8))
    calls = []

    def perturb_step_5(module, inputs, output):
        calls.append(None)
        return output + 1.0 if len(calls) == 6 else output  # the top layer's MLP at step 5

    with torch.no_grad():
        plain = model(input_ids, output_hidden_states=True).hidden_states
        handle = model.model.layers[-1].mlp.register_forward_hook(perturb_step_5)
        perturbed = model(input_ids, output_hidden_states=True).hidden_states
        handle.remove()
    first_layer, first_layer_perturbed = plain[1], perturbed[1]
    torch.testing.assert_close(first_layer_perturbed[:, :6], first_layer[:, :6])  # the past is untouched
    assert (first_layer_perturbed[:, 6] - first_layer[:, 6]).abs().max() > 1e-3  # impossible in a Transformer


def test_the_memory_is_a_softmax_mix_of_the_layers():
    model = _model()
    with torch.no_grad():
        model.model.layer_weights.copy_(torch.tensor([40.0, -40.0, -40.0, -40.0]))  # softmax ≈ (1, 0, 0, 0)
        cache = model(torch.tensor([[7]]), use_cache=True).cache
        body = model.model
        memory = body.memory_norm(body.embed_tokens(torch.tensor([7])))  # m_0 = the embedding alone
        expected = body.k_proj(memory).view(1, 2, 16)  # rotary at position 0 is the identity
    torch.testing.assert_close(cache.layers[0].keys[:, :, 0], expected, atol=1e-5, rtol=0)
    weights = torch.softmax(torch.tensor([0.3, -1.0, 2.0, 0.5]), 0)
    assert math.isclose(weights.sum().item(), 1.0, rel_tol=1e-6)


def test_memory_span_bounds_what_is_attended():
    model = _model(memory_span=3)
    layer = model.model.layers[0]
    slot_positions = torch.arange(10)[None]
    window = (None, None, slot_positions, torch.ones(1, 10, dtype=torch.bool))
    bias = memory_bias(model.model, layer, window, torch.tensor([10]))
    assert torch.isfinite(bias[0, 0]).tolist() == [False] * 7 + [True] * 3  # only m_7, m_8, m_9
    cache = model(torch.randint(0, 256, (1, 20)), use_cache=True).cache
    assert cache.layers[0].keys.shape[2] == 3 and sorted(cache.layers[0].positions[0].tolist()) == [17, 18, 19]


@pytest.mark.parametrize("variant", ["shared_rotary", "unshared_relative_bias"])
def test_both_projection_layouts_train(variant):
    model = _model(variant).train()
    input_ids = torch.randint(0, 256, (4, 16))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(25):
        optimizer.zero_grad()
        loss = model(input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.6 * losses[0], losses


def test_cache_holds_one_set_for_all_layers_when_shared():
    shared = _model().model
    unshared = _model("unshared_rotary").model
    with torch.no_grad():
        shared_cache = shared(torch.randint(0, 256, (1, 4)), use_cache=True).cache
        unshared_cache = unshared(torch.randint(0, 256, (1, 4)), use_cache=True).cache
    assert len(shared_cache.layers) == 1 and len(unshared_cache.layers) == 3
    assert unshared_cache.memory_bytes() == 3 * shared_cache.memory_bytes()


@pytest.mark.parametrize("variant", ["shared_rotary", "unshared_relative_bias"])
def test_the_ring_grows_with_the_context_up_to_the_memory_span(variant):
    """A short prompt holds memory for its tokens, not for τ; decoding doubles the ring (capped at τ), then
    overwrites the oldest memories; the logits equal the un-cached forward's throughout."""
    model = _model(variant, memory_span=48)
    config = model.config
    input_ids = torch.randint(0, 256, (2, 70))
    bytes_per_slot = 2 * 2 * config.num_attention_heads * config.head_dim * 4 * config.memory_groups  # k and v

    def slots(cache):
        return cache.layers[0].keys.shape[2]

    with torch.no_grad():
        full = model(input_ids).logits
        output = model(input_ids[:, :6], use_cache=True)
        cache, pieces, seen = output.cache, [output.logits], []
        assert cache.memory_bytes() == 6 * bytes_per_slot  # the prompt's 6 memories, not τ = 48
        for t in range(6, 70):
            output = model(input_ids[:, t : t + 1], cache=cache)
            pieces.append(output.logits)
            seen.append(slots(cache))
    # 6 slots, then doubled at least to 16, 32, then capped at τ = 48, never more.
    assert sorted(set(seen)) == [16, 32, 48] and seen == sorted(seen)
    assert cache.memory_bytes() == 48 * bytes_per_slot
    torch.testing.assert_close(torch.cat(pieces, 1), full, atol=1e-4, rtol=0)


def test_bad_inputs_and_configs():
    model = _model()
    input_ids = torch.randint(0, 256, (2, 4))
    with pytest.raises(TypeError, match="FeedbackCache; got a cache of type DynamicCache"):
        model(input_ids, cache=DynamicCache())
    with pytest.raises(ValueError, match="attention_mask must be a 2-D padding mask"):
        model(input_ids, attention_mask=torch.ones(2, 9))
    with pytest.raises(ValueError, match=r"input_ids must lie in \[0, vocab_size=258\)"):
        model(torch.tensor([[3, 999]]))
    cache = model(input_ids, use_cache=True).cache
    with pytest.raises(ValueError, match="holds a batch of 2 rows but the input has 1"):
        model(input_ids[:1, :1], cache=cache)
    with pytest.raises(ValueError, match="crop takes minus the number of tokens to remove"):
        cache.crop(1)
    for options, message in [
        ({"memory_span": 0}, "memory_span must be a positive integer"),
        ({"position_encoding": "alibi"}, "position_encoding must be one of 'rotary', 'relative_bias'"),
        ({"share_key_value": "yes"}, "share_key_value must be True or False"),
        ({"hidden_size": 30, "num_attention_heads": 4}, "must be a multiple of num_attention_heads"),
        ({"hidden_size": 36, "num_attention_heads": 4}, "must be even for position_encoding='rotary'"),
        ({"attention_dropout": 1.0}, r"attention_dropout must be a number in \[0, 1\)"),
        ({"memory_spam": 4}, "did you mean 'memory_span'"),
    ]:
        with pytest.raises(ValueError, match=message):
            FeedbackTransformerConfig(**options)
    FeedbackTransformerConfig(hidden_size=36, num_attention_heads=4, position_encoding="relative_bias")


def test_config_round_trip(tmp_path):
    config = FeedbackTransformerConfig(memory_span=77, share_key_value=False, position_encoding="relative_bias")
    config.save_pretrained(tmp_path)
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert type(loaded) is FeedbackTransformerConfig
    assert (loaded.memory_span, loaded.share_key_value, loaded.position_encoding) == (77, False, "relative_bias")
    assert "τ = 77" in "\n".join(config.describe())


def test_dropout_only_in_training():
    model = _model(hidden_dropout=0.3, attention_dropout=0.3)
    input_ids = torch.randint(0, 256, (1, 6))
    with torch.no_grad():
        assert torch.equal(model(input_ids).logits, model(input_ids).logits)
        model.train()
        assert not torch.equal(model(input_ids).logits, model(input_ids).logits)


def test_loss_is_next_token_cross_entropy():
    model = _model()
    input_ids = torch.randint(0, 256, (2, 7))
    output = model(input_ids, labels=input_ids)
    expected = F.cross_entropy(output.logits[:, :-1].reshape(-1, 258), input_ids[:, 1:].reshape(-1))
    torch.testing.assert_close(output.loss, expected)


# generate() and pipeline()


def test_greedy_equals_a_loop_of_full_forwards():
    model = _model()
    prompt = torch.randint(0, 256, (2, 4))
    generated = model.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    sequence = prompt
    with torch.no_grad():
        for _ in range(12):
            sequence = torch.cat([sequence, model(sequence).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(generated, sequence)


def test_sampling_and_beam_search_match_recomputation():
    model = _model("unshared_relative_bias")
    prompt = torch.randint(0, 256, (2, 4))
    options = {"do_sample": True, "max_new_tokens": 10, "min_new_tokens": 10, "top_k": 0}
    torch.manual_seed(5)
    cached = model.generate(prompt, **options)
    torch.manual_seed(5)
    assert torch.equal(cached, model.generate(prompt, use_cache=False, **options))
    beams = {"num_beams": 3, "num_return_sequences": 2, "max_new_tokens": 10, "min_new_tokens": 10,
             "do_sample": False}  # fmt: skip
    assert torch.equal(model.generate(prompt, **beams), model.generate(prompt, use_cache=False, **beams))


def test_left_padded_generation_and_pipeline(tmp_path, tokenizer):
    model = _model()
    tokenizer.padding_side = "left"
    prompts = ["Feedback memory", "Hi"]
    generated = model.generate(**tokenizer(prompts, return_tensors="pt", padding=True), max_new_tokens=6,
                               min_new_tokens=6, do_sample=False)  # fmt: skip
    for index, prompt in enumerate(prompts):
        alone = model.generate(**tokenizer([prompt], return_tensors="pt"), max_new_tokens=6, min_new_tokens=6,
                               do_sample=False)  # fmt: skip
        assert generated[index, -6:].tolist() == alone[0, -6:].tolist()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    generator = pipeline("text-generation", model=str(tmp_path), device="cpu")
    text = generator("Feedback memory", max_new_tokens=5, min_new_tokens=5, do_sample=False)[0]["generated_text"]
    expected = model.generate(**tokenizer(["Feedback memory"], return_tensors="pt"), max_new_tokens=5,
                              min_new_tokens=5, do_sample=False)  # fmt: skip
    assert text == tokenizer.decode(expected[0], skip_special_tokens=True)


def test_gradient_checkpointing_gives_the_same_gradients():
    model = _model("unshared_relative_bias").train()
    input_ids = torch.randint(0, 256, (2, 10))

    def gradients():
        model.zero_grad()
        model(input_ids, labels=input_ids).loss.backward()
        return {name: parameter.grad.clone() for name, parameter in model.named_parameters()}

    plain = gradients()
    activation_checkpointing_enable(model)
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
    checkpointed = gradients()
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_step_rotation_gives_apply_rotarys_very_numbers(dtype):
    from memlm.kernels.rotary import rotate, signed_sine
    from memlm.modeling.layers import RotaryEmbedding, apply_rotary

    rotary = RotaryEmbedding(head_dim=8, rope_theta=10000.0)
    positions = torch.tensor([0, 5, 2047])
    cos, sin = rotary(positions[:, None])  # (B, 1, 1, d)
    signed_sin = signed_sine(sin)[:, 0]
    queries = torch.randn(3, 2, 8, dtype=torch.float64).to(dtype)  # (B, H, d)
    keys = torch.randn(1, 3, 2, 8, dtype=torch.float64).to(dtype)  # (G, B, H, d)
    assert torch.equal(rotate(queries, cos[:, 0], signed_sin), apply_rotary(queries[:, :, None], cos, sin)[:, :, 0])
    assert torch.equal(rotate(keys, cos[:, 0], signed_sin), apply_rotary(keys[:, :, :, None], cos, sin)[:, :, :, 0])


def test_compile_step_option():
    with pytest.raises(ValueError, match="compile_step must be True or False"):
        FeedbackTransformerConfig(compile_step="yes")
    config = FeedbackTransformerConfig(compile_step=True)
    assert FeedbackTransformerConfig.from_dict(config.to_dict()).compile_step is True
    assert FeedbackTransformerConfig().compile_step is False
