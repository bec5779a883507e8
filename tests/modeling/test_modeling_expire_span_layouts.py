"""Expire-Span's block layouts and the official model's options (issue 30; SPEC §8): the default layout round-trips
(tests/modeling/test_old_checkpoints.py loads checkpoints saved before these options), the papers' layout (LayerNorm,
post-norm, plain biased MLP, biases, dropouts), an independent head width, the learned relative positions, no
attention to self, the zero initial memory, the official span-loss value and renormalisation, memories recomputed
from hidden states, noisy spans and layer drop, float64 throughout."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from memlm import ExpireSpanConfig, ExpireSpanForCausalLM
from memlm.kernels.expire_attention import expire_span_attention, expire_span_mask
from memlm.modeling.layers import LayerNorm, LearnedRelativePositions, PlainMLP
from tests.modeling.weight_changes import assert_generate_walks_once_and_sees_a_change

TINY = {
    "vocab_size": 40,
    "hidden_size": 24,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "max_span": 12,
    "ramp": 3,
    "block_size": 6,
    "initial_span_fraction": 0.3,
}
# The official model's options (facebookresearch/transformer-sequential, models/expire_span.py).
OFFICIAL = {
    "head_dim": 10,
    "position_encoding": "learned_relative",
    "attend_to_self": False,
    "initial_memory": "zeros",
    "span_loss_form": "remaining_span",
    "renormalization_epsilon": 1e-8,
    "norm_type": "layernorm",
    "norm_position": "post",
    "final_norm": False,
    "mlp_type": "plain",
    "mlp_bias": True,
    "hidden_act": "relu",
    "lm_head_bias": True,
}


def _model(dtype=torch.float32, **overrides) -> ExpireSpanForCausalLM:
    """A tiny model with spread-out spans (random span predictors) and every parameter moved off its initial value."""
    torch.manual_seed(0)
    model = ExpireSpanForCausalLM(ExpireSpanConfig(**{**TINY, **overrides})).to(dtype).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.2)
        for layer in model.model.layers:
            layer.attention.span_predictor.weight.normal_(0, 0.6)
    return model


def _input_ids(length=20, batch=2):
    return torch.randint(0, TINY["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(1))


def test_the_default_layout_round_trips_through_save_pretrained(tmp_path):
    model = _model()
    names = set(model.state_dict())
    assert "model.norm.weight" in names and "model.layers.0.mlp.gate_proj.weight" in names
    assert not any(name.endswith(".bias") and "span_predictor" not in name for name in names)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=_input_ids()).logits, loaded(input_ids=_input_ids()).logits)


@pytest.mark.parametrize("norm_position", ["pre", "post"])
def test_the_papers_layout_builds_its_blocks_and_round_trips(norm_position, tmp_path):
    layout = {"norm_position": norm_position, "final_norm": norm_position == "pre", "attention_dropout": 0.1}
    model = _model(**{**OFFICIAL, **layout})
    layer = model.model.layers[0]
    assert isinstance(layer.input_layernorm, LayerNorm) and isinstance(layer.mlp, PlainMLP)
    assert layer.mlp.up_proj.bias is not None and model.lm_head.bias is not None
    assert layer.attention.q_proj.weight.shape == (2 * 10, 24) and layer.attention.o_proj.weight.shape == (24, 20)
    assert isinstance(model.model.norm, LayerNorm) == (norm_position == "pre")
    assert model.num_parameters() == model.config.estimated_parameters()
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=_input_ids()).logits, loaded(input_ids=_input_ids()).logits)


def test_post_norm_is_norm_of_the_residual_sum():
    model = _model(**OFFICIAL)
    layer = model.model.layers[0]
    hidden = torch.randn(1, 6, 24)
    positions = torch.arange(6)[None]
    valid = torch.ones(1, 6, dtype=torch.bool)
    with torch.no_grad():
        output, memory, *_ = layer(
            hidden,
            positions,
            valid,
            None,
            None,
            relative_positions=model.model.relative_positions,
            keep_span_inputs=True,
        )
        mixed, *_ = layer.attention(
            hidden, positions, valid, None, None, None, None, False, model.model.relative_positions
        )
        middle = layer.input_layernorm(hidden + mixed)  # official: h2 = norm1(h + attn(h)); out = norm2(h2 + ff(h2))
        expected = layer.post_attention_layernorm(middle + layer.mlp(middle))
    assert torch.allclose(output, expected, atol=1e-6)
    assert torch.equal(memory.span_inputs, hidden)  # post-norm: the memories are the raw layer inputs


def test_learned_relative_positions_score_q_dot_p_of_the_distance():
    positions = LearnedRelativePositions(num_positions=4, head_dim=3)
    with torch.no_grad():
        positions.weight.normal_()
    query = torch.randn(2, 2, 3, 3)
    query_positions = torch.tensor([[5, 6, 7], [0, 1, 2]])
    key_positions = torch.tensor([[0, 2, 3, 5, 6, 7], [-3, -2, -1, 0, 1, 2]])
    scores = positions(query, query_positions, key_positions)
    for b in range(2):
        for t in range(3):
            for n in range(6):
                distance = int(query_positions[b, t] - key_positions[b, n])
                expected = query[b, :, t] @ positions.weight[distance - 1] if 1 <= distance <= 4 else torch.zeros(2)
                assert torch.allclose(scores[b, :, t, n], expected, atol=1e-6), (b, t, n)


def test_the_padded_table_a_decoding_step_reads_is_kept_while_the_weight_stays():
    """`LearnedRelativePositions.padded`: [0; table; 0] in the dtype asked, the same tensor at every step while the
    weight stays, padded again after an in-place write, a new weight, a move to another dtype; not kept by a copy."""
    positions = LearnedRelativePositions(num_positions=4, head_dim=3)
    with torch.no_grad():
        positions.weight.normal_()

    def expected(dtype):
        zero = torch.zeros(1, 3, dtype=dtype)
        return torch.cat([zero, positions.weight.detach().to(dtype), zero])

    padded = positions.padded(torch.float32)
    assert torch.equal(padded, expected(torch.float32)) and not padded.requires_grad
    assert positions.padded(torch.float32) is padded
    assert torch.equal(positions.padded(torch.float64), expected(torch.float64))
    with torch.no_grad():
        positions.weight.mul_(2)  # an optimizer step or a load writes in place
    assert torch.equal(positions.padded(torch.float32), expected(torch.float32))
    positions.weight = torch.nn.Parameter(torch.randn(4, 3))
    assert torch.equal(positions.padded(torch.float32), expected(torch.float32))
    positions.double()  # the same parameter, its data swapped
    assert torch.equal(positions.padded(torch.float64), expected(torch.float64))
    assert copy.deepcopy(positions)._padded.table is None


def test_decoding_reads_the_positions_table_as_it_is_now():
    """A decoding step reads the padded table kept from earlier steps only while the table stays: after an in-place
    change (a training step between two generations), a new cache decodes with the new table, as the forward does."""
    model = _model(**OFFICIAL)
    input_ids = _input_ids(length=9)
    with torch.no_grad():
        for _ in range(2):
            cache = model(input_ids=input_ids[:, :-1], use_cache=True).cache
            stepped = model(input_ids=input_ids[:, -1:], cache=cache, use_cache=True).logits[:, -1]
            whole = model(input_ids=input_ids).logits[:, -1]
            torch.testing.assert_close(stepped, whole, atol=1e-5, rtol=1e-5)
            model.model.relative_positions.weight.add_(1)


def test_one_relative_position_table_is_shared_by_the_layers():
    model = _model(**OFFICIAL)
    table = model.model.relative_positions.weight
    assert table.shape == (min(TINY["max_span"], TINY["block_size"]), 10)
    assert [name for name in model.state_dict() if "relative_positions" in name] == ["model.relative_positions.weight"]
    loss = model(input_ids=_input_ids()).logits.square().mean()
    loss.backward()
    assert table.grad is not None and table.grad.abs().sum() > 0


@pytest.mark.parametrize("renormalization_epsilon", [0.0, 1e-2])
def test_attention_without_self_equals_hiding_the_own_key(renormalization_epsilon):
    generator = torch.Generator().manual_seed(2)
    query, key, value = (torch.randn(2, 2, 5, 4, generator=generator, dtype=torch.float64) for _ in range(3))
    positions = torch.arange(5)[None].expand(2, 5)
    spans = torch.rand(2, 5, generator=generator, dtype=torch.float64) * 6
    options = {"ramp": 2.0, "renormalization_epsilon": renormalization_epsilon}
    without_self = expire_span_attention(
        query, key, value, spans, positions, positions, attend_to_self=False, **options
    )
    for t in range(1, 5):  # query t sees keys 0..t-1: the same as query t with keys up to t-1 only
        alone = expire_span_attention(
            query[:, :, t : t + 1], key[:, :, :t], value[:, :, :t], spans[:, :t], positions[:, t : t + 1],
            positions[:, :t], **options,
        )  # fmt: skip
        assert torch.allclose(without_self[:, :, t : t + 1], alone, atol=1e-12)
    assert without_self[:, :, 0].abs().max() == 0  # the first token sees nothing


def test_the_official_renormalization_divides_by_the_masked_sum_plus_epsilon():
    generator = torch.Generator().manual_seed(3)
    query, key, value = (torch.randn(1, 2, 4, 3, generator=generator, dtype=torch.float64) for _ in range(3))
    positions = torch.arange(4)[None]
    spans = torch.tensor([[0.2, 3.0, 0.5, 2.0]], dtype=torch.float64)
    epsilon = 0.05
    output = expire_span_attention(
        query, key, value, spans, positions, positions, ramp=1.5, renormalization_epsilon=epsilon
    )
    mask = expire_span_mask(spans, positions, positions, 1.5)[:, None]  # m_ti, Eq. 5
    live = (mask > 0) & (positions[:, None, :, None] >= positions[:, None, None, :])
    scores = (query @ key.mT / 3**0.5).masked_fill(~live, float("-inf"))  # official: −inf where m = 0
    weights = scores.softmax(-1) * mask
    expected = weights / (weights.sum(-1, keepdim=True) + epsilon) @ value
    assert torch.allclose(output, expected, atol=1e-14)
    exact = expire_span_attention(query, key, value, spans, positions, positions, ramp=1.5)
    assert (output - exact).abs().max() > 1e-4  # ε changes the output: the option is not a no-op


@pytest.mark.parametrize("recompute_memory", [False, True])
def test_the_official_options_give_the_same_output_block_by_block_and_token_by_token(recompute_memory):
    model = _model(torch.float64, **OFFICIAL, recompute_memory=recompute_memory)
    input_ids = _input_ids(length=21)
    with torch.no_grad():
        whole = model(input_ids=input_ids).logits
        cache, pieces = None, []
        for start in range(0, 21, 6):
            output = model(input_ids=input_ids[:, start : start + 6], cache=cache, use_cache=True)
            cache, pieces = output.cache, pieces + [output.logits]
        assert (torch.cat(pieces, 1) - whole).abs().max() < 1e-12
        cache, pieces = None, []
        for t in range(21):
            output = model(input_ids=input_ids[:, t : t + 1], cache=cache, use_cache=True)
            cache, pieces = output.cache, pieces + [output.logits]
        assert (torch.cat(pieces, 1) - whole).abs().max() < 1e-12
        generated = model.generate(input_ids[:, :8], max_new_tokens=5, do_sample=False)
        recomputed = input_ids[:, :8]
        for _ in range(5):  # greedy decoding with the cache equals full forwards without one
            recomputed = torch.cat([recomputed, model(input_ids=recomputed).logits[:, -1:].argmax(-1)], dim=1)
        beams = model.generate(input_ids[:, :8], max_new_tokens=5, num_beams=3, do_sample=False)
    assert torch.equal(generated, recomputed) and beams.shape == (2, 13)


def test_the_zero_initial_memory_is_attended_before_the_first_token():
    model = _model(torch.float64, **{**OFFICIAL, "max_span": 40, "initial_span_fraction": 0.9})
    input_ids = _input_ids(length=6)
    with torch.no_grad():
        output = model(input_ids=input_ids, use_cache=True)
        memory = output.cache.layers[0].memory
        # positions −6..−1 (counters mem_sz..1 before the first query), zero layer inputs (post-norm: zero keys)
        assert memory.positions[0, :6].tolist() == list(range(-6, 0))
        assert memory.keys[:, :, :6].abs().max() == 0
        empty = model(input_ids=input_ids, cache=None, use_cache=True)
        model.config.initial_memory = "empty"
        without = model(input_ids=input_ids, use_cache=True)
    assert torch.equal(output.logits, empty.logits)  # every forward without a cache starts from the same memory
    assert without.cache.layers[0].memory.width == 6
    # The first token attends to the zero memories (its value is the zero vector, its weight is not zero): without
    # them it has nothing to attend to and its attention output is zero, so the logits differ.
    assert (output.logits - without.logits).abs().max() > 1e-3


def test_the_official_span_loss_sums_the_remaining_spans_on_the_ramp():
    model = _model(torch.float64, **OFFICIAL, span_loss_coefficient=1.0)
    config = model.config
    input_ids = _input_ids(length=6)
    with torch.no_grad():
        output = model(input_ids=input_ids, output_spans=True, use_cache=True)
    # Brute force over (query t, memory i): the memories are the six zero memories and the block's own tokens.
    total = 0.0
    for layer in range(config.num_hidden_layers):
        decoder_layer = model.model.layers[layer]
        zeros = torch.zeros(2, 6, config.hidden_size, dtype=torch.float64)
        memory_spans = torch.cat([decoder_layer.attention.predict_spans(zeros), output.spans[layer]], dim=1)
        memory_positions = torch.arange(-6, 6)
        remaining = memory_spans[:, None, :] - (torch.arange(6)[:, None] - memory_positions[None, :])  # e_i − (t − i)
        mask = 1 + remaining / config.ramp
        total = total + (remaining * ((mask > 0) & (mask < 1))).sum() / config.ramp
    assert torch.allclose(output.aux_loss, total / (2 * 6), atol=1e-12)
    assert output.aux_loss < 0 and torch.equal(output.aux_loss, output.span_loss)


def test_both_span_loss_forms_have_the_same_gradient():
    gradients = []
    for form in ("span", "remaining_span"):
        model = _model(torch.float64, **{**OFFICIAL, "span_loss_form": form}, span_loss_coefficient=1.0).train()
        model(input_ids=_input_ids(length=12)).span_loss.backward()
        gradients.append(torch.cat([layer.attention.span_predictor.weight.grad for layer in model.model.layers]))
    assert gradients[0].abs().max() > 0
    assert torch.allclose(gradients[0], gradients[1], atol=1e-12)


def test_a_float64_model_computes_its_spans_in_float64():
    model = _model(torch.float64)
    with torch.no_grad():
        output = model(input_ids=_input_ids(), output_spans=True)
    assert all(spans.dtype == torch.float64 for spans in output.spans)
    assert output.span_loss.dtype == torch.float64 and output.logits.dtype == torch.float64


def test_embedding_scale_and_the_dropouts_act_where_documented():
    model = _model(embedding_scale=3.0)
    base = _model()
    with torch.no_grad():
        scaled = model(input_ids=_input_ids(), output_hidden_states=True).hidden_states[0]
        plain = base(input_ids=_input_ids(), output_hidden_states=True).hidden_states[0]
    assert torch.allclose(scaled, 3 * plain)
    dropped = _model(embedding_dropout=0.5, activation_dropout=0.5, output_dropout=0.5, mlp_type="plain").train()
    first, second = dropped(input_ids=_input_ids()).logits, dropped(input_ids=_input_ids()).logits
    assert not torch.equal(first, second)
    dropped.eval()
    with torch.no_grad():
        assert torch.equal(dropped(input_ids=_input_ids()).logits, dropped(input_ids=_input_ids()).logits)


@pytest.mark.parametrize("position_encoding", ["rotary", "learned_relative"])
def test_recomputed_memories_give_the_same_outputs_and_reach_the_projections_through_the_memory(position_encoding):
    """With fixed weights, recomputing the memories' keys, values and spans from their hidden states changes nothing;
    in training it sends the next block's loss into the key/value projections through the carried memories."""
    options = {**OFFICIAL, "position_encoding": position_encoding, "head_dim": 12, "norm_position": "pre"}
    carried = _model(torch.float64, **options)
    recomputed = _model(torch.float64, **options, recompute_memory=True)
    input_ids = _input_ids(length=12)
    with torch.no_grad():
        expected = carried(input_ids=input_ids).logits
        cache, pieces = None, []
        for start in (0, 6):
            output = recomputed(input_ids=input_ids[:, start : start + 6], cache=cache, use_cache=True)
            cache, pieces = output.cache, pieces + [output.logits]
    assert cache.layers[0].memory.hidden_states is not None
    assert (torch.cat(pieces, 1) - expected).abs().max() < 1e-12
    gradients = []
    for model in (carried, recomputed):
        model.train()
        first = model(input_ids=input_ids[:, :6], use_cache=True)
        model.zero_grad()
        second = model(input_ids=input_ids[:, 6:], cache=first.cache, use_cache=True)
        second.logits.square().mean().backward()
        layer = model.model.layers[0]
        gradients.append((layer.attention.k_proj.weight.grad.clone(), layer.input_layernorm.weight.grad.clone()))
    # The second block's keys from the first block's memories: only the recomputed memories carry that gradient.
    assert (gradients[0][0] - gradients[1][0]).abs().max() > 1e-6
    assert (gradients[0][1] - gradients[1][1]).abs().max() > 1e-6


def test_noisy_spans_clamp_what_the_mask_sees_in_training_only():
    model = _model(**OFFICIAL, noisy_spans=True, span_loss_coefficient=1.0)
    input_ids = _input_ids(length=12)
    with torch.no_grad():
        evaluated = model(input_ids=input_ids).logits
        model.config.noisy_spans = False
        assert torch.equal(model(input_ids=input_ids).logits, evaluated)  # never active in eval mode
        model.config.noisy_spans = True
    model.train()
    torch.manual_seed(4)
    noisy = model(input_ids=input_ids)
    torch.manual_seed(4)
    again = model(input_ids=input_ids)
    assert torch.equal(noisy.logits, again.logits)  # one draw per forward from torch's generator
    assert (noisy.logits - evaluated).abs().max() > 1e-4
    # The attention sees min(e_i, limit): the layer with the limit passed equals the clamped spans; the memories it
    # returns keep their own spans (they expire by them).
    layer, relative = model.model.layers[0], model.model.relative_positions
    hidden = torch.randn(2, 6, 24)
    positions, valid = torch.arange(6)[None].expand(2, 6), torch.ones(2, 6, dtype=torch.bool)
    limit = 0.4
    with torch.no_grad():
        clamped, memory, spans, loss, _ = layer.attention(
            hidden, positions, valid, None, None, None, None, True, relative, span_limit=limit
        )
        assert torch.equal(memory.spans, spans) and spans.max() > limit
        free, *_ = layer.attention(hidden, positions, valid, None, None, None, None, True, relative)
    assert (clamped - free).abs().max() > 1e-6


def test_layer_drop_skips_layers_in_training_but_keeps_their_memories():
    model = _model(layer_drop=0.999).train()
    input_ids = _input_ids(length=12)
    torch.manual_seed(0)
    output = model(input_ids=input_ids, use_cache=True, output_hidden_states=True)
    embeddings = model.model.embed_tokens(input_ids)
    # every layer dropped: the LM head reads the normed embeddings; no span loss; every layer still has its memories
    assert torch.allclose(output.logits, model.lm_head(model.model.norm(embeddings)), atol=1e-6)
    assert output.span_loss == 0
    assert all(layer.memory is not None and layer.memory.width > 0 for layer in output.cache.layers)
    model.eval()
    with torch.no_grad():
        kept = model(input_ids=input_ids).logits
    assert (kept - output.logits).abs().max() > 1e-3  # never active in eval mode


@pytest.mark.parametrize("projections", ["plain", "lora_query", "lora_key_value"])
@pytest.mark.parametrize("norm_position", ["post", "pre"])
# peft's own `PeftModel.__init__` reads the deprecated `is_gradient_checkpointing` (see tests/clients/test_peft.py)
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_recomputed_memories_train_the_same_in_one_forward_as_block_by_block(norm_position, projections):
    """With `recompute_memory`, a training forward over several blocks gives the losses and every gradient of one
    forward per block (the official trainer's), memories carried between them: later blocks read the memories of
    earlier ones with gradients into the weights (as recomputed from detached hidden states; in one forward the
    block's own keys and values reused, or projected again when peft's LoRA wraps the projections), not into the
    hidden states that made them. With LoRA on the queries alone, the first layer's memories need no gradient while
    its queries do: the memories a block's attention read stay as they were for its backward (they were once pruned
    in place by later blocks). Blocks of 6 over 21 tokens, the zero initial memory, float64."""
    options = {**OFFICIAL, "norm_position": norm_position, "recompute_memory": True}
    input_ids = _input_ids(length=21)
    gradients = []
    for pieces in ([slice(0, 21)], [slice(start, start + 6) for start in range(0, 21, 6)]):
        model = _model(torch.float64, **options).train()
        if projections != "plain":
            peft = pytest.importorskip("peft")
            targets = ["q_proj"] if projections == "lora_query" else ["k_proj", "v_proj"]
            lora = peft.LoraConfig(r=2, target_modules=targets, init_lora_weights=False)
            torch.manual_seed(0)
            model = peft.get_peft_model(model, lora)
        projected = []  # the rows layer 0's key projection sees
        base = model if projections == "plain" else model.get_base_model()
        key_projection = base.model.layers[0].attention.k_proj
        key_projection.register_forward_hook(
            lambda module, inputs, output, rows=projected: rows.append(inputs[0].shape[1])
        )
        cache, losses = None, []
        for piece in pieces:
            output = model(input_ids=input_ids[:, piece], cache=cache, use_cache=True)
            # (The span loss is a mean over the forward's tokens: a sum over blocks of other lengths is another loss.)
            output.logits.square().sum().backward()
            cache, losses = output.cache, losses + [output.logits.detach()]
        gradients.append({name: parameter.grad for name, parameter in model.named_parameters()})
        if len(pieces) == 1 and projections != "lora_key_value":  # the zero initial memory, then each block once
            assert projected == [base.config.initial_memory_size, 6, 6, 6, 3], projected
        if len(pieces) == 1:
            whole, whole_cache = losses[0], cache
    assert (torch.cat(losses, 1) - whole).abs().max() < 1e-12
    for name, expected in gradients[1].items():
        if expected is None:  # frozen under LoRA
            assert gradients[0][name] is None and projections != "plain", name
            continue
        assert (gradients[0][name] - expected).abs().max() <= 1e-10 * expected.abs().max(), name
    for ours, theirs in zip(whole_cache.layers, cache.layers):  # the same memories carried on, detached
        assert not ours.memory.keys.requires_grad and not ours.memory.hidden_states.requires_grad
        assert (ours.memory.keys - theirs.memory.keys).abs().max() < 1e-12


def test_carried_memories_are_pruned_on_the_spans_of_the_current_weights():
    """With `recompute_memory`, carried memories are pruned before they are projected again (only those that live on
    are projected), on the spans the current weights give them: after the span predictor changed, a training forward
    reads the memories the new spans keep, as the order recompute-then-prune (the one a recording cache keeps) does.
    The cache is made with short spans (most memories dead), then the spans are made long."""
    model = _model(torch.float64, **OFFICIAL, recompute_memory=True).train()
    input_ids = _input_ids(length=24)
    for layer in model.model.layers:
        layer.attention.span_predictor.bias.data.fill_(-6.0)  # spans of ~0.03 · 12 tokens
    with torch.no_grad():
        cache = model(input_ids=input_ids[:, :18], use_cache=True).cache
    for layer in model.model.layers:
        layer.attention.span_predictor.bias.data.fill_(6.0)  # spans of ~12 tokens: the memories live again
    results = []
    for recording in (False, True):
        carried = copy.deepcopy(cache)
        if recording:
            carried.activate_past_recording()
        results.append(model(input_ids=input_ids[:, 18:], cache=carried, use_cache=True).logits)
    assert (results[0] - results[1]).abs().max() < 1e-12
    with torch.no_grad():
        fresh = model(input_ids=input_ids[:, 18:], use_cache=True).logits
    assert (results[0] - fresh).abs().max() > 1e-3  # the carried memories are read


def test_recomputed_memories_are_reused_while_the_weights_stay_and_recomputed_when_they_change():
    """`recompute_memory` without gradients (decoding): while no weight changed since the cache's memories were made,
    a forward projects only its own tokens (the carried keys, values and spans are what a recomputation would give);
    after a weight changes in place (an optimizer step), it recomputes every carried memory with the new weights."""
    import copy

    from memlm.modeling.memory import weights_version

    model = _model(torch.float64, **OFFICIAL, recompute_memory=True)
    input_ids = _input_ids(length=14)
    projected = []
    model.model.layers[0].attention.k_proj.register_forward_hook(
        lambda module, inputs, output: projected.append(inputs[0].shape[1])
    )
    with torch.no_grad():
        cache = model(input_ids=input_ids[:, :12], use_cache=True).cache
        projected.clear()
        step = model(input_ids=input_ids[:, 12:13], cache=cache, use_cache=True)
        assert projected == [1]  # the new token's key only
        recomputing = copy.deepcopy(step.cache)
        recomputing.weights_version = None  # unknown: every carried memory is recomputed
        projected.clear()
        expected = model(input_ids=input_ids[:, 13:14], cache=recomputing, use_cache=True).logits
        assert projected[0] > 1
        projected.clear()
        reused = model(input_ids=input_ids[:, 13:14], cache=copy.deepcopy(step.cache), use_cache=True).logits
        assert projected == [1] and (reused - expected).abs().max() < 1e-12
        for parameter in model.model.layers[0].parameters():  # an optimizer step, in place
            parameter.add_(torch.randn_like(parameter) * 0.1)
        projected.clear()
        changed = model(input_ids=input_ids[:, 13:14], cache=copy.deepcopy(step.cache), use_cache=True).logits
        assert projected[0] > 1
        stale_cache = copy.deepcopy(step.cache)
        stale_cache.weights_version = weights_version(model.model)  # pretend the old memories are current
        stale = model(input_ids=input_ids[:, 13:14], cache=stale_cache, use_cache=True).logits
        recomputing = copy.deepcopy(step.cache)
        recomputing.weights_version = None
        expected = model(input_ids=input_ids[:, 13:14], cache=recomputing, use_cache=True).logits
    assert (changed - expected).abs().max() < 1e-12  # the carried memories as the new weights make them
    assert (stale - expected).abs().max() > 1e-6


def test_generate_walks_the_weights_once_a_call_and_the_next_call_sees_a_change(monkeypatch):
    """`recompute_memory`: the weights the memories were made with are checked once per `generate` call, and the next
    call sees an optimizer step between them (`weight_changes`)."""
    model = _model(torch.float64, **OFFICIAL, recompute_memory=True)
    assert_generate_walks_once_and_sees_a_change(model, _input_ids(length=10), monkeypatch)


def test_a_crop_forgets_the_weights_the_memories_were_made_with_only_past_a_recomputation():
    """A cache remembers the weights its memories were made with (`weights_version`). A crop keeps that while every
    recorded forward found the memories made with the current weights; a crop reaching back past a forward that
    recomputed them (the weights had changed) brings back older memories and forgets it, as a restored snapshot does;
    the next forward then recomputes them."""
    from memlm.modeling.memory import weights_version

    model = _model(torch.float64, **OFFICIAL, recompute_memory=True)
    input_ids = _input_ids(length=16)
    with torch.no_grad():
        cache = model(input_ids=input_ids[:, :8], use_cache=True).cache
        made_with = weights_version(model.model)
        assert cache.weights_version == made_with
        snapshot = cache.snapshot()
        cache.activate_past_recording()
        model(input_ids=input_ids[:, 8:11], cache=cache, use_cache=True)
        cache.crop(-2)
        assert cache.weights_version == made_with  # the same weights throughout
        for parameter in model.model.layers[0].parameters():  # an optimizer step, in place
            parameter.add_(0.1)
        model(input_ids=input_ids[:, 9:12], cache=cache, use_cache=True)  # recomputes every carried memory
        assert cache.weights_version == weights_version(model.model)
        cache.crop(-3)  # back to the memories made with the earlier weights
        assert cache.weights_version is None
        model(input_ids=input_ids[:, 9:10], cache=cache, use_cache=True)
        assert cache.weights_version == weights_version(model.model)
        cache.restore(snapshot)
        assert cache.weights_version is None
