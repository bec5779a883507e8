"""Expire-Span's memories (memory.py) and block loop (blocks.py): in-place appends equal concatenation, lazy pruning
deletes only dead memories and stays bounded, the counts match the dense mask, and the blocks cover the input."""

import pytest
import torch

from memlm.kernels.expire_attention import expire_span_mask, visible_keys
from memlm.kernels.expire_attention.blocks import compact_memories, split_into_blocks
from memlm.kernels.expire_attention.memory import (
    COMPACT_FRACTION,
    ExpireSpanMemory,
    check_interval,
    decoding_slack,
    expired_memories,
    memory_counts,
    next_decoding_slack,
)

RAMP = 2.0


def make_memory(start, length, batch_size=2, spans=True, seed=0, requires_grad=False):
    generator = torch.Generator().manual_seed(seed + start)
    positions = torch.arange(start, start + length).expand(batch_size, length).clone()
    return ExpireSpanMemory(
        keys=torch.randn(batch_size, 2, length, 4, generator=generator, requires_grad=requires_grad),
        values=torch.randn(batch_size, 2, length, 4, generator=generator),
        positions=positions,
        valid=torch.ones(batch_size, length, dtype=torch.bool),
        spans=6 * torch.rand(batch_size, length, generator=generator) if spans else None,
        span_inputs=None,
    )


def assert_same(first: ExpireSpanMemory, second: ExpireSpanMemory):
    for name, tensor in first.tensors().items():
        other = getattr(second, name)
        assert (tensor is None) == (other is None), name
        if tensor is not None:
            assert torch.equal(tensor, other), name


@torch.no_grad()  # decoding: appends write into a preallocated buffer
def test_in_place_appends_equal_concatenation():
    memory, joined = make_memory(0, 3), make_memory(0, 3)
    for step in range(3, 200):
        block = make_memory(step, 1)
        memory, joined = memory.append(block), joined._joined(block)
        assert_same(memory, joined)
    assert memory.buffer is not None and memory.buffer.capacity < 2 * memory.width  # preallocated, not a copy a step


@torch.no_grad()
def test_an_older_prefix_never_overwrites_a_newer_one():
    base = make_memory(0, 4).append(make_memory(4, 1))
    first = base.append(make_memory(5, 1, seed=1))
    second = base.append(make_memory(5, 1, seed=2))  # a second branch from the same memories copies
    assert second.buffer is not first.buffer
    assert_same(first, make_memory(0, 4)._joined(make_memory(4, 1))._joined(make_memory(5, 1, seed=1)))
    assert_same(second, make_memory(0, 4)._joined(make_memory(4, 1))._joined(make_memory(5, 1, seed=2)))


def test_appends_with_gradients_enabled_concatenate():
    """With gradients enabled, even memories that need none (an attention's queries may, and its backward reads the
    memories later) are concatenated and pruned into new tensors, never written in place."""
    memory = make_memory(0, 3, requires_grad=True).append(make_memory(3, 1))
    assert memory.buffer is None and memory.keys.requires_grad
    plain = make_memory(0, 3).append(make_memory(3, 1))
    assert plain.buffer is None
    with torch.no_grad():
        assert make_memory(0, 3, requires_grad=True).append(make_memory(3, 1)).buffer is not None
        buffered = make_memory(0, 3).append(make_memory(3, 1))
    valid = buffered.valid
    buffered.buffer.next_check = 0  # a check is due
    pruned = buffered.prune(lambda: torch.ones_like(valid))
    assert valid.all() and not pruned.valid.any()  # with gradients enabled the old validity is left as it was


def test_detached_drops_gradients_and_span_inputs():
    memory = make_memory(0, 3, requires_grad=True)
    memory.span_inputs = torch.randn(2, 3, 5, requires_grad=True)
    kept, dropped = memory.detached(keep_span_inputs=True), memory.detached(keep_span_inputs=False)
    assert not kept.keys.requires_grad and not kept.span_inputs.requires_grad
    assert dropped.span_inputs is None


def test_select_compacts_each_row_in_order():
    memory = make_memory(0, 5)
    keep = torch.tensor([[True, False, True, False, True], [False, False, True, True, False]])
    selected = memory.select(keep)
    assert selected.positions.tolist() == [[0, 2, 4], [2, 3, 0]]
    assert selected.valid.tolist() == [[True, True, True], [True, True, False]]
    torch.testing.assert_close(selected.keys[0, :, 1], memory.keys[0, :, 2], rtol=0, atol=0)


@pytest.mark.parametrize("requires_grad", [False, True])
def test_select_of_one_row_equals_the_same_row_among_others(requires_grad):
    """One row takes its kept slots by index (decoding a single sequence), several rows gather: the same memory, and
    the same gradient to the keys."""
    keep = torch.tensor([[True, False, False, True, True, False, True]])
    alone = make_memory(0, 7, batch_size=1, requires_grad=requires_grad)
    batched = make_memory(0, 7, batch_size=1, requires_grad=requires_grad)
    # the batched path: the same row next to a second row that keeps everything
    pair = ExpireSpanMemory(**{name: None if tensor is None else torch.cat([tensor, tensor]) for name, tensor
                               in batched.tensors().items()})  # fmt: skip
    selected, both = alone.select(keep), pair.select(torch.cat([keep, torch.ones_like(keep)]))
    assert selected.width == 4 and both.width == 7
    for name, tensor in selected.tensors().items():
        if tensor is not None:
            other = getattr(both, name)[:1].narrow(1 if tensor.dim() == 2 else 2, 0, 4)
            assert torch.equal(tensor, other), name
    assert selected.positions.tolist() == [[0, 3, 4, 6]] and bool(selected.valid.all())
    if requires_grad:
        (selected.keys * torch.arange(4.0)[:, None]).sum().backward()
        (both.keys[:1, :, :4] * torch.arange(4.0)[:, None]).sum().backward()
        assert torch.equal(alone.keys.grad, batched.keys.grad)


@pytest.mark.parametrize("spans", [True, False])
def test_expired_memories_are_those_no_later_query_reads(spans):
    memory = make_memory(0, 30, spans=spans)
    first = torch.tensor([20, -1])  # the second row has no real query: nothing expires
    dead = expired_memories(memory.positions, memory.spans, first, RAMP, max_span=5)
    later = torch.arange(20, 40).expand(2, 20)
    readable = visible_keys(later, memory.positions, None, None if spans else 5)
    if spans:
        readable = readable & (expire_span_mask(memory.spans, later, memory.positions, RAMP) > 0)
    assert torch.equal(dead[0], ~readable[0].any(0))
    assert not dead[1].any()


@torch.no_grad()  # decoding
def decode(memory, steps, spans=True, start=None):
    """Decode `steps` tokens: prune for the next query, then append its memory, as a layer does."""
    start = memory.width if start is None else start
    widths = []
    for step in range(start, start + steps):
        first = torch.full((2,), step)
        memory = memory.prune(lambda m=memory, f=first: expired_memories(m.positions, m.spans, f, RAMP, max_span=5))
        memory = memory.append(make_memory(step, 1, spans=spans))
        widths.append(memory.width)
    return memory, widths


@pytest.mark.parametrize("spans", [True, False])
def test_lazy_pruning_keeps_every_readable_memory_and_a_bounded_layout(spans):
    memory, widths = decode(make_memory(0, 1, spans=spans), 600, spans=spans)
    # Every memory the next query (position 600) can read is kept valid.
    final = torch.full((2,), 600)
    readable = ~expired_memories(memory.positions, memory.spans, final, RAMP, max_span=5)
    assert bool((memory.valid | ~readable).all())
    # At most e + R + 1 ≤ 9 memories (6 without expiration) are alive at any time; the layout stays bounded by the
    # lazy rule (and far below the 600 decoded tokens).
    live = 9 if spans else 6
    checked = int(live / (1 - COMPACT_FRACTION)) + 1
    assert max(widths) <= checked + check_interval(checked) + 1
    assert min(widths[100:]) < max(widths)  # it is compacted from time to time


@torch.no_grad()  # decoding
def test_lazy_pruning_looks_once_per_check_interval_also_after_a_compaction():
    """A decoding buffer looks for dead memories once every `check_interval` appended memories: a buffer made anew —
    by the first append after a compaction, or by growing — does not look again at once (nothing new has died)."""
    memory, looked, compactions = make_memory(0, 1), [], 0
    for step in range(1, 400):
        first = torch.full((2,), step)

        def dead(m=memory, f=first, step=step):
            looked.append(step)
            return expired_memories(m.positions, m.spans, f, RAMP, max_span=5)

        pruned = memory.prune(dead)
        compactions += pruned.buffer is None and memory.buffer is not None
        memory = pruned.append(make_memory(step, 1))
    gaps = [later - earlier for earlier, later in zip(looked, looked[1:])]
    assert compactions > 5 and min(gaps) >= check_interval(1), (compactions, gaps)


def test_lazy_pruning_marks_dead_memories_invalid_in_place():
    memory, _ = decode(make_memory(0, 1), 40)
    first = torch.full((2,), 40)
    memory.buffer.next_check = 0  # force a check now
    dead = expired_memories(memory.positions, memory.spans, first, RAMP, max_span=5)
    with torch.no_grad():
        pruned = memory.prune(lambda: dead)
    assert not (pruned.valid & expired_memories(pruned.positions, pruned.spans, first, RAMP, max_span=5)).any()


def test_compact_memories_deletes_the_invalid_slots():
    memory = make_memory(0, 6)
    memory.valid = torch.tensor([[True, False, True, True, False, False], [False, True, False, False, False, False]])
    (compacted,) = compact_memories([memory], [3])
    assert compacted.positions.tolist() == [[0, 2, 3], [1, 0, 2]]  # live first, in order; then unused slots
    assert compacted.valid.tolist() == [[True, True, True], [True, False, False]]


QUERIES = {
    "consecutive": [[12, 13, 14, 15], [-1, 16, 17, -1]],
    "gaps": [[12, 14, 15, 19], [12, 14, 15, 19]],
    "one query": [[13], [-1]],  # decoding: one query per row, or a padded one
}


@pytest.mark.parametrize("spans", ["random", "whole", None])
@pytest.mark.parametrize("queries", QUERIES)
@pytest.mark.parametrize("max_distance", [None, 4.0])
def test_memory_counts_equal_the_dense_mask(queries, max_distance, spans):
    memory = make_memory(0, 20, spans=spans is not None)
    if spans == "whole":  # m lands exactly on 0 and 1 (the ends of the ramp)
        memory.spans = memory.spans.round()
    memory.valid[1, 3] = False
    positions = torch.tensor(QUERIES[queries])
    token_valid = positions >= 0
    read, on_ramp = memory_counts(memory.spans, positions, token_valid, memory, RAMP, max_distance)
    visible = visible_keys(positions, memory.positions, memory.valid, max_distance) & token_valid[:, :, None]
    mask = expire_span_mask(memory.spans, positions, memory.positions, RAMP)
    torch.testing.assert_close(read, (visible & (mask > 0)).sum(1).float(), rtol=0, atol=0)
    torch.testing.assert_close(on_ramp, (visible & (mask > 0) & (mask < 1)).sum(1).float(), rtol=0, atol=0)


def test_blocks_cover_the_input_with_each_rows_first_query():
    positions = torch.tensor([[-1, -1, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 6]])
    blocks = split_into_blocks(positions, positions >= 0, 2, lambda p: (p.float(), p.float()))
    assert [block.tokens for block in blocks] == [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)]
    assert [block.first_positions.tolist() for block in blocks] == [[-1, 0], [0, 2], [2, 4], [4, 6]]


def test_decoding_slack_is_the_least_remaining_span_of_the_valid_memories():
    """r_ti = e_i − (t − i) (paper Eq. 5) over the valid slots; a dead slot on the ramp does not count; unknown (None)
    when a row's token is padding and nothing was kept; kept slacks are returned as they are."""
    memory = make_memory(0, 4, batch_size=2)
    memory.spans = torch.tensor([[5.0, 0.5, 3.0, 10.0], [9.0, 9.0, 9.0, 1.5]])
    memory.valid[0, 1] = False  # r = 0.5 − 3 < 0, but dead
    query = torch.tensor([[4], [4]])
    real = torch.ones(2, 1, dtype=torch.bool)
    assert decoding_slack(memory, query, real) == 0.5  # row 1, slot 3: 1.5 − (4 − 3)
    assert decoding_slack(memory, query, torch.tensor([[True], [False]])) is None
    assert decoding_slack(None, query, real) == float("inf")
    memory.expiry_slack = -2.0
    assert decoding_slack(memory, query, real) == -2.0
    # The next query is one further; the memory just made has r = e_t − 1 for it.
    assert next_decoding_slack(0.5, torch.tensor([[3.0], [0.25]])) == -0.75
    assert next_decoding_slack(0.5, torch.tensor([[3.0], [7.0]])) == -0.5
