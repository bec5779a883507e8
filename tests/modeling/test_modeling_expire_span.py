"""Expire-Span: block-parallel forward == decoding, padding, the span mechanism, the pruned cache, generation."""

import copy

import pytest
import torch
from transformers import DynamicCache, pipeline

from memlm import ExpireSpanCache, ExpireSpanConfig, ExpireSpanForCausalLM
from memlm.compat import activation_checkpointing_enable, output_cache
from memlm.kernels.expire_attention.memory import COMPACT_FRACTION, check_interval
from tests.modeling.padding import LAYOUTS, check_rows_alone, padding_mask

TINY = {
    "vocab_size": 258,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "max_span": 16,
    "ramp": 4,
    "block_size": 8,
    "initial_span_fraction": 0.3,
    "eos_token_id": 256,
    "bos_token_id": 256,
    "pad_token_id": 257,
}


def _model(span_weight=0.5, span_bias=None, **overrides) -> ExpireSpanForCausalLM:
    """A tiny model whose spans differ from token to token (random span-predictor weights)."""
    model = ExpireSpanForCausalLM(ExpireSpanConfig(**{**TINY, **overrides})).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
        for layer in model.model.layers:
            predictor = layer.attention.span_predictor
            if predictor is not None:
                predictor.weight.normal_(0, span_weight)
                if span_bias is not None:
                    predictor.bias.fill_(span_bias)
    return model


def lazy_width_bound(live: int, block: int = 1) -> int:
    """The widest layout lazy pruning may keep for `live` memories (see `ExpireSpanMemory.prune`), a bound that does
    not grow with the context."""
    checked = int(live / (1 - COMPACT_FRACTION)) + 1  # the widest layout a pruning check leaves uncompacted
    return checked + check_interval(checked) + block


def _decode(model, input_ids, prefill, **kwargs):
    with torch.no_grad():
        output = model(input_ids[:, :prefill], use_cache=True, **kwargs)
        cache, pieces = output.cache, [output.logits]
        for t in range(prefill, input_ids.shape[1]):
            output = model(input_ids[:, t : t + 1], cache=cache, use_cache=True)
            cache = output.cache
            pieces.append(output.logits)
    return torch.cat(pieces, 1), cache


@pytest.mark.parametrize(
    "overrides",
    [{}, {"block_size": 3}, {"block_size": 64}, {"expire_memories": False}, {"ramp": 1.5, "max_span": 7}],
)
def test_full_forward_equals_prefill_then_token_by_token_decoding(overrides):
    model = _model(**overrides)
    input_ids = torch.randint(0, 256, (2, 45))
    with torch.no_grad():
        full = model(input_ids).logits
    decoded, cache = _decode(model, input_ids, prefill=11)
    torch.testing.assert_close(decoded, full, atol=1e-4, rtol=0)
    assert cache.get_seq_length() == 45


@pytest.mark.parametrize("overrides", [{"max_span": 12, "ramp": 3}, {"expire_memories": False, "max_span": 10}])
def test_lazily_pruned_decoding_equals_the_full_forward_over_many_compactions(overrides):
    model = _model(block_size=16, **overrides)
    input_ids = torch.randint(0, 256, (2, 260))
    with torch.no_grad():
        full = model(input_ids).logits
    decoded, cache = _decode(model, input_ids, prefill=5)
    torch.testing.assert_close(decoded, full, atol=1e-4, rtol=0)
    buffer = cache.layers[0].memory.buffer
    assert buffer is not None  # decoded in place, in a preallocated buffer
    # Memories live at most max_span + R + 1 tokens: the layout is bounded, far below the 260 tokens decoded.
    assert max(cache.memory_entries()) <= lazy_width_bound(overrides["max_span"] + overrides.get("ramp", 0) + 1)


def test_block_size_does_not_change_the_result():
    input_ids = torch.randint(0, 256, (2, 40))
    torch.manual_seed(3)
    reference = _model(block_size=1)
    logits = []
    for block_size in (1, 5, 8, 40):
        model = copy.deepcopy(reference)
        model.config.block_size = block_size
        with torch.no_grad():
            logits.append(model(input_ids).logits)
    for other in logits[1:]:
        torch.testing.assert_close(other, logits[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", ["inference", "training"])
def test_padding_anywhere_gives_each_row_alone(layout, mode):
    """The padded chunk spans three blocks of 8; training runs the training path (no dropout in TINY)."""
    model = _model()
    if mode == "training":
        model.train()
    check_rows_alone(model, padding_mask(layout, (21, 9, 4), width=24), model.config.pad_token_id, prefix_length=5,
                     following_length=6, training=mode == "training")  # fmt: skip


def test_backends_agree_at_model_level(monkeypatch):
    model = _model()
    input_ids = torch.randint(0, 256, (2, 30))
    with torch.no_grad():
        fast = model(input_ids).logits
        monkeypatch.setenv("MEMLM_KERNELS", "reference")
        reference = model(input_ids).logits
    torch.testing.assert_close(fast, reference, atol=1e-5, rtol=0)


def test_span_parameters_learn_from_the_language_modelling_loss_through_the_mask():
    model = _model(span_loss_coefficient=0.0, span_bias=-1.0).train()
    input_ids = torch.randint(0, 256, (2, 40))
    output = model(input_ids, labels=input_ids)
    assert output.span_loss == 0 and torch.equal(output.loss, output.lm_loss)
    output.loss.backward()
    for layer in model.model.layers:
        predictor = layer.attention.span_predictor
        assert predictor.weight.grad.abs().sum() > 0 and predictor.bias.grad.abs() > 0


def test_span_loss_alone_drives_spans_down():
    model = _model(span_loss_coefficient=1.0, span_bias=0.0).train()
    input_ids = torch.randint(0, 256, (2, 40))
    predictors = [layer.attention.span_predictor for layer in model.model.layers]
    optimizer = torch.optim.SGD([p for predictor in predictors for p in predictor.parameters()], lr=0.5)

    def mean_span():
        with torch.no_grad():
            return torch.cat(model.eval()(input_ids, output_spans=True).spans).mean().item()

    before = mean_span()
    for _ in range(20):
        model.train()
        optimizer.zero_grad()
        output = model(input_ids)
        assert output.span_loss > 0
        output.span_loss.backward()
        optimizer.step()
    after = mean_span()
    assert after < 0.5 * before, (before, after)


def test_earlier_blocks_pass_no_gradient_to_their_hidden_states_but_spans_still_learn():
    model = _model(block_size=10, span_bias=1.0, span_loss_coefficient=0.0).train()
    embeds = model.get_input_embeddings()(torch.randint(0, 256, (1, 20))).detach().requires_grad_(True)
    output = model(inputs_embeds=embeds)
    output.logits[:, 10:].sum().backward()  # a loss on the second block only
    assert embeds.grad[:, :10].abs().sum() == 0
    assert embeds.grad[:, 10:].abs().sum() > 0
    assert model.model.layers[0].attention.span_predictor.weight.grad.abs().sum() > 0


def test_outputs_report_losses_spans_and_memory_size():
    model = _model(span_loss_coefficient=1e-3)
    input_ids = torch.randint(0, 256, (2, 20))
    output = model(input_ids, labels=input_ids, output_spans=True, output_hidden_states=True)
    assert torch.equal(output.loss, output.lm_loss)  # eval mode: the span loss is reported, not added
    assert output.span_loss > 0
    assert len(output.spans) == 2 and output.spans[0].shape == (2, 20)
    assert ((output.spans[0] >= 0) & (output.spans[0] <= 16)).all()
    assert 1 <= output.memory_size <= 20
    assert len(output.hidden_states) == 3 and output.hidden_states[0].shape == (2, 20, 32)
    model.train()
    trained = model(input_ids, labels=input_ids)
    torch.testing.assert_close(trained.loss, trained.lm_loss + trained.span_loss)
    as_tuple = model.eval()(input_ids, return_dict=False)
    assert isinstance(as_tuple, tuple)
    torch.testing.assert_close(as_tuple[0], output.logits)


def test_initial_spans_follow_the_configured_fraction():
    model = ExpireSpanForCausalLM(ExpireSpanConfig(**{**TINY, "initial_span_fraction": 0.25}))
    spans = model(torch.randint(0, 256, (1, 6)), output_spans=True).spans
    for layer_spans in spans:
        torch.testing.assert_close(layer_spans, torch.full_like(layer_spans, 0.25 * 16))


def test_short_spans_keep_the_generation_cache_bounded():
    model = _model(span_weight=0.0, span_bias=-30.0, ramp=6)  # e ≈ 0: a memory lives R tokens
    token = torch.tensor([[5]])
    largest = 0
    with torch.no_grad():
        output = model(token, use_cache=True)
        cache = output.cache
        for _ in range(400):  # unpruned, the memory would hold all 401 tokens
            token = output.logits[:, -1:].argmax(-1)
            output = model(token, cache=cache, use_cache=True)
            largest = max(largest, *cache.memory_entries())
    assert cache.get_seq_length() == 401
    assert largest <= lazy_width_bound(6 + 1)  # the span (≈ 0) plus the ramp R, plus the token itself


def test_long_spans_make_the_cache_grow_with_the_context():
    model = _model(span_weight=0.0, span_bias=30.0, max_span=10_000, ramp=6)
    _, cache = _decode(model, torch.randint(0, 256, (1, 300)), prefill=50)
    assert cache.memory_entries() == [300, 300]


def test_pruning_changes_memory_use_but_not_the_logits():
    model = _model(max_span=12, ramp=3)
    input_ids = torch.randint(0, 256, (2, 80))
    pruned_logits, pruned_cache = _decode(model, input_ids, prefill=30)
    unpruned = copy.deepcopy(model)
    unpruned.model.prune_expired_memories = False
    unpruned_logits, unpruned_cache = _decode(unpruned, input_ids, prefill=30)
    torch.testing.assert_close(pruned_logits, unpruned_logits, atol=1e-5, rtol=0)
    assert max(pruned_cache.memory_entries()) <= lazy_width_bound(12 + 3 + 1)
    assert unpruned_cache.memory_entries() == [80, 80]


def test_fixed_span_mode_keeps_exactly_the_last_max_span_memories():
    model = _model(expire_memories=False, max_span=10)
    assert all(layer.attention.span_predictor is None for layer in model.model.layers)
    _, cache = _decode(model, torch.randint(0, 256, (1, 50)), prefill=20)
    for layer in cache.layers:  # positions t-10 … t (t = 49) stay until the next token comes
        memory = layer.memory
        assert (memory.valid & (memory.positions >= 39)).sum(1).tolist() == [11]
    assert max(cache.memory_entries()) <= lazy_width_bound(11)


def test_memory_shortening_only_in_training():
    torch.manual_seed(0)
    model = _model(memory_shortening=True, max_span=32, block_size=8)
    plain = copy.deepcopy(model)
    plain.config.memory_shortening = False
    input_ids = torch.randint(0, 256, (1, 40))
    with torch.no_grad():
        evaluated = [model(input_ids).logits for _ in range(3)]
        assert all(torch.equal(logits, evaluated[0]) for logits in evaluated)
        torch.testing.assert_close(evaluated[0], plain(input_ids).logits)
        model.train()
        plain.train()
        trained = [model(input_ids).logits for _ in range(3)]
        assert not all(torch.allclose(logits, trained[0]) for logits in trained[1:])
        assert not torch.allclose(trained[0], plain(input_ids).logits)


def test_gradient_checkpointing_gives_the_same_gradients():
    model = _model(span_loss_coefficient=1e-2).train()
    input_ids = torch.randint(0, 256, (2, 24))

    def gradients():
        model.zero_grad()
        model(input_ids, labels=input_ids).loss.backward()
        return {name: parameter.grad.clone() for name, parameter in model.named_parameters()}

    plain = gradients()
    activation_checkpointing_enable(model)
    checkpointed = gradients()
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], atol=1e-6, rtol=1e-5)


def test_bad_inputs_raise_clear_errors():
    model = _model()
    input_ids = torch.randint(0, 256, (2, 5))
    with pytest.raises(TypeError, match="ExpireSpanCache; got a cache of type DynamicCache"):
        model(input_ids, cache=DynamicCache())
    with pytest.raises(ValueError, match=r"attention_mask must be a 2-D padding mask"):
        model(input_ids, attention_mask=torch.ones(2, 9))
    with pytest.raises(ValueError, match=r"input_ids must lie in \[0, vocab_size=258\)"):
        model(torch.tensor([[1, 300]]))
    with pytest.raises(ValueError, match=r"position_ids must have shape \(batch, 5\)"):
        model(input_ids, position_ids=torch.arange(4)[None])
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        model(input_ids, cache_position=torch.arange(5))
    cache = model(input_ids, use_cache=True).cache
    with pytest.raises(ValueError, match="holds a batch of 2 rows but the input has 1"):
        model(input_ids[:1, :1], cache=cache)
    with pytest.raises(ValueError, match="crop takes minus the number of tokens to remove"):
        cache.crop(1)


# generate() and pipeline()


def test_greedy_equals_a_loop_of_full_forwards():
    model = _model()
    prompt = torch.randint(0, 256, (2, 7))
    generated = model.generate(prompt, max_new_tokens=25, min_new_tokens=25, do_sample=False)
    sequence = prompt
    with torch.no_grad():
        for _ in range(25):
            sequence = torch.cat([sequence, model(sequence).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(generated, sequence)


def test_sampling_and_beam_search_match_recomputation():
    model = _model()
    prompt = torch.randint(0, 256, (2, 6))
    options = {"do_sample": True, "max_new_tokens": 20, "min_new_tokens": 20, "top_k": 0}
    torch.manual_seed(11)
    cached = model.generate(prompt, **options)
    torch.manual_seed(11)
    recomputed = model.generate(prompt, use_cache=False, **options)
    assert torch.equal(cached, recomputed)
    beams = {"num_beams": 3, "num_return_sequences": 2, "max_new_tokens": 20, "min_new_tokens": 20,
             "do_sample": False}  # fmt: skip
    assert torch.equal(model.generate(prompt, **beams), model.generate(prompt, use_cache=False, **beams))


def test_left_padded_generation_and_pipeline(tmp_path, tokenizer):
    model = _model()
    tokenizer.padding_side = "left"
    prompts = ["Memories expire", "Hi"]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    generated = model.generate(**batch, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    for index, prompt in enumerate(prompts):
        alone = model.generate(**tokenizer([prompt], return_tensors="pt"), max_new_tokens=8, min_new_tokens=8,
                               do_sample=False)  # fmt: skip
        assert generated[index, -8:].tolist() == alone[0, -8:].tolist()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    generator = pipeline("text-generation", model=str(tmp_path), device="cpu")
    text = generator("Memories expire", max_new_tokens=6, min_new_tokens=6, do_sample=False)[0]["generated_text"]
    expected = model.generate(**tokenizer(["Memories expire"], return_tensors="pt"), max_new_tokens=6,
                              min_new_tokens=6, do_sample=False)  # fmt: skip
    assert text == tokenizer.decode(expected[0], skip_special_tokens=True)


def test_generate_returns_an_expire_span_cache():
    model = _model()
    output = model.generate(torch.randint(0, 256, (1, 5)), max_new_tokens=30, min_new_tokens=30, do_sample=False,
                            return_dict_in_generate=True)  # fmt: skip
    cache = output_cache(output)  # `output.cache` from 🤗 5.24, `output.past_key_values` before
    assert isinstance(cache, ExpireSpanCache)
    assert cache.get_seq_length() == 34


def test_rows_expire_at_their_own_rate_in_a_compacted_layout():
    model = _model(span_weight=2.0, max_span=24, ramp=2)
    input_ids = torch.randint(0, 256, (3, 60))
    _, cache = _decode(model, input_ids, prefill=20)
    unpruned = copy.deepcopy(model)
    unpruned.model.prune_expired_memories = False
    _, full_cache = _decode(unpruned, input_ids, prefill=20)
    live_counts = [layer.memory.valid.sum(1).tolist() for layer in cache.layers]
    assert any(len(set(counts)) > 1 for counts in live_counts)  # rows keep different numbers of memories
    for layer, full_layer, counts in zip(cache.layers, full_cache.layers, live_counts):
        assert layer.memory.positions.shape[1] <= lazy_width_bound(max(counts))  # compacted (lazily) to the fullest
        # Nothing the last token (position 59) could read was deleted: every memory with m > 0 there is kept.
        full = full_layer.memory
        readable = full.valid & (full.positions + full.spans + 2 > 59)
        for row in range(3):
            kept = set(layer.memory.positions[row][layer.memory.valid[row]].tolist())
            assert set(full.positions[row][readable[row]].tolist()) <= kept
        assert layer.memory.positions.shape[1] < full.positions.shape[1]  # and the dead were deleted


def _decode_steps(model, input_ids, prefill):
    """Prefill, then one token at a time: per step the logits, span loss and memory size."""
    steps = []
    with torch.no_grad():
        cache = model(input_ids[:, :prefill], use_cache=True).cache
        for t in range(prefill, input_ids.shape[1]):
            output = model(input_ids[:, t : t + 1], cache=cache, use_cache=True)
            steps.append((output.logits, output.span_loss, output.memory_size))
    return steps


@pytest.mark.parametrize("span_bias", [2.0, -0.5])
def test_decoding_without_the_mask_while_no_memory_is_on_the_ramp_equals_the_masked_step(monkeypatch, span_bias):
    """Decoding skips the soft mask while the slack (least e_i − (t − i)) is >= 0. With long spans (bias 2: e ≈ 0.88
    L, all 36 tokens fit) every step takes that path; with shorter ones (bias -0.5: e ≈ 0.38 L) the memories reach
    the ramp and later steps must mask. Either way each step equals the masked step (the path forced off) and the full
    forward, span loss and memory size included."""
    import memlm.modeling.modeling_expire_span as modeling

    model = _model(span_weight=0.05, span_bias=span_bias, max_span=64, ramp=4, block_size=4)
    model.config.span_loss_coefficient = 1.0
    input_ids = torch.randint(0, 256, (2, 36))
    slacks = []

    def recorded(*arguments):
        slacks.append(modeling_slack(*arguments))
        return slacks[-1]

    modeling_slack = modeling.decoding_slack
    monkeypatch.setattr(modeling, "decoding_slack", recorded)
    fast = _decode_steps(model, input_ids, prefill=6)
    monkeypatch.setattr(modeling, "decoding_slack", lambda *arguments: None)
    masked = _decode_steps(model, input_ids, prefill=6)
    for (logits, span_loss, memory_size), (masked_logits, masked_span_loss, masked_memory_size) in zip(fast, masked):
        torch.testing.assert_close(logits, masked_logits, atol=1e-6, rtol=0)
        torch.testing.assert_close(span_loss, masked_span_loss, atol=1e-9, rtol=1e-6)
        torch.testing.assert_close(memory_size, masked_memory_size, atol=0, rtol=0)
    with torch.no_grad():
        full = model(input_ids).logits
    torch.testing.assert_close(torch.cat([step[0] for step in fast], 1), full[:, 6:], atol=1e-4, rtol=0)
    assert all(slack is not None for slack in slacks)
    if span_bias > 0:
        assert min(slacks) >= 0  # the unmasked path throughout
    else:
        assert max(slacks) >= 0 and min(slacks) < 0  # both paths
        assert max(float(step[1]) for step in masked) > 0  # memories on the ramp: a span loss the fast path must keep


def test_decoding_slack_is_a_lower_bound_of_the_remaining_spans():
    """The slack kept across steps never exceeds the least r_ti = e_i − (t − i) of a valid memory (paper Eq. 5), so
    the unmasked path is never taken with a memory on the ramp."""
    from memlm.kernels.expire_attention.memory import ExpireSpanMemory, decoding_slack

    model = _model(span_weight=0.3, span_bias=-1.0, max_span=24, ramp=3, block_size=4)
    input_ids = torch.randint(0, 256, (3, 50))
    with torch.no_grad():
        cache = model(input_ids[:, :5], use_cache=True).cache
        for t in range(5, 50):
            cache = model(input_ids[:, t : t + 1], cache=cache, use_cache=True).cache
            for layer in cache.layers:
                memory = layer.memory
                if memory.expiry_slack is None:
                    continue
                exact = decoding_slack(
                    ExpireSpanMemory(memory.keys, memory.values, memory.positions, memory.valid, memory.spans, None),
                    torch.full((3, 1), t + 1),
                    torch.ones(3, 1, dtype=torch.bool),
                )
                assert memory.expiry_slack <= exact


def test_decoding_at_given_positions_that_jump_past_the_spans_still_masks(monkeypatch):
    """The kept slack assumes each step's query is at most one position further; position_ids may jump further, and
    a jump that puts memories on the ramp must be masked exactly as with the path off."""
    import memlm.modeling.modeling_expire_span as modeling

    model = _model(span_weight=0.05, span_bias=0.0, max_span=40, ramp=4, block_size=4)  # e ≈ 20
    model.config.span_loss_coefficient = 1.0
    input_ids = torch.randint(0, 256, (2, 12))
    given_positions = [0, 1, 2, 3, 4, 5, 6, 7, 8, 24, 25, 40]  # jumps of 16 and 15

    def decode():
        steps = []
        with torch.no_grad():
            cache = model(input_ids[:, :3], use_cache=True).cache
            for t in range(3, 12):
                positions = torch.tensor([[given_positions[t]]] * 2) if t >= 9 else None
                output = model(input_ids[:, t : t + 1], position_ids=positions, cache=cache, use_cache=True)
                steps.append((output.logits, output.span_loss, output.memory_size))
        return steps

    fast = decode()
    monkeypatch.setattr(modeling, "decoding_slack", lambda *arguments: None)
    masked = decode()
    for (logits, span_loss, memory_size), (masked_logits, masked_span_loss, masked_memory_size) in zip(fast, masked):
        torch.testing.assert_close(logits, masked_logits, atol=1e-6, rtol=0)
        torch.testing.assert_close(span_loss, masked_span_loss, atol=1e-9, rtol=1e-6)
        torch.testing.assert_close(memory_size, masked_memory_size, atol=0, rtol=0)
    assert float(masked[-3][1]) > 0  # the jump to 24 put memories on the ramp (to 40: past it, expired)
    with torch.no_grad():
        full = model(input_ids, position_ids=torch.tensor([given_positions] * 2)).logits
    torch.testing.assert_close(torch.cat([step[0] for step in fast], 1), full[:, 3:], atol=1e-4, rtol=0)


OFFICIAL_OPTIONS = {  # the official code's attention and layer (benchmarks/paper_layouts.py's official layout)
    "position_encoding": "learned_relative",
    "attend_to_self": False,
    "renormalization_epsilon": 1e-3,
    "recompute_memory": True,
    "norm_type": "layernorm",
    "norm_position": "post",
    "mlp_type": "plain",
    "mlp_bias": True,
    "hidden_act": "relu",
    "initial_memory": "zeros",
    "span_loss_form": "remaining_span",
}


@pytest.mark.parametrize("one_query", [True, False, "alternate"],
                         ids=["one_query_attention", "general_attention", "some_layers_general"])  # fmt: skip
@pytest.mark.parametrize(
    ("span_bias", "options"),
    [(2.0, {}), (-0.5, {}), (-0.5, {"span_loss_form": "remaining_span"}), (-0.5, OFFICIAL_OPTIONS)],
    ids=["long_spans", "short_spans", "short_spans_remaining_loss", "official_layout"],
)
def test_a_decoding_step_equals_the_forward_of_one_token(monkeypatch, span_bias, options, one_query):
    """`ExpireSpanModel.step` (a decoding step without the forward's work for blocks and padding) gives what the
    forward gives for the same token: logits, spans, hidden states, span loss, memory size and the memories left in
    the cache, over many steps — with lazy pruning marking memories dead in place (the step then masks them) and
    compacting, and, with short spans (bias -0.5), memories on the ramp, which the step masks as the forward does
    (with either span loss: the span, or the official remaining span), and in the official layout (learned relative
    positions, no attention to the token itself, ε, memories recomputed from their hidden states, post-norm), whose
    step always takes the masked attention.
    float64, so that the two paths' different products (softmax attention against the masked one) show only at
    1e-12. Also with the one-query attention answering None (a non-finite output), where the step takes the general
    masked attention, at every layer or at every other call (the layers that took the one-query attention are then
    counted apart from those that did not)."""
    from memlm.modeling import modeling_expire_span
    from memlm.modeling.modeling_expire_span import ExpireSpanDecoderLayer, ExpireSpanModel

    for name in ("plain_one_query_attention", "official_one_query_attention") if one_query is not True else ():
        calls, attention = [], getattr(modeling_expire_span, name)

        def sometimes(*arguments, calls=calls, attention=attention):
            calls.append(1)
            return attention(*arguments) if one_query == "alternate" and len(calls) % 2 else None

        monkeypatch.setattr(modeling_expire_span, name, sometimes)

    model = _model(span_weight=0.05, span_bias=span_bias, max_span=24, ramp=4, block_size=4, **options).double()
    model.config.span_loss_coefficient = 1.0
    input_ids = torch.randint(0, 256, (2, 70))
    steps = {"unmasked": 0, "masked": 0, "new_buffer": 0, "forward_in_step": 0, "in_step": False}
    layer_step, layer_forward = ExpireSpanDecoderLayer.step, ExpireSpanDecoderLayer.forward

    def counted(self, *arguments, **options):
        steps["in_step"] = True
        outputs = layer_step(self, *arguments, **options)
        steps["in_step"] = False
        masked = not isinstance(outputs[3], int) or outputs[4] is None
        steps["masked" if masked else "unmasked"] += 1  # (the span loss a sum, or the reads counted by the model)
        steps["new_buffer"] += outputs[1].buffer is not arguments[3].buffer  # (compacted by the pruning)
        return outputs

    def forward_counted(self, *arguments, **options):
        steps["forward_in_step"] += steps["in_step"]
        return layer_forward(self, *arguments, **options)

    def decode(mask=False, padded=False):
        prompt_mask = torch.ones(2, 6, dtype=torch.long)
        if padded:  # row 0 starts with 3 padding tokens: invalid slots the step must mask
            prompt_mask[0, :3] = 0
        outputs = []
        with torch.no_grad():
            cache = model(input_ids[:, :6], attention_mask=prompt_mask, use_cache=True).cache
            for t in range(6, input_ids.shape[1]):
                full_mask = torch.cat([prompt_mask, torch.ones(2, t - 5, dtype=torch.long)], dim=1)
                given = {"attention_mask": full_mask} if mask or padded else {}
                output = model(input_ids[:, t : t + 1], cache=cache, use_cache=True, output_spans=True,
                               output_hidden_states=True, **given)  # fmt: skip
                cache = output.cache
                memories = [(layer.memory.positions.clone(), layer.memory.valid.clone()) for layer in cache.layers]
                outputs.append((output, memories))
        return outputs

    monkeypatch.setattr(ExpireSpanDecoderLayer, "step", counted)
    monkeypatch.setattr(ExpireSpanDecoderLayer, "forward", forward_counted)
    stepped, stepped_with_mask, stepped_padded = decode(), decode(mask=True), decode(padded=True)
    # Every step took the step's path, also after a pruning compacted the memory (its buffer then comes from the step's
    # append).
    assert steps["forward_in_step"] == 0 and steps["new_buffer"] > 0
    monkeypatch.setattr(ExpireSpanModel, "steps_one_token", lambda *arguments: False)
    forward, forward_padded = decode(), decode(padded=True)
    official = options is OFFICIAL_OPTIONS
    assert (steps["unmasked"] == 0) if official else (steps["unmasked"] > 0)  # the official options always mask
    if span_bias < 0:
        assert steps["masked"] > 0  # memories on the ramp
        assert any(float(output.span_loss) != 0 for output, _ in stepped)  # (the remaining span is negative)
    for run, expected_run in ((stepped, forward), (stepped_with_mask, forward), (stepped_padded, forward_padded)):
        for (output, memories), (expected, expected_memories) in zip(run, expected_run):
            torch.testing.assert_close(output.logits, expected.logits, atol=1e-12, rtol=0)
            for name in ("spans", "hidden_states"):
                for value, expected_value in zip(getattr(output, name), getattr(expected, name)):
                    torch.testing.assert_close(value, expected_value, atol=1e-12, rtol=0)
            torch.testing.assert_close(output.span_loss, expected.span_loss, atol=1e-12, rtol=1e-9)
            torch.testing.assert_close(output.memory_size, expected.memory_size, atol=0, rtol=0)
            for (positions, valid), (expected_positions, expected_valid) in zip(memories, expected_memories):
                assert torch.equal(positions, expected_positions) and torch.equal(valid, expected_valid)
    dead = [not bool(valid.all()) for _, memories in forward for _, valid in memories]
    assert any(dead)  # memories marked dead in place: the step masked them


@pytest.mark.parametrize("options", [{}, OFFICIAL_OPTIONS], ids=["default_layout", "official_layout"])
def test_generate_decodes_without_the_counts_it_does_not_read(options):
    """Inside `generate`, which reads of its forwards only the logits, the cache and the hidden states it is asked
    for, the decoding steps leave the span loss and the memories read out (None), and so run fewer operations than the
    same steps that count (the counting work is skipped, not only its result dropped); the logits are those of steps
    that count, called one by one outside `generate`. After `generate`, also after one that failed, steps count
    again."""
    from memlm.modeling.memory import auxiliary_outputs_read
    from tests.operations import CountOperations

    def start(module, arguments):  # the ATen operations of each forward of the base model, one count per forward
        starts.append(operations.total)
        operations.counting = True

    def stop(module, arguments, output):
        operations.counting = False
        counts.append(operations.total - starts[-1])
        outputs.append(output)

    model = _model(span_weight=0.05, span_bias=-0.5, max_span=24, ramp=4, block_size=4, **options)
    prompt = torch.randint(0, 256, (2, 9))
    outputs, starts, counts, operations = [], [], [], CountOperations()
    operations.counting = False
    handles = [model.model.register_forward_pre_hook(start), model.model.register_forward_hook(stop)]
    with operations:
        generated = model.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False, output_logits=True,
                                   return_dict_in_generate=True)  # fmt: skip
    assert len(outputs) == 12 and outputs[0].memory_size is not None  # (the prompt's forward is no step: it counts)
    assert all(output.span_loss is None and output.aux_loss is None and output.memory_size is None
               for output in outputs[1:])  # fmt: skip
    assert auxiliary_outputs_read()
    inside, outputs[:], counts = counts, [], []
    with torch.no_grad(), operations:
        output = model(prompt, use_cache=True, logits_to_keep=1)  # (as generate reads the prompt)
        for index, logits in enumerate(generated.logits):
            assert torch.equal(output.logits[:, -1], logits)
            if index:  # a step outside generate counts (memories on the ramp: a span loss)
                assert output.memory_size is not None and float(output.span_loss) != 0
            token = generated.sequences[:, prompt.shape[1] + index, None]
            output = model(token, cache=output.cache, use_cache=True)
    for handle in handles:
        handle.remove()
    # The same steps over the same memories, counting and not: the counts' operations (9 to 11 here) left out.
    assert all(counting - skipping >= 8 for skipping, counting in zip(inside[2:], counts[2:12]))
    with pytest.raises(ValueError):
        model.generate(prompt, max_new_tokens=-1)
    assert auxiliary_outputs_read()


@pytest.mark.parametrize(
    ("span_bias", "options"),
    [(2.0, {}), (-0.5, {}), (-0.5, OFFICIAL_OPTIONS)],
    ids=["long_spans", "short_spans", "official_layout"],
)
def test_a_decoding_step_keeps_a_non_finite_memory_it_does_not_read_in_place(monkeypatch, span_bias, options):
    """A NaN in memories a decoding step does not read (padding slots) leaves its logits finite and those of the
    forward, as the general attention keeps it in place (issue 33): the step's attentions do not check their outputs,
    the step looks at its last hidden states once and, finding them not finite, runs its layers again from the
    memories before it, each attention checking its output. A finite step runs each layer once; one that hides no
    memory from the token (no padding, no memory on the ramp: long spans) does not look. The same on a device whose
    operations do not check at every call (a GPU's, emulated on the CPU): the step's look reads back there too."""
    from memlm import kernels
    from memlm.modeling import modeling_expire_span
    from memlm.modeling.modeling_expire_span import ExpireSpanDecoderLayer, ExpireSpanModel

    model = _model(span_weight=0.05, span_bias=span_bias, max_span=24, ramp=4, block_size=4, **options).double()
    input_ids = torch.randint(0, 256, (2, 7))
    prompt_mask = torch.ones(2, 6, dtype=torch.long)
    prompt_mask[0, :3] = 0  # row 0 starts with 3 padding tokens: invalid slots in every layer's memory
    layer_steps = []
    layer_step = ExpireSpanDecoderLayer.step

    def counted(self, *arguments, **keywords):
        layer_steps.append(1)
        return layer_step(self, *arguments, **keywords)

    monkeypatch.setattr(ExpireSpanDecoderLayer, "step", counted)

    def step(poisoned: bool):
        with torch.no_grad():
            cache = model(input_ids[:, :6], attention_mask=prompt_mask, use_cache=True).cache
            if poisoned:
                for layer in cache.layers:
                    layer.memory.keys[0, :, ~layer.memory.valid[0]] = float("nan")
            layer_steps.clear()
            mask = torch.cat([prompt_mask, torch.ones(2, 1, dtype=torch.long)], dim=1)
            return model(input_ids[:, 6:], attention_mask=mask, cache=cache).logits, len(layer_steps)

    (clean, clean_steps), (stepped, poisoned_steps) = step(False), step(True)
    layers = model.config.num_hidden_layers
    assert clean_steps == layers and poisoned_steps == 2 * layers
    with monkeypatch.context() as device:  # a GPU's operations: checked only inside `checking_every_call`
        device.setattr(kernels, "DEVICES_CHECKED_AT_EVERY_CALL", set())
        (device_clean, device_clean_steps), (device_stepped, device_poisoned_steps) = step(False), step(True)
    assert device_clean_steps == layers and device_poisoned_steps == 2 * layers
    assert torch.equal(device_clean, clean) and torch.equal(device_stepped, stepped)
    looks, is_finite_now = [], modeling_expire_span.is_finite_now
    monkeypatch.setattr(modeling_expire_span, "is_finite_now", lambda tensor: looks.append(1) or is_finite_now(tensor))
    with torch.no_grad():
        cache = model(input_ids[:, :6], use_cache=True).cache
        looks.clear()
        model(input_ids[:, 6:], cache=cache)
    if span_bias > 0 or options:  # (short spans: on the ramp only later) no memory hidden, or the official mask
        assert len(looks) == (1 if options else 0)
    assert torch.isfinite(stepped).all()
    monkeypatch.setattr(ExpireSpanModel, "steps_one_token", lambda *arguments: False)
    (expected, _), (expected_clean, _) = step(True), step(False)
    torch.testing.assert_close(stepped, expected, atol=1e-12, rtol=0)
    torch.testing.assert_close(clean, expected_clean, atol=1e-12, rtol=0)


def test_hooks_see_every_module_run_in_decoding_steps():
    """The decoding step computes with the weights and forwards directly only where a call would run just the class's
    forward: a hook on a decoder layer, on a projection, on an MLP's linear layer or activation or on a norm, each
    alone, sees its module run at every step, and the logits stay those of the unhooked model."""
    model = _model(span_weight=0.05, span_bias=2.0, max_span=64, block_size=4)
    input_ids = torch.randint(0, 256, (2, 12))
    plain, _ = _decode(model, input_ids, prefill=6)
    layers = model.model.layers
    modules = [
        layers[0], layers[1].attention.q_proj, layers[1].mlp.down_proj, layers[0].attention.span_predictor,
        layers[1].mlp.act_fn, layers[0].post_attention_layernorm, layers[1].input_layernorm,
    ]  # fmt: skip
    for module in modules:
        calls = []
        handle = module.register_forward_hook(lambda *_, calls=calls: calls.append(1))
        hooked, _ = _decode(model, input_ids, prefill=6)
        handle.remove()
        assert len(calls) == 2 + 6, (module, len(calls))  # the prefill's two blocks, the six steps
        torch.testing.assert_close(hooked, plain, atol=0, rtol=0)
