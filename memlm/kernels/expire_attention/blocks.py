"""Expire-Span's block-parallel forward (SPEC §2): the input is cut into blocks, and each layer runs over the blocks in
order, each block attending to the layer's memories of earlier blocks and to itself.

Sukhbaatar et al. (2021), *Not All Memories are Created Equal: Learning to Forget by Expiring*: a layer's memories
are its own inputs h_i of earlier tokens, with spans e_i (paper Eq. 3) that decide when they expire (Eq. 5). A layer's
memories depend only on that layer's inputs of earlier blocks, so running layer by layer, each over all blocks, equals
running block by block, and each layer's whole output is the next layer's input.
"""

from typing import NamedTuple

import torch

from .memory import ExpireSpanMemory

__all__ = ["Block", "compact_memories", "first_queries", "run_layer_over_blocks", "split_into_blocks"]


class Block(NamedTuple):
    """What one block needs, the same in every layer."""

    tokens: slice  # the block's slice of the input
    positions: torch.Tensor  # (B, T_block) absolute positions, -1 at padding
    valid: torch.Tensor  # (B, T_block) False at padding
    cos: torch.Tensor | None  # rotation of the block's positions (None without rotary positions)
    sin: torch.Tensor | None
    first_positions: torch.Tensor  # (B,) each row's first real query, -1 when the row has none (deletes nothing)


def first_queries(positions: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(B,) each row's first real query among `positions` (B, T), -1 for a row with none (which deletes nothing)."""
    first = torch.where(valid, positions, torch.iinfo(torch.long).max).amin(1)
    return first.masked_fill(~valid.any(1), -1)


def split_into_blocks(positions, token_valid, block_size: int, rotary_embedding) -> list[Block]:
    """The blocks of `block_size` tokens of an input with `positions` and `token_valid` (B, T); `rotary_embedding`
    gives each block's cos and sin (None: no rotation)."""
    blocks = []
    for start in range(0, positions.shape[1], block_size):
        tokens = slice(start, start + block_size)
        block_positions, block_valid = positions[:, tokens], token_valid[:, tokens]
        first_positions = first_queries(block_positions, block_valid)
        rotation = rotary_embedding(block_positions) if rotary_embedding is not None else (None, None)
        blocks.append(Block(tokens, block_positions, block_valid, *rotation, first_positions))
    return blocks


def run_layer_over_blocks(layer, hidden_states, blocks: list[Block], memory, keep_span_inputs: bool,
                          recompute_memory: bool = False, **options):  # fmt: skip
    """One layer over the blocks in order. `layer(block_hidden_states, positions, valid, cos, sin, memory=...,
    first_positions=..., recompute_memory=..., keep_span_inputs=..., last_block=..., **options)` returns the block's
    output, the memories after the block as the next block reads them (the earlier ones, pruned, then the block's),
    its spans, its span-loss sum and its number of memories read. `recompute_memory`: the first block computes the
    carried memories' keys, values and spans again from their hidden states (later blocks read memories made with the
    same weights).

    Returns the layer's output (B, T, D), its memories after the last block (detached: truncated back-propagation
    through time, as the official code carries them), the spans of each block, and the summed span loss and reads."""
    outputs, spans, span_loss_sum, read_count = [], [], 0, 0
    # One split, not a slice per block: a slice's gradient is a zero tensor of the whole input per block.
    inputs = hidden_states.split([block.positions.shape[1] for block in blocks], dim=1)
    for index, block in enumerate(blocks):
        output, memory, block_spans, block_span_loss, block_read = layer(
            inputs[index], block.positions, block.valid, block.cos, block.sin, memory=memory,
            first_positions=block.first_positions, recompute_memory=recompute_memory and index == 0,
            keep_span_inputs=keep_span_inputs, last_block=index == len(blocks) - 1, **options,
        )  # fmt: skip
        outputs.append(output)
        if block_spans is not None:
            spans.append(block_spans)
        span_loss_sum = span_loss_sum + block_span_loss
        read_count = read_count + block_read
    hidden_states = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
    return hidden_states, memory.detached(keep_span_inputs), spans, span_loss_sum, read_count


def compact_memories(memories: list[ExpireSpanMemory], widths: list[int]) -> list[ExpireSpanMemory]:
    """Delete the slots marked invalid in every layer (compiled, the layers mask their dead memories instead of
    deleting them); `widths`: per layer, the most valid slots of any row, read by the caller in one go (a graph
    break, which torch.compile takes best in the compiled frame itself)."""
    return [memory.select(memory.valid, width) for memory, width in zip(memories, widths)]
