"""generate() and pipeline() with DeltaNet: the cache path gives what recomputing from scratch gives."""

import copy

import pytest
import torch
from transformers import pipeline

from memlm import DeltaNetCache, DeltaNetForCausalLM
from memlm.compat import output_cache
from tests.conftest import DELTANET_VARIANTS

# 🤗-facing: also run under the newest and the oldest 🤗 releases allowed (`make test-releases`).
pytestmark = pytest.mark.huggingface


def _model(name="fla", **extra):
    model = DeltaNetForCausalLM(DELTANET_VARIANTS[name](**extra)).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.3)  # sharper distributions: greedy paths differ
    return model


@pytest.mark.parametrize("name", ["paper", "fla", "sum_rule_normalised"])
def test_greedy_equals_a_loop_of_full_forwards(name):
    model = _model(name)
    prompt = torch.randint(0, 256, (2, 5))
    generated = model.generate(prompt, max_new_tokens=12, do_sample=False, min_new_tokens=12)
    sequence = prompt
    with torch.no_grad():
        for _ in range(12):
            next_token = model(sequence).logits[:, -1].argmax(-1, keepdim=True)
            sequence = torch.cat([sequence, next_token], 1)
    assert torch.equal(generated, sequence)


@pytest.mark.parametrize("name", ["paper", "sum_rule_normalised"])
def test_an_eager_decoding_step_updates_the_fast_weights_where_they_lie(name):
    """After the prompt, each eager one-token step writes the new fast weights into the cache's own tensor (no new
    state, no copy back), with the numbers of a step that makes a new state; a cache recording its past for rolling
    back keeps the states before each forward untouched instead."""
    model = _model(name)
    prompt = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(0))
    token = torch.tensor([[7], [9]])
    with torch.no_grad():
        cache = output_cache(model(prompt, use_cache=True))
        before = [layer.fast_weights for layer in cache.layers]
        values_before = [tensor.clone() for tensor in before]
        replaced = copy.deepcopy(cache)
        replaced.activate_past_recording()  # a recording cache takes new states
        expected = model(token, cache=replaced, use_cache=True)
        returned = []  # the new fast weights each layer's attention returns
        hooks = [
            layer.attention.register_forward_hook(lambda module, inputs, output: returned.append(output[1]))
            for layer in model.model.layers
        ]
        logits = model(token, cache=cache, use_cache=True).logits
        for hook in hooks:
            hook.remove()
    assert all(state is tensor is layer.fast_weights for state, tensor, layer in zip(returned, before, cache.layers))
    torch.testing.assert_close(logits, expected.logits, rtol=0, atol=1e-6)
    for layer, other, value_before in zip(cache.layers, replaced.layers, values_before):
        torch.testing.assert_close(layer.fast_weights, other.fast_weights, rtol=0, atol=1e-6)
        assert not torch.equal(layer.fast_weights, value_before)  # the step did write
        assert torch.equal(other.recorded[0][0], value_before)  # the recording kept the state before the step


def test_generate_returns_the_cache_and_can_continue():
    model = _model()
    prompt = torch.randint(0, 256, (1, 4))
    output = model.generate(prompt, max_new_tokens=6, do_sample=False, min_new_tokens=6, return_dict_in_generate=True)
    cache = output_cache(output)  # `output.cache` from 🤗 5.24, `output.past_key_values` before
    assert isinstance(cache, DeltaNetCache)
    # The cache holds every token but the last generated one (which has not been fed back yet).
    assert cache.get_seq_length() == output.sequences.shape[1] - 1
    continued = model.generate(output.sequences, cache=cache, max_new_tokens=3, do_sample=False, min_new_tokens=3)
    fresh = model.generate(output.sequences, max_new_tokens=3, do_sample=False, min_new_tokens=3)
    assert torch.equal(continued, fresh)


def test_seeded_sampling_is_reproducible_and_matches_recomputation():
    model = _model()
    prompt = torch.randint(0, 256, (2, 5))
    options = {"do_sample": True, "max_new_tokens": 10, "min_new_tokens": 10, "top_k": 0, "temperature": 1.0}
    torch.manual_seed(123)
    cached = model.generate(prompt, **options)
    torch.manual_seed(123)
    again = model.generate(prompt, **options)
    torch.manual_seed(123)
    recomputed = model.generate(prompt, use_cache=False, **options)
    torch.manual_seed(124)
    other_seed = model.generate(prompt, **options)
    assert torch.equal(cached, again) and torch.equal(cached, recomputed)
    assert not torch.equal(cached, other_seed)


@pytest.mark.parametrize("name", ["paper", "fla"])
def test_beam_search_with_cache_equals_without(name):
    model = _model(name)
    prompt = torch.randint(0, 256, (2, 4))
    options = {
        "num_beams": 4,
        "num_return_sequences": 3,
        "max_new_tokens": 8,
        "min_new_tokens": 8,
        "do_sample": False,
        "output_scores": True,
        "return_dict_in_generate": True,
    }
    cached = model.generate(prompt, **options)
    recomputed = model.generate(prompt, use_cache=False, **options)
    assert cached.sequences.shape == (6, 12)
    assert torch.equal(cached.sequences, recomputed.sequences)
    torch.testing.assert_close(cached.sequences_scores, recomputed.sequences_scores, atol=1e-4, rtol=0)
    assert len({tuple(row.tolist()) for row in cached.sequences[:3]}) == 3  # the beams differ


def test_num_return_sequences_with_sampling():
    model = _model()
    prompt = torch.randint(0, 256, (2, 4))
    torch.manual_seed(5)
    output = model.generate(prompt, do_sample=True, num_return_sequences=4, max_new_tokens=8, min_new_tokens=8)
    assert output.shape == (8, 12)
    assert torch.equal(output[:4, :4], prompt[0].expand(4, 4)) and torch.equal(output[4:, :4], prompt[1].expand(4, 4))
    assert len({tuple(row.tolist()) for row in output[:4]}) > 1


def test_left_padded_batch_generates_what_each_prompt_generates_alone(tokenizer):
    model = _model()
    tokenizer.padding_side = "left"
    prompts = ["The fast weights", "Hi"]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    generated = model.generate(**batch, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    for index, prompt in enumerate(prompts):
        alone = model.generate(
            **tokenizer([prompt], return_tensors="pt"), max_new_tokens=8, min_new_tokens=8, do_sample=False
        )
        assert generated[index, -8:].tolist() == alone[0, -8:].tolist()


def test_text_generation_pipeline_with_a_saved_tokenizer(tmp_path, tokenizer):
    model = _model("paper")
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    generator = pipeline("text-generation", model=str(tmp_path), device="cpu")
    assert type(generator.model) is DeltaNetForCausalLM
    result = generator("Fast weight programmers", max_new_tokens=10, min_new_tokens=10, do_sample=False)
    text = result[0]["generated_text"]
    assert text.startswith("Fast weight programmers")
    ids = tokenizer("Fast weight programmers", return_tensors="pt").input_ids
    expected = model.generate(ids, max_new_tokens=10, min_new_tokens=10, do_sample=False)
    assert text == tokenizer.decode(expected[0], skip_special_tokens=True)
    batched = generator(["One", "Two words"], max_new_tokens=4, do_sample=False, batch_size=2)
    assert [row[0]["generated_text"][:3] for row in batched] == ["One", "Two"]


def test_assisted_generation_is_refused_with_positions_counted_within_each_call():
    """Sinusoidal positions count down within each forward call, so verifying drafts in one call would not give the
    tokens of plain decoding (assisted decoding itself: tests/modeling/test_speculative_decoding.py)."""
    model = _model(position_encoding="sinusoidal")
    prompt = torch.randint(0, 256, (1, 4))
    for speculation in ({"assistant_model": _model()}, {"prompt_lookup_num_tokens": 2}):
        with pytest.raises(ValueError, match="position_encoding='sinusoidal'.*verifying several drafted tokens"):
            model.generate(prompt, max_new_tokens=3, do_sample=False, **speculation)
