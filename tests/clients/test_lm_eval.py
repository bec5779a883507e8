"""lm-evaluation-harness on the three memlm families, with the real `lm_eval` package: its Hugging Face back-end
(`HFLM`, given the model object, so nothing is downloaded) scores and generates what the model itself computes.

Requests are built by hand as `Instance`s, as a task would build them: no data set is loaded. `HFLM` batches
`loglikelihood` requests right-padded with no attention mask and `generate_until` requests left-padded with one,
through `model(input_ids).logits` and `model.generate(..., attention_mask=..., use_cache=True, stopping_criteria=...)`.
"""

import pytest

pytest.importorskip("lm_eval")

import torch  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402

from tests.clients.models import FAMILIES, tiny_model  # noqa: E402

# 🤗-facing: also run under the newest and the oldest 🤗 releases allowed (`make test-releases`).
pytestmark = pytest.mark.huggingface


def token_ids(text: str) -> list[int]:
    """The byte-level tokenizer's ids for `text`: its UTF-8 bytes."""
    return list(text.encode())


def scored(model, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """log P(continuation | context) from one forward pass of the model over the unpadded sequence, and whether every
    continuation token is the argmax after what precedes it."""
    tokens = torch.tensor([context + continuation])
    with torch.no_grad():
        log_probabilities = torch.log_softmax(model(input_ids=tokens).logits[0].double(), dim=-1)
    positions = torch.arange(len(context) - 1, len(context) + len(continuation) - 1)
    targets = torch.tensor(continuation)
    total = log_probabilities[positions, targets].sum().item()
    greedy = bool((log_probabilities[positions].argmax(-1) == targets).all())
    return total, greedy


def greedy_text(model, tokenizer, prompt: str, steps: int) -> str:
    """The model's own greedy continuation of `prompt` alone (no padding), decoded."""
    with torch.no_grad():
        output = model.generate(torch.tensor([token_ids(prompt)]), max_new_tokens=steps, do_sample=False)
    return tokenizer.decode(output[0, len(token_ids(prompt)) :], skip_special_tokens=True)


def harness(model, tokenizer, batch_size: int = 3) -> HFLM:
    return HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)


@pytest.mark.parametrize("family", FAMILIES)
def test_loglikelihood_is_the_models_log_probability(family, tokenizer):
    model = tiny_model(family, tokenizer)
    own_words = greedy_text(model, tokenizer, "once upon a time", 4)
    pairs = [
        ("the cat", " sat on the mat"),
        ("", "hello"),  # no context: lm-eval conditions on the prefix token (<|endoftext|>)
        ("once upon a time", own_words),  # the model's own greedy words: is_greedy must be True
        ("once upon a time", " x"),  # one-token continuations of one context share a forward pass in lm-eval
        ("once upon a time", " y"),
    ]
    requests = [Instance("loglikelihood", {}, pair, index) for index, pair in enumerate(pairs)]
    results = harness(model, tokenizer).loglikelihood(requests, disable_tqdm=True)

    assert len(results) == len(pairs)
    for (context, continuation), (log_likelihood, is_greedy) in zip(pairs, results):
        context_ids = token_ids(context) or [tokenizer.bos_token_id]
        expected, expected_greedy = scored(model, context_ids, token_ids(continuation))
        assert log_likelihood == pytest.approx(expected, rel=0, abs=1e-4), (context, continuation)
        assert is_greedy == expected_greedy, (context, continuation)
    assert [is_greedy for _, is_greedy in results] == [False, False, True, False, False]


@pytest.mark.parametrize("family", FAMILIES)
def test_loglikelihood_rolling_sums_every_token(family, tokenizer):
    model = tiny_model(family, tokenizer)
    texts = ["a rolling window over a text of some length", "short"]
    requests = [Instance("loglikelihood_rolling", {}, (text,), index) for index, text in enumerate(texts)]
    results = harness(model, tokenizer, batch_size=2).loglikelihood_rolling(requests, disable_tqdm=True)

    assert len(results) == len(texts)
    for text, log_likelihood in zip(texts, results):
        # Every token of the text scored once, the first one after the prefix token.
        expected, _ = scored(model, [tokenizer.bos_token_id], token_ids(text))
        assert log_likelihood == pytest.approx(expected, rel=0, abs=1e-4), text


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_until_is_the_models_greedy_continuation(family, tokenizer):
    model = tiny_model(family, tokenizer)
    prompts = ["the quick brown fox jumps", "over", "a lazy dog"]  # unequal lengths: lm-eval pads on the left
    options = {"until": ["\n\n"], "max_gen_toks": 8, "do_sample": False}
    requests = [Instance("generate_until", {}, (prompt, options), index) for index, prompt in enumerate(prompts)]
    results = harness(model, tokenizer).generate_until(requests, disable_tqdm=True)

    expected = [greedy_text(model, tokenizer, prompt, 8) for prompt in prompts]
    assert all(len(text) == 8 for text in expected)
    assert results == expected


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_until_stops_at_the_stop_string(family, tokenizer):
    model = tiny_model(family, tokenizer)
    prompt, steps = "the quick brown fox jumps", 12
    free = greedy_text(model, tokenizer, prompt, steps)
    stop = free[4:6]  # two letters the model will say, so generation must stop there
    before_stop = free[: free.index(stop)]

    forward_calls = []
    hook = model.register_forward_hook(lambda module, arguments, output: forward_calls.append(1))
    try:
        options = {"until": [stop], "max_gen_toks": steps, "do_sample": False}
        results = harness(model, tokenizer).generate_until(
            [Instance("generate_until", {}, (prompt, options), 0)], disable_tqdm=True
        )
    finally:
        hook.remove()

    assert results == [before_stop]
    # Generation itself stopped once the stop string was out (one forward pass per token), not after `steps` tokens.
    assert len(forward_calls) == len(before_stop) + len(stop) < steps
