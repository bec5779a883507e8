"""Readable definition of the Feedback recurrence (SPEC §3).

Fan, Lavril, Grave, Joulin & Sukhbaatar (ICLR 2021), *Addressing Some Limitations of Transformers with Feedback
Memory*, Sec. 3. At step t every layer l attends, with a query from its input, over the memories of the last τ steps,
and the step's memory mixes the embedding and every layer's output (Eq. 1)::

    z_t^l = Attn(x_t^{l−1}, {m_{t−τ}, …, m_{t−1}})        keys and values are projections of the memories
    m_t   = Σ_{l=0..L} softmax(w)_l · x_t^l

m_t needs the top layer at t, so the loop over t is sequential, in training too. The step itself (layers, the mix,
the projections) is the model's `step` function; this file is the loop around it and the memory it reads and writes:
the carried memories as tensors and Python lists with one entry per step, and plain autograd. Every step reads every memory so far; which ones it sees is
decided by positions alone (`bias` is −inf outside [t − τ, t − 1], for padding and for empty slots). Slow (O(T²)) and
plain on purpose: the fast path of `memlm.kernels.feedback` is tested against it.
"""

from typing import NamedTuple

import torch

__all__ = ["ListMemory", "WeightsTransform", "feedback_recurrence_reference"]


def adaptive_span_mask(span_ratio: torch.Tensor, distance: torch.Tensor, memory_span: int, ramp) -> torch.Tensor:
    """The soft mask of the adaptive span (Sukhbaatar et al., 2019: m_z(x) = clamp((R + z − x)/R, 0, 1)) as the
    official code computes it, m(d) = clamp((1 − d + z·τ)/R + 1, 0, 1) for a memory d steps back, in its order of
    operations (its template holds 1 − d for the window's slots): span_ratio (H,), distance (B, W) → (B, H, W)."""
    template = (1 - distance).to(span_ratio.dtype)[:, None]  # (B, 1, W)
    return ((template + span_ratio[None, :, None] * memory_span) / ramp + 1).clamp(0, 1)


def adaptive_span_mask_backward(span_ratio: torch.Tensor, distance: torch.Tensor, memory_span: int, ramp,
                                grad_mask: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """The gradient of `adaptive_span_mask` for the span ratios (H,), given the mask's (B, H, W): τ / R wherever the
    clamp passes its input (0 ≤ · ≤ 1, as autograd's clamp), summed over the rows and slots."""
    template = (1 - distance).to(span_ratio.dtype)[:, None]  # (B, 1, W)
    ramp_position = (template + span_ratio[None, :, None] * memory_span) / ramp + 1
    passes = (ramp_position >= 0) & (ramp_position <= 1)
    return torch.where(passes, grad_mask.to(span_ratio.dtype), 0.0).sum((0, 2)) * memory_span / ramp


class WeightsTransform(NamedTuple):
    """What the official code does to a step's softmax weights a (N, W) before they read the values: the adaptive
    span's soft mask m (N, W) and renormalisation a' = a·m / (Σ a·m + ε) (Sukhbaatar et al., 2019, Sec. 3.1; a row
    whose Σ a·m + ε is 0 reads nothing), then dropout with probability `dropout` (0: none). Calling it applies it
    with autograd (the readable path); the training tape differentiates the same formula by hand (`tape._TapeRead`).
    `seed`: the dropout mask is drawn from a generator seeded with it (None: from the global one), so that a backward
    draws it again instead of keeping it.
    """

    mask: torch.Tensor | None
    epsilon: float
    dropout: float
    seed: int | None = None

    def dropout_mask(self, like: torch.Tensor) -> torch.Tensor | None:
        """The kept entries scaled by 1 / (1 − p), drawn as `F.dropout` draws them (the same random numbers for the
        same shape), from `seed`'s own generator when given: the same mask for the same seed, shape and dtype."""
        if self.dropout == 0:
            return None
        generator = None if self.seed is None else torch.Generator(like.device).manual_seed(self.seed)
        return torch.empty_like(like).bernoulli_(1 - self.dropout, generator=generator).div_(1 - self.dropout)

    def __call__(self, weights: torch.Tensor) -> torch.Tensor:
        if self.mask is not None:
            weights = weights * self.mask.to(weights.dtype)
            denominator = weights.sum(-1, keepdim=True) + self.epsilon
            weights = weights / denominator.masked_fill(denominator == 0, 1.0)
        kept = self.dropout_mask(weights)
        return weights if kept is None else weights * kept


class ListMemory:
    """The memory as the carried prefix (the cache's slots, as tensors) and Python lists with one entry per new memory:
    keys and values (G, B, H, d) (G key/value sets: one when the layers share their projections), the position (B,)
    and whether it holds a memory (B,; False for padding); and, when the model carries them (`memory_carry=
    "hidden_states"`), the memories' hidden states (B, D). A step reads the prefix and the new memories concatenated,
    so it costs O(τ + t) whatever the prefix holds."""

    def __init__(self, cache_layers, like: torch.Tensor):
        self.batch_size, self.device, self.dtype = like.shape[0], like.device, like.dtype
        self.keys, self.values, self.positions, self.valid, self.hidden = [], [], [], [], []
        self.prefix = None
        first = cache_layers[0]
        if first.keys is not None:  # carried from the cache: every slot, its position says if it is seen
            hidden = getattr(first, "hidden", None)
            self.prefix = {
                "keys": torch.stack([layer.keys for layer in cache_layers]).to(like.dtype),  # (G, B, H, P, d)
                "values": torch.stack([layer.values for layer in cache_layers]).to(like.dtype),
                "positions": first.positions,  # (B, P)
                "valid": first.valid,
                "hidden": hidden.to(like.dtype) if hidden is not None else None,  # (B, P, D)
            }

    def __len__(self) -> int:
        return (self.prefix["positions"].shape[1] if self.prefix is not None else 0) + len(self.positions)

    def _joined(self, name: str, dim: int, pick=lambda entry: entry) -> torch.Tensor | None:
        """The prefix's and the new memories' `name` along `dim`, the new ones stacked there."""
        parts = [pick(self.prefix[name])] if self.prefix is not None and self.prefix[name] is not None else []
        if getattr(self, name):
            parts.append(torch.stack([pick(entry) for entry in getattr(self, name)], dim=dim))
        return torch.cat(parts, dim=dim) if parts else None

    def window(self, group: int, step: int):
        """Positions and validity (B, W) of the memories a step reads: all of them."""
        if not len(self):
            empty = torch.zeros(self.batch_size, 0, dtype=torch.long, device=self.device)
            return None, None, empty, empty.bool()
        return None, None, self._joined("positions", 1), self._joined("valid", 1)

    def read(self, group: int, step: int, query: torch.Tensor, bias: torch.Tensor | None, transform=None,
             terms=None) -> torch.Tensor:  # fmt: skip
        """softmax(q·Kᵀ/√d + bias) · V for query (B·H, d) and bias (B·H, W); zero where no memory is visible (the
        paper's "no attention term" before the first memory). `transform`: a `WeightsTransform` applied to the
        softmax weights (B·H, W) before they read the values (the adaptive span's mask, dropout on the weights);
        `terms` (a `memlm.kernels.feedback.tape.ScoreTerms`): what builds the bias and the transform instead."""
        if not len(self):
            return torch.zeros_like(query)
        if terms is not None:
            bias, transform = terms(query)
        keys = self._joined("keys", 2, lambda entry: entry[group]).flatten(0, 1)  # (B·H, W, d)
        values = self._joined("values", 2, lambda entry: entry[group]).flatten(0, 1)
        scores = torch.einsum("nd,nwd->nw", query, keys) * query.shape[-1] ** -0.5 + bias
        seen = (bias > float("-inf")).any(-1, keepdim=True)
        weights = torch.softmax(scores.masked_fill(~seen, 0.0), dim=-1) * seen
        if transform is not None:
            weights = transform(weights)
        return torch.einsum("nw,nwd->nd", weights, values)

    def write(self, step: int, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
              hidden: torch.Tensor | None = None):  # fmt: skip
        """Append m_t's keys and values (G, B, H, d) at positions (B,), and its hidden state (B, D) when given;
        padding is appended too, never seen."""
        self.keys.append(keys)
        self.values.append(values)
        self.positions.append(positions)
        self.valid.append(valid)
        if hidden is not None:
            self.hidden.append(hidden)

    def carried(self, indices: list[int]) -> tuple:
        """The memories at `indices` (in the order prefix, then new): keys and values (G, B, H, W, d), positions and
        validity (B, W), and their hidden states (B, W, D) when every memory has one."""
        keys, values = self._joined("keys", 3)[:, :, :, indices], self._joined("values", 3)[:, :, :, indices]
        window = (keys, values, self._joined("positions", 1)[:, indices], self._joined("valid", 1)[:, indices])
        hidden = self._joined("hidden", 1)
        if hidden is not None and hidden.shape[1] == len(self):
            window += (hidden[:, indices],)
        return window


def feedback_recurrence_reference(step, inputs_embeds, positions, valid, cache_layers, next_positions, memory_span,
                                  carry_from=None):  # fmt: skip
    """Run `step` over the T positions with a `ListMemory`.

    Args:
        step: the model's step function, `step(embeddings (B, D), positions (B,), valid (B,), memory, t)` →
            (top layer's output (B, D), every layer's output).
        inputs_embeds: (B, T, D). positions, valid: (B, T); padding has position −1 and valid False.
        cache_layers: the key/value sets entering the sequence (`keys` None: empty).
        next_positions: (B,) the position of each row's next real token before this call.
        memory_span: τ.
        carry_from: (B,) positions from which the carried memories must stay visible (default: each row's next real
            token after this call); a cache that may roll tokens back carries those its earliest next token sees.

    Returns:
        The top layer's outputs (B, T, D), the list of every step's layer outputs, and the memory to carry: keys and
        values (G, B, H, W, d), positions and validity (B, W) of the memories some row can still see next, and their
        hidden states (B, W, D) when the step writes them.
    """
    memory = ListMemory(cache_layers, inputs_embeds)
    outputs, states = [], []
    for t, (embeddings, step_positions, step_valid) in enumerate(
        zip(inputs_embeds.unbind(1), positions.unbind(1), valid.unbind(1))
    ):
        hidden_states, layer_states = step(embeddings, step_positions, step_valid, memory, t)
        outputs.append(hidden_states)
        states.append(layer_states)
    _, _, memory_positions, memory_valid = memory.window(0, len(outputs))
    following = next_positions + valid.sum(1) if carry_from is None else carry_from
    carried = (memory_valid & (following[:, None] - memory_positions <= memory_span)).any(0).nonzero()[:, 0].tolist()
    window = memory.carried(carried)
    return torch.stack(outputs, dim=1), states, window
