"""DeltaNet as a 🤗 model: exact semantics of every option, cache equivalence, padding, dtypes, errors."""

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from memlm import DeltaNetCache, DeltaNetConfig, DeltaNetForCausalLM, DeltaNetModel
from memlm.compat import activation_checkpointing_enable
from memlm.modeling.modeling_deltanet import DeltaNetShortConvolution
from tests.conftest import DELTANET_VARIANTS


def reference_attention(attention, hidden_states):
    """A token-by-token reading of SPEC §1 written independently of the model code: projections, causal convolution
    as an explicit sum over the window, φ by its definition, normalisation, the recurrence, output norm and gate."""
    config = attention.config
    batch_size, length, _ = hidden_states.shape
    heads, key_dim, value_dim = config.num_attention_heads, config.key_head_dim, config.value_head_dim
    query = hidden_states @ attention.q_proj.weight.T
    key = hidden_states @ attention.k_proj.weight.T
    value = hidden_states @ attention.v_proj.weight.T
    if config.short_convolution:
        weight = attention.convolution.weight[:, 0]  # (channels, kernel); the last tap multiplies the current input
        projected = torch.cat([query, key, value], -1)
        convolved = torch.zeros_like(projected)
        kernel = weight.shape[1]
        for t in range(length):
            for j in range(kernel):
                source = t - (kernel - 1) + j
                if source >= 0:
                    convolved[:, t] += weight[:, j] * projected[:, source]
        query, key, value = convolved.split([heads * key_dim, heads * key_dim, heads * value_dim], -1)

    def features(x):  # x (..., key_dim)
        if config.feature_map == "dpfp":
            r = torch.cat([x.clamp_min(0), (-x).clamp_min(0)], -1)
            n = r.shape[-1]
            parts = [
                torch.stack([r[..., i] * r[..., (i - j) % n] for i in range(n)], -1)
                for j in range(1, config.dpfp_nu + 1)
            ]
            out = torch.cat(parts, -1)
        elif config.feature_map == "elu+1":
            out = torch.where(x > 0, x + 1, torch.exp(x))
        elif config.feature_map == "silu":
            out = x * torch.sigmoid(x)
        elif config.feature_map == "identity":
            out = x
        else:
            omega = attention.feature_map.projection
            scaled = x / key_dim**0.25
            out = torch.exp(scaled @ omega.T - (scaled**2).sum(-1, keepdim=True) / 2) / omega.shape[0] ** 0.5
        if config.query_key_normalization == "sum":
            out = out / out.sum(-1, keepdim=True)
        elif config.query_key_normalization == "l2":
            out = out / torch.sqrt((out**2).sum(-1, keepdim=True) + 1e-6)
        return out

    query = features(query.view(batch_size, length, heads, key_dim))
    key = features(key.view(batch_size, length, heads, key_dim))
    value = value.view(batch_size, length, heads, value_dim)
    if config.value_activation == "silu":
        value = value * torch.sigmoid(value)
    if config.scale_queries:
        query = query / query.shape[-1] ** 0.5
    if config.use_beta:
        beta = torch.sigmoid(hidden_states @ attention.beta_proj.weight.T)  # (B, T, H)
    else:
        beta = torch.ones(batch_size, length, heads)
    memory = torch.zeros(batch_size, heads, query.shape[-1], value_dim)
    normaliser = torch.zeros(batch_size, heads, query.shape[-1])
    outputs = []
    for t in range(length):
        k, v, q, b = key[:, t], value[:, t], query[:, t], beta[:, t, :, None]
        if config.update_rule == "delta":
            retrieved = torch.einsum("bhkv,bhk->bhv", memory, k)
            memory = memory + torch.einsum("bhk,bhv->bhkv", k, b * (v - retrieved))
            normaliser = normaliser + k  # the delta rule's z_t sums the keys without β
        else:
            memory = memory + torch.einsum("bhk,bhv->bhkv", b * k, v)
            normaliser = normaliser + b * k
        out = torch.einsum("bhkv,bhk->bhv", memory, q)
        if config.attention_normalizer:
            out = out / ((normaliser * q).sum(-1, keepdim=True) + config.attention_normalizer_eps)
        outputs.append(out)
    output = torch.stack(outputs, 1)  # (B, T, H, d_v)
    if config.output_norm:
        output = output / torch.sqrt((output**2).mean(-1, keepdim=True) + config.rms_norm_eps)
        output = output * attention.output_norm.weight
    if config.output_gate:
        gate = (hidden_states @ attention.g_proj.weight.T).view(batch_size, length, heads, value_dim)
        output = output * gate * torch.sigmoid(gate)
    if config.scale_output:
        output = output / config.key_head_dim**0.5
    bias = 0 if attention.o_proj.bias is None else attention.o_proj.bias
    return output.reshape(batch_size, length, -1) @ attention.o_proj.weight.T + bias


def _randomised(model):
    """Norm weights start at 1 and would hide a wrong weight; give every parameter a random value."""
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    return model


def test_attention_matches_the_token_by_token_reference(deltanet_config):
    model = _randomised(DeltaNetModel(deltanet_config).eval())
    attention = model.layers[0].attention
    hidden_states = torch.randn(2, 19, deltanet_config.hidden_size)
    output, *_ = attention(hidden_states)
    expected = reference_attention(attention, hidden_states)
    torch.testing.assert_close(output, expected, atol=2e-5, rtol=1e-4)


def test_projection_hooks_and_adapters_are_honoured(preset_config):
    # Plain projections run as one product of their stacked weights; a hook (or an adapter replacing the module)
    # must still see the projections run and change what they give.
    model = _randomised(DeltaNetModel(preset_config).eval())
    attention = model.layers[0].attention
    hidden_states = torch.randn(2, 9, preset_config.hidden_size)
    output, *_ = attention(hidden_states)
    expected = reference_attention(attention, hidden_states)
    torch.testing.assert_close(output, expected, atol=2e-5, rtol=1e-4)
    calls = []
    handle = attention.v_proj.register_forward_hook(lambda module, inputs, result: calls.append(1) or result * 2)
    try:
        hooked, *_ = attention(hidden_states)
    finally:
        handle.remove()
    assert calls == [1] and not torch.allclose(hooked, output)
    with torch.no_grad():
        attention.v_proj.weight.mul_(2)
    doubled = attention(hidden_states)[0]
    torch.testing.assert_close(hooked, doubled, atol=2e-5, rtol=1e-4)
    # A projection given a bias (a plain nn.Linear, no hook) runs as a module too: the bias is not dropped.
    biased = torch.nn.Linear(preset_config.hidden_size, attention.v_proj.out_features)
    with torch.no_grad():
        biased.weight.copy_(attention.v_proj.weight)
        biased.bias.normal_()
    attention.v_proj = biased
    with_bias = attention(hidden_states)[0]
    assert not torch.allclose(with_bias, doubled)
    with torch.no_grad():
        biased.bias.zero_()
    torch.testing.assert_close(attention(hidden_states)[0], doubled, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_short_convolution_of_one_token_is_the_convolution_of_its_window(dtype):
    """Decoding: one token's output is its window (the tail, then the token) times the kernel, summed over time,
    without a conv1d call; the tail moves on by the token. The same numbers as the convolution of the window."""
    convolution = DeltaNetShortConvolution(12, 4).to(dtype)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        convolution.weight.copy_(torch.randn(12, 1, 4, generator=generator))
        inputs, tail = torch.randn(3, 1, 12, generator=generator), torch.randn(3, 3, 12, generator=generator)
        output, new_tail = convolution(inputs.to(dtype), tail.to(dtype))
        window = torch.cat([tail, inputs], dim=1).to(dtype)
        expected = F.conv1d(window.transpose(1, 2), convolution.weight, groups=12).transpose(1, 2)
    torch.testing.assert_close(output, expected, rtol=0, atol=1e-12 if dtype == torch.float64 else 1e-5)
    assert torch.equal(new_tail, window[:, 1:])


def test_full_forward_equals_prefill_then_token_by_token_decoding(deltanet_config):
    model = _randomised(DeltaNetForCausalLM(deltanet_config).eval())
    input_ids = torch.randint(0, 256, (2, 23))
    with torch.no_grad():
        full = model(input_ids).logits
        prefill = model(input_ids[:, :10], use_cache=True)
        cache, pieces = prefill.cache, [prefill.logits]
        for t in range(10, 23):
            step = model(input_ids[:, t : t + 1], cache=cache, use_cache=True)
            cache = step.cache
            pieces.append(step.logits)
    assert isinstance(cache, DeltaNetCache) and cache.get_seq_length() == 23
    torch.testing.assert_close(torch.cat(pieces, 1), full, atol=1e-4, rtol=0)


def test_a_decoding_step_equals_the_forward_of_one_token(deltanet_config, monkeypatch):
    """`DeltaNetModel.step` (a decoding step without the forward's work for padding, packing and recording; the rule's
    one-token step called directly) gives what the forward gives for the same token: logits, hidden states and every
    state the cache keeps, with and without an attention mask and after a left-padded prompt, in float64."""
    from memlm.modeling import modeling_deltanet

    model = _randomised(DeltaNetForCausalLM(deltanet_config).eval()).double()
    input_ids = torch.randint(0, 256, (2, 16))
    calls = {"step": 0, "rule_step": 0}
    model_step = DeltaNetModel.step
    rule_name = "delta_rule_step" if deltanet_config.update_rule == "delta" else "sum_rule_step"
    rule_step = getattr(modeling_deltanet, rule_name)

    def counted_step(*arguments, **options):
        calls["step"] += 1
        return model_step(*arguments, **options)

    def counted_rule_step(*arguments, **options):
        calls["rule_step"] += 1
        return rule_step(*arguments, **options)

    monkeypatch.setattr(DeltaNetModel, "step", counted_step)
    monkeypatch.setattr(modeling_deltanet, rule_name, counted_rule_step)

    def decode(mask=False, padded=False):
        prompt_mask = torch.ones(2, 6, dtype=torch.long)
        if padded:
            prompt_mask[0, :2] = 0
        outputs = []
        with torch.no_grad():
            cache = model(input_ids[:, :6], attention_mask=prompt_mask, use_cache=True).cache
            for t in range(6, input_ids.shape[1]):
                full_mask = torch.cat([prompt_mask, torch.ones(2, t - 5, dtype=torch.long)], dim=1)
                given = {"attention_mask": full_mask} if mask or padded else {}
                output = model(
                    input_ids[:, t : t + 1], cache=cache, use_cache=True, output_hidden_states=True, **given
                )
                cache = output.cache
                states = [
                    [
                        None if (tensor := getattr(layer, name)) is None else tensor.clone()
                        for name in layer.tensor_names
                    ]
                    for layer in cache.layers
                ]
                outputs.append((output, states))
        return outputs

    stepped, stepped_with_mask, stepped_padded = decode(), decode(mask=True), decode(padded=True)
    assert calls["step"] == 3 * 10 and calls["rule_step"] == 3 * 10 * deltanet_config.num_hidden_layers
    monkeypatch.setattr(DeltaNetModel, "steps_one_token", lambda *arguments: False)
    forward, forward_padded = decode(), decode(padded=True)
    assert calls["step"] == 3 * 10
    for run, expected_run in ((stepped, forward), (stepped_with_mask, forward), (stepped_padded, forward_padded)):
        for (output, states), (expected, expected_states) in zip(run, expected_run):
            torch.testing.assert_close(output.logits, expected.logits, atol=1e-12, rtol=0)
            for value, expected_value in zip(output.hidden_states, expected.hidden_states, strict=True):
                torch.testing.assert_close(value, expected_value, atol=1e-12, rtol=0)
            for layer, expected_layer in zip(states, expected_states, strict=True):
                for tensor, expected_tensor in zip(layer, expected_layer, strict=True):
                    assert (tensor is None) == (expected_tensor is None)
                    if tensor is not None:
                        torch.testing.assert_close(tensor, expected_tensor, atol=1e-12, rtol=0)


def test_hooks_see_every_module_run_in_decoding_steps():
    """A decoding step runs a decoder layer's body and its attention's forward without their module calls only where
    nothing would see them: a hook on a layer or on an attention sees it run at every step (and on a projection,
    which the step calls through `linear`), and the logits stay those of the unhooked model."""
    model = _randomised(DeltaNetForCausalLM(DELTANET_VARIANTS["fla"]()).eval())
    input_ids = torch.randint(0, 256, (2, 12))

    def decode():
        with torch.no_grad():
            cache = model(input_ids[:, :6], use_cache=True).cache
            logits = []
            for t in range(6, 12):
                output = model(input_ids[:, t : t + 1], cache=cache, use_cache=True)
                cache = output.cache
                logits.append(output.logits)
        return torch.cat(logits, 1)

    plain = decode()
    layers = model.model.layers
    modules = [layers[0], layers[1].attention, layers[0].attention.q_proj, layers[1].mlp]
    calls = {index: 0 for index in range(len(modules))}
    handles = [
        module.register_forward_hook(lambda *_, index=index: calls.__setitem__(index, calls[index] + 1))
        for index, module in enumerate(modules)
    ]
    hooked = decode()
    for handle in handles:
        handle.remove()
    assert all(count == 1 + 6 for count in calls.values()), calls  # the prefill, the six steps
    torch.testing.assert_close(hooked, plain, atol=0, rtol=0)


def test_prefill_in_several_chunks_equals_one_forward(preset_config):
    model = _randomised(DeltaNetForCausalLM(preset_config).eval())
    input_ids = torch.randint(0, 256, (1, 30))
    with torch.no_grad():
        full = model(input_ids).logits
        first = model(input_ids[:, :13], use_cache=True)
        second = model(input_ids[:, 13:], cache=first.cache, use_cache=True)
    torch.testing.assert_close(torch.cat([first.logits, second.logits], 1), full, atol=1e-4, rtol=0)


def test_left_padding_equals_each_row_alone(deltanet_config):
    model = _randomised(DeltaNetForCausalLM(deltanet_config).eval())
    pad = deltanet_config.pad_token_id
    rows = [torch.randint(0, 256, (n,)) for n in (11, 6, 3)]
    width = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), width), pad)
    attention_mask = torch.zeros(len(rows), width, dtype=torch.long)
    for index, row in enumerate(rows):
        input_ids[index, width - len(row) :] = row
        attention_mask[index, width - len(row) :] = 1
    with torch.no_grad():
        batch = model(input_ids, attention_mask=attention_mask, use_cache=True)
        next_tokens = torch.randint(0, 256, (len(rows), 4))
        mask = torch.cat([attention_mask, torch.ones(len(rows), 4, dtype=torch.long)], 1)
        continued = model(next_tokens, attention_mask=mask, cache=batch.cache, use_cache=True)
        for index, row in enumerate(rows):
            alone = model(row[None], use_cache=True)
            torch.testing.assert_close(batch.logits[index, width - len(row) :], alone.logits[0], atol=1e-4, rtol=0)
            alone_next = model(next_tokens[index : index + 1], cache=alone.cache, use_cache=True)
            torch.testing.assert_close(continued.logits[index], alone_next.logits[0], atol=1e-4, rtol=0)


def test_padding_writes_nothing_into_the_memory():
    config = DELTANET_VARIANTS["fla"]()
    model = _randomised(DeltaNetForCausalLM(config).eval())
    row = torch.randint(0, 256, (1, 5))
    padded = torch.cat([torch.full((1, 7), config.pad_token_id), row], 1)
    mask = torch.cat([torch.zeros(1, 7, dtype=torch.long), torch.ones(1, 5, dtype=torch.long)], 1)
    with torch.no_grad():
        alone = model(row, use_cache=True).cache
        with_padding = model(padded, attention_mask=mask, use_cache=True).cache
        only_padding = model(padded[:, :7], attention_mask=mask[:, :7], use_cache=True).cache
    for layer, padded_layer, empty_layer in zip(alone.layers, with_padding.layers, only_padding.layers):
        torch.testing.assert_close(padded_layer.fast_weights, layer.fast_weights, atol=1e-5, rtol=0)
        torch.testing.assert_close(padded_layer.convolution_tail, layer.convolution_tail, atol=1e-6, rtol=0)
        assert torch.count_nonzero(empty_layer.fast_weights) == 0
        assert torch.count_nonzero(empty_layer.convolution_tail) == 0


def test_gradient_checkpointing_gives_the_same_gradients(preset_config):
    model = _randomised(DeltaNetForCausalLM(preset_config))
    input_ids = torch.randint(0, 256, (2, 17))

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


def test_gradient_checkpointing_keeps_a_carried_memory():
    config = DELTANET_VARIANTS["fla"]()
    model = _randomised(DeltaNetForCausalLM(config)).train()
    first, second = torch.randint(0, 256, (2, 2, 9))
    with torch.no_grad():
        cache = model(first, use_cache=True).cache
    reference = model(second, cache=copy.deepcopy(cache), use_cache=True).logits
    activation_checkpointing_enable(model)
    checkpointed = model(second, cache=copy.deepcopy(cache), use_cache=True).logits
    torch.testing.assert_close(checkpointed, reference)
    checkpointed.sum().backward()


def test_every_parameter_gets_a_gradient(deltanet_config):
    model = DeltaNetForCausalLM(deltanet_config)
    input_ids = torch.randint(0, 256, (2, 12))
    model(input_ids, labels=input_ids).loss.backward()
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None and torch.count_nonzero(parameter.grad) > 0, name


def test_favor_features_are_redrawn_in_training_fixed_in_eval_and_saved(tmp_path):
    config = DELTANET_VARIANTS["favor_conv_gate"]()
    model = DeltaNetForCausalLM(config)
    projection = model.model.layers[0].attention.feature_map.projection
    input_ids = torch.randint(0, 256, (1, 8))
    model.train()
    before = projection.clone()
    model(input_ids)
    after_first = projection.clone()
    model(input_ids)
    assert not torch.equal(before, after_first) and not torch.equal(after_first, projection)
    model.eval()
    frozen = projection.clone()
    first, second = model(input_ids).logits, model(input_ids).logits
    assert torch.equal(first, second) and torch.equal(frozen, projection)
    model.save_pretrained(tmp_path)
    loaded = DeltaNetForCausalLM.from_pretrained(tmp_path).eval()
    torch.testing.assert_close(loaded.model.layers[0].attention.feature_map.projection, projection)
    torch.testing.assert_close(loaded(input_ids).logits, first)


def test_hidden_dropout_is_active_only_in_training():
    model = DeltaNetForCausalLM(DELTANET_VARIANTS["paper"](hidden_dropout=0.5))
    input_ids = torch.randint(0, 256, (1, 10))
    model.train()
    assert not torch.equal(model(input_ids).logits, model(input_ids).logits)
    model.eval()
    assert torch.equal(model(input_ids).logits, model(input_ids).logits)


def test_chunk_size_does_not_change_the_result():
    input_ids = torch.randint(0, 256, (2, 40))
    logits = []
    for chunk_size in (4, 16, 64):
        torch.manual_seed(1)
        model = DeltaNetForCausalLM(DELTANET_VARIANTS["paper"](chunk_size=chunk_size)).eval()
        logits.append(model(input_ids).logits)
    torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=0)
    torch.testing.assert_close(logits[0], logits[2], atol=1e-5, rtol=0)


def test_inputs_embeds_hidden_states_tuples_and_logits_to_keep(preset_config):
    model = DeltaNetForCausalLM(preset_config).eval()
    input_ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        by_ids = model(input_ids, output_hidden_states=True)
        by_embeds = model(inputs_embeds=model.get_input_embeddings()(input_ids))
        as_tuple = model(input_ids, return_dict=False)
        last_two = model(input_ids, logits_to_keep=2).logits
        picked = model(input_ids, logits_to_keep=torch.tensor([0, 4])).logits
    torch.testing.assert_close(by_embeds.logits, by_ids.logits)
    assert len(by_ids.hidden_states) == preset_config.num_hidden_layers + 1
    torch.testing.assert_close(by_ids.hidden_states[0], model.get_input_embeddings()(input_ids))
    assert isinstance(as_tuple, tuple)
    torch.testing.assert_close(as_tuple[0], by_ids.logits)
    torch.testing.assert_close(last_two, by_ids.logits[:, -2:])
    torch.testing.assert_close(picked, by_ids.logits[:, [0, 4]])


def test_tied_and_untied_embeddings(tmp_path):
    tied = DeltaNetForCausalLM(DELTANET_VARIANTS["paper"](tie_word_embeddings=True))
    assert tied.lm_head.weight.data_ptr() == tied.model.embed_tokens.weight.data_ptr()
    untied = DeltaNetForCausalLM(DELTANET_VARIANTS["paper"]())
    assert untied.lm_head.weight.data_ptr() != untied.model.embed_tokens.weight.data_ptr()
    tied.save_pretrained(tmp_path)
    loaded = DeltaNetForCausalLM.from_pretrained(tmp_path)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_is_close_to_float32(preset_config, dtype):
    model = _randomised(DeltaNetForCausalLM(preset_config).eval())
    input_ids = torch.randint(0, 256, (2, 21))
    with torch.no_grad():
        reference = model(input_ids).logits
        half = copy.deepcopy(model).to(dtype)
        output = half(input_ids, use_cache=True)
    assert output.logits.dtype == dtype
    assert all(layer.fast_weights.dtype == torch.float32 for layer in output.cache.layers)
    error = (output.logits.float() - reference).norm() / reference.norm()
    assert error < 0.05


def test_initialisation_follows_initializer_range():
    model = DeltaNetForCausalLM(
        DeltaNetConfig.from_preset(
            "paper", hidden_size=256, num_attention_heads=4, vocab_size=512, initializer_range=0.05
        )
    )
    std = model.model.layers[0].attention.q_proj.weight.std().item()
    assert abs(std - 0.05) < 0.005
    assert torch.equal(model.model.norm.weight, torch.ones(256))


def test_bad_inputs_raise_clear_errors():
    config = DELTANET_VARIANTS["paper"]()
    model = DeltaNetForCausalLM(config).eval()
    input_ids = torch.randint(0, 256, (2, 5))
    with pytest.raises(TypeError, match="DeltaNetCache; got a cache of type DynamicCache"):
        model(input_ids, cache=DynamicCache())
    with pytest.raises(ValueError, match=r"attention_mask must be a 2-D padding mask of shape \(batch=2, length=5\)"):
        model(input_ids, attention_mask=torch.ones(2, 7))
    with pytest.raises(ValueError, match=r"attention_mask must be a 2-D"):
        model(input_ids, attention_mask=torch.ones(2, 1, 5, 5))
    with pytest.raises(ValueError, match=r"input_ids must lie in \[0, vocab_size=258\); got values from 0 to 258"):
        model(torch.tensor([[0, 258]]))
    with pytest.raises(ValueError, match="input_ids must lie in"):
        model(torch.tensor([[-1, 3]]))
    with pytest.raises(ValueError, match="input_ids must be integer token ids"):
        model(torch.rand(1, 3))
    with pytest.raises(ValueError, match="exactly one of input_ids or inputs_embeds"):
        model(input_ids, inputs_embeds=torch.zeros(2, 5, 32))
    with pytest.raises(ValueError, match=r"inputs_embeds must have shape \(batch, length, hidden_size=32\)"):
        model(inputs_embeds=torch.zeros(2, 5, 31))
    with pytest.raises(TypeError, match="unexpected keyword argument.*position_embeddings"):
        model(input_ids, position_embeddings=None)
    with pytest.raises(ValueError, match="does not return attention weights"):
        model(input_ids, output_attentions=True)
    cache = model(input_ids, use_cache=True).cache
    with pytest.raises(ValueError, match="holds a batch of 2 rows but the input has 3"):
        model(torch.randint(0, 256, (3, 1)), cache=cache)
    with pytest.raises(ValueError, match="crop takes minus the number of tokens to remove"):
        cache.crop(2)
    with pytest.raises(TypeError, match="DeltaNetCache is written by the model.s layers themselves"):
        cache.update(torch.zeros(1), torch.zeros(1), 0)


def test_cache_memory_does_not_grow_with_the_context():
    model = DeltaNetForCausalLM(DELTANET_VARIANTS["fla"]()).eval()
    with torch.no_grad():
        short = model(torch.randint(0, 256, (1, 8)), use_cache=True).cache
        long = model(torch.randint(0, 256, (1, 200)), use_cache=True).cache

    def size(cache):
        return sum(layer.fast_weights.numel() + layer.convolution_tail.numel() for layer in cache.layers)

    assert size(short) == size(long)
    assert long.get_seq_length() == 200


def test_loss_is_next_token_cross_entropy():
    model = DeltaNetForCausalLM(DELTANET_VARIANTS["paper"]()).eval()
    input_ids = torch.randint(0, 256, (2, 8))
    output = model(input_ids, labels=input_ids)
    expected = F.cross_entropy(output.logits[:, :-1].reshape(-1, 258), input_ids[:, 1:].reshape(-1))
    torch.testing.assert_close(output.loss, expected)


def test_dpfp1_keys_over_four_dimensions_switch_on_one_or_three_of_eight_features():
    """The sparsity benchmarks/README.md cites for DPFP-1 at d_key = 4: each feature is the product of two
    neighbouring rectified coordinates, so a key switches on exactly 1 or 3 of its 8 (about half of keys: 1)."""
    from memlm.modeling.modeling_deltanet import DeltaNetFeatureMap

    config = DeltaNetConfig.from_preset("paper", vocab_size=10, hidden_size=16, num_hidden_layers=1,
                                        num_attention_heads=1, key_head_dim=4, query_key_normalization="none")  # fmt: skip
    keys = torch.randn(100_000, 4, generator=torch.Generator().manual_seed(0))
    active = (DeltaNetFeatureMap(config)(keys) > 0).sum(-1)
    assert config.feature_dim == 8 and set(active.unique().tolist()) == {1, 3}
    assert 0.45 < (active == 1).float().mean().item() < 0.55


def test_repr_names_the_kernel_each_layer_runs(monkeypatch):
    """The model's repr says which implementation runs the rule, for the weights' device and dtype."""
    monkeypatch.delenv("MEMLM_KERNELS", raising=False)
    model = DeltaNetForCausalLM(DELTANET_VARIANTS["fla"]())
    assert "kernels=\"torch: memlm's PyTorch chunkwise implementation" in repr(model)
    monkeypatch.setenv("MEMLM_KERNELS", "reference")
    assert 'kernels="reference: ' in repr(model)
    assert 'kernels="reference: ' in repr(DeltaNetForCausalLM(DELTANET_VARIANTS["identity_sum_rule"]()))
    monkeypatch.setenv("MEMLM_KERNELS", "no-such-backend")
    assert "kernels=<environment variable MEMLM_KERNELS='no-such-backend' is not a known kernel backend" in repr(model)


def test_cache_holds_only_the_convolution_tail_not_the_whole_prefill():
    """After a prefill the cached convolution tail owns its (kernel - 1) × channels values, not the storage of the
    whole prompt's projection it was sliced from (which made the cache grow with the prompt)."""
    model = DeltaNetForCausalLM(DELTANET_VARIANTS["favor_conv_gate"]()).eval()
    with torch.no_grad():
        cache = model(torch.randint(0, 256, (2, 64)), use_cache=True).cache
    for layer in cache.layers:
        tail = layer.convolution_tail
        assert tail.shape[:2] == (2, model.config.convolution_size - 1)
        assert tail.untyped_storage().nbytes() == tail.numel() * tail.element_size()


def test_few_tokens_run_the_three_projections_and_many_run_one_product_over_their_weights(monkeypatch):
    """Decoding (fewer than FUSED_PROJECTION_TOKENS tokens) calls q/k/v one by one instead of copying their weights
    side by side every token; a longer input runs one product over the weights side by side, same numbers."""
    from memlm.compat import cache_keyword, output_cache
    from memlm.modeling.modeling_deltanet import FUSED_PROJECTION_TOKENS

    torch.manual_seed(0)
    config = DeltaNetConfig.from_preset("paper", vocab_size=32, hidden_size=32, num_hidden_layers=1,
                                        num_attention_heads=2)  # fmt: skip
    model = DeltaNetForCausalLM(config).eval()
    projection = model.model.layers[0].attention.q_proj
    calls = []
    linear = F.linear

    def counted(states, weight, bias=None):  # a product with q's own weight (the module's, or the step's)
        if weight is projection.weight:
            calls.append(states.shape[:2])
        return linear(states, weight, bias)

    monkeypatch.setattr(F, "linear", counted)
    tokens = torch.randint(0, 32, (1, FUSED_PROJECTION_TOKENS))
    with torch.no_grad():
        whole = model(tokens).logits
        assert calls == []  # one product over the stacked weights
        cache = output_cache(model(tokens[:, :-1], use_cache=True))
        calls.clear()
        last = model(tokens[:, -1:], use_cache=True, **{cache_keyword(model): cache}).logits
    assert calls == [(1, 1)]  # the single token's product with q's weight alone
    torch.testing.assert_close(last[:, -1], whole[:, -1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("field", ["embedding_dropout", "activation_dropout", "output_dropout", "hidden_dropout"])
def test_each_dropout_acts_in_training_only(field):
    """Each dropout of the block layout changes a training forward and leaves evaluation as without it."""
    input_ids = torch.randint(0, 256, (2, 12))
    config = DELTANET_VARIANTS["official_block"]()
    torch.manual_seed(0)
    plain = _randomised(DeltaNetForCausalLM(config))
    torch.manual_seed(0)
    dropped = _randomised(DeltaNetForCausalLM(DELTANET_VARIANTS["official_block"](**{field: 0.5})))
    with torch.no_grad():
        torch.testing.assert_close(dropped.eval()(input_ids).logits, plain.eval()(input_ids).logits)
        assert not torch.allclose(dropped.train()(input_ids).logits, plain.train()(input_ids).logits, atol=1e-4)


def test_sinusoidal_positions_count_down_within_each_call():
    """Transformer-XL's encoding as the official code applies it: the call's last token at position 0."""
    config = DELTANET_VARIANTS["paper"](
        position_encoding="sinusoidal", hidden_size=8, key_head_dim=4, value_head_dim=4
    )
    model = DeltaNetModel(config)
    table = model.sinusoidal_positions(3, torch.zeros((), dtype=torch.float64))
    frequencies = 1 / 10000 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    for row, position in enumerate((2.0, 1.0, 0.0)):
        expected = torch.cat([torch.sin(position * frequencies), torch.cos(position * frequencies)])
        torch.testing.assert_close(table[row], expected)
    # The embeddings of a call get them added: only the last token of a call sees position 0.
    hidden = model(torch.tensor([[5, 6, 7]]), output_hidden_states=True).hidden_states[0]
    torch.testing.assert_close(hidden[0], model.embed_tokens.weight[[5, 6, 7]] + table.float())
    # The last table is kept (every decoding step asks for one position): the same tensor again for the same length,
    # dtype, device and inference mode, a new one otherwise, with the same numbers as made afresh.
    step = model.sinusoidal_positions(1, hidden)
    assert model.sinusoidal_positions(1, hidden) is step
    torch.testing.assert_close(step, torch.cat([torch.zeros(4), torch.ones(4)])[None], atol=0, rtol=0)
    for length, like in ((3, hidden), (1, hidden.double())):
        assert model.sinusoidal_positions(length, like) is not step
        assert model.sinusoidal_positions(length, like).dtype == like.dtype
    with torch.inference_mode():
        assert model.sinusoidal_positions(1, hidden) is not step
    torch.testing.assert_close(model.sinusoidal_positions(3, hidden), table.float(), atol=0, rtol=0)
