"""What a Feedback step adds to its attention scores and does to its weights, for the step, the reference loop and the
hand-written backward alike: the visibility of the memories (distance 1..τ), a learned bias per distance and head,
the official code's learned relative positions q_t · p_{t−i} / √d (`key_pe`), the adaptive span's trimmed window and
mask (Sukhbaatar et al., 2019), and dropout on the weights, with the gradients of the terms that learn. The functions
take the model (`FeedbackTransformerModel`), whose weights and layout options they read."""

import functools
import math

import torch

from ..expire_attention.reference import (
    relative_position_index,
    relative_position_scores,
    relative_position_scores_backward,
)
from .reference import WeightsTransform, adaptive_span_mask, adaptive_span_mask_backward
from .tape import ScoreTerms


def adaptive_span_window(span_ratio: torch.Tensor, memory_span: int, ramp, trim_step: int) -> int | torch.Tensor:
    """How many of the last τ memories a layer reads when the official code trims its window
    (`AdaptiveSpan.get_trim_len`): τ − n with n = ⌊min(τ − 1, τ − S) / s⌋ · s and S = min(τ, ⌈max(z) · τ + R⌉) the
    layer's longest span with its ramp (beyond it every head's mask is 0). While compiling, as a 0-d tensor (no
    value is read on the host), computed in float64 as Python computes the int."""
    if torch.compiler.is_compiling():
        longest = (span_ratio.max().to(torch.float64) * memory_span + ramp).ceil().clamp(0, memory_span)
        trimmed = torch.div((memory_span - longest).clamp(max=memory_span - 1), trim_step, rounding_mode="floor")
        return memory_span - trimmed.long() * trim_step
    longest = max(0, min(memory_span, math.ceil(span_ratio.max().item() * memory_span + ramp)))
    trimmed = math.floor(min(memory_span - 1, memory_span - longest) / trim_step) * trim_step
    return memory_span - trimmed


def memory_bias(model, layer, window, positions: torch.Tensor) -> torch.Tensor:
    """(B, H or 1, W) additive bias of one step: −inf for empty slots and memories outside [t − τ, t − 1], plus
    `layer`'s learned relative bias when configured (`layer=None`: the visibility alone)."""
    _, _, slot_positions, slot_valid = window
    distance = positions[:, None] - slot_positions  # (B, W)
    visible = slot_valid & (distance >= 1) & (distance <= model.memory_span)
    if layer is not None and hasattr(layer.attention, "relative_bias"):
        index = (distance - 1).clamp(0, model.memory_span - 1)
        bias = layer.attention.relative_bias[:, index].permute(1, 0, 2)  # (B, H, W)
        return bias.to(torch.promote_types(bias.dtype, torch.float32)).masked_fill(~visible[:, None], -math.inf)
    return torch.where(visible[:, None], 0.0, -math.inf)  # the visibility alone, in the default float dtype


def weights_transform(model, attention, window, positions: torch.Tensor, span_ratio=None, seed: int | None = None):
    """What the official code does to the softmax weights (B·H, W) of `attention` (a `FeedbackAttention`) before
    reading the values, as a `WeightsTransform`, or None: the adaptive span's mask and renormalisation, then dropout
    (its mask drawn from `seed`)."""
    adaptive = hasattr(attention, "span_ratio")
    dropout = not model.attention_dropout_on_context and model.training and attention.dropout.p > 0
    if not adaptive and not dropout:
        return None
    mask = None
    if adaptive:
        _, _, slot_positions, _ = window
        distance = positions[:, None] - slot_positions  # (B, W)
        span_ratio = attention.span_ratio if span_ratio is None else span_ratio
        mask = adaptive_span_mask(span_ratio, distance, model.memory_span, model.config.adaptive_span_ramp)
        mask = mask.flatten(0, 1)  # (B·H, W)
    return WeightsTransform(mask, model.config.renormalization_epsilon, attention.dropout.p if dropout else 0.0,
                            seed if dropout else None)  # fmt: skip


def score_terms(model, layer_idx: int, store, group: int, step: int, positions: torch.Tensor, query: torch.Tensor,
                table: torch.Tensor | None, span_ratio: torch.Tensor | None, prepared=None,
                seed: int | None = None):  # fmt: skip
    """A step's bias (B·H, W) and `WeightsTransform` in the official layouts (a `ScoreTerms.build`): the visibility,
    the learned relative positions q_t · p_{t−i} / √d from `table`, the adaptive span's trimmed window, and its mask
    from `span_ratio`; and a function that turns the gradients of the bias and the mask into those of the query, the
    table and the span ratios. `prepared`: the step's visibility bias and index of the distances, which its layers
    share (made again when None, in the backward); `seed`: the dropout mask's (`weights_dropout_seed`)."""
    batch_size, heads, head_dim = positions.shape[0], model.num_heads, model.head_dim
    window = store.window(group, step)
    distance = positions[:, None] - window[2]  # (B, W)
    bias, relative = prepared if prepared is not None else (None, None)
    if bias is None:
        bias = memory_bias(model, None, window, positions).expand(batch_size, heads, -1).flatten(0, 1)
    scale = head_dim**-0.5
    heads_query = query.view(batch_size, -1, head_dim)
    if table is not None:  # the official position term q_t · p_{t−i} / √d
        if relative is None:
            relative = relative_position_index(distance[:, None], model.memory_span)
        by_row = not model.training  # (a decoding step's few rows, see `_position_products`)
        bias = bias + relative_position_scores(table, heads_query, relative, by_row).flatten(0, 1) * scale
    if model.read_windows is not None:  # the adaptive span's trimmed window: memories 1..n steps back
        outside = (distance > model.read_windows[layer_idx])[:, None].expand(-1, heads, -1)
        bias = bias.masked_fill(outside.flatten(0, 1), -math.inf)
    transform = weights_transform(model, model.layers[layer_idx].attention, window, positions, span_ratio, seed)

    def gradients(grad_bias, grad_mask, needs_table: bool, needs_span_ratio: bool):
        grad_query = grad_table = grad_span_ratio = None
        if table is not None:
            grad_scores = grad_bias.view(batch_size, heads, -1) * scale
            grad_query, grad_table = relative_position_scores_backward(table, heads_query, relative, grad_scores,
                                                                       needs_table)  # fmt: skip
            grad_query = grad_query.flatten(0, 1)
        if grad_mask is not None and needs_span_ratio:
            grad_span_ratio = adaptive_span_mask_backward(
                span_ratio, distance, model.memory_span, model.config.adaptive_span_ramp,
                grad_mask.view(batch_size, heads, -1),
            )  # fmt: skip
        return grad_query, grad_table, grad_span_ratio

    return bias.to(query.dtype), transform, gradients


def read_bias(model, layer_idx: int, store, group: int, step: int, positions: torch.Tensor, query: torch.Tensor):
    """The bias (B·H, W) that layer `layer_idx`'s read at step `step` added to its scores, built again as the step
    builds it (the visibility, the relative bias or the learned relative positions, the trimmed window): the
    hand-written backward keeps a step's query, not its weights over the window."""
    if model.shared_bias and not model.default_step:
        return score_terms(model, layer_idx, store, group, step, positions, query, model.relative_positions, None)[0]
    window = store.window(group, step)
    bias = memory_bias(model, None if model.shared_bias else model.layers[layer_idx], window, positions)
    bias = bias.expand(positions.shape[0], model.num_heads, -1).flatten(0, 1)
    if not model.default_step and model.read_windows is not None:  # the adaptive span's trimmed window
        outside = (positions[:, None] - window[2] > model.read_windows[layer_idx])[:, None]
        bias = bias.masked_fill(outside.expand(-1, model.num_heads, -1).flatten(0, 1), -math.inf)
    return bias.to(query.dtype)


def weights_dropout_seed(model, layer_idx: int, step: int, base: int | None = None) -> int | None:
    """The seed of layer `layer_idx`'s dropout mask on the attention weights at step `step` of the model's forward, or
    of the forward whose `dropout_base_seed` was `base` (None outside a forward that drops the weights): the forward's
    base plus the pair's index, so that a backward draws the mask again instead of keeping it."""
    base = model.dropout_base_seed if base is None else base
    return None if base is None else base + step * len(model.layers) + layer_idx


def step_terms(model, store, step: int, positions: torch.Tensor) -> tuple:
    """What every layer of a step adds alike to its scores (the slots of every key/value set hold the same
    positions): without a relative bias per layer the visibility bias (B·H, W); with the learned relative positions
    either the index of the distances t − i (B, 1, W) or, where a read adds them to its keys (`keys_take_positions`),
    each slot's row p_{t−i} (B, 1, W, d); each None when not shared. Returns (bias, index, rows)."""
    bias = relative = rows = None
    if model.shared_bias:
        bias = memory_bias(model, None, store.window(0, step), positions)
        bias = bias.expand(positions.shape[0], model.num_heads, -1).flatten(0, 1)
    if not model.default_step and model.relative_positions is not None:
        distance = positions[:, None] - store.window(0, step)[2]  # (B, W)
        if keys_take_positions(model, store):
            table = model.padded_positions(store.layers[0].keys.dtype)
            # Row t − i of [0; p_1..p_P; 0]: the zero row for the token itself and beyond P (the bias hides them).
            index = distance.clamp(0, table.shape[0] - 1)
            rows = table.index_select(0, index.flatten()).view(distance.shape[0], 1, distance.shape[1], -1)
        else:
            relative = relative_position_index(distance[:, None], model.memory_span)
    return bias, relative, rows


def keys_take_positions(model, store) -> bool:
    """Whether a step's reads add the learned relative positions to their keys, q·k_i + q·p_{t−i} = q·(k_i + p_{t−i}),
    and read the memory with one fused attention (SDPA) instead of writing out the position scores: in the ring
    (no gradients), with nothing done to the softmax weights (no adaptive span, no dropout on them)."""
    return (
        getattr(store, "adds_positions_to_keys", False) and not model.adaptive_span and model.dropout_base_seed is None
    )


def read_memory(model, layer_idx: int, store, step: int, positions: torch.Tensor, query: torch.Tensor, shared: tuple):
    """Layer `layer_idx`'s read of the memory at step `step` (query (B·H, d)), with the terms of its scores and
    weights; `shared`: the step's `step_terms`. Returns the context (B·H, d)."""
    group = 0 if model.memory_groups == 1 else layer_idx
    attention = model.layers[layer_idx].attention
    bias, relative, rows = shared
    if rows is not None:  # (the official layouts' decoding: no other terms, see `keys_take_positions`)
        return store.read(group, step, query, bias.to(query.dtype), key_positions=rows)
    if bias is None:  # each layer's own relative bias (and the adaptive span's trimmed window)
        bias = read_bias(model, layer_idx, store, group, step, positions, query)
    if model.default_step:  # (decoding's path: no dropout on the weights, no other terms)
        return store.read(group, step, query, bias.to(query.dtype))
    seed = weights_dropout_seed(model, layer_idx, step)
    if not model.shared_bias:  # the official blocks with a relative bias per layer
        transform = weights_transform(model, attention, store.window(group, step), positions, seed=seed)
        return store.read(group, step, query, bias, transform)
    # The official layouts: the bias and the transform built by the store's read. Without a trimmed window the layers
    # add only finite terms to the visibility bias, so its rows that see nothing are those of every layer.
    build = functools.partial(score_terms, model, layer_idx, store, group, step, positions, seed=seed)
    blind_from = bias if model.read_windows is None else None
    terms = ScoreTerms(build, model.relative_positions, getattr(attention, "span_ratio", None), (bias, relative),
                       blind_from)  # fmt: skip
    return store.read(group, step, query, None, terms=terms)
