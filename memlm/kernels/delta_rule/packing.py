"""Padding and packed documents for the delta rule: which tokens of a (B, T) batch run, in which layout.

A DeltaNet layer must never let a padding token write into its memory, and documents packed back to back into one
row (position_ids restarting at 0, as 🤗's DataCollatorWithFlattening builds them) must each start from an empty
memory. :class:`PaddingPacker` turns an attention mask (and the documents' starts) into the layout the layers run
on, and back:

- packed: the real tokens of all rows go back to back into one row of shape (1, N, D), with ``cu_seqlens`` marking
  where each sequence (a row, or a document in it) starts; the kernels take ``cu_seqlens`` and no padding is
  computed;
- reordered: each row's real tokens move, in order, to the front of the row, and the padding behind them is masked
  with ``attention_mask`` (the PyTorch backend, which runs all rows in one batched call).

This is machinery, not model: ``modeling_deltanet.py`` builds one per forward that has padding or documents.
"""

import torch
import torch.nn.functional as F

__all__ = ["PaddingPacker"]


class PaddingPacker:
    """How a padded batch, or a row of packed documents, runs. Padding is skipped: each row's real tokens give the
    outputs and the memory they give alone, wherever the padding sits (left, right or between tokens). Documents
    packed into a row (position_ids restarting, as 🤗's DataCollatorWithFlattening builds them) each start from an
    empty memory, and the row's memory afterwards is its last document's.

    - Packed (documents, or padding on the Triton delta rule): the real tokens of all rows go back to back into one
      row, with `cu_seqlens` marking where each sequence (a row, or a document in it) starts, so the padding costs
      nothing; the outputs at padding are zeros.
    - Otherwise each row's real tokens move, in order, to the front of the row (a stable reordering, undone at the
      end) and the padding behind them is masked: it writes nothing into the memory.
    """

    def __init__(self, attention_mask: torch.Tensor, pack: bool, document_starts: torch.Tensor | None = None):
        self.shape = attention_mask.shape
        self.lengths = attention_mask.sum(1)
        self.last_sequences = None  # with documents: the index of each row's last sequence
        if pack or document_starts is not None:
            flat_mask = attention_mask.flatten()
            self.indices = flat_mask.nonzero().squeeze(1)
            row_offsets = F.pad(self.lengths.cumsum(0), (1, 0))
            self.cu_seqlens = row_offsets.to(torch.int32)
            if document_starts is not None:
                packed_positions = flat_mask.long().cumsum(0) - 1
                starts = torch.cat([row_offsets[:-1], packed_positions[document_starts.flatten()]]).sort().values
                self.cu_seqlens = torch.cat([starts, row_offsets[-1:]]).to(torch.int32)
                self.last_sequences = (1 + document_starts.sum(1)).cumsum(0) - 1  # a row's sequences are adjacent
            self.attention_mask = None
            self.cu_seqlens_cpu = self.cu_seqlens.tolist()  # read back once for all layers, not once per layer
        else:
            # One token per row (a decoding step) is where it belongs: no reordering (and no sort in a compiled step).
            single = self.shape[1] == 1
            self.order = None if single else torch.sort((~attention_mask).to(torch.uint8), dim=1, stable=True).indices
            self.attention_mask = torch.arange(self.shape[1], device=attention_mask.device) < self.lengths[:, None]
            self.cu_seqlens = self.cu_seqlens_cpu = None

    def row_states(self, state: torch.Tensor | None) -> torch.Tensor | None:
        """Per-sequence memory (fast weights or convolution tails) → each row's: its last sequence's."""
        if state is None or self.last_sequences is None:
            return state
        return state[self.last_sequences]

    def gather(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """(B, T, D) in the caller's order → the layout the layers run on: (1, N, D) packed, else (B, T, D)."""
        if self.cu_seqlens is not None:
            return hidden_states.flatten(0, 1)[self.indices][None]
        if self.order is None:
            return hidden_states
        return hidden_states.gather(1, self.order[..., None].expand_as(hidden_states))

    def as_rows(self, packed: torch.Tensor, dim: int) -> torch.Tensor:
        """A packed tensor (batch 1, the N real tokens along `dim`, one sequence per row) → (B, ..., T, ...): each
        row's real tokens first, in order, and zeros after them, the layout of the reordered (unpacked) runs."""
        batch_size, length = self.shape
        steps = torch.arange(length, device=packed.device)
        real = steps < self.lengths.to(packed.device)[:, None]  # (B, T)
        index = torch.where(real, self.cu_seqlens[:-1, None].to(packed.device).long() + steps, 0)
        rows = packed[0].index_select(dim - 1, index.flatten())  # N → B·T along dim − 1
        rows = rows.unflatten(dim - 1, (batch_size, length)).movedim(dim - 1, 0)
        shape = [batch_size] + [1] * (rows.dim() - 1)
        shape[dim] = length
        return torch.where(real.view(shape), rows, torch.zeros((), dtype=rows.dtype, device=rows.device))

    def scatter(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The inverse of `gather`: back to (B, T, D) in the caller's order."""
        if self.cu_seqlens is not None:
            width = hidden_states.shape[-1]
            restored = hidden_states.new_zeros(self.shape.numel(), width).index_copy(0, self.indices, hidden_states[0])
            return restored.view(*self.shape, width)
        if self.order is None:
            return hidden_states
        return hidden_states.new_empty(hidden_states.shape).scatter(
            1, self.order[..., None].expand_as(hidden_states), hidden_states
        )
