"""The 🤗 `Cache` contract of memlm's three caches (`DeltaNetCache`, `ExpireSpanCache`, `FeedbackCache`).

memlm's caches subclass 🤗's `Cache` through `MemoryCache` (memlm/modeling/memory.py), with layers of their own
(`MemoryCacheLayer`) rather than 🤗's attention or linear-attention layers. 🤗 Transformers 5.24's `generate` drives a
cache through the methods of that base class: it reorders it for beam search (`reorder_cache`), trims a continued
prompt by what the cache has seen (`get_seq_length`, unless every layer `is_linear`), asks whether it can be
compiled (`is_compileable`) or rolled back (`is_croppable`, `activate_past_recording`, `crop`). Custom decoding
strategies (🤗's contrastive search, now on the Hub) also grow and shrink its batch (`batch_repeat_interleave`,
`batch_select_indices`); `generate` itself expands the inputs before the first forward instead. One test per
method, each checking what the method does to the memory: the logits of the next forward on a cache the method
changed equal those of a cache built from scratch for the batch the method stands for.

Every test runs for each of the three models, with tiny configurations (🤗's testers' sizes); the batch is padded
differently in every row, so that rows reach different positions and a row mixed up with another shows.
"""

import copy
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from transformers import GenerationConfig, PreTrainedConfig

import memlm
from memlm.compat import output_cache

# 🤗-facing: also run under the newest and the oldest 🤗 releases allowed (`make test-releases`).
pytestmark = pytest.mark.huggingface

VOCAB_SIZE = 99
PAD_TOKEN_ID = 0
TINY = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "pad_token_id": PAD_TOKEN_ID,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
ROWS = 3
PROMPT_LENGTH = 9  # longer than the Feedback memory and the Expire-Span span below: the oldest memories go
TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}


@dataclass(frozen=True)
class Family:
    """One of memlm's models: how to build it tiny, and its cache."""

    config: Callable[[], PreTrainedConfig]
    model_class: type
    cache_class: type
    memory_layers: int  # layers of its cache: Feedback shares one key/value set between all its layers


FAMILIES = {
    "deltanet": Family(
        lambda: memlm.DeltaNetConfig.from_preset("fla", chunk_size=4, **TINY),
        memlm.DeltaNetForCausalLM,
        memlm.DeltaNetCache,
        memory_layers=2,
    ),
    "expire_span": Family(
        lambda: memlm.ExpireSpanConfig(max_span=8, ramp=2, block_size=4, **TINY),
        memlm.ExpireSpanForCausalLM,
        memlm.ExpireSpanCache,
        memory_layers=2,
    ),
    "feedback_transformer": Family(
        lambda: memlm.FeedbackTransformerConfig(memory_span=6, **TINY),
        memlm.FeedbackTransformerForCausalLM,
        memlm.FeedbackCache,
        memory_layers=1,
    ),
}


@pytest.fixture(params=list(FAMILIES))
def family(request) -> Family:
    return FAMILIES[request.param]


@pytest.fixture
def model(family):
    torch.manual_seed(0)
    model = family.model_class(family.config()).eval()
    # No end of sequence: every row generates all its tokens, with or without cache.
    model.generation_config = GenerationConfig(pad_token_id=PAD_TOKEN_ID, eos_token_id=None)
    return model


def padded_batch(rows: int = ROWS, length: int = PROMPT_LENGTH, seed: int = 0):
    """Token ids and attention mask of `rows` prompts, padded on the left by a different width in every row, one
    with a gap inside: each row's next real token comes at a different position."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, VOCAB_SIZE, (rows, length), generator=generator)
    attention_mask = torch.ones(rows, length, dtype=torch.long)
    for row in range(rows):
        attention_mask[row, : 2 * row] = 0
    attention_mask[0, length // 2] = 0
    return input_ids.masked_fill(attention_mask == 0, PAD_TOKEN_ID), attention_mask


def following_tokens(rows: int, steps: int, seed: int = 1) -> torch.Tensor:
    """(rows, steps) tokens to decode one at a time after a prompt."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB_SIZE, (rows, steps), generator=generator)


@torch.no_grad()
def forward(model, cache, input_ids, attention_mask=None) -> torch.Tensor:
    """The logits of `input_ids` read after `cache` (which the forward advances)."""
    outputs = model(input_ids, attention_mask=attention_mask, cache=cache, use_cache=True)
    assert outputs.cache is cache
    return outputs.logits


def build_cache(family, model, input_ids, attention_mask, decoded: torch.Tensor):
    """The cache of a prompt, then of `decoded` (rows, steps) read one token at a time."""
    cache = family.cache_class(model.config)
    forward(model, cache, input_ids, attention_mask)
    for step in range(decoded.shape[1]):
        forward(model, cache, decoded[:, step : step + 1])
    return cache


def assert_same_positions(cache, reference):
    """The position of each row's next real token (for the models that count positions; DeltaNet has none)."""
    if reference.next_positions is None:
        assert cache.next_positions is None
    else:
        assert torch.equal(cache.next_positions, reference.next_positions)


def assert_same_memory(model, cache, reference, following: torch.Tensor):
    """`cache` holds what `reference` holds: the same token count, the same positions, and the same logits for the
    `following` tokens."""
    assert cache.batch_size == reference.batch_size
    assert cache.get_seq_length() == reference.get_seq_length()
    assert_same_positions(cache, reference)
    torch.testing.assert_close(forward(model, cache, following), forward(model, reference, following), **TOLERANCE)


# ---- the batch: beam search, `num_return_sequences` and batch selection ----


def test_reorder_cache_continues_the_reordered_batch(family, model):
    """What beam search does after each step: the rows of the memory follow `beam_idx` (a row may be dropped or
    repeated), as if the reordered batch had been run from the start."""
    input_ids, attention_mask = padded_batch()
    decoded = following_tokens(ROWS, 2)
    beam_idx = torch.tensor([2, 0, 0])
    cache = build_cache(family, model, input_ids, attention_mask, decoded)
    cache.reorder_cache(beam_idx)
    reference = build_cache(family, model, input_ids[beam_idx], attention_mask[beam_idx], decoded[beam_idx])
    assert_same_memory(model, cache, reference, following_tokens(ROWS, 1, seed=2))


def test_batch_repeat_interleave_continues_the_repeated_batch(family, model):
    """Each row repeated `n` times in place (what `generate` does to the prompts for several sequences per prompt,
    done to a memory); the copies then continue apart."""
    input_ids, attention_mask = padded_batch(rows=2)
    decoded = following_tokens(2, 1)
    cache = build_cache(family, model, input_ids, attention_mask, decoded)
    cache.batch_repeat_interleave(3)
    repeated = (tensor.repeat_interleave(3, dim=0) for tensor in (input_ids, attention_mask, decoded))
    reference = build_cache(family, model, *repeated)
    assert cache.batch_size == 6
    assert_same_memory(model, cache, reference, following_tokens(6, 1, seed=2))


def test_batch_select_indices_continues_the_selected_rows(family, model):
    """Only the selected rows kept, in the order given."""
    input_ids, attention_mask = padded_batch()
    decoded = following_tokens(ROWS, 1)
    indices = torch.tensor([2, 0])
    cache = build_cache(family, model, input_ids, attention_mask, decoded)
    cache.batch_select_indices(indices)
    reference = build_cache(family, model, input_ids[indices], attention_mask[indices], decoded[indices])
    assert cache.batch_size == 2
    assert_same_memory(model, cache, reference, following_tokens(2, 1, seed=2))


def test_batch_size_is_unknown_before_the_first_forward(family, model):
    """-1 until a forward gives the memory its rows, as for 🤗's caches."""
    cache = family.cache_class(model.config)
    assert cache.batch_size == -1
    input_ids, attention_mask = padded_batch()
    forward(model, cache, input_ids, attention_mask)
    assert cache.batch_size == ROWS


# ---- counting tokens: `generate` trims a continued prompt by them ----


def test_get_seq_length_counts_every_token_consumed(family, model):
    """Padding included, over a prefill and decoding steps, in every memory layer; a layer beyond the cache has
    seen nothing."""
    cache = family.cache_class(model.config)
    assert cache.get_seq_length() == 0
    input_ids, attention_mask = padded_batch()
    forward(model, cache, input_ids, attention_mask)
    assert [cache.get_seq_length(layer) for layer in range(len(cache))] == [PROMPT_LENGTH] * len(cache)
    decoded = following_tokens(ROWS, 3)
    forward(model, cache, decoded[:, :1])
    # Two tokens at once, the first of one row padding (a mask over the past and the new tokens).
    mask = torch.cat([attention_mask, torch.tensor([[1, 1, 1], [1, 0, 1], [1, 1, 1]])], dim=1)
    forward(model, cache, decoded[:, 1:], attention_mask=mask)
    assert [cache.get_seq_length(layer) for layer in range(len(cache))] == [PROMPT_LENGTH + 3] * len(cache)
    assert cache.get_seq_length(len(cache)) == 0


def test_no_layer_is_linear_so_generate_trims_a_continued_prompt(family, model):
    """🤗's linear-attention layers cannot count tokens: with `all(cache.is_linear)` `generate` would feed a continued
    prompt whole again. memlm's layers count them, so `generate` feeds only what the cache has not seen."""
    assert family.cache_class(model.config).is_linear == [False] * family.memory_layers
    input_ids, attention_mask = padded_batch()
    whole = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=5, do_sample=False)
    first = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=2, do_sample=False,
                           return_dict_in_generate=True)  # fmt: skip
    cache = output_cache(first)
    assert cache.is_linear == [False] * family.memory_layers
    assert not all(cache.is_linear)
    assert cache.get_seq_length() == first.sequences.shape[1] - 1  # the last token generated is not read yet
    mask = torch.cat([attention_mask, torch.ones(ROWS, 2, dtype=torch.long)], dim=1)
    rest = model.generate(first.sequences, attention_mask=mask, cache=cache, max_new_tokens=3, do_sample=False)
    assert torch.equal(rest, whole)
    assert cache.get_seq_length() == whole.shape[1] - 1


def test_chunked_prefill_equals_a_whole_prefill(family, model):
    """`prefill_chunk_size`: `generate` reads the prompt in pieces into the cache given, slicing the attention mask
    by `get_seq_length` before each piece."""
    input_ids, attention_mask = padded_batch()
    whole = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=3, do_sample=False)
    cache = family.cache_class(model.config)
    chunked = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=3, do_sample=False, cache=cache,
                             prefill_chunk_size=4)  # fmt: skip
    assert torch.equal(chunked, whole)
    assert cache.get_seq_length() == PROMPT_LENGTH + 2


def test_get_mask_sizes_are_the_tokens_seen_and_the_query(family, model):
    cache = family.cache_class(model.config)
    assert cache.get_mask_sizes(4, 0) == (4, 0)
    input_ids, attention_mask = padded_batch()
    forward(model, cache, input_ids, attention_mask)
    assert cache.get_mask_sizes(1, 0) == (PROMPT_LENGTH + 1, 0)
    assert cache.get_mask_sizes(4, len(cache)) == (4, 0)


def test_get_max_length_is_unbounded(family, model):
    cache = family.cache_class(model.config)
    input_ids, attention_mask = padded_batch()
    forward(model, cache, input_ids, attention_mask)
    assert cache.get_max_length() == -1
    assert cache.get_max_length(0) == -1


def test_len_is_the_number_of_memory_layers(family, model):
    assert len(family.cache_class(model.config)) == family.memory_layers
    input_ids, attention_mask = padded_batch()
    with torch.no_grad():
        assert len(model(input_ids, attention_mask=attention_mask, use_cache=True).cache) == family.memory_layers


# ---- rolling back, compiling, resetting ----


def test_crop_rolls_back_the_last_tokens_of_a_recording_memory(family, model):
    """After `activate_past_recording` (what `generate` calls for assisted decoding), `crop(-n)` makes the memory what
    the tokens before the last n left; `crop(0)` keeps them all. Both end the recording's history: the next crop can
    remove only what came after."""
    input_ids, attention_mask = padded_batch()
    decoded = following_tokens(ROWS, 3)
    cache = family.cache_class(model.config)
    assert cache.is_croppable is True
    cache.activate_past_recording()
    forward(model, cache, input_ids, attention_mask)
    cache.crop(0)
    for step in range(3):
        forward(model, cache, decoded[:, step : step + 1])
    cache.crop(-2)
    reference = build_cache(family, model, input_ids, attention_mask, decoded[:, :1])
    assert_same_memory(model, cache, reference, following_tokens(ROWS, 1, seed=2))  # both read one more token
    assert cache.get_seq_length() == PROMPT_LENGTH + 2
    cache.crop(0)
    with pytest.raises(ValueError, match="can remove at most the 0 tokens read since"):
        cache.crop(-1)


def test_crop_without_recording_removes_nothing_and_refuses_to(family, model):
    """Without recording a memory keeps no history: `crop(0)` changes nothing, removing tokens is refused with a
    message naming `activate_past_recording`, and a positive count (🤗's old absolute length) is refused too."""
    input_ids, attention_mask = padded_batch()
    cache = build_cache(family, model, input_ids, attention_mask, following_tokens(ROWS, 1))
    before = copy.deepcopy(cache)
    cache.crop(0)
    with pytest.raises(ValueError, match="records no past.*activate_past_recording"):
        cache.crop(-1)
    with pytest.raises(ValueError, match=r"crop takes minus the number of tokens to remove.*crop\(1\)"):
        cache.crop(1)
    assert cache.recorded_forwards == [] and all(layer.recorded == [] for layer in cache.layers)
    assert_same_memory(model, cache, before, following_tokens(ROWS, 1, seed=2))


def test_activate_past_recording_changes_nothing_in_the_memory(family, model):
    """Recording starts for every layer (`is_recording_past`) and leaves the memory as it was."""
    input_ids, attention_mask = padded_batch()
    cache = build_cache(family, model, input_ids, attention_mask, following_tokens(ROWS, 1))
    before = copy.deepcopy(cache)
    cache.activate_past_recording()
    assert [cache.is_recording_past(layer) for layer in range(len(cache))] == [True] * len(cache)
    assert_same_memory(model, cache, before, following_tokens(ROWS, 1, seed=2))
    cache.stop_past_recording()
    assert [cache.is_recording_past(layer) for layer in range(len(cache))] == [False] * len(cache)
    assert cache.recorded_forwards == [] and all(layer.recorded == [] for layer in cache.layers)


def test_only_memories_of_bounded_size_are_compileable(family, model):
    """`generate` compiles the decoding step only over a compileable cache: DeltaNet's fast weights and the Feedback
    ring keep their size (written in place), Expire-Span's memory changes size as its memories expire, and says so; a
    recording memory (🤗's rule for its own layers: a cache recording its past is not compileable) keeps lists."""
    compileable = family.model_class is not memlm.ExpireSpanForCausalLM
    cache = family.cache_class(model.config)
    assert cache.is_compileable is compileable
    input_ids, attention_mask = padded_batch()
    forward(model, cache, input_ids, attention_mask)
    assert cache.is_compileable is compileable
    if compileable:
        assert cache.not_compileable_reason is None
    else:
        assert "changes size as memories expire" in cache.not_compileable_reason
    cache.activate_past_recording()
    assert cache.is_compileable is False
    assert cache.not_compileable_reason is not None


def test_reset_empties_the_cache(family, model):
    """After `reset` the cache takes a new batch, of another size, as a fresh cache does."""
    input_ids, attention_mask = padded_batch()
    cache = build_cache(family, model, input_ids, attention_mask, following_tokens(ROWS, 1))
    cache.reset()
    assert cache.batch_size == -1
    assert cache.get_seq_length() == 0
    assert cache.next_positions is None
    other_ids, other_mask = padded_batch(rows=2, length=5, seed=3)
    fresh = family.cache_class(model.config)
    torch.testing.assert_close(
        forward(model, cache, other_ids, other_mask), forward(model, fresh, other_ids, other_mask), **TOLERANCE
    )
    assert_same_memory(model, cache, fresh, following_tokens(2, 1, seed=2))


# ---- the decoding strategies of `generate` that move rows ----


def test_beam_search_equals_beam_search_without_cache(family, model):
    """Beam search reorders the cache at every step: with it, the beams are those found by reading the whole
    sequences again at every step."""
    input_ids, attention_mask = padded_batch()
    settings = {"attention_mask": attention_mask, "max_new_tokens": 4, "num_beams": 2, "num_return_sequences": 2,
                "do_sample": False}  # fmt: skip
    cached = model.generate(input_ids, return_dict_in_generate=True, **settings)
    uncached = model.generate(input_ids, use_cache=False, **settings)
    assert cached.sequences.shape == (2 * ROWS, PROMPT_LENGTH + 4)
    assert torch.equal(cached.sequences, uncached)
    cache = output_cache(cached)
    assert cache.batch_size == 2 * ROWS  # a row per beam
    assert cache.get_seq_length() == PROMPT_LENGTH + 3


def test_sampling_several_sequences_equals_sampling_without_cache(family, model):
    """`num_return_sequences` repeats every prompt (and its mask) before the first forward; the samples then go
    their own ways, drawing what they draw without the cache."""
    input_ids, attention_mask = padded_batch()
    settings = {"attention_mask": attention_mask, "max_new_tokens": 4, "num_return_sequences": 2, "do_sample": True,
                "top_k": 10}  # fmt: skip
    torch.manual_seed(5)
    cached = model.generate(input_ids, return_dict_in_generate=True, **settings)
    torch.manual_seed(5)
    uncached = model.generate(input_ids, use_cache=False, **settings)
    assert cached.sequences.shape == (2 * ROWS, PROMPT_LENGTH + 4)
    assert torch.equal(cached.sequences, uncached)
    assert torch.equal(cached.sequences[:, :PROMPT_LENGTH], input_ids.repeat_interleave(2, dim=0))
    assert output_cache(cached).batch_size == 2 * ROWS
