"""Expire-Span attention of a decoding step: one query t per row, after every key, without gradients (SPEC §2, §8).

A step's query reads each key i at the distance d_i = t − i ≥ 0 with Eq. 5's mask m_i = clamp(1 + (e_i − d_i) / R,
0, 1) and, with the official options, the positions' row p_{d_i} and the renormalisation ε (see `official.py` for
the weights). What a key contributes besides its key and value vectors — m, the softmax's bias and the positions'
row, `OneQueryTerms` — depends only on its span and distance, not on the layer's input: a decoding step computes
the terms of every layer's keys in one pass over them side by side (`one_query_terms`, ~10 operations a step where
each layer took as many), and each layer's attention reads its columns (`plain_one_query_attention`: SDPA with the
bias log m; `official_one_query_attention`: SDPA too, with ε in the bias and the values' weights).
`expire_span_attention_decoding` and `expire_span_attention_official_decoding` do both for one layer. On a CPU a step
of a small model is bound by its number of operations, not their arithmetic: every operation a step does not run is
time.
Tested against the general attention in tests/kernels/test_expire_attention.py.
"""

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from memlm.kernels import in_dtype, sums_are_finite

from .reference import _compute_dtype

__all__ = [
    "OneQueryTerms",
    "expire_span_attention_decoding",
    "expire_span_attention_official_decoding",
    "official_one_query_attention",
    "one_query_terms",
    "padded_position_table",
    "plain_one_query_attention",
]


def padded_position_table(table: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[0; table; 0] (P + 2, d) in `dtype`: row d holds p_d for the distances d = 1..P, and a zero row stands for the
    token itself (d = 0) and for every key farther than P, so that a key's positions' row is min(t − i, P + 1)."""
    zero = table.new_zeros(1, table.shape[1], dtype=dtype)
    return torch.cat([zero, in_dtype(table, dtype), zero])


class OneQueryTerms(NamedTuple):
    """What a decoding step's attention reads of its keys besides their vectors: Eq. 5's mask m (B, N) (0 at a hidden
    key); shaped as the scores of one query (B, 1, 1, N), which SDPA and the heads broadcast, the softmax's bias
    (log m; with ε log(m + ε), −inf at a hidden key) and, with ε, the values' weights m / (m + ε) (`weighing`; see
    `official_one_query_attention`); and with the learned positions each key's row p_{t−i} of the padded table
    (`positions`, (B, 1, N, d), broadcast over the heads), which the attention adds to the key: q·k_i + q·p_{t−i} =
    q·(k_i + p_{t−i}), one product (None without positions)."""

    mask: torch.Tensor | None
    bias: torch.Tensor
    positions: torch.Tensor | None = None
    weighing: torch.Tensor | None = None

    def split(self, widths: list[int]) -> list["OneQueryTerms"]:
        """What each of several layers' attentions reads of terms computed for their keys side by side, `widths[l]`
        keys each, in order: views (one `split_with_sizes` per tensor, not a `narrow` per layer), without the (B, N)
        mask, which only the counts read."""
        count = len(widths)
        bias = self.bias.split_with_sizes(widths, 3)
        positions = [None] * count if self.positions is None else self.positions.split_with_sizes(widths, 2)
        weighing = [None] * count if self.weighing is None else self.weighing.split_with_sizes(widths, 3)
        return [
            OneQueryTerms(None, layer_bias, layer_positions, layer_weighing)
            for layer_bias, layer_positions, layer_weighing in zip(bias, positions, weighing)
        ]


def one_query_terms(spans, distance, key_valid, ramp: float, dtype: torch.dtype, epsilon: float = 0.0,
                    padded_table=None, attend_to_self: bool = True) -> OneQueryTerms:  # fmt: skip
    """The `OneQueryTerms` in `dtype` of keys with `spans` (B, N) at `distance` t − i >= 0 (B, N) from the query,
    `key_valid` None when every key is valid; with the learned positions' `padded_table` (`padded_position_table`);
    without `attend_to_self`, the key at distance 0 hidden."""
    ramp_position = (in_dtype(spans, dtype) - distance).div_(ramp).add_(1)  # 1 + (e_i − (t − i)) / R
    mask = (ramp_position if key_valid is None else torch.where(key_valid, ramp_position, 0)).clamp_(0, 1)  # Eq. 5
    if not attend_to_self:
        mask.masked_fill_(distance == 0, 0)  # the token's own key, hidden
    shape = (mask.shape[0], 1, 1, mask.shape[1])
    weighing = None
    if epsilon > 0:  # the bias log(m + ε) and the values' weights m / (m + ε) (see `official_one_query_attention`)
        shifted = mask + epsilon
        bias = torch.where(mask > 0, shifted.log(), -math.inf).view(shape)
        weighing = (mask / shifted).view(shape)
    else:
        bias = mask.log().view(shape)  # log 0 = −inf
    if padded_table is None:
        return OneQueryTerms(mask, bias, weighing=weighing)
    rows = distance.clamp(max=padded_table.shape[0] - 1)  # p_{t−i}: row t − i, the zero row past P
    positions = padded_table.index_select(0, rows.flatten()).view(shape[0], 1, shape[3], padded_table.shape[1])
    return OneQueryTerms(mask, bias, positions, weighing)


def plain_one_query_attention(query, key, value, bias, checked: bool = True):
    """Softmax attention of one query per row (B, H, 1, d) with the bias log m (B, 1, 1, N) (Eqs. 4–5): the output,
    or None when it is not finite (a NaN reaches it, or no key is visible). Unless `checked`, the output as it is (a
    caller that checks a later sum, which a non-finite output reaches, instead)."""
    output = F.scaled_dot_product_attention(query, key, value, attn_mask=in_dtype(bias, query.dtype))
    return output if not checked or sums_are_finite(output) else None


def official_one_query_attention(query, key, value, terms: OneQueryTerms, epsilon: float = 0.0,
                                 checked: bool = True):  # fmt: skip
    """The official weights (`official.py`) of one query per row (B, H, 1, d) over keys read with `terms` (in their
    dtype, float32 or float64), w_i = m_i p_i / (Σ_j m_j p_j + ε) with p the softmax over the visible keys (m > 0), as
    one SDPA call: with Z = Σ_visible e^{s_j},
        w_i = m_i e^{s_i} / (Σ_j m_j e^{s_j} + ε Z) = (m_i + ε) e^{s_i} / Σ_visible (m_j + ε) e^{s_j} · m_i / (m_i + ε),
    the softmax of s + log(m + ε) over values weighed by m / (m + ε); with ε = 0 the softmax of s + log m. The scores
    s_i = q·(k_i + p_{t−i}) / √d take each key's positions' row added to it. The output in the query's dtype, or None
    when it is not finite (unless `checked`, as `plain_one_query_attention`)."""
    dtype, output_dtype = terms.bias.dtype, query.dtype
    query, key, value = (in_dtype(tensor, dtype) for tensor in (query, key, value))
    if terms.positions is not None:  # q·k_i + q·p_{t−i} = q·(k_i + p_{t−i}), one product
        key = key + terms.positions
    if epsilon > 0:
        value = value * terms.weighing.mT  # (B, 1, N, 1), broadcast over the heads and the features
    output = F.scaled_dot_product_attention(query, key, value, attn_mask=terms.bias)
    return in_dtype(output, output_dtype) if not checked or sums_are_finite(output) else None


def expire_span_attention_decoding(query, key, value, spans, distance, key_valid, ramp: float):
    """A decoding step's Expire-Span attention of one layer: one query t per row, after every key (``distance``
    t − i >= 0, (B, N)), the token's own key among them, valid, no distance limit; `key_valid` None when every key is
    valid. The same bias and product as `expire_span_attention_sdpa` for such a query, bit for bit, in fewer passes:
    the visible keys are the valid ones, and the query sees its own key (m >= 1), so no row needs zeroing. Returns the
    output and the soft mask m (B, N) (Eq. 5, 0 at an invalid key; float32, or float64 with float64 spans), from
    which the caller counts the reads and the pairs on the ramp; None when the output is not finite: the caller then
    takes `expire_span_attention`, which keeps a non-finite key, value or span where it is."""
    dtype = torch.float64 if spans.dtype == torch.float64 else torch.float32
    terms = one_query_terms(spans, distance, key_valid, ramp, dtype)
    output = plain_one_query_attention(query, key, value, terms.bias)
    return None if output is None else (output, terms.mask)


def expire_span_attention_official_decoding(query, key, value, spans, distance, key_valid, ramp: float, table=None,
                                            attend_to_self=True, renormalization_epsilon=0.0, padded_table=None):  # fmt: skip
    """A decoding step's attention of one layer with the official options: one query t per row, after every key
    (``distance`` t − i >= 0, (B, N)), the token's own key the only one at distance 0, no distance limit; `key_valid`
    None when every key is valid; `table` the learned relative positions (P, d) or None, `padded_table` the table as
    `padded_position_table` pads it (padded here when not given, or not in the compute dtype).
    `expire_span_attention_official`'s weights (see `official.py`) for that query in fewer passes: no (T, N) pair
    terms, no band search, no 1/m (with ε, m weighs the softmax after). Returns the output and the soft mask m (B, N)
    it attended with (Eq. 5; 0 at a hidden key: invalid, or the token's own without `attend_to_self`), for the caller
    to count the reads; None when the output is not finite (a hidden key's NaN reaches it, or no key is visible): the
    caller then takes `expire_span_attention`."""
    dtype = _compute_dtype(query, key, value, spans)
    if table is not None and (padded_table is None or padded_table.dtype != dtype):
        padded_table = padded_position_table(table, dtype)
    terms = one_query_terms(spans, distance, key_valid, ramp, dtype, renormalization_epsilon,
                            padded_table if table is not None else None, attend_to_self)  # fmt: skip
    output = official_one_query_attention(query, key, value, terms, renormalization_epsilon)
    return None if output is None else (output, terms.mask)
