"""Expire-Span: a Transformer whose memories learn when to expire.

Sukhbaatar, Ju, Poff, Roller, Szlam, Weston & Fan (ICML 2021), "Not All Memories are Created Equal: Learning to
Forget by Expiring". Every memory h_i of a layer gets a span e_i = L·σ(w·h_i/p + b) (paper Eq. 3); query t reads it
through the soft mask m_ti = clamp(1 + (e_i − (t − i))/R, 0, 1) (Eq. 5), renormalised over the memories (Eq. 4),
which is attention with the additive bias log m_ti. A memory with m = 0 never comes back and is deleted.

The file reads top to bottom: outputs → span predictor → attention → decoder layer → the cache (`cache`) →
PreTrainedModel → ExpireSpanModel → ExpireSpanForCausalLM. The machinery around the model lives in
`memlm.kernels.expire_attention`: the attention itself, the memories of a layer with their pruning (`memory.py`) and
the block-parallel forward (`blocks.py`).
"""

import dataclasses
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_utils import slice_logits_to_keep
from transformers.utils import logging

from ..compat import (
    CACHE_NAMES,
    BaseModelOutputWithPast,
    CausalLMOutputWithPast,
    is_exporting,
    model_output,
    resolve_cache_argument,
    with_cache,
)
from ..configuration.configuration_expire_span import ExpireSpanConfig
from ..export import RemoteCodeMixin
from ..kernels import checking_every_call, in_dtype, is_finite_now, plain_weights, sums_are_finite
from ..kernels.expire_attention import expire_span_attention
from ..kernels.expire_attention.blocks import (
    Block,
    compact_memories,
    first_queries,
    run_layer_over_blocks,
    split_into_blocks,
)
from ..kernels.expire_attention.memory import (
    ExpireSpanMemory,
    MemorySnapshot,
    decoding_slack,
    expired_memories,
    memory_counts,
    next_decoding_slack,
)
from ..kernels.expire_attention.one_query import (
    OneQueryTerms,
    official_one_query_attention,
    one_query_terms,
    plain_one_query_attention,
)
from ..kernels.hub import HubKernelsMixin, HubLayerMixin, use_kernel_forward_from_hub
from ..kernels.rotary import rotate, signed_sine
from .layers import (
    KEEP_IN_FLOAT32,
    WIDE,
    LearnedRelativePositions,
    RotaryEmbedding,
    add_sublayer_output,
    apply_rotary,
    dropout,
    layer_runs_as_defined,
    linear,
    make_mlp,
    make_norm,
    small_projection,
    sublayer_input,
)
from .memory import (
    CountsOwnPositions,
    MemoryCache,
    MemoryCacheLayer,
    Rollback,
    auxiliary_outputs_read,
    causal_lm_loss,
    check_extra_kwargs,
    check_fits_in_memory,
    current_padding_mask,
    current_weights_version,
    embed_inputs,
    keeps_non_finite_in_place,
    prompt_loop,
    refuse_packed_documents,
    zero_padding,
)

logger = logging.get_logger(__name__)


@dataclass
class ExpireSpanModelOutput(BaseModelOutputWithPast):
    """
    last_hidden_state: (B, T, D) after the final norm.
    cache: the `ExpireSpanCache` with each layer's unexpired memories (the field is `past_key_values` under 🤗
        Transformers before 5.24, where `.cache` reads it too).
    hidden_states: embeddings and each layer's output, when `output_hidden_states`.
    attentions: always None (Expire-Span does not return attention weights).
    spans: per layer, the span e_t (B, T) predicted for each input token, when `output_spans`.
    span_loss: the auxiliary loss α·Σ e_i / T computed on the ramp (SPEC §2), summed over layers (the official
        value with `span_loss_form="remaining_span"`).
    aux_loss: the auxiliary loss training adds to the language-modelling loss: the span loss (the name the three
        models share).
    memory_size: mean number of memories each query attended to (m > 0), over queries and layers.
    The last three are None in the decoding steps of `generate`, which does not read them (`auxiliary_outputs_read`).
    """

    spans: tuple[torch.FloatTensor, ...] | None = None
    span_loss: torch.FloatTensor | None = None
    aux_loss: torch.FloatTensor | None = None
    memory_size: torch.FloatTensor | None = None


@dataclass
class ExpireSpanCausalLMOutput(CausalLMOutputWithPast):
    """
    loss: in training mode `lm_loss + span_loss`; in eval mode `lm_loss`.
    lm_loss: next-token cross-entropy.
    Other fields as in `ExpireSpanModelOutput`, plus the logits.
    """

    spans: tuple[torch.FloatTensor, ...] | None = None
    lm_loss: torch.FloatTensor | None = None
    span_loss: torch.FloatTensor | None = None
    aux_loss: torch.FloatTensor | None = None
    memory_size: torch.FloatTensor | None = None


class ExpireSpanPredictor(nn.Linear):
    """The span predictor of one layer (paper Eq. 3): w·h + b, one output shared by the heads."""

    def __init__(self, hidden_size: int):
        super().__init__(hidden_size, 1, bias=True)


class _ReusedProjection(torch.autograd.Function):
    """A block's own keys (or values) `output` (B, H, N, d) = inputs · Wᵀ, reused as the memories that later blocks read
    with `recompute_memory`: the same values (the inputs are the same values, detached from what made them), and the
    gradients projecting again would give, to W and to `inputs` (a pre-norm's parameters), without the product."""

    @staticmethod
    def forward(ctx, output, inputs, weight):
        ctx.save_for_backward(inputs, weight)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        inputs, weight = ctx.saved_tensors
        batch_size, num_heads, length, head_dim = grad_output.shape
        grad = grad_output.transpose(1, 2).reshape(batch_size * length, num_heads * head_dim)
        grad_inputs = (grad @ weight).view(inputs.shape) if ctx.needs_input_grad[1] else None
        grad_weight = grad.mT @ inputs.reshape(batch_size * length, -1) if ctx.needs_input_grad[2] else None
        return None, grad_inputs, grad_weight


def _reusable(projection: nn.Module) -> bool:
    """Whether a projection is a plain bias-free nn.Linear with a plain weight (not LoRA-wrapped, not quantized)."""
    return type(projection) is nn.Linear and projection.bias is None and plain_weights(projection)


class OneQueryReads(NamedTuple):
    """What a decoding step's one-query attentions read (`ExpireSpanModel.prepare_step`, the layers' side by side):
    the soft mask m (B, N) they attended with (paper Eq. 5; 0 at invalid slots) and, per memory, what the span loss
    sums over the pairs on the ramp (e_i, or with the official loss e_i − (t − i)); `columns`: each layer's
    {index: (start, stop)}. `ExpireSpanModel.step_layers` counts every layer's at once."""

    mask: torch.Tensor
    loss_terms: torch.Tensor
    columns: dict[int, tuple[int, int]]

    def counted(self, layers: list[int], ramp: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The span-loss sum and the number of memories read of `layers` (their indices), as `count_reads` counts
        them: read ⇔ m > 0; on the ramp ⇔ 0 < m < 1, where m has a fractional part (paper Eq. 6 and "Loss
        Computation")."""
        mask, loss_terms = self.mask, self.loss_terms
        if len(layers) < len(self.columns):  # (some layers took the general attention, which counts its own)
            ranges = [self.columns[index] for index in layers]
            mask, loss_terms = (
                torch.cat([part[:, start:stop] for start, stop in ranges], 1) for part in (mask, loss_terms)
            )
        span_loss_sum = torch.where(mask.frac().bool(), loss_terms, 0).sum() / ramp
        return span_loss_sum, torch.count_nonzero(mask)


@use_kernel_forward_from_hub("ExpireSpanAttention")
class ExpireSpanAttention(HubLayerMixin, nn.Module):
    """Multi-head attention over the layer's memories and the current block, masked by the learned spans."""

    def __init__(self, config: ExpireSpanConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        # Read at every call, as plain attributes: a config's attribute read costs ~1.6 µs (🤗's `__getattribute__`),
        # tens of µs in a decoding step whose caches the weights have just flushed.
        self.max_span, self.span_pre_divisor, self.ramp = config.max_span, config.span_pre_divisor, config.ramp
        self.attend_to_self, self.renormalization_epsilon = config.attend_to_self, config.renormalization_epsilon
        self.recompute_memory = config.recompute_memory
        width = config.num_attention_heads * config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.o_proj = nn.Linear(width, config.hidden_size, bias=config.attention_output_bias)
        # Paper Eq. 3: one span per memory, shared by the heads.
        self.span_predictor = ExpireSpanPredictor(config.hidden_size) if config.expire_memories else None
        # Decoding may skip the mask while no memory is on the ramp only when the attention is plain softmax attention
        # over the visible memories (not the official variant: positions in the scores, no self, ε).
        self.plain_attention = (
            config.position_encoding == "rotary" and config.attend_to_self and config.renormalization_epsilon == 0
        )

    def predict_spans(self, span_inputs: torch.Tensor, checked: bool = False) -> torch.Tensor:
        """e_i = L · σ(w · h_i / p + b) (paper Eq. 3), in float32 or wider: (B, N, D) → (B, N). `checked` as for
        `linear`."""
        divisor = self.span_pre_divisor
        inputs = span_inputs if divisor == 1 else span_inputs / divisor
        logits = small_projection(self._modules["span_predictor"], inputs, checked)  # (see `layers.own_parameter`)
        logits = logits.squeeze(-1)
        if logits.dtype not in WIDE:
            logits = logits.float()
        return self.max_span * torch.sigmoid(logits)

    def project(self, hidden_states: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None):
        """Queries, keys and values (B, H, T, d) of hidden_states (B, T, D), queries and keys rotated with rotary
        positions (cos and sin None otherwise)."""
        batch_size, length, _ = hidden_states.shape
        query = self.q_proj(hidden_states).view(batch_size, length, self.num_heads, self.head_dim).transpose(1, 2)
        if cos is not None:
            query = apply_rotary(query, cos, sin)
        return (query, *self.project_memory(hidden_states, cos, sin))

    def project_memory(self, hidden_states: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None):
        """Keys (rotated as in `project`) and values (B, H, N, d) of hidden_states (B, N, D)."""
        batch_size, length, _ = hidden_states.shape
        shape = (batch_size, length, self.num_heads, self.head_dim)
        key = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        value = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        return (key if cos is None else apply_rotary(key, cos, sin)), value

    def make_memory(self, hidden_states, positions, valid, cos, sin, layer_inputs=None) -> ExpireSpanMemory:
        """The memories of hidden_states (B, N, D) (normed as the attention reads them) at `positions` (B, N);
        `layer_inputs`: the layer inputs they came from, kept with `recompute_memory`."""
        key, value = self.project_memory(hidden_states, cos, sin)
        spans = self.predict_spans(hidden_states) if self.span_predictor is not None else None
        return ExpireSpanMemory(key, value, positions, valid, spans, hidden_states, layer_inputs)

    def remade_memory(self, own: ExpireSpanMemory, hidden_states: torch.Tensor) -> ExpireSpanMemory:
        """`make_memory(hidden_states, …)` for a block's own memories `own`, where hidden_states (B, N, D) holds the
        values of the attention inputs that made them, detached from the layer inputs: the block's keys and values are
        reused as they are (`_ReusedProjection`) when no rotation and plain projections allow it, else computed again.
        """
        reusable = not torch.is_autocast_enabled(hidden_states.device.type) and all(
            _reusable(projection) for projection in (self.k_proj, self.v_proj)
        )
        if not reusable:
            return self.make_memory(hidden_states, own.positions, own.valid, None, None, own.hidden_states)
        key = _ReusedProjection.apply(own.keys.detach(), hidden_states, self.k_proj.weight)
        value = _ReusedProjection.apply(own.values.detach(), hidden_states, self.v_proj.weight)
        spans = self.predict_spans(hidden_states) if self.span_predictor is not None else None
        return ExpireSpanMemory(key, value, own.positions, own.valid, spans, hidden_states, own.hidden_states)

    def forward(
        self,
        hidden_states: torch.Tensor,
        positions: torch.Tensor,
        token_valid: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        memory: ExpireSpanMemory | None,
        max_distance: float | None,
        counted_positions: bool = False,
        relative_positions: nn.Module | None = None,  # a LearnedRelativePositions
        layer_inputs: torch.Tensor | None = None,
        span_limit: float | None = None,
    ) -> tuple[torch.Tensor, ExpireSpanMemory, torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """hidden_states (B, T, D) normed; positions (B, T); token_valid (B, T); `counted_positions`: the positions
        were counted from the padding mask (consecutive in each row). Returns the output, the memories after the block
        (`memory` then the block's own, not detached), the block's spans, the span-loss sum and the number of attended
        memories. `relative_positions`: the model's learned relative positions (shared by the layers), or None;
        `layer_inputs`: the block's layer inputs, kept in its memories with `recompute_memory`; `span_limit`: with
        `noisy_spans` in training, the mask and the span loss see the spans clamped at this (the memories keep
        theirs)."""
        batch_size, length, _ = hidden_states.shape
        query, key, value = self.project(hidden_states, cos, sin)
        spans = self.predict_spans(hidden_states) if self.span_predictor is not None else None
        block = ExpireSpanMemory(key, value, positions, token_valid, spans, hidden_states, layer_inputs)

        visible_memory = block if memory is None else memory.append(block)
        memory_spans = visible_memory.spans
        recomputed = memory is not None and memory.hidden_states is not None  # spans already follow the weights
        has_inputs = memory is not None and visible_memory.span_inputs is not None
        if self.span_predictor is not None and has_inputs and not recomputed:
            # Spans of earlier memories are recomputed from the current span parameters, so they keep learning.
            memory_spans = torch.cat([self.predict_spans(memory.span_inputs), spans], dim=1)
        if span_limit is not None and memory_spans is not None:
            memory_spans = memory_spans.clamp(max=span_limit)  # official --expire-span-noisy: min(e_i, u·L)
        # Decoding without gradient: while no memory the query sees can be on the ramp (slack >= 0), the mask is 1
        # wherever visible (Eq. 5), so the step is plain attention and counts nothing on the ramp (no span loss).
        # The slack is kept only while positions are counted (a query at most one position after the last).
        slack = None
        decoding = length == 1 and counted_positions and self.plain_attention and not torch.compiler.is_compiling()
        if decoding and memory_spans is visible_memory.spans:
            if memory_spans is not None and not (torch.is_grad_enabled() and memory_spans.requires_grad):
                slack = decoding_slack(memory, positions, token_valid)
        dropout = self.config.attention_dropout if self.training else 0.0
        if slack is not None and slack >= 0:
            memory_spans = None
            if max_distance is None:
                # Every query sees every memory (valid, i ≤ t) too: no mask at all, and every memory is read.
                seen = visible_memory.valid & (visible_memory.positions <= positions)
                if bool(seen.all()):
                    output = F.scaled_dot_product_attention(
                        query, visible_memory.keys, visible_memory.values, dropout_p=dropout
                    )
                    output = self.o_proj(output.transpose(1, 2).reshape(batch_size, length, -1))
                    visible_memory.expiry_slack = next_decoding_slack(slack, spans)
                    read_count = torch.full((), seen.numel(), dtype=torch.float32, device=output.device)
                    no_loss = output.new_zeros((), dtype=torch.promote_types(output.dtype, torch.float32))
                    return output, visible_memory, spans, no_loss, read_count
        output, span_loss_sum, read = self.attend(
            query, visible_memory, memory_spans, positions, token_valid, max_distance, counted_positions, dropout,
            relative_positions,
        )  # fmt: skip
        output = self.o_proj(output.transpose(1, 2).reshape(batch_size, length, -1))
        if slack is not None:
            visible_memory.expiry_slack = next_decoding_slack(slack, spans)
        return output, visible_memory, spans, span_loss_sum, read

    def attend(self, query, memory, spans, positions, token_valid, max_distance, counted_positions, dropout=0.0,
               relative_positions=None):  # fmt: skip
        """The masked attention of `query` (B, H, T, d) at `positions` over `memory` (paper Eqs. 4–5, with `spans` as
        the mask sees them), before the output projection; the span-loss sum and the memories read."""
        table = relative_positions.weight if relative_positions is not None else None  # q_t · p_{t−i}
        # The official options' backward reuses the weights when they take no more memory per query than the layer
        # keeps per token anyway (about 8·D + 2·I floats: inputs, projections, outputs, norms, the MLP's activations).
        config = self.config
        keep_weights = self.num_heads * memory.width <= 8 * config.hidden_size + 2 * config.intermediate_size
        output = expire_span_attention(
            query, memory.keys, memory.values, spans, positions, memory.positions, ramp=config.ramp,
            key_valid=memory.valid, max_distance=max_distance, dropout=dropout, relative_positions=table,
            attend_to_self=config.attend_to_self, renormalization_epsilon=config.renormalization_epsilon,
            keep_weights=keep_weights,
        )  # fmt: skip

        return (output, *self.count_reads(memory, spans, positions, token_valid, max_distance, counted_positions))

    def attend_decoding(self, query, memory: ExpireSpanMemory, earlier: ExpireSpanMemory, terms: OneQueryTerms,
                        checked: bool = True):  # fmt: skip
        """The masked attention of a decoding step's query (one per row, after every memory) over `memory` (the token's
        own last), or without `attend_to_self` over `earlier` (the memory before the token's own was appended), with
        the `terms` of those keys (`ExpireSpanModel.prepare_step`): the plain one-query attention, or the official
        options' (learned relative positions, ε). None when `checked` and the output is not finite (the caller then
        takes `attend`)."""
        read = memory if self.attend_to_self else earlier
        if self.plain_attention:
            return plain_one_query_attention(query, read.keys, read.values, terms.bias, checked)
        return official_one_query_attention(
            query, read.keys, read.values, terms, self.renormalization_epsilon, checked
        )

    def count_reads(self, memory, spans, positions, token_valid, max_distance, counted_positions):
        """The span-loss sum and the memories read of `attend`: which (query, memory) pairs are read (m > 0), and
        which are on the ramp (0 < m < 1), where the span loss is computed (paper, "Loss Computation"): the loss is
        Σ_i e_i · (queries seeing i on the ramp) / R, or with the official value Σ (e_i − (t − i)) / R over the same
        pairs (the remaining span; same gradient)."""
        config, ramp = self.config, self.ramp
        remaining = config.span_loss_form == "remaining_span"
        read_counts, ramp_counts, *distances = memory_counts(
            spans, positions, token_valid, memory, ramp, max_distance, counted_positions,
            attend_to_self=config.attend_to_self, distance_sums=remaining,
        )  # fmt: skip
        if spans is None:
            span_loss_sum = read_counts.new_zeros((), dtype=torch.promote_types(memory.keys.dtype, torch.float32))
        elif remaining:
            span_loss_sum = ((ramp_counts * spans).sum() - distances[0].sum()) / ramp
        else:
            span_loss_sum = (ramp_counts * spans).sum() / ramp
        return span_loss_sum, read_counts.sum()


class ExpireSpanDecoderLayer(GradientCheckpointingLayer):
    """x = x + attention(norm(x), memories); x = x + mlp(norm(x)) (pre-norm), or x = norm(x + attention(x,
    memories)); x = norm(x + mlp(x)) (post-norm, the official default). A layer's memories are its attention inputs
    (normed in pre-norm). Memories enter as tensors, never through the cache object, so gradient checkpointing
    recomputes the layer from the same state."""

    def __init__(self, config: ExpireSpanConfig, layer_idx: int):
        super().__init__()
        self.norm_position = config.norm_position
        self.input_layernorm = make_norm(config)
        self.attention = ExpireSpanAttention(config, layer_idx)
        self.post_attention_layernorm = make_norm(config)
        self.mlp = make_mlp(config)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def initial_memory(self, hidden_states, positions, cos, sin) -> ExpireSpanMemory:
        """The memories of the layer inputs hidden_states (B, N, D) at `positions` (the official zero memory)."""
        valid = torch.ones(positions.shape, dtype=torch.bool, device=positions.device)
        return self.memory_of(hidden_states, positions, valid, cos, sin)

    def memory_of(self, hidden_states, positions, valid, cos, sin) -> ExpireSpanMemory:
        """The memories of the layer inputs hidden_states (B, N, D): keys, values and spans of the attention input
        (normed in pre-norm) with the current weights; the layer inputs kept with `recompute_memory`."""
        attention_input = sublayer_input(hidden_states, self.input_layernorm, self.norm_position)
        kept = hidden_states if self.attention.config.recompute_memory else None
        return self.attention.make_memory(attention_input, positions, valid, cos, sin, kept)

    def recompute(self, memory: ExpireSpanMemory, rotary_embedding) -> ExpireSpanMemory:
        """`recompute_memory`: the memories' keys, values and spans computed again from their (detached) layer inputs
        with the current weights (Transformer-XL; the official Expire-Span training), so that the norm, the
        projections and the span predictor get gradients through the memories and nothing is stale."""
        cos, sin = rotary_embedding(memory.positions) if rotary_embedding is not None else (None, None)
        return self.memory_of(memory.hidden_states, memory.positions, memory.valid, cos, sin)

    def with_current_spans(self, memory: ExpireSpanMemory) -> ExpireSpanMemory:
        """The memory with the spans its layer inputs get from the current weights, without gradient: what `prune`
        decides on before `recompute` (which computes them again, with gradient, for the memories that live on)."""
        if self.attention.span_predictor is None:
            return memory
        with torch.no_grad():
            inputs = sublayer_input(memory.hidden_states, self.input_layernorm, self.norm_position)
            return dataclasses.replace(memory, spans=self.attention.predict_spans(inputs))

    def next_block_memory(self, memory: ExpireSpanMemory, length: int, cos, sin, keep_span_inputs: bool):
        """The memories after a block of `length` tokens (rotated by `cos`, `sin`) as the next block of the same
        forward reads them: without gradient to the hidden states that made them (the official code carries them
        detached). With `recompute_memory` under autograd, the block's own memories (the last slots) are computed
        again from their detached layer inputs, once (`ExpireSpanAttention.remade_memory`: the block's keys and values
        reused, with the gradients of that computation): later blocks' losses then reach the norm, the projections and
        the span predictor through them, as through the official code's recomputation at every block (the earlier
        memories already are such recomputations, or the zero initial memory). Part of the layer's forward, where
        FSDP has gathered its weights."""
        made = (memory.keys, memory.values, memory.spans)  # with gradient to the weights (or the layer inputs)
        if memory.hidden_states is None or not (
            torch.is_grad_enabled() and any(tensor is not None and tensor.requires_grad for tensor in made)
        ):
            return memory.detached(keep_span_inputs)
        own = memory.slots(memory.width - length, length)
        inputs = own.hidden_states.detach()
        if cos is None:  # the block's keys and values as they are, with the gradients of a recomputation
            attention_input = sublayer_input(inputs, self.input_layernorm, self.norm_position)
            recomputed = self.attention.remade_memory(dataclasses.replace(own, hidden_states=inputs), attention_input)
        else:
            recomputed = self.memory_of(inputs, own.positions, own.valid, cos, sin)
        joined = memory.slots(0, memory.width - length).append(recomputed)
        return dataclasses.replace(joined, span_inputs=None)

    def prune(self, memory: ExpireSpanMemory, first_positions: torch.Tensor, delete_expired: bool):
        """The memory without empty slots and, with `delete_expired`, without the memories that are dead for each
        row's first query of the coming block (see `ExpireSpanMemory.prune`). Part of the layer (not the model) so
        that it runs inside the layer's forward, where FSDP has gathered the span predictor's weights."""
        config = self.attention.config

        def dead():
            spans = memory.spans if config.expire_memories else None
            if spans is not None and memory.span_inputs is not None and memory.hidden_states is None:
                with torch.no_grad():  # spans follow the current parameters (recomputed memories' already do)
                    spans = self.attention.predict_spans(memory.span_inputs)
            return expired_memories(memory.positions, spans, first_positions, config.ramp, config.max_span)

        return memory.prune(dead if delete_expired else None)

    def forward(self, hidden_states, positions, token_valid, cos, sin, memory=None, max_distance=None,
                first_positions=None, delete_expired=True, counted_positions=False, relative_positions=None,
                rotary_embedding=None, span_limit=None, recording=None, recompute_memory=False,
                keep_span_inputs=False, last_block=False):  # fmt: skip
        """Returns the new hidden states, the memories after this block as the next block reads them (the earlier ones
        pruned for each row's first query `first_positions`, then this block's; `next_block_memory`), this block's
        spans, the span-loss sum and the memories read.
        `recording` (a list; a cache recording its past): gets the memories as the block found them (before pruning)
        and the block's own, from which a rollback rebuilds the memories after any of the block's tokens.
        `recompute_memory`: compute the memories' keys, values and spans again from their hidden states first.
        `last_block`: the forward's last block, whose memories leave it detached (not made again for a later block)."""
        recompute = self.attention.config.recompute_memory
        recomputing = memory is not None and recompute_memory and memory.hidden_states is not None
        found = None
        if recomputing and recording is None:  # pruned first: only the memories that live on are projected again
            stale = dataclasses.replace(self.with_current_spans(memory), keys=None, values=None)  # not kept: remade
            memory = self.prune(stale, first_positions, delete_expired)
            memory = self.recompute(memory, rotary_embedding)
        else:
            if recomputing:
                memory = self.recompute(memory, rotary_embedding)
            found = MemorySnapshot.of(memory) if recording is not None else None
            if memory is not None:
                memory = self.prune(memory, first_positions, delete_expired)
        mixed, memory, spans, span_loss_sum, read = self.attention(
            sublayer_input(hidden_states, self.input_layernorm, self.norm_position), positions, token_valid, cos, sin,
            memory, max_distance, counted_positions, relative_positions, hidden_states if recompute else None,
            span_limit,
        )  # fmt: skip
        if recording is not None:  # the block's memories are the last slots, as the block made them
            length = positions.shape[1]
            own = dataclasses.replace(memory.slots(memory.width - length, length), positions=positions,
                                      valid=token_valid)  # fmt: skip
            recording.append((found, own))
        if last_block:
            memory = memory.detached(keep_span_inputs)
        else:
            memory = self.next_block_memory(memory, positions.shape[1], cos, sin, keep_span_inputs)
        hidden_states = add_sublayer_output(
            hidden_states, dropout(self.dropout, mixed), self.input_layernorm, self.norm_position
        )
        mlp_output = self.mlp(sublayer_input(hidden_states, self.post_attention_layernorm, self.norm_position))
        hidden_states = add_sublayer_output(
            hidden_states, dropout(self.dropout, mlp_output), self.post_attention_layernorm, self.norm_position
        )
        return hidden_states, memory, spans, span_loss_sum, read

    def step(self, hidden_states, block: Block, rotation: tuple | None, memory: ExpireSpanMemory | None,
             slack: float | None, terms: OneQueryTerms | None = None, checked: bool = True, **options):  # fmt: skip
        """A decoding step (`ExpireSpanModel.steps_one_token`: one real token per row, no gradients, evaluation), as
        `run_layer_over_blocks` over the one block returns it: the layer's forward without its work for blocks, padding
        and training — the token's keys and values written into the memory's buffer, then, with the plain attention
        and while no memory the token sees is on the ramp (`slack`, the `decoding_slack`, >= 0, so Eq. 5's mask is 1
        on every valid memory), softmax attention over the valid memories with no span loss and the reads as a Python
        number, else the masked attention (`ExpireSpanAttention.attend_decoding`: the one-query attention, plain or with
        the official options — learned relative positions, no attention to the token itself, ε — with the keys'
        `terms`, which the model computed for its layers at once, and whose reads it counts: the reads are then None;
        `attend` where its output is not finite, which only a `checked` step looks at — an unchecked one leaves it to
        the model, which looks at the step's output). A memory without a buffer (compacted by the last pruning) gets
        one from the append.
        Before the first memory, where the slack is unknown (None), or where a hook or a kernel would see the layer
        run, the layer's forward runs (`ExpireSpanModel.prepare_step` decides it, and prunes the memory first). Else
        `prepare_step` has seen the layer and its modules run as defined (`layer_runs_as_defined`): the step calls
        their forwards and products without the module calls' machinery and checks.
        `rotation`: the block's cos and `signed_sine` (None without rotary positions)."""
        if terms is None and not (slack is not None and slack >= 0):  # (see `ExpireSpanModel.prepare_step`)
            return run_layer_over_blocks(self, hidden_states, [block], memory, False, **options)
        modules = self._modules  # (children read from `_modules`: see `layers.own_parameter`)
        attention, mlp = modules["attention"], modules["mlp"]
        input_norm, output_norm = modules["input_layernorm"].forward, modules["post_attention_layernorm"].forward
        products = attention._modules
        q_proj, k_proj, v_proj, o_proj = products["q_proj"], products["k_proj"], products["v_proj"], products["o_proj"]
        attention_input = sublayer_input(hidden_states, input_norm, self.norm_position)
        batch_size = hidden_states.shape[0]
        heads, head_dim = attention.num_heads, attention.head_dim
        shape = (batch_size, heads, 1, head_dim)  # (one token: the products (B, 1, H·d) read as (B, H, 1, d) directly)
        if rotation is not None:  # queries and keys side by side (2H heads), rotated in one pass: half the ops
            query_key = torch.cat(
                [linear(q_proj, attention_input, True), linear(k_proj, attention_input, True)], -1
            ).view(batch_size, 2 * heads, 1, head_dim)
            query, key = rotate(query_key, *rotation).chunk(2, 1)
        else:
            query = linear(q_proj, attention_input, True).view(shape)
            key = linear(k_proj, attention_input, True).view(shape)
        value = linear(v_proj, attention_input, True).view(shape)
        spans = attention.predict_spans(attention_input, True)
        kept_inputs = hidden_states if attention.recompute_memory else None
        dense = memory.every_valid  # else: padding, or memories marked dead in place and not yet compacted away
        if dense is None:
            dense = bool(memory.valid.all())
        earlier = memory
        memory = memory.append(ExpireSpanMemory(key, value, block.positions, block.valid, spans, None, kept_inputs))
        memory.every_valid = dense  # (the token is valid)
        if slack >= 0:  # softmax attention over the valid memories, nothing on the ramp
            mask = None if dense else memory.valid[:, None, None, :]
            output = F.scaled_dot_product_attention(query, memory.keys, memory.values, attn_mask=mask)
            span_loss_sum, reads = 0, memory.valid.numel() if dense else memory.valid.sum()
            if checked and not dense and not sums_are_finite(output):
                output = None  # (a NaN in an invalid slot reaches SDPA's output: 0 · NaN)
        else:  # memories on the ramp, or the official options: Eq. 4–5's mask, the span loss and the reads
            output, span_loss_sum, reads = attention.attend_decoding(query, memory, earlier, terms, checked), 0, None
        if output is None:  # not finite: the general attention keeps a non-finite memory in place
            output, span_loss_sum, reads = attention.attend(
                query, memory, memory.spans, block.positions, block.valid, None, True, 0.0,
                options.get("relative_positions"),
            )  # fmt: skip
        output = linear(o_proj, output.reshape(batch_size, 1, -1), True)  # (B, H, 1, d): no transpose
        if attention.plain_attention:
            memory.expiry_slack = next_decoding_slack(slack, spans)
        hidden_states = add_sublayer_output(hidden_states, output, input_norm, self.norm_position)
        mlp_output = mlp.forward(sublayer_input(hidden_states, output_norm, self.norm_position), checked=True)
        hidden_states = add_sublayer_output(hidden_states, mlp_output, output_norm, self.norm_position)
        return hidden_states, memory, [spans], span_loss_sum, reads


class ExpireSpanCacheLayer(MemoryCacheLayer):
    """The memories of one layer (an `ExpireSpanMemory`, or None before the first token) and the tokens seen. While the
    cache records its past, each forward keeps the memories as it found them and, per block, as the block found them
    with the block's own: a rollback restores the block the cut falls in, deletes what expired for its kept tokens'
    first query and appends their memories, as a forward over the kept tokens alone would have."""

    tensor_names = ("memory",)
    not_compileable_reason = (
        "An Expire-Span memory changes size as memories expire and are deleted (its width is data), so a compiled "
        "step would meet new shapes at almost every token; Expire-Span decodes eagerly."
    )

    def __repr__(self):
        return f"ExpireSpanCacheLayer(entries={self.num_entries()}, seen_tokens={self.seen_tokens})"

    def num_entries(self) -> int:
        """Width of the padded layout: at least the largest number of live memories in any row (decoding compacts
        the layout lazily, see `ExpireSpanMemory.prune`)."""
        return 0 if self.memory is None else self.memory.width

    def num_live_entries(self) -> int:
        """The largest number of memories any row keeps valid."""
        return 0 if self.memory is None else int(self.memory.valid.sum(1).max())

    def map(self, function):
        if self.memory is not None:
            self.memory = self.memory.map(function)

    def snapshot(self):
        """The memories as they are (`MemorySnapshot`: later forwards append into the buffer and mark memories dead in
        place, so only the validity and the buffer's counters are copied), the tokens seen and the recorded forwards."""
        return MemorySnapshot.of(self.memory), self.seen_tokens, len(self.recorded)

    def restore(self, snapshot):
        memory, self.seen_tokens, recorded = snapshot
        self.memory = memory.restore()
        del self.recorded[recorded:]

    @torch.no_grad()  # cache bookkeeping: the memories are pruned and appended as decoding does
    def roll_back(self, rollback: Rollback):
        if not rollback.removes_tokens:
            return
        before, blocks, block_size, keep_span_inputs, expiry = self.recorded[rollback.forward]
        if rollback.kept == 0:
            self.memory = before.restore()
            return
        block, last = divmod(rollback.kept - 1, block_size)  # the block of the last kept token, its place there
        found, own = blocks[block]
        memory = found.restore()
        kept = own.slots(0, last + 1)
        if memory is not None:  # what expired for the kept tokens' first query (the block's may lie past the cut)
            expire_memories, ramp, max_span, delete_expired = expiry
            first = first_queries(kept.positions, kept.valid)

            def dead(memory=memory):  # as `ExpireSpanDecoderLayer.prune` decides it without gradients
                spans = memory.spans if expire_memories else None
                return expired_memories(memory.positions, spans, first, ramp, max_span)

            memory = memory.prune(dead if delete_expired else None)
        self.memory = (kept if memory is None else memory.append(kept)).detached(keep_span_inputs)


class ExpireSpanCache(MemoryCache):
    """The cache of Expire-Span: per layer the keys, values, spans and positions of the unexpired memories,
    in a padded layout compacted as memories expire (rows of a batch expire at different rates; decoding compacts
    lazily, once dead slots fill a fraction of the layout), and per row the
    position of the next real token. Supports beam search, `num_return_sequences` and batch selection."""

    layer_class = ExpireSpanCacheLayer

    def memory_entries(self) -> list[int]:
        """Per layer, the width of the padded layout (what the memories occupy)."""
        return [layer.num_entries() for layer in self.layers]

    def live_memory_entries(self) -> list[int]:
        """Per layer, the largest number of memories any row keeps valid."""
        return [layer.num_live_entries() for layer in self.layers]


class ExpireSpanPreTrainedModel(HubKernelsMixin, RemoteCodeMixin, PreTrainedModel):
    config: ExpireSpanConfig
    config_class = ExpireSpanConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["ExpireSpanDecoderLayer"]
    _keep_in_fp32_modules = KEEP_IN_FLOAT32
    _skip_keys_device_placement = list(CACHE_NAMES)
    # Its memory's width is data (expired memories are deleted): the graph breaks where they are compacted.
    _can_compile_fullgraph = False
    _supports_sdpa = True
    # The memories roll back (`ExpireSpanCache.crop`), so 🤗's assisted and prompt-lookup decoding run.
    _is_stateful = False
    hub_card_template = "expire_span.md"

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # `generate` must not build a DynamicCache: the model creates its own ExpireSpanCache on the first forward.
        return False

    @torch.no_grad()
    def _init_weights(self, module: nn.Module):
        if isinstance(module, ExpireSpanPredictor):
            # Official code / paper "small initial spans": w = 0, b = logit(fraction), so e = fraction · L at first.
            init.zeros_(module.weight)
            init.constant_(module.bias, self.config.initial_span_bias)
            return
        if isinstance(module, LearnedRelativePositions):
            init.normal_(module.weight, std=self.config.initializer_range)
            return
        super()._init_weights(module)
        if isinstance(module, RotaryEmbedding):
            init.copy_(module.inv_freq, module.compute_inverse_frequencies())


class ExpireSpanModel(ExpireSpanPreTrainedModel):
    # Delete memories that can no longer be read (m = 0 for the next query). Turning it off keeps them (they are
    # still masked out), which changes nothing but memory use; the tests compare both.
    prune_expired_memories = True

    def __init__(self, config: ExpireSpanConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        check_fits_in_memory(config, self.embed_tokens.weight)  # before the layers are built
        self.layers = nn.ModuleList(
            [ExpireSpanDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = make_norm(config) if config.final_norm else nn.Identity()
        rotary = config.position_encoding == "rotary"
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta) if rotary else None
        # The official learned relative positions: one module, shared by the layers.
        self.relative_positions = (
            None if rotary else LearnedRelativePositions(config.num_relative_positions, config.head_dim)
        )
        self.embedding_dropout = nn.Dropout(config.embedding_dropout)
        self.output_dropout = nn.Dropout(config.output_dropout)
        # Read at every decoding step, as plain attributes (as `ExpireSpanAttention` keeps them: a config's attribute
        # read costs ~1.6 µs).
        self.expire_memories, self.recompute_memory = config.expire_memories, config.recompute_memory
        self.attend_to_self, self.ramp = config.attend_to_self, config.ramp
        self.renormalization_epsilon = config.renormalization_epsilon
        self.gradient_checkpointing = False
        self.post_init()

    @keeps_non_finite_in_place
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: ExpireSpanCache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        output_spans: bool | None = None,
        return_dict: bool | None = None,
        past_key_values: ExpireSpanCache | None = None,
        **kwargs,
    ) -> ExpireSpanModelOutput | tuple:
        r"""
        attention_mask: (B, T) or (B, past + T) padding mask; padded tokens never become memories and do not advance
            the positions.
        position_ids: absolute positions of the tokens; by default counted from the first real token of each row.
        cache: an `ExpireSpanCache` with the memories of earlier tokens (`past_key_values` is its name before 🤗
            Transformers 5.24, still accepted).
        output_spans: also return, per layer, the span e_t predicted for each input token.
        """
        check_extra_kwargs(kwargs, type(self).__name__)
        if is_exporting():
            # Expired memories are deleted, so the memory's width is data: an exported graph would fix the widths of
            # the example it was traced with and give other inputs a different answer, without an error.
            raise ValueError(
                "torch.export cannot capture Expire-Span: the number of memories it keeps depends on the data (expired "
                "memories are deleted), which an exported graph would fix to the traced example's. Run it eagerly or "
                "with torch.compile, which breaks the graph where memories are compacted."
            )
        cache = resolve_cache_argument(cache, past_key_values, type(self).__name__)
        config = self.config
        use_cache = use_cache if use_cache is not None else config.use_cache
        output_hidden_states = (
            output_hidden_states if output_hidden_states is not None else config.output_hidden_states
        )
        return_dict = return_dict if return_dict is not None else config.return_dict
        inputs_embeds = embed_inputs(input_ids, inputs_embeds, self.embed_tokens)
        if config.embedding_scale != 1:
            inputs_embeds = inputs_embeds * config.embedding_scale
        batch_size, length = inputs_embeds.shape[:2]
        device = inputs_embeds.device

        if cache is not None and not isinstance(cache, ExpireSpanCache):
            raise TypeError(
                "Expire-Span keeps its memories in an ExpireSpanCache; got a cache of type "
                f"{type(cache).__name__}. Pass None (a cache is created) or the ExpireSpanCache a previous "
                "call returned."
            )
        if use_cache and cache is None:
            cache = ExpireSpanCache(config)
        past_length = 0
        if cache is not None:
            cache.check_against(config, batch_size)
            past_length = cache.get_seq_length()
        token_valid = current_padding_mask(attention_mask, batch_size, length, past_length)
        recording = cache is not None and cache.recording
        if self.steps_one_token(length, cache, recording, position_ids, token_valid):
            return self.step(
                inputs_embeds, cache, token_valid, use_cache, output_hidden_states, output_spans, return_dict
            )
        if recording:
            cache.record_forward(length, token_valid)
        if token_valid is None:
            token_valid = torch.ones(batch_size, length, dtype=torch.bool, device=device)
        else:
            inputs_embeds = zero_padding(inputs_embeds, token_valid)
        inputs_embeds = dropout(self.embedding_dropout, inputs_embeds)

        start_positions = torch.zeros(batch_size, dtype=torch.long, device=device)
        if cache is not None and cache.next_positions is not None:
            start_positions = cache.next_positions.to(device)
        if position_ids is None:
            positions = start_positions[:, None] + token_valid.long().cumsum(1) - 1
        else:
            if position_ids.dim() != 2 or position_ids.shape[-1] != length:
                raise ValueError(f"position_ids must have shape (batch, {length}), got {tuple(position_ids.shape)}.")
            positions = position_ids.to(device).long().expand(batch_size, length)
        refuse_packed_documents(position_ids, token_valid, batch_size, length, "Expire-Span", kwargs)
        positions = positions.masked_fill(~token_valid, -1)  # padding sees nothing and is seen by nothing

        # Paper "Memory shortening": per forward draw l ~ U(0, L) and hide memories older than l (training only).
        max_distance = None if config.expire_memories else config.max_span
        if self.training and config.memory_shortening:
            drawn = float(torch.rand(()) * config.max_span)
            max_distance = drawn if max_distance is None else min(max_distance, drawn)

        memories = [
            cache.layers[index].memory if cache is not None else None for index in range(config.num_hidden_layers)
        ]
        initial = config.initial_memory == "zeros" and all(memory is None for memory in memories) and past_length == 0
        if initial:
            memories = self.initial_memories(inputs_embeds, start_positions)
        # With `recompute_memory`, memories carried from an earlier forward get their keys, values and spans again from
        # their hidden states with the current weights: under autograd (the weights get gradients through them), or
        # when the weights changed since the cache's memories were made. (The zero initial memory is made here.)
        version = current_weights_version(self, cache) if config.recompute_memory and cache is not None else None
        recompute = (
            config.recompute_memory
            and not initial
            and (torch.is_grad_enabled() or cache is None or cache.weights_version != version)
        )
        if recording and recompute:
            cache.recomputed_while_recording = True
        # Spans of carried memories follow the current parameters in training: recomputed from their span inputs, or
        # with `recompute_memory` from their hidden states together with their keys and values.
        keep_span_inputs = (
            self.training and torch.is_grad_enabled() and config.expire_memories and not config.recompute_memory
        )
        blocks = split_into_blocks(positions, token_valid, config.block_size, self.rotary_emb)
        options = {"relative_positions": self.relative_positions} if self.relative_positions is not None else {}
        if config.recompute_memory and self.rotary_emb is not None:
            options["rotary_embedding"] = self.rotary_emb  # memories are rotated again as they are recomputed
        if self.training and config.noisy_spans and config.expire_memories:
            # Official --expire-span-noisy: per forward u ~ U(0, 1), the mask sees min(e_i, u·L) in every layer.
            options["span_limit"] = float(torch.rand(())) * config.max_span
        hidden_states = inputs_embeds
        all_hidden_states = [hidden_states] if output_hidden_states else None
        all_spans = []
        span_loss_sum = inputs_embeds.new_zeros((), dtype=torch.float32)
        read_count = torch.zeros((), dtype=torch.long, device=device)
        # A recording cache keeps, per layer, the memories before the forward and what each block found and made.
        before = [MemorySnapshot.of(cache.layers[index].memory) for index in range(len(memories))] if recording else []
        block_records = [[] for _ in before]
        # Traced by torch.compile, a prompt's blocks run outside the graph (`prompt_loop`); a one-token step is traced.
        over_blocks = prompt_loop(run_layer_over_blocks, length)
        for index, decoder_layer in enumerate(self.layers):
            if recording:
                options["recording"] = block_records[index]
            layer_output, memories[index], layer_spans, layer_span_loss, layer_read = over_blocks(
                decoder_layer, hidden_states, blocks, memories[index], keep_span_inputs, max_distance=max_distance,
                delete_expired=self.prune_expired_memories, counted_positions=position_ids is None,
                recompute_memory=recompute, **options,
            )  # fmt: skip
            if self.training and config.layer_drop > 0 and float(torch.rand(())) < config.layer_drop:
                # LayerDrop (official --expire-span-layerdrop): the layer made and pruned its memories; its output
                # and its span loss are left out.
                layer_output, layer_span_loss = hidden_states, 0
            hidden_states = layer_output
            span_loss_sum = span_loss_sum + layer_span_loss
            read_count = read_count + layer_read
            if output_hidden_states:
                all_hidden_states.append(hidden_states)
            if output_spans and layer_spans:
                all_spans.append(torch.cat(layer_spans, dim=1))

        if torch.compiler.is_compiling() and cache is not None:
            # Compiled, the layers masked their dead memories instead of deleting them (`prune`): delete them now,
            # with one read of every layer's width.
            widths = torch.stack([memory.valid.sum(1).amax() for memory in memories]).tolist()
            memories = compact_memories(memories, widths)

        hidden_states = dropout(self.output_dropout, self.norm(hidden_states))
        hidden_states_out = None
        if output_hidden_states:
            # As in 🤗 Llama: the last entry is the normed output.
            hidden_states_out = tuple(all_hidden_states[:-1]) + (hidden_states,)
        spans_out = tuple(all_spans) if output_spans else None

        queries = token_valid.sum().clamp_min(1)
        span_loss = config.span_loss_coefficient * span_loss_sum / queries
        memory_size = read_count.float() / (queries * config.num_hidden_layers)

        if cache is not None:
            for index, layer in enumerate(cache.layers):
                if recording:
                    expiry = (config.expire_memories, config.ramp, config.max_span, self.prune_expired_memories)
                    layer.recorded.append((before[index], block_records[index], config.block_size, keep_span_inputs,
                                           expiry))  # fmt: skip
                layer.memory = memories[index]
                layer.seen_tokens += length
            cache.next_positions = start_positions + token_valid.sum(1)
            cache.weights_version = version
        output = model_output(
            ExpireSpanModelOutput,
            last_hidden_state=hidden_states,
            **with_cache(cache if use_cache else None),
            hidden_states=hidden_states_out,
            spans=spans_out,
            span_loss=span_loss,
            aux_loss=span_loss,
            memory_size=memory_size,
        )
        return output if return_dict else output.to_tuple()

    def steps_one_token(self, length, cache, recording, position_ids, token_valid) -> bool:
        """Whether the forward is a decoding `step`: one real token per row at its counted position, continuing a cache
        that does not record, without gradients, in evaluation and eagerly, over expiring memories whose keys and
        values were made with the current weights."""
        if not (
            length == 1 and cache is not None and cache.get_seq_length() > 0 and cache.next_positions is not None
            and not recording and position_ids is None and not self.training and not torch.is_grad_enabled()
            and not torch.compiler.is_compiling()
        ):  # fmt: skip
            return False
        if not self.expire_memories:
            return False
        if self.recompute_memory and cache.weights_version != current_weights_version(self, cache):
            return False
        return token_valid is None or bool(token_valid.all())

    def step(self, inputs_embeds, cache, token_valid, use_cache, output_hidden_states, output_spans, return_dict):
        """The forward of a decoding step (`steps_one_token`): each row's token at the position after the cache's,
        through each layer's `step`; the forward's outputs, without its work for blocks, padding and training, and
        inside `generate` without the span loss and the memories read, which it does not read."""
        config = self.config
        first_positions = cache.next_positions  # (B,)
        if first_positions.device != inputs_embeds.device:
            first_positions = first_positions.to(inputs_embeds.device)
        positions = first_positions.unsqueeze(1)  # (B, 1)
        valid = torch.ones_like(positions, dtype=torch.bool) if token_valid is None else token_valid
        modules = self._modules  # (children read from `_modules`: see `layers.own_parameter`)
        rotary_embedding, relative_positions = modules.get("rotary_emb"), modules.get("relative_positions")
        rotary = rotary_embedding is not None
        cos, sin = rotary_embedding(positions) if rotary else (None, None)
        block = Block(slice(0, 1), positions, valid, cos, sin, first_positions)
        rotation = (cos, signed_sine(sin)) if rotary else None  # for every layer's `rotate`
        options = {"max_distance": None, "delete_expired": self.prune_expired_memories, "counted_positions": True}
        if self.recompute_memory and rotary:
            options["rotary_embedding"] = rotary_embedding
        if relative_positions is not None:
            options["relative_positions"] = relative_positions
        counts = auxiliary_outputs_read()  # (inside `generate` nobody reads the span loss and the memories read)
        memories, slacks, terms, reads = self.prepare_step(cache, block, counts)
        layers = (modules["layers"], cache.layers, memories, slacks, terms)
        hidden_states, span_loss_sum, read_count, all_hidden_states, all_spans = self.step_layers(
            inputs_embeds, block, rotation, *layers, reads, output_hidden_states, output_spans, False, options
        )
        hiding = terms or not all(cache_layer.memory.every_valid for cache_layer in cache.layers)
        if hiding and not is_finite_now(hidden_states):
            # A layer's attention over memories the mask hides from the token (memories on the ramp or expired, or
            # invalid slots), unchecked, let a non-finite one reach the output (0 · NaN), where the general attention
            # keeps it in place: run the layers again from the memories before the step, each attention checking its
            # output (inside `checking_every_call`, where a GPU's attentions check too). A non-finite output stays
            # non-finite through every later layer, so one look at the last tells: a read-back on every device (on a
            # GPU one wait of its queue per step, while some memory is hidden).
            for cache_layer, memory in zip(cache.layers, memories):
                cache_layer.memory, cache_layer.seen_tokens = memory, cache_layer.seen_tokens - 1
            with checking_every_call():
                hidden_states, span_loss_sum, read_count, all_hidden_states, all_spans = self.step_layers(
                    inputs_embeds, block, rotation, *layers, reads, output_hidden_states, output_spans, True, options
                )
        hidden_states = modules["norm"](hidden_states)
        cache.next_positions = first_positions + 1
        span_loss = memory_size = None
        if counts:
            batch_size, device = positions.shape[0], hidden_states.device
            wide = torch.promote_types(hidden_states.dtype, torch.float32)  # as the forward sums the layers' losses
            if isinstance(span_loss_sum, int):  # no layer had memories on the ramp: a zero loss, in one op
                span_loss = torch.zeros((), dtype=wide, device=device)
            else:  # (one product: the coefficient and the batch size as one number)
                span_loss = in_dtype(span_loss_sum, wide) * (config.span_loss_coefficient / batch_size)
            memory_size = torch.as_tensor(read_count, dtype=torch.float32, device=device)
            memory_size = memory_size / (batch_size * len(self.layers))
        output = model_output(
            ExpireSpanModelOutput,
            last_hidden_state=hidden_states,
            **with_cache(cache if use_cache else None),
            hidden_states=tuple(all_hidden_states[:-1]) + (hidden_states,) if output_hidden_states else None,
            spans=tuple(all_spans) if output_spans else None,
            span_loss=span_loss,
            aux_loss=span_loss,
            memory_size=memory_size,
        )
        return output if return_dict else output.to_tuple()

    def step_layers(self, hidden_states, block, rotation, layers, cache_layers, memories, slacks, terms, reads,
                    output_hidden_states, output_spans, checked, options):  # fmt: skip
        """The layers of a decoding `step` over `cache_layers` from `memories` (`prepare_step`'s, as are `slacks`,
        `terms` and `reads`), each attention checking its output when `checked`: the last hidden states, the span-loss
        sum and the number of memories read (Python numbers while no layer needed its forward), and each layer's
        hidden states and spans when asked."""
        all_hidden_states = [hidden_states] if output_hidden_states else None
        all_spans, span_loss_sum, read_count = [], 0, 0
        counted = []  # the layers that attended with their terms: counted together after the last
        for index, (layer, cache_layer) in enumerate(zip(layers, cache_layers)):
            hidden_states, cache_layer.memory, spans, span_loss, read = layer.step(
                hidden_states, block, rotation, memories[index], slacks[index], terms.get(index), checked, **options
            )
            cache_layer.seen_tokens += 1
            if read is None:
                counted.append(index)
            else:
                span_loss_sum, read_count = span_loss_sum + span_loss, read_count + read
            if output_hidden_states:
                all_hidden_states.append(hidden_states)
            if output_spans:
                all_spans.append(torch.cat(spans, dim=1))
        if counted and reads is not None:  # (None: nothing masked, or nobody reads the counts)
            span_loss, read = reads.counted(counted, self.ramp)
            if len(counted) < len(layers):  # (else the sums are still 0: nothing to add)
                span_loss, read = span_loss_sum + span_loss, read_count + read
            span_loss_sum, read_count = span_loss, read
        return hidden_states, span_loss_sum, read_count, all_hidden_states, all_spans

    def prepare_step(self, cache: "ExpireSpanCache", block: Block, counts: bool = True) -> tuple:
        """What a decoding step's layers need before the first runs: each layer's memory, pruned lazily
        (`ExpireSpanMemory.prune`); its slack (`decoding_slack` with the plain attention, −inf with the official
        options, which always mask; None where the layer's forward must run: no memory yet, an unknown slack, a hook or
        a kernel that would see the layer run); and, for the layers whose step masks (slack < 0), their keys' terms
        (`OneQueryTerms`: Eq. 5's mask, the bias, the positions' rows), computed for all of them at once over their
        memories side by side — a dozen operations a step where each layer ran as many — as {layer index: terms},
        with what they read (`OneQueryReads`, None when no layer masks). A layer that attends to its own token
        appends it before attending: it enters here at distance 0 with span 0 (m = 1, as for any span e_t >= 0)."""
        config = self.config
        positions = block.positions
        memories, slacks, masked = [], [], []
        modules = self._modules  # (children read from `_modules`: see `layers.own_parameter`)
        for layer, cache_layer in zip(modules["layers"], cache.layers):
            memory, attention = cache_layer.memory, layer._modules["attention"]
            if memory is not None and memory.checks_pruning():  # every `check_interval` memories (lazy pruning)
                memory = layer.prune(memory, block.first_positions, self.prune_expired_memories)
            slack = decoding_slack(memory, positions, block.valid) if attention.plain_attention else -math.inf
            if memory is None or not layer_runs_as_defined(layer):  # (a hook or a kernel sees the forward run)
                slack = None
            if slack is not None and slack < 0:
                masked.append((len(memories), memory))
                if memory.every_valid is None:  # (known for the step's append too)
                    memory.every_valid = bool(memory.valid.all())
            memories.append(memory)
            slacks.append(slack)
        if not masked:
            return memories, slacks, {}, None
        own = self.attend_to_self  # the token's key is attended to, appended after the earlier memories
        zero = torch.zeros(positions.shape, dtype=masked[0][1].spans.dtype, device=positions.device) if own else None
        key_positions, spans, valid = [], [], []
        for _, memory in masked:
            key_positions.append(memory.positions)
            spans.append(memory.spans)
            valid.append(memory.valid)
            if own:  # the token itself: distance 0, span 0
                key_positions.append(positions)
                spans.append(zero)
                valid.append(block.valid)
        distance = positions - torch.cat(key_positions, 1)  # t − i
        spans = torch.cat(spans, 1)
        valid = None if all(memory.every_valid for _, memory in masked) else torch.cat(valid, 1)
        dtype = torch.float64 if torch.float64 in (masked[0][1].keys.dtype, spans.dtype) else torch.float32
        relative_positions = modules.get("relative_positions")
        table = None if relative_positions is None else relative_positions.padded(dtype)
        terms = one_query_terms(spans, distance, valid, self.ramp, dtype, self.renormalization_epsilon, table)
        widths = [memory.width + own for _, memory in masked]
        per_layer = dict(zip((index for index, _ in masked), terms.split(widths)))
        if not counts:
            return memories, slacks, per_layer, None
        columns, start = {}, 0
        for (index, _), width in zip(masked, widths):
            columns[index], start = (start, start + width), start + width
        loss_terms = spans - distance if config.span_loss_form == "remaining_span" else spans
        return memories, slacks, per_layer, OneQueryReads(terms.mask, loss_terms, columns)

    def initial_memories(self, inputs_embeds: torch.Tensor, start_positions: torch.Tensor) -> list[ExpireSpanMemory]:
        """The official initial memory (`init_hid_cache`): per layer, `initial_memory_size` zero layer inputs at the
        positions just before each row's first token, whose keys, values and spans each layer computes."""
        size = self.config.initial_memory_size
        batch_size = inputs_embeds.shape[0]
        offsets = torch.arange(-size, 0, device=inputs_embeds.device)
        positions = start_positions[:, None] + offsets  # counters size..1 before the first query
        zeros = inputs_embeds.new_zeros(batch_size, size, inputs_embeds.shape[-1])
        cos, sin = self.rotary_emb(positions) if self.rotary_emb is not None else (None, None)
        return [layer.initial_memory(zeros, positions, cos, sin) for layer in self.layers]


class ExpireSpanForCausalLM(ExpireSpanPreTrainedModel, CountsOwnPositions, GenerationMixin):
    cache_class = ExpireSpanCache
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: ExpireSpanConfig):
        super().__init__(config)
        self.model = ExpireSpanModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=config.lm_head_bias)
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: ExpireSpanCache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        output_spans: bool | None = None,
        return_dict: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        past_key_values: ExpireSpanCache | None = None,
        **kwargs,
    ) -> ExpireSpanCausalLMOutput | tuple:
        r"""
        labels: (B, T) token ids; next-token cross-entropy (shifted inside), -100 ignored. In training mode the span
            loss is added to it (`loss = lm_loss + span_loss`); both are reported.
        logits_to_keep: an int keeps the last that many positions (0 keeps all); a tensor selects positions.
        """
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        cache = resolve_cache_argument(cache, past_key_values, type(self).__name__)
        outputs = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            cache=cache, inputs_embeds=inputs_embeds, use_cache=use_cache,
            output_hidden_states=output_hidden_states, output_spans=output_spans, return_dict=True, **kwargs,
        )  # fmt: skip
        logits = linear(self.lm_head, slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep))

        loss = lm_loss = causal_lm_loss(self, logits, labels, kwargs)
        if lm_loss is not None and self.training:
            loss = lm_loss + outputs.span_loss.to(lm_loss.dtype)
        output = model_output(
            ExpireSpanCausalLMOutput,
            loss=loss, logits=logits, **with_cache(outputs.cache), hidden_states=outputs.hidden_states,
            spans=outputs.spans, lm_loss=lm_loss, span_loss=outputs.span_loss, aux_loss=outputs.aux_loss,
            memory_size=outputs.memory_size,
        )  # fmt: skip
        return output if return_dict else output.to_tuple()


__all__ = ["ExpireSpanCache", "ExpireSpanForCausalLM", "ExpireSpanModel", "ExpireSpanPreTrainedModel"]
