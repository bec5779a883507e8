"""What every memlm model owes a 🤗 user (SPEC §4), checked the same way for all three."""

import copy

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM

import memlm
from tests.conftest import DELTANET_VARIANTS
from tests.modeling.padding import LAYOUTS, padding_mask

TINY = {"vocab_size": 258, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 2, "pad_token_id": 257}  # fmt: skip
CONFIGS = {
    "deltanet": lambda **extra: DELTANET_VARIANTS["fla"](**extra),
    # The official code's block (LayerNorm, post-norm, plain biased MLP, biased and adaptive-softmax output).
    "deltanet_official": lambda **extra: DELTANET_VARIANTS["official_block"](**extra),
    "expire_span": lambda **extra: memlm.ExpireSpanConfig(
        **{**TINY, "max_span": 8, "ramp": 2, "block_size": 4, **extra}
    ),  # fmt: skip
    "feedback": lambda **extra: memlm.FeedbackTransformerConfig(**{**TINY, "memory_span": 6, **extra}),
}
CLASSES = {
    "deltanet": (memlm.DeltaNetModel, memlm.DeltaNetForCausalLM),
    "deltanet_official": (memlm.DeltaNetModel, memlm.DeltaNetForCausalLM),
    "expire_span": (memlm.ExpireSpanModel, memlm.ExpireSpanForCausalLM),
    "feedback": (memlm.FeedbackTransformerModel, memlm.FeedbackTransformerForCausalLM),
}


def _model(name, **extra):
    model = CLASSES[name][1](CONFIGS[name](**extra)).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    return model


@pytest.mark.parametrize("name", list(CONFIGS))
def test_auto_classes(name):
    config = CONFIGS[name]()
    assert type(AutoModel.from_config(config)) is CLASSES[name][0]
    assert type(AutoModelForCausalLM.from_config(config)) is CLASSES[name][1]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_inputs_embeds_tuples_hidden_states_and_logits_to_keep(name):
    model = _model(name)
    input_ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        by_ids = model(input_ids, output_hidden_states=True)
        by_embeds = model(inputs_embeds=model.get_input_embeddings()(input_ids))
        as_tuple = model(input_ids, return_dict=False)
        last_two = model(input_ids, logits_to_keep=2).logits
    torch.testing.assert_close(by_embeds.logits, by_ids.logits)
    assert len(by_ids.hidden_states) == model.config.num_hidden_layers + 1
    assert isinstance(as_tuple, tuple)
    torch.testing.assert_close(as_tuple[0], by_ids.logits)
    torch.testing.assert_close(last_two, by_ids.logits[:, -2:])


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_is_close_to_float32(name, dtype):
    model = _model(name)
    input_ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        reference = model(input_ids).logits
        half = copy.deepcopy(model).to(dtype)
        logits = half(input_ids).logits
        prefill = half(input_ids[:, :6], use_cache=True)
        step = half(input_ids[:, 6:7], cache=prefill.cache)
    assert logits.dtype == dtype and step.logits.dtype == dtype
    assert (logits.float() - reference).norm() / reference.norm() < 0.05
    assert torch.isfinite(step.logits).all()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_tied_embeddings_survive_saving(tmp_path, name):
    model = CLASSES[name][1](CONFIGS[name](tie_word_embeddings=True))
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.lm_head.weight.data_ptr() == loaded.get_input_embeddings().weight.data_ptr()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_resize_token_embeddings(name):
    model = _model(name)
    if getattr(model.config, "adaptive_softmax_cutoffs", None):  # its clusters are fixed ranges of the vocabulary
        with pytest.raises(ValueError, match="cannot be resized"):
            model.resize_token_embeddings(300)
        return
    model.resize_token_embeddings(300)
    assert model.config.vocab_size == 300 and model.lm_head.weight.shape[0] == 300
    assert model(torch.tensor([[299, 5, 7]])).logits.shape == (1, 3, 300)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_meta_device_initialisation(name):
    with torch.device("meta"):
        model = CLASSES[name][1](CONFIGS[name]())
    assert all(parameter.is_meta for parameter in model.parameters())
    model.to_empty(device="cpu")
    model.init_weights()
    assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_dtype_argument_of_from_pretrained(tmp_path, name):
    _model(name).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    assert model(torch.tensor([[1, 2, 3]])).logits.dtype == torch.bfloat16


@pytest.mark.parametrize("name", list(CONFIGS))
def test_cache_reorder_repeat_and_select(name):
    """Beam search (reorder), num_return_sequences (repeat) and batch selection continue each row as if it had been
    run alone: compare the next token's logits with a full forward over the reordered prompts."""
    model = _model(name)
    prompt = torch.randint(0, 256, (3, 10))
    follow = torch.randint(0, 256, (3, 1))
    follow6 = torch.randint(0, 256, (6, 1))
    cases = [
        (lambda cache: cache.reorder_cache(torch.tensor([2, 0, 0])), prompt[[2, 0, 0]], follow),
        (lambda cache: cache.batch_repeat_interleave(2), prompt.repeat_interleave(2, 0), follow6),
        (lambda cache: cache.batch_select_indices(torch.tensor([1])), prompt[1:2], follow[1:2]),
    ]
    with torch.no_grad():
        cache = model(prompt, use_cache=True).cache
        for change, prompts, following in cases:
            changed = copy.deepcopy(cache)
            change(changed)
            expected = model(torch.cat([prompts, following], 1)).logits[:, -1:]
            torch.testing.assert_close(model(following, cache=changed).logits, expected, atol=1e-4, rtol=0)
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.next_positions is None


@pytest.mark.parametrize(
    ("name", "option", "value"),
    [
        ("expire_span", "span_pre_divisor", 4.0),
        ("expire_span", "rope_theta", 100.0),
        ("expire_span", "ramp", 5),
        ("expire_span", "max_span", 5),
        ("expire_span", "initial_span_fraction", 0.6),
        ("feedback", "rope_theta", 100.0),
        ("feedback", "memory_span", 2),
        ("feedback", "rms_norm_eps", 0.5),
        ("deltanet", "rms_norm_eps", 0.5),
        ("deltanet", "convolution_size", 2),
        ("deltanet", "position_encoding", "sinusoidal"),
        ("deltanet", "scale_output", True),
        ("deltanet", "norm_type", "layernorm"),
        ("deltanet", "norm_position", "post"),
        ("deltanet", "final_norm", False),
        ("deltanet", "mlp_type", "plain"),
        ("deltanet", "mlp_bias", True),
        ("deltanet", "attention_output_bias", True),
        ("deltanet", "lm_head_bias", True),
        ("deltanet", "embedding_scale", 3.0),
        ("deltanet_official", "layer_norm_eps", 0.5),
        ("deltanet_official", "attention_normalizer_eps", 0.5),
        ("deltanet_official", "attention_normalizer", False),
        ("deltanet_official", "adaptive_softmax_cutoffs", [100]),
    ],
)
def test_every_option_changes_the_output(name, option, value):
    """Same seed, same weights where shapes allow: changing one option must change the logits."""
    input_ids = torch.randint(0, 256, (1, 24))
    outputs = []
    for extra in ({}, {option: value}):
        torch.manual_seed(0)
        model = _model(name, **extra)
        if name == "expire_span":
            with torch.no_grad():
                for layer in model.model.layers:
                    layer.attention.span_predictor.weight.normal_(0, 0.5)
        with torch.no_grad():
            outputs.append(model(input_ids).logits)
    assert not torch.allclose(outputs[0], outputs[1], atol=1e-5)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_shift_labels_give_the_loss_of_labels(name):
    """Pre-shifted labels (context-parallel Trainer runs, some collators) are taken as 🤗's loss takes them: the loss
    from `shift_labels` alone, or with `labels` beside them, equals the loss from `labels`."""
    model = _model(name)
    input_ids = torch.randint(0, 256, (2, 9))
    labels = input_ids.clone()
    labels[0, :3] = -100
    shift_labels = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    with torch.no_grad():
        expected = model(input_ids, labels=labels).loss
        alone = model(input_ids, shift_labels=shift_labels).loss
        both = model(input_ids, labels=labels, shift_labels=shift_labels).loss
        counted = model(input_ids, shift_labels=shift_labels, num_items_in_batch=torch.tensor(5)).loss
        unlabelled = model(input_ids).loss
    torch.testing.assert_close(alone, expected)
    torch.testing.assert_close(both, expected)
    assert unlabelled is None
    # num_items_in_batch still divides the summed loss: 14 targets in the batch, their mean times 14 / 5.
    torch.testing.assert_close(counted, expected * 14 / 5)


def _gradients_at_layer_outputs(model, input_ids, attention_mask=None):
    """dL/d(output of every layer) computed without `output_hidden_states`: a hook adds a zero leaf to each layer's
    MLP output (the last term of the layer's output, x + mlp(norm(x))), or post-norm to the output of the layer's last
    norm (norm(x + mlp(x))), whose gradient is the layer output's."""
    leaves, handles = [], []
    for layer in model.model.layers:
        leaf = torch.zeros(*input_ids.shape, model.config.hidden_size, dtype=torch.float64, requires_grad=True)
        offset = [0]

        def add_leaf(module, inputs, output, leaf=leaf, offset=offset):
            if output.dim() == 2:  # the Feedback Transformer: one step (B, D)
                added = output + leaf[:, offset[0]]
                offset[0] += 1
                return added
            added = output + leaf[:, offset[0] : offset[0] + output.shape[1]]  # a block (B, K, D)
            offset[0] += output.shape[1]
            return added

        leaves.append(leaf)
        post_norm = getattr(model.config, "norm_position", "pre") == "post"
        last = layer.post_attention_layernorm if post_norm else layer.mlp
        handles.append(last.register_forward_hook(add_leaf))
    model(input_ids, attention_mask=attention_mask).logits.pow(2).mean().backward()
    for handle in handles:
        handle.remove()
    return [leaf.grad for leaf in leaves]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_retained_hidden_states_get_the_gradient_of_the_loss(name):
    """🤗's retain_grad check, for every entry of output_hidden_states: after retain_grad() and a backward, the
    embeddings and every layer's output hold dL/d(that tensor), the gradient a hook at each layer's output gives."""
    model = _model(name, tie_word_embeddings=False).double()  # the table's gradient is then the embeddings' alone
    input_ids = torch.randint(0, 256, (2, 9))
    output = model(input_ids, output_hidden_states=True)
    for hidden_states in output.hidden_states:
        hidden_states.retain_grad()
    output.logits.pow(2).mean().backward()
    grads = [hidden_states.grad for hidden_states in output.hidden_states]
    assert all(grad is not None for grad in grads)
    embeddings = model.get_input_embeddings().weight.grad.clone()
    model.zero_grad()
    expected = _gradients_at_layer_outputs(model, input_ids)
    for layer_idx in range(model.config.num_hidden_layers - 1):  # the last layer's entry is the normed output
        torch.testing.assert_close(grads[layer_idx + 1], expected[layer_idx])
    # Entry 0 is the embedding output (times embedding_scale): its gradient, summed per token id, is the table's.
    table = torch.zeros_like(embeddings).index_add_(0, input_ids.flatten(), grads[0].flatten(0, 1))
    table = table * getattr(model.config, "embedding_scale", 1.0)
    torch.testing.assert_close(table, embeddings)
    assert grads[-1].abs().sum() > 0


@pytest.mark.parametrize("name", list(CONFIGS))
def test_empty_input_is_refused_clearly(name):
    """A (B, 0) input (an empty prompt) raises one clear ValueError naming the shape, from forward and generate."""
    model = _model(name)
    empty = torch.zeros(2, 0, dtype=torch.long)
    with pytest.raises(ValueError, match=r"input_ids holds no tokens \(shape \(2, 0\)\)"):
        model(empty)
    with pytest.raises(ValueError, match=r"inputs_embeds holds no tokens \(shape \(2, 0, 32\)\)"):
        model(inputs_embeds=torch.zeros(2, 0, 32))
    # generate with one row reaches forward (with more rows 🤗's own right-padding check fails first, IndexError).
    with pytest.raises(ValueError, match=r"input_ids holds no tokens \(shape \(1, 0\)\)"):
        model.generate(empty[:1], max_new_tokens=2, do_sample=False)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("layout", ["left", "right", "between"])
def test_non_finite_embeddings_at_padding_do_not_reach_real_tokens(name, layout):
    """Padding is skipped, also when its embeddings are NaN or inf: the real tokens' logits are finite and equal those
    with ordinary padding embeddings, without and with gradients (the training paths), and the gradients are finite."""
    model = _model(name)
    mask = padding_mask(layout, (9, 5, 3), 10)
    input_ids = torch.randint(0, 256, mask.shape).masked_fill(mask == 0, model.config.pad_token_id)
    clean = model.get_input_embeddings()(input_ids).detach()
    poisoned = clean.clone()
    padding = (mask == 0).nonzero()
    poisoned[padding[::2, 0], padding[::2, 1]] = float("nan")
    poisoned[padding[1::2, 0], padding[1::2, 1]] = float("inf")
    real = mask.bool()
    with torch.no_grad():
        expected = model(inputs_embeds=clean, attention_mask=mask).logits[real]
        logits = model(inputs_embeds=poisoned, attention_mask=mask).logits[real]
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(logits, expected)
    trained = model(inputs_embeds=poisoned, attention_mask=mask).logits[real]
    torch.testing.assert_close(trained, expected, atol=1e-5, rtol=1e-5)
    trained.pow(2).mean().backward()
    assert all(torch.isfinite(parameter.grad).all() for parameter in model.parameters() if parameter.grad is not None)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_generation_with_and_without_cache_agree_on_every_padding_layout(name):
    """Greedy tokens from a padded batch are the same with the cache (one token a step) and without it (the whole
    sequence every step, where 🤗 gives the tokens after a right-padded prompt positions that repeat), and, where each
    prompt ends with a real token, equal each row's tokens generated alone."""
    model = _model(name)
    pad = model.config.pad_token_id
    for layout in LAYOUTS:
        mask = padding_mask(layout, (6, 4, 2), 7)
        input_ids = torch.randint(0, 256, mask.shape).masked_fill(mask == 0, pad)
        generated = [
            model.generate(input_ids, attention_mask=mask, max_new_tokens=4, do_sample=False, use_cache=use_cache,
                           pad_token_id=pad)[:, -4:]
            for use_cache in (True, False)
        ]  # fmt: skip
        torch.testing.assert_close(generated[0], generated[1], msg=f"{layout} padding")
        for row in range(3):
            real = input_ids[row, mask[row].bool()][None]
            if real.shape[1] and mask[row, -1]:  # else generate's first token is read at padding
                alone = model.generate(real, max_new_tokens=4, do_sample=False, pad_token_id=pad)[:, -4:]
                torch.testing.assert_close(generated[0][row : row + 1], alone, msg=f"{layout} padding, row {row}")


@pytest.mark.parametrize("name", ["expire_span", "feedback"])
def test_packed_documents_are_refused_whatever_marks_them(name):
    """Expire-Span and the Feedback Transformer cannot keep packed documents apart: position_ids restarting at 0,
    seq_idx and cu_seq_lens are each refused; positions that only repeat (🤗 generate after right padding) are not."""
    model = _model(name)
    input_ids = torch.randint(0, 256, (1, 7))
    with torch.no_grad():
        for marks in (
            {"position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3]])},
            {"seq_idx": torch.tensor([[0, 0, 0, 1, 1, 1, 1]])},
            {"cu_seq_lens_q": torch.tensor([0, 3, 7], dtype=torch.int32)},
        ):
            with pytest.raises(ValueError, match="cannot keep packed documents apart"):
                model(input_ids, **marks)
        assert torch.isfinite(model(input_ids, position_ids=torch.tensor([[0, 1, 2, 1, 2, 3, 4]])).logits).all()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_non_finite_input_leaves_every_earlier_position_as_it_was(name):
    """Causality with a NaN or inf at a real position t (issue 33): every logit before t is finite and equal to the
    logits without it, as in 🤗 Llama; the chunkwise products must not carry it backwards (0 · NaN = NaN)."""
    model = _model(name)
    input_ids = torch.randint(0, 256, (2, 19))
    clean = model.get_input_embeddings()(input_ids).detach()
    with torch.no_grad():
        expected = model(inputs_embeds=clean).logits
        for position, value in ((13, float("nan")), (5, float("inf"))):
            poisoned = clean.clone()
            poisoned[1, position, 3] = value
            logits = model(inputs_embeds=poisoned).logits
            assert torch.isfinite(logits[1, :position]).all(), (position, value)
            torch.testing.assert_close(logits[1, :position], expected[1, :position])
            torch.testing.assert_close(logits[0], expected[0])  # the other row never sees it


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_non_finite_input_stays_in_place_with_one_check_per_forward(name, monkeypatch):
    """On a GPU the operations do not check their output at every call (a read-back per layer would stall the
    queue): the forward reads one number of its output and, when it is not finite, runs again from the memory and the
    random state it was given with every call checked (issue 33). That path, run here on CPU tensors with the per-call
    checks off, gives the per-call-checked logits and memory: without a cache, continuing one, in training with
    dropout, and in a cache recording for a rollback (which then goes back to before the NaN). A finite forward runs its layers once and reads back one value more, with 3 layers as with 1."""
    from memlm import kernels
    from memlm.compat import output_cache
    from tests.kernels.test_delta_rule import DeviceReads

    model = _model(name, hidden_dropout=0.2)
    prefix, follow = torch.randint(0, 256, (2, 6)), torch.randint(0, 256, (2, 3))
    clean = model.get_input_embeddings()(torch.randint(0, 256, (2, 19))).detach()
    poisoned = clean.clone()
    poisoned[1, 13, 3] = float("nan")
    layer_calls = []
    model.model.layers[0].register_forward_hook(lambda *_: layer_calls.append(1))

    def run(embeddings, training=False, continued=True, recording=False):
        model.train(training)
        torch.manual_seed(0)
        with torch.no_grad():
            cache = output_cache(model(prefix, use_cache=True)) if continued else None
            if recording:
                cache.activate_past_recording()
                model(follow, cache=cache)  # a recorded forward before, which the rerun must keep
            layer_calls.clear()
            logits = model(inputs_embeds=embeddings, cache=cache, use_cache=continued).logits
            calls = len(layer_calls)
            if recording:  # back to before the NaN (speculative decoding's rollback), into the first recorded forward
                cache.crop(-embeddings.shape[1] - 1)
                cache.stop_past_recording()
            after = model(follow, cache=cache).logits if continued else None
        return logits, after, calls

    cases = {"continued": {}, "fresh": {"continued": False}, "training": {"training": True, "continued": False},
             "recording": {"recording": True}}  # fmt: skip
    expected = {case: run(poisoned, **options) for case, options in cases.items()}  # checked at every call (CPU)
    monkeypatch.setattr(kernels, "DEVICES_CHECKED_AT_EVERY_CALL", set())
    for case, options in cases.items():
        logits, after, calls = run(poisoned, **options)
        assert torch.isfinite(logits[1, :13]).all() and torch.isfinite(logits[0]).all(), case
        torch.testing.assert_close(logits, expected[case][0], equal_nan=True, rtol=0, atol=0)
        if after is not None:
            torch.testing.assert_close(after, expected[case][1], equal_nan=True, rtol=0, atol=0)
            assert torch.isfinite(after[0]).all() and torch.isfinite(after[1]).all() == (case == "recording"), case
        # A finite forward runs once; one with a NaN twice, in the families that mix positions in one product (the
        # Feedback Transformer's steps never do). Expire-Span runs a layer once per block.
        once = run(clean, **options)[2]
        assert once == expected[case][2] and calls == (1 if name == "feedback" else 2) * once, (case, calls, once)

    added = []  # the reads the once-per-forward check adds to the forward's own (Expire-Span reads widths per layer)
    for layers in (1, 3):
        deeper = _model(name, num_hidden_layers=layers)
        reads = []
        for checked_on_cpu in ({"cpu"}, set()):
            monkeypatch.setattr(kernels, "DEVICES_CHECKED_AT_EVERY_CALL", checked_on_cpu)
            with torch.no_grad(), DeviceReads() as counted:  # the CPU's per-call checks read without a dispatch
                deeper(inputs_embeds=clean)
            reads.append(counted.count)
        added.append(reads[1] - reads[0])
    assert added == ([0, 0] if name == "feedback" else [1, 1]), added
