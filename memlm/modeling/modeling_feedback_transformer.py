"""Feedback Transformer: every layer attends to the past's highest representations.

Fan, Lavril, Grave, Joulin & Sukhbaatar (ICLR 2021), "Addressing Some Limitations of Transformers with Feedback
Memory". At step t the layers read one shared memory of earlier steps (SPEC §3, paper Eq. 1):

    m_t   = Σ_{l=0..L} softmax(w)_l · x_t^l            x^0 = token embedding, x^l = output of layer l
    z_t^l = Attn(query x_t^l, keys/values of m_{t−τ} … m_{t−1})

m_t needs the top layer at t, so the computation is sequential in t, in training too. One step function
(`FeedbackTransformerModel.step`: the layers, then the memory mix of Eq. 1 and its keys/values) serves the full
forward and decoding, so they cannot drift apart; its pure functions, which `compile_step` compiles, are in
`memlm.kernels.feedback.compiled`. The loop over the steps and the memory it reads and writes are the
operation `memlm.kernels.feedback.feedback_recurrence`: its `reference.py` is the plain loop; its fast path keeps the
memory in preallocated buffers (the cache's ring of up to τ slots, a training tape) and differentiates the loop by hand.
The `record` arguments of `step` keep what that hand-written backward needs (`Recording`).

What a step adds to its scores (visibility, relative positions, the adaptive span's window and mask, dropout on the
weights) is in `memlm.kernels.feedback.scores`, shared by the step and the hand-written backward.

The file reads top to bottom: the adaptive span's clamp → attention →
decoder layer → recurrence (the loop, a hub layer of 🤗's `kernels`) → cache → PreTrainedModel →
FeedbackTransformerModel (its step, then its forward) → FeedbackTransformerForCausalLM.
"""

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_utils import slice_logits_to_keep

from ..compat import (
    CACHE_NAMES,
    BaseModelOutputWithPast,
    CausalLMOutputWithPast,
    model_output,
    resolve_cache_argument,
    with_cache,
)
from ..configuration.configuration_feedback_transformer import FeedbackTransformerConfig
from ..export import RemoteCodeMixin
from ..kernels import mark_static
from ..kernels.feedback import feedback_recurrence
from ..kernels.feedback.compiled import (
    ACTIVATIONS,
    step_block,
    step_memory,
    step_query,
)
from ..kernels.feedback.compiled import compiled as compiled_function
from ..kernels.feedback.scores import adaptive_span_window, read_memory, step_terms
from ..kernels.feedback.tape import ProjectedMemories, allocate_ring, grow_ring, roll_back_layer
from ..kernels.feedback.through_time import Recording, StepGradients
from ..kernels.hub import HubKernelsMixin, HubLayerMixin, use_kernel_forward_from_hub
from ..kernels.rotary import rotate, signed_sine
from .layers import (
    GatedMLP,
    LayerNorm,
    PaddedPositions,
    PlainMLP,
    RMSNorm,
    RotaryEmbedding,
    dropout,
    linear,
    make_mlp,
    make_norm,
)
from .memory import (
    CountsOwnPositions,
    MemoryCache,
    Rollback,
    StaticMemoryCacheLayer,
    auxiliary_outputs_read,
    causal_lm_loss,
    check_extra_kwargs,
    check_fits_in_memory,
    current_padding_mask,
    current_weights_version,
    embed_inputs,
    padding_first,
    past_length_to_check,
    prompt_loop,
    refuse_packed_documents,
    restore_order,
    writes_in_place,
    zero_padding,
)


@dataclass
class FeedbackModelOutput(BaseModelOutputWithPast):
    """
    last_hidden_state: (B, T, D) after the final norm.
    cache: the `FeedbackCache` (the field is `past_key_values` under 🤗 Transformers before 5.24, where `.cache`
        reads it too).
    hidden_states: embeddings and each layer's output, when `output_hidden_states`.
    aux_loss: with `adaptive_span`, the span loss Σ_layers coefficient · τ · mean_heads(z_l) (Sukhbaatar et al.,
        2019: the ℓ1 penalty on the spans, with the official code's scale); None otherwise, and inside `generate`,
        which does not read it (`auxiliary_outputs_read`).
    """

    aux_loss: torch.FloatTensor | None = None


@dataclass
class FeedbackCausalLMOutput(CausalLMOutputWithPast):
    """
    loss: in training mode `lm_loss + aux_loss` (when there is an auxiliary loss); in eval mode `lm_loss`.
    lm_loss: next-token cross-entropy.
    aux_loss: as in `FeedbackModelOutput`.
    """

    lm_loss: torch.FloatTensor | None = None
    aux_loss: torch.FloatTensor | None = None


def clamp_adaptive_spans(model: nn.Module) -> int:
    """The official trainer's last rule for the adaptive span (transformer-sequential `trainer.py` calls each layer's
    `param_clamp()` after every optimizer step): every span ratio z in `model` (a memlm model, or one wrapped by
    DDP, Accelerate or PEFT) clamped to [0, 1] in place. Returns how many layers hold one. `memlm train` calls it after
    each optimizer step, `memlm.training.callbacks.ClampAdaptiveSpans` does for a 🤗 `Trainer`."""
    ratios = [module.span_ratio for module in model.modules()
              if isinstance(module, FeedbackAttention) and hasattr(module, "span_ratio")]  # fmt: skip
    with torch.no_grad():
        for ratio in ratios:
            ratio.clamp_(0, 1)
    return len(ratios)


class FeedbackAttention(nn.Module):
    """The query side of one layer's attention over the memory (keys/values come from the memory, once per step when
    shared), and its output projection."""

    def __init__(self, config: FeedbackTransformerConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        width = config.attention_width
        self.q_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.o_proj = nn.Linear(width, config.hidden_size, bias=config.attention_output_bias)
        if not config.share_key_value:
            self.k_proj = nn.Linear(config.hidden_size, width, bias=False)
            self.v_proj = nn.Linear(config.hidden_size, width, bias=False)
        if config.position_encoding == "relative_bias":
            # Learned score bias per head for distances 1..τ (index d − 1).
            self.relative_bias = nn.Parameter(torch.zeros(config.num_attention_heads, config.memory_span))
        if config.adaptive_span:
            # The span ratio z of each head (Sukhbaatar et al., 2019: the span is z·τ).
            self.span_ratio = nn.Parameter(
                torch.full((config.num_attention_heads,), float(config.adaptive_span_initial_ratio))
            )
        self.dropout = nn.Dropout(config.attention_dropout)


class FeedbackDecoderLayer(nn.Module):
    """x = x + attention(norm(x), memory); x = x + mlp(norm(x)), for one step (run by `FeedbackTransformerModel.step`;
    the layer has no forward of its own, because a step interleaves all layers with the memory). With gradient
    checkpointing on, the MLP block of every step is recomputed in the backward instead of kept."""

    def __init__(self, config: FeedbackTransformerConfig, layer_idx: int):
        super().__init__()
        self.gradient_checkpointing = False
        self.input_layernorm = make_norm(config)
        self.attention = FeedbackAttention(config, layer_idx)
        self.post_attention_layernorm = make_norm(config)
        self.mlp = make_mlp(config)
        self.dropout = nn.Dropout(config.hidden_dropout)


@use_kernel_forward_from_hub("FeedbackRecurrence")
class FeedbackRecurrence(HubLayerMixin, nn.Module):
    """The loop over the time steps (paper Eq. 1 makes them sequential) and the memory it reads and writes, as a
    module without weights: the model passes itself, so a kernel repository of 🤗's `kernels` package can replace the
    loop (`kernels.kernelize`) while the weights stay the model's."""

    def forward(self, model, inputs_embeds, positions, valid, cache_layers, next_positions, padding_steps=0,
                keep_states=False, carry_from=None):  # fmt: skip
        return feedback_recurrence(model, inputs_embeds, positions, valid, cache_layers, next_positions,
                                   padding_steps=padding_steps, keep_states=keep_states,
                                   carry_from=carry_from)  # fmt: skip


class FeedbackRecord(NamedTuple):
    """What a forward into a recording `FeedbackCache` keeps, per key/value set, to be undone. When it wrote the ring in
    place: the ring's width before it (None: no ring yet) and per step what the step's write overwrote. When it left a
    window (the official layouts' step loop): the layer's tensors before it (keys, values, positions, valid, hidden,
    ring) and every memory its first token saw (`window`: keys, values, positions, valid, hidden), within `reach`."""

    ring_width: int | None
    undo_steps: list | None
    memory_span: int
    before: tuple | None
    window: tuple | None
    reach: int


class FeedbackCacheLayer(StaticMemoryCacheLayer):
    """One key/value set of the feedback memory: up to τ slots per row (slot = position mod τ), with each slot's
    position and whether it holds a memory. The ring grows with the context (doubling, capped at τ): while it holds
    fewer than τ slots no position has reached its end, so slot = position mod τ = position and growing keeps every
    slot where it is. With `full_ring` (compiled decoding, `FeedbackCache.prepare_compiled_decoding`) it holds τ slots
    from the start, so its shapes never change; its size is bounded either way (`StaticMemoryCacheLayer`). The ring
    is allocated, grown, written and undone in `memlm.kernels.feedback.tape` (`allocate_ring`, `grow_ring`,
    `_RingStore`, `roll_back_layer`).

    While the cache records its past (`FeedbackRecord`), a forward that writes the ring in place keeps, per step, what
    the step overwrote (`undo_steps`, filled by the ring), and a rollback writes it back, newest first; a forward that
    leaves a window (the official layouts' step loop) also gets back every memory its first token sees, from which a
    rollback keeps those the token after the cut sees, as a forward over the kept tokens alone would have."""

    # `hidden`: with `memory_carry="hidden_states"`, the memories' hidden states (B, W, D), from which each forward
    # recomputes the keys and values (`keys` and `values` then hold those of the last forward).
    tensor_names = ("keys", "values", "positions", "valid", "hidden")

    def __repr__(self):
        shape = None if self.keys is None else tuple(self.keys.shape)
        return f"FeedbackCacheLayer(keys={shape}, seen_tokens={self.seen_tokens})"

    def __init__(self):
        super().__init__()
        # True: τ slots with slot = position mod τ (written in place by inference). False: a window of memories in any
        # order (what a training forward or the reference loop leaves), turned into a ring when inference needs one.
        self.ring = False
        self.full_ring = False
        # A list while a recording forward runs: what each step's write into the ring overwrote.
        self.undo_steps = None

    def roll_back(self, rollback: Rollback):
        roll_back_layer(self, rollback)


class FeedbackCache(MemoryCache):
    """The cache of the Feedback Transformer: the keys and values of the last τ memories, one set for all
    layers when the projections are shared (a standard Transformer caches L sets), plus per row the position of the
    next real token. Supports beam search, `num_return_sequences` and batch selection."""

    layer_class = FeedbackCacheLayer

    def __init__(self, config):
        super().__init__(config)
        self.memory_span = config.memory_span
        # While a recording forward runs (`begin_recorded_forward` → `end_forward`): the layers before it.
        self._before = self._ring_widths = None

    @staticmethod
    def layer_count(config) -> int:
        return config.memory_groups  # one key/value set for all layers when shared

    def prepare_compiled_decoding(self):
        """The ring takes its τ slots at once (and a ring already allocated grows to them): a compiled step then
        sees the same shapes at every token. It reads all τ slots, filled or not (masked), where eager decoding reads
        only the filled ones."""
        for layer in self.layers:
            layer.full_ring = True
            if layer.ring and layer.keys.shape[2] < self.memory_span:
                grow_ring(layer, self.memory_span)

    @classmethod
    def given_or_new(cls, cache, config, batch_size: int) -> "FeedbackCache":
        """The cache a forward was given (checked against the model's config and the batch), or a new one."""
        if cache is not None and not isinstance(cache, cls):
            raise TypeError(
                "The Feedback Transformer keeps its memory in a FeedbackCache; got a cache of type "
                f"{type(cache).__name__}. Pass None (a cache is created) or the FeedbackCache a previous call returned."
            )
        cache = cache if cache is not None else cls(config)
        cache.check_against(config, batch_size)
        return cache

    def token_positions(self, valid: torch.Tensor) -> torch.Tensor:
        """The positions (B, T) of a forward's tokens, padding first in each row (`padding_first`): counted on from
        each row's next position (0 in a fresh cache), −1 for padding."""
        if self.next_positions is None:
            self.next_positions = mark_static(torch.zeros(valid.shape[0], dtype=torch.long, device=valid.device))
        counted = valid.long().cumsum(1) if valid.shape[1] > 1 else valid.long()  # (a compiled step: no cumsum)
        return (self.next_positions[:, None] + counted - 1).masked_fill(~valid, -1)

    def begin_recorded_forward(self, length: int, valid: torch.Tensor | None, allows_gradients: bool):
        """At the start of a forward into a recording cache (`valid`: its padding mask in the caller's order): what a
        rollback into it needs from before it (the layers' tensors, the ring's width), and the ring logs what its
        writes overwrite. Only the tape (`allows_gradients`, the official layouts) records a forward with
        gradients."""
        if torch.is_grad_enabled() and not allows_gradients:
            raise ValueError(
                "This FeedbackCache records its past for rolling back (activate_past_recording, as generate does "
                "for assisted decoding), which it can do for forwards without gradients: run the model under "
                "torch.no_grad()."
            )
        self.record_forward(length, valid)
        self._before = [(layer.keys, layer.values, layer.positions, layer.valid, layer.hidden, layer.ring)
                        for layer in self.layers]  # fmt: skip
        self._ring_widths = [layer.keys.shape[2] if layer.ring else None for layer in self.layers]
        for layer in self.layers:
            layer.undo_steps = []

    def end_forward(self, window, following: torch.Tensor, reach: int, length: int, version):
        """After a forward's step loop: take the window it hands to the next call (None when it wrote the ring in
        place), close the forward's record when recording, and move each row's next position to `following`.

        The window (keys, values (G, B, H, W, d), positions, valid (B, W), and the hidden states (B, W, D) with
        `memory_carry="hidden_states"`) is carried detached (truncated back-propagation through time): the next
        training forward takes it as its prefix, inference lays it out as a ring. Only the slots some row still sees
        within `reach` steps of its next position are kept. Keys and values None: only the hidden states are
        carried (the cache's keys and values become None). `version`: the version of the weights that the
        memories' keys and values are a projection of (the cache's `weights_version`; None: not all are)."""
        recording = self.recording
        seen_windows = None
        if window is not None:
            keys, values, slot_positions, slot_valid, *hidden = window
            hidden = hidden[0] if hidden else None
            if recording:  # every memory the forward's first token sees, per key/value set
                seen_windows = [(keys[group], values[group], slot_positions, slot_valid, hidden if group == 0 else None)
                                for group in range(len(self.layers))]  # fmt: skip
            slot_valid = slot_valid & (following[:, None] - slot_positions <= reach)
            # (A recording forward's window reaches further back, and a tape's holds its whole prefix while the call
            # is shorter than τ.)
            kept = slot_valid.any(0).nonzero()[:, 0]
            groups = len(self.layers)
            # (Indexing copies: each set is a view of one copy of them all.)
            keys = [None] * groups if keys is None else keys[:, :, :, kept].detach().unbind(0)
            values = [None] * groups if values is None else values[:, :, :, kept].detach().unbind(0)
            slot_positions, slot_valid = slot_positions[:, kept], slot_valid[:, kept]
            hidden = hidden[:, kept] if hidden is not None else None
            for group, layer in enumerate(self.layers):
                layer.keys, layer.values = keys[group], values[group]
                layer.positions, layer.valid, layer.ring = slot_positions.clone(), slot_valid, False
                # One set of hidden states for every key/value set, kept by the first.
                layer.hidden = hidden.detach().clone() if hidden is not None and group == 0 else None
        self.weights_version = version
        if recording:
            for group, layer in enumerate(self.layers):
                if window is None:
                    record = FeedbackRecord(self._ring_widths[group], layer.undo_steps, self.memory_span, None, None,
                                            reach)  # fmt: skip
                else:
                    record = FeedbackRecord(None, None, self.memory_span, self._before[group], seen_windows[group],
                                            reach)  # fmt: skip
                layer.recorded.append(record)
                layer.undo_steps = None
            self._before = self._ring_widths = None
        # In place for a compiled step (the same address); replaced while recording, whose record keeps the old one.
        if not recording and writes_in_place(self.next_positions, following):
            self.next_positions.copy_(following)
        else:
            self.next_positions = following
        for layer in self.layers:
            layer.count_tokens(length)

    def memory_bytes(self) -> int:
        """Bytes of the cached keys and values (and of the hidden states, with `memory_carry="hidden_states"`: one
        set for all layers)."""
        total = sum(
            layer.keys.numel() * layer.keys.element_size() * 2 for layer in self.layers if layer.keys is not None
        )
        hidden = self.layers[0].hidden if self.layers else None
        return total + (hidden.numel() * hidden.element_size() if hidden is not None else 0)


class FeedbackTransformerPreTrainedModel(HubKernelsMixin, RemoteCodeMixin, PreTrainedModel):
    config: FeedbackTransformerConfig
    config_class = FeedbackTransformerConfig
    base_model_prefix = "model"
    # Checkpointing recomputes each step's MLP block (its activations are the largest) in the backward.
    supports_gradient_checkpointing = True
    # Every time step runs every layer (the memory feeds back from the top), reading their weights directly rather
    # than through each layer's forward: the whole stack is one unit for FSDP wrapping and device maps.
    _no_split_modules = ["FeedbackTransformerModel"]
    _skip_keys_device_placement = list(CACHE_NAMES)
    # A decoding step compiles to one graph over the ring of τ slots (with the PyTorch kernels, which CPUs run:
    # tests/modeling/test_compile.py).
    _can_compile_fullgraph = True
    # The memory rolls back (`FeedbackCache.crop`), so 🤗's assisted and prompt-lookup decoding run.
    _is_stateful = False
    hub_card_template = "feedback_transformer.md"

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # `generate` must not build a DynamicCache: the model creates its own FeedbackCache on the first forward.
        return False

    @torch.no_grad()
    def _init_weights(self, module: nn.Module):
        super()._init_weights(module)
        if isinstance(module, FeedbackTransformerModel):
            init.zeros_(module.layer_weights)  # softmax(0): every layer weighs the same at first
            if module.relative_positions is not None:
                init.normal_(module.relative_positions, std=self.config.initializer_range)
        elif isinstance(module, FeedbackAttention):
            if hasattr(module, "relative_bias"):
                init.zeros_(module.relative_bias)
            if hasattr(module, "span_ratio"):
                init.constant_(module.span_ratio, self.config.adaptive_span_initial_ratio)
        elif isinstance(module, RotaryEmbedding):
            init.copy_(module.inv_freq, module.compute_inverse_frequencies())


class FeedbackTransformerModel(FeedbackTransformerPreTrainedModel):
    # The modules `step` runs: the hand-written backward of `memlm.kernels.feedback` knows these (and the config's
    # activation) only; any other module, e.g. an adapter, runs the steps with autograd.
    step_modules = (FeedbackDecoderLayer, FeedbackAttention, GatedMLP, PlainMLP, RMSNorm, LayerNorm, RotaryEmbedding,
                    nn.Linear, nn.Dropout, nn.ModuleList, FeedbackRecurrence)  # fmt: skip

    def __init__(self, config: FeedbackTransformerConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        check_fits_in_memory(config, self.embed_tokens.weight)  # before the layers are built
        self.layers = nn.ModuleList(
            [FeedbackDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = make_norm(config) if config.final_norm else nn.Identity()
        self.embedding_dropout = nn.Dropout(config.embedding_dropout)
        self.output_dropout = nn.Dropout(config.output_dropout)
        # Paper Eq. 1: one learned scalar per representation (the embedding and each layer's output).
        self.layer_weights = nn.Parameter(torch.zeros(config.num_hidden_layers + 1))
        self.memory_norm = make_norm(config) if config.memory_normalization == "mixture" else None
        if config.share_key_value:
            # Keys and values of a memory computed once per step for all layers (paper Sec. 3.2).
            self.k_proj = nn.Linear(config.hidden_size, config.attention_width, bias=False)
            self.v_proj = nn.Linear(config.hidden_size, config.attention_width, bias=False)
        self.rotary_emb = (
            RotaryEmbedding(config.head_dim, config.rope_theta) if config.position_encoding == "rotary" else None
        )
        # The official code's relative positions (`key_pe`, scored by `relative_position_scores`): row d − 1 is p_d,
        # shared by the layers and heads.
        self.relative_positions = (
            nn.Parameter(torch.zeros(config.memory_span, config.head_dim))
            if config.position_encoding == "learned_relative"
            else None
        )
        self._padded = PaddedPositions()  # the table as a decoding step reads it
        # The config values `step` reads, as plain attributes: a 🤗 config's attribute lookup costs microseconds,
        # and `step` runs once per token (about a tenth of a decoded token's time went to these lookups).
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.memory_span = config.memory_span
        self.share_key_value = config.share_key_value
        # No learned bias per layer: one bias (the visibility) serves every layer of a step.
        self.shared_bias = config.position_encoding != "relative_bias"
        self.rms_norm_eps = config.rms_norm_eps
        self.norm_position = config.norm_position
        self.default_step = config.default_step
        self.layer_norms_memory = config.memory_normalization == "layer"
        self.memory_groups = config.memory_groups
        self.carry_first_layer_norm = config.carry_first_layer_norm
        self.attention_dropout_on_context = config.attention_dropout_position == "context"
        self.carries_hidden_states = config.memory_carry == "hidden_states"
        # With `adaptive_span_trim_step`: how many memories each layer reads, set at the start of every forward.
        self.read_windows = None
        self.embedding_scale = config.embedding_scale
        self.recomputes_carried_memory = config.recomputes_carried_memory
        self.adaptive_span = config.adaptive_span
        self.trims_adaptive_span = config.adaptive_span and config.adaptive_span_trim_step is not None
        # The options the ring does not hold (`needs_tape`): keys and values computed from hidden states at the start
        # of a forward, the adaptive span's mask, dropout on the attention weights (in training, every layout runs on
        # the tape).
        self.needs_tape = (
            config.recomputes_carried_memory or config.adaptive_span or config.attention_dropout_position == "weights"
        )
        # While a one-token forward without gradients runs with `carry_first_layer_norm`: its step projects the keys
        # and values of its memory from the hidden state it carries, as the next forward reads them (no step of this
        # forward reads them).
        self.projects_carried_memory = False
        # While a step loop runs with autograd: its linear layers' weight gradients, gathered over the steps
        # (`DeferredWeightGradients`, set by `memlm.kernels.feedback`).
        self.deferred = None
        # Dropout on the attention weights draws each (layer, step)'s mask from its own seed, this forward's base plus
        # the pair's index (`scores.weights_dropout_seed`), so that a backward draws it again instead of keeping it.
        self.dropout_base_seed = None
        self.recurrence = FeedbackRecurrence()
        self.post_init()

    def _dropout(self, states: torch.Tensor, probability: float, record: "Recording | None", key) -> torch.Tensor:
        """Dropout with an explicit mask, kept in `record` for the hand-written backward (both training paths draw
        the same masks from the same seed)."""
        if not self.training or probability == 0:
            return states
        mask = torch.empty_like(states).bernoulli_(1 - probability).div_(1 - probability)
        if record is not None:
            record.masks[key] = mask
        return states * mask

    def _linear(self, module: nn.Linear, states: torch.Tensor) -> torch.Tensor:
        """`module(states)` (`linear`), its weight gradient deferred while a step loop runs with autograd
        (`self.deferred`)."""
        return linear(module, states) if self.deferred is None else self.deferred.linear(module, states)

    def _feed_forward(self, layer: FeedbackDecoderLayer, residual: torch.Tensor, record=None, key=()):
        """The MLP block's output (before the residual sum); `record` keeps its gate and up projections."""
        mlp = layer.mlp
        normed = layer.post_attention_layernorm(residual) if self.norm_position == "pre" else residual
        if record is None and self.deferred is not None:  # the MLP's lines (`GatedMLP`, `PlainMLP`), deferred
            if isinstance(mlp, PlainMLP):
                output = self._linear(mlp.down_proj, mlp.dropout(mlp.act_fn(self._linear(mlp.up_proj, normed))))
            else:
                gated = mlp.act_fn(self._linear(mlp.gate_proj, normed)) * self._linear(mlp.up_proj, normed)
                output = self._linear(mlp.down_proj, gated)
        elif record is None:
            output = mlp(normed)
        elif isinstance(mlp, PlainMLP):  # the MLP's lines, to keep its projection (see `through_time.covers`)
            up = mlp.up_proj(normed)
            if not layer.gradient_checkpointing:
                record.ups[key] = up
            output = mlp.down_proj(self._dropout(mlp.act_fn(up), mlp.dropout.p, record, ("activation",) + key))
        else:
            gate_up = F.linear(normed, record.gate_up[key[0]], record.gate_up_bias[key[0]])
            gate, up = gate_up.split(mlp.gate_proj.out_features, dim=-1)
            if not layer.gradient_checkpointing:
                record.gates[key], record.ups[key] = gate, up
            output = mlp.down_proj(mlp.act_fn(gate) * up)
        return self._dropout(output, layer.dropout.p, record, ("mlp",) + key)

    def step(self, embeddings: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, store, step: int,
             record: "Recording | None" = None, compiled: bool = False):  # fmt: skip
        """One time step for a batch: embeddings (B, D) of the tokens at `positions` (B,); `valid` (B,) False for
        padding, which writes nothing into the memory. Returns the top layer's output (B, D) and every layer's.
        `record` (training without autograd) keeps what the hand-written backward needs. `compiled` (only without
        autograd, dropout or hooks: `through_time.compiled_step_applies`) runs the step's pure functions through
        `torch.compile`."""
        batch_size = embeddings.shape[0]
        cos = sin = None
        rotation = (None, None)
        if self.rotary_emb is not None:
            cos, sin = self.rotary_emb(positions[:, None])  # (B, 1, 1, d)
            # For (B, H, d) queries and (G, B, H, d) keys, with rotate-half's sign folded into sin (`rotate`).
            rotation = cos[:, 0], signed_sine(sin)[:, 0]  # (B, 1, d)
        if compiled:
            query_function, block_function, memory_function = (
                compiled_function(step_query), compiled_function(step_block), compiled_function(step_memory)
            )  # fmt: skip
            activation = ACTIVATIONS[self.config.hidden_act]
        states = [embeddings]
        hidden_states = embeddings
        shared = step_terms(self, store, step, positions)  # what the step's layers add alike to their scores
        for layer_idx, layer in enumerate(self.layers):
            attention = layer.attention
            key = (layer_idx, step)
            if compiled:
                query = query_function(hidden_states, layer.input_layernorm.weight, self.rms_norm_eps,
                                       attention.q_proj.weight, *rotation, self.head_dim)  # fmt: skip
            else:
                attention_input = (
                    layer.input_layernorm(hidden_states) if self.norm_position == "pre" else hidden_states
                )
                query = self._linear(attention.q_proj, attention_input).view(batch_size, -1, self.head_dim)
                if cos is not None:
                    query = rotate(query, *rotation)
                query = query.reshape(-1, self.head_dim)
            context = read_memory(self, layer_idx, store, step, positions, query, shared)
            if compiled:  # no dropout (see `through_time.compiled_step_applies`)
                mlp = layer.mlp
                gate_up = (record.gate_up[layer_idx], None) if record is not None else (
                    mlp.gate_proj.weight, mlp.up_proj.weight
                )  # fmt: skip
                residual, gate, up, hidden_states_next = block_function(
                    hidden_states, context.view(batch_size, -1), attention.o_proj.weight,
                    layer.post_attention_layernorm.weight, self.rms_norm_eps, *gate_up, mlp.down_proj.weight,
                    activation,
                )  # fmt: skip
                if record is not None and not layer.gradient_checkpointing:
                    record.gates[key], record.ups[key] = gate, up
            else:
                if self.attention_dropout_on_context:
                    context = self._dropout(context, attention.dropout.p, record, ("context",) + key)
                mixed = self._dropout(self._linear(attention.o_proj, context.reshape(batch_size, -1)), layer.dropout.p,
                                      record, ("attention",) + key)  # fmt: skip
                residual = hidden_states + mixed
                if self.norm_position == "post":  # norm(x + attention(x)), the official default
                    if record is not None:
                        record.sums[("attention",) + key] = residual
                    residual = layer.input_layernorm(residual)
                if layer.gradient_checkpointing and self.training and torch.is_grad_enabled():
                    feed_forward = layer._gradient_checkpointing_func(self._feed_forward, layer, residual)
                else:
                    feed_forward = self._feed_forward(layer, residual, record, key)
                hidden_states_next = residual + feed_forward
                if self.norm_position == "post":
                    if record is not None:
                        record.sums[("mlp",) + key] = hidden_states_next
                    hidden_states_next = layer.post_attention_layernorm(hidden_states_next)
            if record is not None:
                record.inputs[key], record.queries[key] = hidden_states, query
                if record.keeps_weights(store.last_weights, self.num_heads):
                    record.weights[key] = store.last_weights
                if store.last_kept is not None:  # dropout on the attention weights
                    record.kept[key] = store.last_kept
                record.contexts[key], record.residuals[key] = context, residual
            hidden_states = hidden_states_next
            states.append(hidden_states)
        # Paper Eq. 1: the memory of this step mixes the embedding and every layer's output.
        if compiled:
            stack, mixture, memory, keys, values = memory_function(
                states, self.layer_weights, self.memory_norm.weight, self.rms_norm_eps, self._projections(),
                *rotation, self.head_dim,
            )  # fmt: skip
        else:
            wide = torch.promote_types(self.layer_weights.dtype, torch.float32)
            weights = torch.softmax(self.layer_weights.to(wide), dim=0).to(hidden_states.dtype)
            stack = torch.stack(states)
            mixture = torch.einsum("l,lbd->bd", weights, stack)
            memory = self.memory_norm(mixture) if self.memory_norm is not None else mixture
        carried = None
        if self.carries_hidden_states:
            # What the next forward starts from (and recomputes keys and values of): the memory, or with
            # `carry_first_layer_norm` the memory after the first layer's input norm, as the official pre-norm code
            # stores it.
            carried = self.layers[0].input_layernorm(memory) if self.carry_first_layer_norm else memory
        if not compiled:
            if record is not None:
                sources = [layer.input_layernorm(memory) for layer in self.layers] if self.layer_norms_memory else (
                    [memory] * len(record.key_value)
                )  # fmt: skip
                keys, values = torch.stack(
                    [F.linear(source, weight) for source, weight in zip(sources, record.key_value)]
                ).chunk(2, dim=-1)
            else:
                keys, values = self._project_memory(carried if self.projects_carried_memory else memory)
            keys = keys.view(keys.shape[0], batch_size, -1, self.head_dim)
            values = values.view(values.shape[0], batch_size, -1, self.head_dim)
            if cos is not None:
                keys = rotate(keys, *rotation)
        store.write(step, keys, values, positions, valid, hidden=carried)
        if record is not None:
            record.mixtures[step], record.stacks[step] = mixture, stack
            record.memories[step], record.rotations[step] = memory, (cos, sin)
        return hidden_states, states

    def _project_memory(self, memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (G, ..., H·d) of memories (..., D): with the shared projections once, else with each
        layer's own projections, or the shared ones after each layer's own input norm (`memory_normalization=
        "layer"`, the official pre-norm code: k = W_k · norm_l(m))."""
        if self.memory_groups == 1:
            return self._linear(self.k_proj, memory)[None], self._linear(self.v_proj, memory)[None]
        keys, values = [], []
        for layer in self.layers:
            source = layer.input_layernorm(memory) if self.layer_norms_memory else memory
            projections = self if self.share_key_value else layer.attention
            keys.append(self._linear(projections.k_proj, source))
            values.append(self._linear(projections.v_proj, source))
        return torch.stack(keys), torch.stack(values)

    def padded_positions(self, dtype: torch.dtype) -> torch.Tensor:
        """The learned relative positions as a decoding step adds them to its keys (`layers.PaddedPositions`)."""
        return self._padded.of(self.relative_positions, dtype)

    def _projections(self) -> tuple:
        """(W_k, W_v) of each key/value set: one pair shared by the layers, or one per layer."""
        if self.share_key_value:
            return ((self.k_proj.weight, self.v_proj.weight),)
        return tuple((layer.attention.k_proj.weight, layer.attention.v_proj.weight) for layer in self.layers)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: FeedbackCache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        past_key_values: FeedbackCache | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast | tuple:
        r"""
        attention_mask: (B, T) or (B, past + T) padding mask. Padding may sit anywhere in a row: it writes nothing
            into the memory and does not advance the positions, so each row's real tokens give what they give alone.
            (Rows run with their padding moved first, a stable reordering undone on the outputs.)
        position_ids: accepted for 🤗 `generate`; positions are counted from each row's first real token.
        cache: a `FeedbackCache` with the keys and values of the last τ memories (`past_key_values` is its name
            before 🤗 Transformers 5.24, still accepted).
        """
        check_extra_kwargs(kwargs, type(self).__name__)
        cache = resolve_cache_argument(cache, past_key_values, type(self).__name__)
        config = self.config
        use_cache = use_cache if use_cache is not None else config.use_cache
        output_hidden_states = (
            output_hidden_states if output_hidden_states is not None else config.output_hidden_states
        )
        return_dict = return_dict if return_dict is not None else config.return_dict
        inputs_embeds = embed_inputs(input_ids, inputs_embeds, self.embed_tokens)
        if self.embedding_scale != 1:
            inputs_embeds = inputs_embeds * self.embedding_scale
        inputs_embeds = dropout(self.embedding_dropout, inputs_embeds)
        batch_size, length = inputs_embeds.shape[:2]
        device = inputs_embeds.device
        cache = FeedbackCache.given_or_new(cache, config, batch_size)
        valid = current_padding_mask(attention_mask, batch_size, length, past_length_to_check(cache))
        recording = cache.recording
        if recording:  # keep what a rollback into this forward needs (`FeedbackCache.crop`)
            cache.begin_recorded_forward(length, valid, allows_gradients=self.needs_tape)
            # A recorded forward recomputes every carried memory (`_starting_memory`): a crop into it forgets the
            # weights they were made with.
            if self.recomputes_carried_memory:
                cache.recomputed_while_recording = True
        if valid is None:
            valid = torch.ones(batch_size, length, dtype=torch.bool, device=device)
        else:
            inputs_embeds = zero_padding(inputs_embeds, valid.to(device))
        valid = valid.to(device)
        refuse_packed_documents(position_ids, valid, batch_size, length, "The Feedback Transformer", kwargs)
        given_embeds = inputs_embeds
        # Padding first, real tokens after it in their order: steps then count memories as positions do.
        inputs_embeds, valid, order = padding_first(inputs_embeds, valid, attention_mask)
        padding_steps = 0
        if order is not None and (torch.is_grad_enabled() or self.needs_tape):  # the tape widens its windows by it
            padding_steps = int((~valid).sum(1).max())
        fresh = cache.next_positions is None
        positions = cache.token_positions(valid)
        if self.trims_adaptive_span:
            self.read_windows = [
                adaptive_span_window(layer.attention.span_ratio, config.memory_span, config.adaptive_span_ramp,
                                     config.adaptive_span_trim_step)
                for layer in self.layers
            ]  # fmt: skip
        memory_layers = cache.layers
        # The weights now (an optimizer step or a load changes it), which the cache's memories were or are made with
        # (not read while compiling: see `_starting_memory`).
        compiling = torch.compiler.is_compiling()
        version = current_weights_version(self, cache) if self.carries_hidden_states and not compiling else None
        if self.recomputes_carried_memory:
            memory_layers = self._starting_memory(cache, fresh, inputs_embeds, version)
        # With `carry_first_layer_norm` the next forward reads this one's memories projected from the hidden states
        # they carry, normed once more than what the steps project. Without gradients they are projected so here: at
        # once by the step of a one-token forward (`projects_carried_memory`), again at the end of a longer one.
        renews = self.carry_first_layer_norm and not torch.is_grad_enabled()
        self.projects_carried_memory = renews and length == 1
        first_positions = cache.next_positions.clone() if renews and length > 1 else None

        # One base seed per training forward for the dropout masks on the attention weights
        # (`scores.weights_dropout_seed`).
        drops_weights = not self.attention_dropout_on_context and any(
            layer.attention.dropout.p > 0 for layer in self.layers
        )  # fmt: skip
        self.dropout_base_seed = int(torch.randint(0, 2**62, ())) if self.training and drops_weights else None
        # The loop over the steps (paper Eq. 1 makes them sequential), with the memory the cache carries. Traced by
        # torch.compile, a prompt's loop runs outside the graph (`prompt_loop`) on its own fast path; a one-token step
        # (decoding) is traced whole.
        try:
            top, all_states, window = prompt_loop(self.recurrence, length)(
                self, inputs_embeds, positions, valid, memory_layers, cache.next_positions, padding_steps,
                output_hidden_states, carry_from=cache.next_positions if recording else None,
            )  # fmt: skip
        finally:  # (a backward reads its forward's seeds from what that forward recorded, not from the model)
            self.projects_carried_memory = False
            self.dropout_base_seed = None
        self._carry(cache, window, valid, version, first_positions)

        def restored(states: torch.Tensor) -> torch.Tensor:  # back to the caller's order
            return restore_order(states, order)

        hidden_states = restored(self.norm(top))
        hidden_states = dropout(self.output_dropout, hidden_states)
        hidden_states_out = None
        if output_hidden_states:
            # As in 🤗 Llama: the embeddings, each layer's output but the last, and the normed output.
            hidden_states_out = (given_embeds, *self._layer_outputs(all_states, restored), hidden_states)
        output = model_output(
            FeedbackModelOutput,
            last_hidden_state=hidden_states,
            **with_cache(cache if use_cache else None),
            hidden_states=hidden_states_out,
            aux_loss=self._adaptive_span_loss() if auxiliary_outputs_read() else None,  # (None inside `generate`)
        )
        return output if return_dict else output.to_tuple()

    def _layer_outputs(self, all_states: list, restored) -> list:
        """Each layer's output but the last, (B, T, D) each, from the steps' states. The embeddings and the normed
        output are the very tensors on the path to the loss; a layer's outputs exist step by step only (step t runs
        before step t + 1 exists), so their stack gets, after a backward, the gradient of each step's output as its
        `.grad` when `retain_grad()` was called (`StepGradients`)."""
        layer_states = []
        for index in range(1, len(self.layers)):
            steps = [states[index] for states in all_states]
            stacked = restored(torch.stack(steps, dim=1))
            if stacked.requires_grad:
                StepGradients(stacked, steps, restored)
            layer_states.append(stacked)
        return layer_states

    def _adaptive_span_loss(self) -> torch.Tensor | None:
        """The adaptive span's loss as the official code adds it: Σ_layers mean_heads(z) · coefficient · τ (None
        without `adaptive_span`)."""
        if not self.adaptive_span:
            return None
        scale = self.config.adaptive_span_loss_coefficient * self.memory_span
        return sum(layer.attention.span_ratio.mean() * scale for layer in self.layers)

    def _starting_memory(self, cache: FeedbackCache, fresh: bool, like: torch.Tensor, version: tuple | None) -> list:
        """The memory a forward starts from when its keys and values are computed here, from hidden states: the
        official initial memory (`initial_memory="zeros"`: τ zero hidden states at positions −τ … −1) when the cache
        is fresh, else the hidden states the cache carries (`memory_carry="hidden_states"`), their keys and values
        recomputed with the current weights (so that gradients reach the projections through them). Otherwise the
        cache's own layers. Without gradients, when the cache's keys and values are projections of its hidden states
        with the weights of now (decoding), they are taken as they are. `version`: the weights' `weights_version` now,
        None while compiling: a compiled step (decoding, which changes no weight) takes the cache's memories as made
        with the weights of now whenever they were made with one version of them."""
        config, first = self.config, cache.layers[0]
        batch_size = like.shape[0]
        if fresh and config.initial_memory == "zeros":
            hidden, positions = self.zero_memory(batch_size, like)
            valid = torch.ones(positions.shape, dtype=torch.bool, device=like.device)
        elif self.carries_hidden_states and first.hidden is not None:
            hidden, positions, valid = first.hidden.to(like.dtype), first.positions, first.valid
            if (
                not torch.is_grad_enabled()
                and not cache.recording
                and cache.weights_version is not None
                and (version is None or cache.weights_version == version)
            ):
                return cache.layers
        else:
            return cache.layers
        carried = hidden if self.carries_hidden_states else None
        if torch.is_grad_enabled():  # projected by the recurrence's path (see `ProjectedMemories`)
            return ProjectedMemories(self._project_hidden, hidden, positions).sets(self.memory_groups, valid,
                                                                                   carried)  # fmt: skip
        # Without gradients the memory is the cache's ring (`_RingStore`): its layers take the memories (in the ring's
        # own slots when they come from it), and the store lays a window out as a ring.
        keys, values = self._project_hidden(hidden, positions)
        ring = first.ring and not fresh
        for group, layer in enumerate(cache.layers):
            layer.keys, layer.values = keys[group].contiguous(), values[group].contiguous()
            layer.positions, layer.valid, layer.ring = positions, valid, ring
            layer.hidden = carried if group == 0 else None  # one set of hidden states, kept by the first
        return cache.layers

    def zero_memory(self, batch_size: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The official initial memory (`initial_memory="zeros"`, `init_hid_cache`): τ zero hidden states (B, τ, D),
        like `like`, at positions −τ … −1 (B, τ)."""
        span = self.memory_span
        positions = torch.arange(-span, 0, device=like.device).expand(batch_size, span)
        return like.new_zeros(batch_size, span, self.config.hidden_size), positions

    def _project_hidden(self, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (G, B, H, W, d) of memories' hidden states (B, W, D) at `positions` (B, W)."""
        batch_size, width = hidden.shape[:2]
        keys, values = self._project_memory(hidden)  # (G, B, W, H·d)
        shape = (keys.shape[0], batch_size, width, self.num_heads, self.head_dim)
        keys, values = keys.view(shape).transpose(2, 3), values.view(shape).transpose(2, 3)  # (G, B, H, W, d)
        if self.rotary_emb is not None:
            cos, sin = self.rotary_emb(positions)  # (B, 1, W, d)
            half = self.head_dim // 2
            keys = rotate(keys, cos, torch.cat([-sin[..., :half], sin[..., half:]], dim=-1))
        return keys, values

    def _carry(self, cache: FeedbackCache, window, valid: torch.Tensor, version: tuple | None, first_positions):
        """After the step loop: what the cache carries to the next call (`FeedbackCache.end_forward`), from the
        `window` the loop left (None: it wrote the cache's ring in place); `valid` (B, T) the forward's real tokens,
        `version` the weights' now, `first_positions` where the memories to project again start (see
        `projects_carried_memory`; None: none)."""
        grad, recording = torch.is_grad_enabled(), cache.recording
        following = cache.next_positions + valid.sum(1)  # each row's next position after this call
        reach = self.memory_span
        if self.read_windows is not None and not grad and not torch.compiler.is_compiling():
            # Without gradients the weights stay as they are: keep only the memories some layer still reads.
            reach = max(self.read_windows)
        if first_positions is not None:  # (in the window too, before a recording keeps it)
            if window is None:
                first = cache.layers[0]
                sets = [(layer.keys, layer.values) for layer in cache.layers]
                self._project_carried_memories(sets, first.positions, first.valid, first.hidden, first_positions)
            else:
                keys, values, positions, slot_valid, hidden = window
                sets = list(zip(keys.unbind(0), values.unbind(0)))
                self._project_carried_memories(sets, positions, slot_valid, hidden, first_positions)
        if torch.compiler.is_compiling():  # the memories' weights as they were
            version = cache.weights_version
        elif recording or (self.carry_first_layer_norm and grad):
            version = None  # keys and values that are no projection of the carried hidden states with these weights
        if window is not None and self.carries_hidden_states and grad and not recording:
            # Training: the next forward projects the carried hidden states again, so their keys and values are not
            # kept (nor the memory they would hold while the backward runs).
            window, version = (None, None, *window[2:]), None
        cache.end_forward(window, following, reach, valid.shape[1], version)

    def _project_carried_memories(self, sets: list, positions, valid, hidden, first_positions: torch.Tensor):
        """Project the keys and values of the memories a forward made (at or after `first_positions` (B,)) again
        from the hidden states (B, W, D) they carry, in place in `sets` ((keys, values) (B, H, W, d) per key/value
        set), with the slots' positions and validity (B, W)."""
        renewed = valid & (positions >= first_positions[:, None])  # (B, W)
        columns = slice(None)  # compiling: every slot (no shape may depend on the data)
        if not torch.compiler.is_compiling():
            columns = renewed.any(0).nonzero()[:, 0]
            if columns.numel() == 0:
                return
        keys, values = self._project_hidden(hidden[:, columns], positions[:, columns])
        chosen = renewed[:, None, columns, None]  # (B, 1, C, 1)
        for group, (group_keys, group_values) in enumerate(sets):
            group_keys[:, :, columns] = torch.where(
                chosen, keys[group].to(group_keys.dtype), group_keys[:, :, columns]
            )
            group_values[:, :, columns] = torch.where(
                chosen, values[group].to(group_values.dtype), group_values[:, :, columns]
            )


class FeedbackTransformerForCausalLM(FeedbackTransformerPreTrainedModel, CountsOwnPositions, GenerationMixin):
    cache_class = FeedbackCache
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def draft_verification_problem(self) -> str | None:
        if self.config.carry_first_layer_norm:
            return (
                "This Feedback Transformer has carry_first_layer_norm=True: memories carried from an earlier forward "
                "call pass the first layer's norm once more than those made within a call, so verifying several "
                "drafted tokens in one forward gives other logits than decoding them one by one, and assisted and "
                "prompt-lookup decoding would not give plain decoding's tokens. Decode without assistant_model / "
                "prompt_lookup_num_tokens (such a model may still draft for another one)."
            )
        return None

    def __init__(self, config: FeedbackTransformerConfig):
        super().__init__(config)
        self.model = FeedbackTransformerModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=config.lm_head_bias)
        self.post_init()

    def allocated_memory(self, batch_size: int = 1) -> FeedbackCache:
        """The memory before any token with every tensor allocated: a full ring of τ slots per key/value set
        (`FeedbackCache.prepare_compiled_decoding`), empty, or holding the official zero initial memory
        (`initial_memory="zeros"`: τ zero hidden states at positions −τ … −1, in slots 0 … τ−1, with their keys and
        values), and each row's next position 0 — as a memory of explicit inputs needs it (an exported graph:
        `memlm.onnx_export`). A forward from it gives what a forward without a cache gives."""
        config, model = self.config, self.model
        weight = model.embed_tokens.weight
        cache = FeedbackCache(config)
        cache.prepare_compiled_decoding()
        for group, layer in enumerate(cache.layers):
            allocate_ring(layer, batch_size, config, weight.dtype, weight.device)
            if group:  # one set of hidden states for every key/value set, kept by the first
                layer.hidden = None
        cache.next_positions = mark_static(torch.zeros(batch_size, dtype=torch.long, device=weight.device))
        if config.initial_memory == "zeros":
            hidden, positions = model.zero_memory(batch_size, weight)
            with torch.no_grad():
                keys, values = model._project_hidden(hidden, positions)
            for group, layer in enumerate(cache.layers):
                layer.keys.copy_(keys[group])
                layer.values.copy_(values[group])
                layer.positions.copy_(positions)
                layer.valid.fill_(True)
        # The keys and values are those of the hidden states with the weights of now.
        cache.weights_version = current_weights_version(model, cache) if model.carries_hidden_states else None
        return cache

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: FeedbackCache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        past_key_values: FeedbackCache | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast | tuple:
        r"""
        labels: (B, T) token ids; next-token cross-entropy (shifted inside), -100 ignored. In training, the
            auxiliary loss (`aux_loss`, the adaptive span's) is added to it.
        logits_to_keep: an int keeps the last that many positions (0 keeps all); a tensor selects positions.
        """
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        cache = resolve_cache_argument(cache, past_key_values, type(self).__name__)
        outputs = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            cache=cache, inputs_embeds=inputs_embeds, use_cache=use_cache,
            output_hidden_states=output_hidden_states, return_dict=True, **kwargs,
        )  # fmt: skip
        logits = self.lm_head(slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep))
        loss = lm_loss = causal_lm_loss(self, logits, labels, kwargs)
        if lm_loss is not None and self.training and outputs.aux_loss is not None:
            loss = lm_loss + outputs.aux_loss.to(lm_loss.dtype)
        output = model_output(
            FeedbackCausalLMOutput,
            loss=loss, logits=logits, **with_cache(outputs.cache), hidden_states=outputs.hidden_states,
            lm_loss=lm_loss, aux_loss=outputs.aux_loss,
        )  # fmt: skip
        return output if return_dict else output.to_tuple()


__all__ = [
    "FeedbackCache",
    "FeedbackTransformerForCausalLM",
    "FeedbackTransformerModel",
    "FeedbackTransformerPreTrainedModel",
]
