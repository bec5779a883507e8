"""Feedback Transformer: every layer attends to the past's highest representations.

Fan, Lavril, Grave, Joulin & Sukhbaatar (ICLR 2021), "Addressing Some Limitations of Transformers with Feedback
Memory". At step t the layers read one shared memory of earlier steps (SPEC §3, paper Eq. 1):

    m_t   = Σ_{l=0..L} softmax(w)_l · x_t^l            x^0 = token embedding, x^l = output of layer l
    z_t^l = Attn(query x_t^l, keys/values of m_{t−τ} … m_{t−1})

m_t needs the top layer at t, so the computation is sequential in t, in training too. One step function
(`FeedbackTransformerModel.step`) serves the full forward (a loop over the T positions) and decoding, so they cannot
drift apart. Its memory lives in preallocated buffers: a ring of τ slots written in place when no gradient is needed
(prefill, decoding), and, in training, a tape of all steps, written once.

Training runs the step loop in one of two ways, with the same step function:
- `_ThroughTime` (the default): the loop runs without autograd, recording what the backward needs, and
  `_backward_through_time` walks the steps back by hand. A graph of ~160 small autograd nodes per step costs more
  than the step itself on a CPU, and the weight gradients become products of many steps at once.
- autograd through every step (`MEMLM_KERNELS=reference`, float16/bfloat16, autocast, `output_hidden_states`, or
  modules the hand-written backward does not know, e.g. adapters or hooks): the tape's gradients are routed by hand
  (`_TapeWrite`, `_TapeRead`), because autograd forbids reading a buffer that later steps write into.
The tests check that both give the same gradients in float64 to 1e-10.

The file reads top to bottom: attention over the memory → the two memory stores → the hand-written backward →
decoder layer → cache → PreTrainedModel → FeedbackTransformerModel → FeedbackTransformerForCausalLM.
"""

import functools
import weakref

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import slice_logits_to_keep

from ..configuration.configuration_feedback_transformer import FeedbackTransformerConfig
from ..export import RemoteCodeMixin
from ..kernels import resolve_backend
from .layers import GatedMLP, RMSNorm, RotaryEmbedding, apply_rotary
from .memory import (
    CountsOwnPositions,
    MemoryCache,
    MemoryCacheLayer,
    causal_lm_loss,
    check_extra_kwargs,
    current_padding_mask,
    embed_inputs,
    refuse_packed_documents,
    zero_padding,
)


def attention_weights(query: torch.Tensor, keys: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Softmax weights of one query per (row, head) over a window of memories: query (N, d), keys (N, W, d), bias
    (N, W) additive (−inf: not visible) → (N, W). A query that sees no memory gets all-zero weights: the paper's
    "no attention term" before the first memory."""
    # (1, d) · (d, W) per row: MKL runs this orientation ~7× faster than (W, d) · (d, 1) on this CPU.
    scores = torch.bmm(query.unsqueeze(1), keys.transpose(1, 2)).squeeze(1)
    weights = torch.softmax(torch.add(bias, scores, alpha=query.shape[-1] ** -0.5), dim=-1)
    return weights.masked_fill_(bias.amax(-1, keepdim=True) == float("-inf"), 0.0)  # its softmax was 0/0


def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """query (N, d), keys/values (N, W, d), bias (N, W) → the attention output (N, d)."""
    return torch.bmm(attention_weights(query, keys, bias).unsqueeze(1), values).squeeze(1)


class FeedbackAttention(nn.Module):
    """The query side of one layer's attention over the memory (keys/values come from the memory, once per step when
    shared), and its output projection."""

    def __init__(self, config: FeedbackTransformerConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        if not config.share_key_value:
            self.k_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
            self.v_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        if config.position_encoding == "relative_bias":
            # Learned score bias per head for distances 1..τ (index d − 1).
            self.relative_bias = nn.Parameter(torch.zeros(config.num_attention_heads, config.memory_span))
        self.dropout = nn.Dropout(config.attention_dropout)


class _RingStore:
    """The memory when no gradient is needed: τ slots per row, slot = position mod τ, written in place. The cache's
    own buffers, so decoding a token costs O(τ) whatever the context length, with no copying."""

    def __init__(self, cache_layers: list["FeedbackCacheLayer"], next_positions: torch.Tensor, config, like):
        self.layers = cache_layers
        window = None
        if not cache_layers[0].ring:
            # An empty cache, or the window a training forward left: lay it out as a ring of τ slots.
            if cache_layers[0].keys is not None:
                window = [(layer.keys, layer.values) for layer in cache_layers]
                window_positions, window_valid = cache_layers[0].positions, cache_layers[0].valid
            for layer in cache_layers:
                layer.allocate_ring(next_positions.shape[0], config, like.dtype, like.device)
        # Slots at or beyond `filled` hold nothing yet (slot = position mod τ and positions start at 0): skip them.
        # Counting them reads tensors, which torch.compile cannot trace: compiled, every slot is read (empty ones are
        # masked out, so the output is the same).
        self.filled = config.memory_span
        if not torch.compiler.is_compiling():
            self.filled = min(config.memory_span, int(next_positions.max()) if next_positions.numel() else 0)
        if window is not None:
            keys = torch.stack([pair[0] for pair in window])
            values = torch.stack([pair[1] for pair in window])
            for index in range(keys.shape[3]):
                self.write(index, keys[:, :, :, index], values[:, :, :, index], window_positions[:, index],
                           window_valid[:, index])  # fmt: skip

    def window(self, group: int, step: int):
        layer = self.layers[group]
        return None, None, layer.positions[:, : self.filled], layer.valid[:, : self.filled]

    def read(self, group: int, step: int, query: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        if self.filled == 0:
            return torch.zeros_like(query)  # no memory yet: the attention term is zero
        layer = self.layers[group]
        keys = layer.keys[:, :, : self.filled].flatten(0, 1)
        values = layer.values[:, :, : self.filled].flatten(0, 1)
        return attend(query, keys, values, bias)

    def write(self, step: int, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor):
        """keys/values (G, B, H, d) of the new memory, positions (B,), valid (B,): padding writes nothing (its slot
        gets its old contents back, so no row count depends on the data and torch.compile traces it)."""
        span = self.layers[0].keys.shape[2]
        rows = torch.arange(positions.shape[0], device=positions.device)
        slots = positions.clamp_min(0) % span
        if not torch.compiler.is_compiling():  # padding has position −1, so an all-padding step changes nothing
            self.filled = max(self.filled, min(span, int(positions.max()) + 1))
        keep = valid[:, None, None]
        for group, layer in enumerate(self.layers):
            layer.keys[rows, :, slots] = torch.where(
                keep, keys[group].to(layer.keys.dtype), layer.keys[rows, :, slots]
            )
            layer.values[rows, :, slots] = torch.where(
                keep, values[group].to(layer.values.dtype), layer.values[rows, :, slots]
            )
            layer.positions[rows, slots] = torch.where(valid, positions, layer.positions[rows, slots])
            layer.valid[rows, slots] = valid | layer.valid[rows, slots]


class _Tape:
    """The memory in training: one slot per step (after a prefix carried from the cache), written once, never
    overwritten, with gradient buffers that the reads fill and the writes hand back to autograd."""

    def __init__(self, cache_layers, steps: int, config, like: torch.Tensor, padding_steps: int = 0):
        """`padding_steps`: the most padding steps of a row (all before its real tokens), which the windows widen by
        so that every row still sees its last τ real memories."""
        first = cache_layers[0]
        groups = len(cache_layers)
        batch_size, num_heads, head_dim = like.shape[0], config.num_attention_heads, config.head_dim
        dtype, device, memory_span = like.dtype, like.device, config.memory_span
        if first.keys is None:  # an empty cache: nothing carried
            empty = torch.zeros(batch_size, num_heads, 0, head_dim, dtype=dtype, device=device)
            cache_layers = [
                FeedbackCacheLayer.window_of(
                    empty,
                    empty,
                    empty.new_zeros(batch_size, 0, dtype=torch.long),
                    empty.new_zeros(batch_size, 0, dtype=torch.bool),
                )
            ] * groups
            first = cache_layers[0]
        # The prefix: the cache's live memories only, live slots first in each row (an empty cache adds nothing).
        live = first.valid
        prefix = int(live.sum(1).max()) if live.numel() else 0
        order = torch.argsort((~live).to(torch.int8), dim=1, stable=True)[:, :prefix]
        size = prefix + steps
        self.prefix = prefix
        self.memory_span = memory_span
        self.reach = memory_span + padding_steps
        self.keys = torch.zeros(groups, batch_size, num_heads, size, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        gather = order[:, None, :, None].expand(batch_size, num_heads, prefix, head_dim)
        self.keys[:, :, :, :prefix] = torch.stack([layer.keys.gather(2, gather) for layer in cache_layers]).to(dtype)
        self.values[:, :, :, :prefix] = torch.stack([layer.values.gather(2, gather) for layer in cache_layers]).to(
            dtype
        )
        self.positions = torch.cat([first.positions.gather(1, order), first.positions.new_zeros(batch_size, steps)], 1)
        self.valid = torch.cat([live.gather(1, order), live.new_zeros(batch_size, steps)], dim=1)
        self._gradients = None
        # Every write takes the previous anchor and makes the next: reads of step t hang on the anchor of step t−1,
        # so the backward of a write runs only after every read of the memory it wrote.
        self.anchor = torch.zeros((), device=device, requires_grad=True)

    def gradients(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Gradient buffers of the keys and values, made at the first read's backward (autograd through the steps)."""
        if self._gradients is None:
            self._gradients = (torch.zeros_like(self.keys), torch.zeros_like(self.values))
        return self._gradients

    def bounds(self, step: int) -> tuple[int, int]:
        """The tape slice that step `step` may read: the prefix (in no particular order) while it is within τ, then
        the last τ steps (τ + the padding steps, when rows are padded). Visibility is decided by positions, so a wider
        slice is harmless."""
        end = self.prefix + step
        return (0, end) if step < self.reach else (end - self.reach, end)

    def window(self, group: int, step: int):
        start, end = self.bounds(step)
        return None, None, self.positions[:, start:end], self.valid[:, start:end]

    def read(self, group: int, step: int, query: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        start, end = self.bounds(step)
        self.last_weights = None
        if start == end:
            return torch.zeros_like(query)  # no memory yet: the attention term is zero
        if torch.is_grad_enabled():
            return _TapeRead.apply(query, bias, self.anchor, self, group, start, end)
        # Recorded for the hand-written backward (`_ThroughTime`), which runs the forward without autograd.
        self.last_weights = attention_weights(query, self.keys[group, :, :, start:end].flatten(0, 1), bias)
        return torch.bmm(self.last_weights.unsqueeze(1), self.values[group, :, :, start:end].flatten(0, 1)).squeeze(1)

    def write(self, step: int, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor):
        index = self.prefix + step
        self.positions[:, index] = positions
        self.valid[:, index] = valid
        if torch.is_grad_enabled():
            self.anchor = _TapeWrite.apply(keys, values, self.anchor, self, index)
        else:
            self.keys[:, :, :, index] = keys
            self.values[:, :, :, index] = values

    def last_memories(self):
        """keys, values (G, B, H, W, d), positions, valid (B, W) of the slice the next step would read."""
        start, end = self.bounds(self.keys.shape[3] - self.prefix)
        return (self.keys[:, :, :, start:end], self.values[:, :, :, start:end], self.positions[:, start:end],
                self.valid[:, start:end])  # fmt: skip


class _TapeWrite(torch.autograd.Function):
    """Store a step's keys/values on the tape; in the backward, return the gradient the later reads accumulated."""

    @staticmethod
    def forward(ctx, keys, values, anchor, tape, index):
        with torch.no_grad():
            tape.keys[:, :, :, index] = keys
            tape.values[:, :, :, index] = values
        ctx.tape, ctx.index = tape, index
        return anchor.detach().clone()

    @staticmethod
    def backward(ctx, grad_anchor):
        tape, index = ctx.tape, ctx.index
        grad_keys, grad_values = tape.gradients()
        return (
            grad_keys[:, :, :, index].clone(),
            grad_values[:, :, :, index].clone(),
            grad_anchor,
            None,
            None,
        )


class _TapeRead(torch.autograd.Function):
    """Attention of one step over a slice of the tape. The backward is written out (softmax attention for a single
    query), reads the keys and values once, and adds their gradients into the tape's gradient buffers in place."""

    @staticmethod
    def forward(ctx, query, bias, anchor, tape, group, start, end):
        with torch.no_grad():
            keys = tape.keys[group, :, :, start:end].flatten(0, 1)  # (B·H, W, d), a view
            weights = attention_weights(query, keys, bias)
            output = torch.bmm(weights.unsqueeze(1), tape.values[group, :, :, start:end].flatten(0, 1)).squeeze(1)
        ctx.save_for_backward(query, weights)
        ctx.tape, ctx.window = tape, (group, start, end)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        query, weights = ctx.saved_tensors
        tape, (group, start, end) = ctx.tape, ctx.window
        keys = tape.keys[group, :, :, start:end].flatten(0, 1)
        values = tape.values[group, :, :, start:end].flatten(0, 1)
        scale = query.shape[-1] ** -0.5
        grad_weights = torch.bmm(grad_output.unsqueeze(1), values.transpose(1, 2)).squeeze(1)  # (N, W)
        grad_scores = weights * (grad_weights - (weights * grad_weights).sum(-1, keepdim=True))  # softmax backward
        grad_query = torch.bmm(grad_scores.unsqueeze(1), keys).squeeze(1) * scale
        grad_keys, grad_values = tape.gradients()
        grad_keys = grad_keys[group, :, :, start:end].flatten(0, 1)
        grad_keys.addcmul_(grad_scores.unsqueeze(-1), (query * scale).unsqueeze(1))  # += dS ⊗ q / sqrt(d)
        grad_values = grad_values[group, :, :, start:end].flatten(0, 1)
        grad_values.addcmul_(weights.unsqueeze(-1), grad_output.unsqueeze(1))  # += w ⊗ dO
        grad_bias = grad_scores if ctx.needs_input_grad[1] else None
        return grad_query, grad_bias, torch.zeros((), device=query.device), None, None, None, None


class _Recording:
    """What the hand-written backward needs from a training forward run without autograd, by (layer, step): the
    layer's input, rotated query, attention weights, context, the residual after attention, the MLP's gate and up
    projections (not kept under gradient checkpointing: recomputed), the dropout masks; by step: the layer mix,
    the normalised memory and the rotation."""

    def __init__(self, model):
        # The products that share an input run as one, with their weights stacked (out, in).
        config, layers = model.config, model.layers
        if config.share_key_value:
            self.key_value = [torch.cat([model.k_proj.weight, model.v_proj.weight])]
        else:
            self.key_value = [
                torch.cat([layer.attention.k_proj.weight, layer.attention.v_proj.weight]) for layer in layers
            ]
        self.gate_up = [torch.cat([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight]) for layer in layers]
        self.inputs, self.queries, self.weights, self.contexts, self.residuals = {}, {}, {}, {}, {}
        self.gates, self.ups, self.masks = {}, {}, {}
        self.mixtures, self.stacks, self.memories, self.rotations = {}, {}, {}, {}


def _rms_norm_backward(grad_output, inputs, norm: RMSNorm, weight_gradient):
    """Gradient of RMSNorm y = x̂ · w, x̂ = x / sqrt(mean(x²) + eps) for its input: (dx̂ − x̂ · mean(dx̂ ⊙ x̂)) / rms with
    dx̂ = dy ⊙ w. Adds dy ⊙ x̂ to `weight_gradient` (B, D) and also returns y (the input of the next product, for its
    weight gradient)."""
    reciprocal = inputs.pow(2).mean(-1, keepdim=True).add_(norm.variance_epsilon).rsqrt_()
    normalized = inputs * reciprocal
    weight_gradient.addcmul_(grad_output, normalized)
    grad_normalized = grad_output * norm.weight
    dot = torch.linalg.vecdot(grad_normalized, normalized).unsqueeze(-1)
    grad_inputs = torch.addcmul(grad_normalized, normalized, dot, value=-1 / inputs.shape[-1]).mul_(reciprocal)
    return grad_inputs, normalized * norm.weight


def _rotary_backward(grad, cos, sin):
    """Gradient of apply_rotary: y = x·cos + rotate(x)·sin with rotate(x) = [−x₂, x₁], so dx = dy·cos + [dy₂, −dy₁]·sin."""
    half = grad.shape[-1] // 2
    scaled = grad * sin
    return grad * cos + torch.cat([scaled[..., half:], -scaled[..., :half]], dim=-1)


def _activation_backward(act_fn, name: str, gate: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Gradient through the MLP's activation (the config's `hidden_act`) with the derivative autograd would use."""
    if name == "silu":
        return torch.ops.aten.silu_backward(grad, gate)
    if name == "gelu":  # transformers' "gelu" is the exact (erf) GELU
        return torch.ops.aten.gelu_backward(grad, gate, approximate="none")
    if name == "relu":
        return torch.ops.aten.threshold_backward(grad, gate, 0)
    with torch.enable_grad():  # other activations: their own autograd formula on this small tensor
        leaf = gate.detach().requires_grad_()
        return torch.autograd.grad(act_fn(leaf), leaf, grad)[0]


class _WeightGradients:
    """Σ over steps of (gradient at a product's output)ᵀ · (its input), for every weight. A step's product has only B
    rows, far below the CPU's GEMM speed, so the steps are gathered into buffers (allocated once, reused) and
    multiplied `steps_per_product` at a time."""

    def __init__(self, needed: set[str], steps_per_product: int):
        self.needed, self.steps_per_product = needed, steps_per_product
        self.buffers, self.filled, self.totals = {}, {}, {}

    def add(self, name: str, grad_output: torch.Tensor, inputs: torch.Tensor):
        if name not in self.needed:
            return
        rows = grad_output.shape[0]
        if name not in self.buffers:
            size = rows * self.steps_per_product
            self.buffers[name] = (
                grad_output.new_empty(size, grad_output.shape[1]),
                inputs.new_empty(size, inputs.shape[1]),
            )
            self.filled[name] = 0
        grads, all_inputs = self.buffers[name]
        start = self.filled[name]
        grads[start : start + rows].copy_(grad_output)
        all_inputs[start : start + rows].copy_(inputs)
        self.filled[name] = start + rows
        if start + rows == grads.shape[0]:
            self.flush(name)

    def flush(self, name: str):
        grads, inputs = self.buffers[name]
        rows, self.filled[name] = self.filled[name], 0
        grads, inputs = grads[:rows], inputs[:rows]
        if name in self.totals:
            self.totals[name].addmm_(grads.t(), inputs)
        else:
            self.totals[name] = grads.t() @ inputs

    def results(self) -> dict[str, torch.Tensor]:
        for name, filled in self.filled.items():
            if filled:
                self.flush(name)
        return self.totals


class _TapeGradients:
    """Gradients of the tape's keys and values in the hand-written backward. A read at step t adds dSᵀ·q/√d to the
    keys and Pᵀ·dO to the values of its whole window; added read by read, each would rewrite the whole window. So the
    backward walks the steps in blocks: what a read adds to slots before its block is kept, and added for all of the
    block's reads by one batched product when the block ends (the slots it lands on belong to earlier steps, whose
    backward comes later); only the few slots inside the block are added right away."""

    most_block_steps = 16

    def __init__(self, store, reads_per_step: int):
        self.store = store
        self.keys, self.values = torch.zeros_like(store.keys), torch.zeros_like(store.values)
        groups, batch_size, num_heads, size, head_dim = store.keys.shape
        self.reads_per_step = reads_per_step
        # Kept rows: (G, B·H, steps · reads, slots); at most about 2²² numbers per buffer.
        self.block_steps = max(
            1, min(self.most_block_steps, 2**22 // (groups * batch_size * num_heads * reads_per_step * size))
        )
        rows = self.block_steps * reads_per_step
        self.kept_scores = store.keys.new_zeros(groups, batch_size * num_heads, rows, size)
        self.kept_weights = torch.zeros_like(self.kept_scores)
        self.kept_queries = store.keys.new_zeros(groups, batch_size * num_heads, rows, head_dim)
        self.kept_contexts = torch.zeros_like(self.kept_queries)

    def begin_block(self, first: int):
        """The backward is about to run the block of steps that starts at `first`, from its last step down."""
        self.boundary = self.store.prefix + first
        self.low = self.store.bounds(first)[0]  # windows only move forward: the block's lowest slot
        self.kept_scores[..., self.low : self.boundary].zero_()
        self.kept_weights[..., self.low : self.boundary].zero_()
        self.rows = [0] * self.keys.shape[0]

    def add(self, group, start, end, grad_scores, scaled_query, weights, grad_context):
        """One read of slots [start, end): grad_scores, weights (B·H, end − start), scaled_query, grad_context
        (B·H, d)."""
        inner = max(start, self.boundary)
        if inner < end:
            self.keys[group, :, :, inner:end].flatten(0, 1).addcmul_(grad_scores[:, inner - start :, None],
                                                                     scaled_query[:, None])  # fmt: skip
            self.values[group, :, :, inner:end].flatten(0, 1).addcmul_(weights[:, inner - start :, None],
                                                                       grad_context[:, None])  # fmt: skip
        if start < self.boundary:
            row = self.rows[group]
            self.rows[group] += 1
            self.kept_scores[group, :, row, start:inner] = grad_scores[:, : inner - start]
            self.kept_weights[group, :, row, start:inner] = weights[:, : inner - start]
            self.kept_queries[group, :, row] = scaled_query
            self.kept_contexts[group, :, row] = grad_context

    def end_block(self):
        low, boundary = self.low, self.boundary
        for group, rows in enumerate(self.rows):
            if rows and low < boundary:
                self.keys[group, :, :, low:boundary].flatten(0, 1).baddbmm_(
                    self.kept_scores[group, :, :rows, low:boundary].transpose(1, 2), self.kept_queries[group, :, :rows]
                )
                self.values[group, :, :, low:boundary].flatten(0, 1).baddbmm_(
                    self.kept_weights[group, :, :rows, low:boundary].transpose(1, 2),
                    self.kept_contexts[group, :, :rows],
                )


class _ThroughTime(torch.autograd.Function):
    """The training forward as one autograd node: the step loop runs without autograd (no graph of ~160 small nodes
    per step), recording its intermediates, and `_backward_through_time` walks the steps back by hand, leaving the
    weight gradients to products of many steps at once."""

    @staticmethod
    def forward(ctx, model, store, inputs_embeds, positions, valid, *parameters):
        record = _Recording(model)
        outputs = [
            model.step(embeddings, step_positions, step_valid, store, step, record)[0]
            for step, (embeddings, step_positions, step_valid) in enumerate(
                zip(inputs_embeds.unbind(1), positions.unbind(1), valid.unbind(1))
            )
        ]
        ctx.model, ctx.store, ctx.record, ctx.positions = model, store, record, positions
        return torch.stack(outputs, dim=1)

    @staticmethod
    def backward(ctx, grad_outputs):
        parameters = ctx.model._recurrent_parameters()
        needed = {name for (name, _), needs in zip(parameters, ctx.needs_input_grad[5:]) if needs}
        grad_embeddings, gradients = _backward_through_time(ctx.model, ctx.store, ctx.record, ctx.positions,
                                                            grad_outputs, needed)  # fmt: skip
        grad_embeddings = grad_embeddings if ctx.needs_input_grad[2] else None
        return (None, None, grad_embeddings, None, None) + tuple(gradients.get(name) for name, _ in parameters)


def _backward_through_time(model, store, record, positions, grad_outputs, needed):
    """Back-propagation through the loop of `FeedbackTransformerModel.step`, from the last step to the first; each
    block reverses a line of the step. Returns the gradient of the input embeddings (B, T, D) and {name: gradient}
    of the parameters named in `needed`."""
    config, layers = model.config, model.layers
    batch_size, steps, hidden_size = grad_outputs.shape
    num_heads, head_dim, num_layers = config.num_attention_heads, config.head_dim, len(layers)
    scale = head_dim**-0.5
    wide = torch.promote_types(model.layer_weights.dtype, torch.float32)
    softmax = torch.softmax(model.layer_weights.to(wide), dim=0)
    mix = softmax.to(grad_outputs.dtype)
    tape = _TapeGradients(store, reads_per_step=num_layers if config.share_key_value else 1)
    prefixes = [""] if config.share_key_value else [f"layers.{index}.attention." for index in range(num_layers)]
    key_value, gate_up = list(zip(prefixes, record.key_value)), record.gate_up
    products = _WeightGradients(
        {name.replace("k_proj", "key_value").replace("v_proj", "key_value").replace("gate_proj", "gate_up")
         .replace("up_proj", "gate_up") for name in needed},
        steps_per_product=max(1, 1024 // batch_size),
    )  # fmt: skip
    norm_names = ["memory_norm.weight"] + [
        f"layers.{index}.{kind}.weight" for index in range(num_layers)
        for kind in ("input_layernorm", "post_attention_layernorm")
    ]  # fmt: skip
    norm_gradients = {name: grad_outputs.new_zeros(batch_size, hidden_size) for name in norm_names}
    grad_mix = torch.zeros(num_layers + 1, dtype=grad_outputs.dtype, device=grad_outputs.device)
    relative_gradients = [
        torch.zeros_like(layer.attention.relative_bias) if hasattr(layer.attention, "relative_bias") else None
        for layer in layers
    ]
    grad_embeddings = [None] * steps

    for step in reversed(range(steps)):
        block_first = step - step % tape.block_steps
        if step == steps - 1 or step % tape.block_steps == tape.block_steps - 1:
            tape.begin_block(block_first)
        slot = store.prefix + step
        cos, sin = record.rotations[step]
        # The memory m_t of this step: every read of it ran later in the loop, so its gradient is complete.
        grad_key = tape.keys[:, :, :, slot]  # (G, B, H, d)
        if cos is not None:
            grad_key = _rotary_backward(grad_key, cos[:, 0], sin[:, 0])
        grad_key_value = torch.cat([grad_key.flatten(2), tape.values[:, :, :, slot].flatten(2)], dim=-1)
        grad_memory = 0
        for group, (prefix, weight) in enumerate(key_value):
            grad_memory = grad_memory + grad_key_value[group] @ weight
            products.add(f"{prefix}key_value.weight", grad_key_value[group], record.memories[step])
        # Eq. 1: m_t = norm(Σ_l softmax(w)_l x_t^l)
        grad_mixture, _ = _rms_norm_backward(grad_memory, record.mixtures[step], model.memory_norm,
                                             norm_gradients["memory_norm.weight"])  # fmt: skip
        grad_mix += torch.einsum("bd,lbd->l", grad_mixture, record.stacks[step])
        grad_hidden = grad_outputs[:, step] + mix[num_layers] * grad_mixture
        for index in reversed(range(num_layers)):
            layer, key, prefix = layers[index], (index, step), f"layers.{index}."
            mlp, attention = layer.mlp, layer.attention
            # hidden = residual + dropout(down(act(gate) · up)), [gate, up] = W · post_norm(residual)
            mask = record.masks.get(("mlp",) + key)
            grad_down = grad_hidden if mask is None else grad_hidden * mask
            residual = record.residuals[key]
            if key in record.gates:
                gate, up = record.gates[key], record.ups[key]
            else:  # gradient checkpointing: recompute the block's projections
                normed = layer.post_attention_layernorm(residual)
                gate, up = (normed @ gate_up[index].t()).split(config.intermediate_size, dim=-1)
            activated = mlp.act_fn(gate)
            products.add(prefix + "mlp.down_proj.weight", grad_down, activated * up)
            grad_product = grad_down @ mlp.down_proj.weight
            grad_gate = _activation_backward(mlp.act_fn, config.hidden_act, gate, grad_product * up)
            grad_gate_up = torch.cat([grad_gate, grad_product * activated], dim=-1)
            grad_residual_norm, normed = _rms_norm_backward(grad_gate_up @ gate_up[index], residual,
                                                            layer.post_attention_layernorm,
                                                            norm_gradients[prefix + "post_attention_layernorm.weight"])  # fmt: skip
            products.add(prefix + "mlp.gate_up.weight", grad_gate_up, normed)
            grad_residual = grad_hidden + grad_residual_norm
            # residual = input + dropout(o_proj(dropout(context)))
            mask = record.masks.get(("attention",) + key)
            grad_mixed = grad_residual if mask is None else grad_residual * mask
            products.add(prefix + "attention.o_proj.weight", grad_mixed, record.contexts[key].view(batch_size, -1))
            grad_context = (grad_mixed @ attention.o_proj.weight).view(-1, head_dim)
            mask = record.masks.get(("context",) + key)
            grad_context = grad_context if mask is None else grad_context * mask
            # context = softmax(q·Kᵀ/√d + bias) · V over the window (`attention_weights`)
            weights, query = record.weights[key], record.queries[key]
            if weights is None:  # no memory was visible: the attention term was zero
                grad_query = torch.zeros_like(query)
            else:
                group = 0 if config.share_key_value else index
                start, end = store.bounds(step)
                keys = store.keys[group, :, :, start:end].flatten(0, 1)
                values = store.values[group, :, :, start:end].flatten(0, 1)
                grad_weights = torch.bmm(grad_context.unsqueeze(1), values.transpose(1, 2)).squeeze(1)
                grad_scores = torch._softmax_backward_data(grad_weights, weights, -1, weights.dtype)
                grad_query = torch.bmm(grad_scores.unsqueeze(1), keys).squeeze(1) * scale
                tape.add(group, start, end, grad_scores, query * scale, weights, grad_context)
                if relative_gradients[index] is not None:  # bias[h, distance − 1]; invisible slots have dS = 0
                    distance = positions[:, step, None] - store.positions[:, start:end]
                    slots = (distance - 1).clamp(0, config.memory_span - 1)
                    per_head = grad_scores.view(batch_size, num_heads, -1).transpose(0, 1).reshape(num_heads, -1)
                    relative_gradients[index].index_add_(1, slots.flatten(), per_head)
            grad_query = grad_query.view(batch_size, num_heads, head_dim)
            if cos is not None:
                grad_query = _rotary_backward(grad_query, cos[:, 0], sin[:, 0])
            grad_query = grad_query.reshape(batch_size, -1)
            # query = q_proj(input_norm(input)); the input also feeds the residual and the memory mix
            grad_input_norm, normed = _rms_norm_backward(grad_query @ attention.q_proj.weight, record.inputs[key],
                                                         layer.input_layernorm,
                                                         norm_gradients[prefix + "input_layernorm.weight"])  # fmt: skip
            products.add(prefix + "attention.q_proj.weight", grad_query, normed)
            grad_hidden = grad_residual + grad_input_norm + mix[index] * grad_mixture
        grad_embeddings[step] = grad_hidden
        if step == block_first:
            tape.end_block()

    gradients = {name: gradient.sum(0) for name, gradient in norm_gradients.items()}
    grad_mix = grad_mix.to(wide)  # the softmax's backward for the layer weights
    gradients["layer_weights"] = (softmax * (grad_mix - (softmax * grad_mix).sum())).to(model.layer_weights.dtype)
    for index, gradient in enumerate(relative_gradients):
        gradients[f"layers.{index}.attention.relative_bias"] = gradient
    for name, gradient in products.results().items():
        if "key_value" in name:
            gradients[name.replace("key_value", "k_proj")], gradients[name.replace("key_value", "v_proj")] = (
                gradient.split(hidden_size)
            )
        elif "gate_up" in name:
            gradients[name.replace("gate_up", "gate_proj")], gradients[name.replace("gate_up", "up_proj")] = (
                gradient.split(config.intermediate_size)
            )
        else:
            gradients[name] = gradient
    return torch.stack(grad_embeddings, dim=1), gradients


class _StepGradients:
    """The `.grad` of a layer's stacked outputs (B, T, D), returned with `output_hidden_states`. Step t's output is
    consumed at step t, before the stack exists, so no gradient flows through the stack into the model; instead each
    step's output hands its gradient (everything the loss owes it, later steps included) to a buffer, and once every
    step has, the stack's `.grad` is set to it if `retain_grad()` was called on the stack."""

    def __init__(self, stacked: torch.Tensor, steps: list[torch.Tensor], restored):
        self.stacked = weakref.ref(stacked)  # the graph holds the hooks, the hooks must not hold the graph's output
        self.restored = restored
        self.buffer = None
        self.pending = set()
        for step, state in enumerate(steps):
            if state.requires_grad:
                self.pending.add(step)
                state.register_hook(functools.partial(self.receive, step, len(steps)))
        self.waiting = set(self.pending)

    def receive(self, step: int, length: int, gradient: torch.Tensor):
        stacked = self.stacked()
        if stacked is None or not stacked.retains_grad:
            return
        if self.buffer is None:
            self.buffer = gradient.new_zeros(gradient.shape[0], length, *gradient.shape[1:])
        self.buffer[:, step] = gradient
        self.waiting.discard(step)
        if not self.waiting:  # the last step of this backward: hand the whole gradient over
            stacked.grad = self.restored(self.buffer)
            self.buffer, self.waiting = None, set(self.pending)


class FeedbackDecoderLayer(nn.Module):
    """x = x + attention(norm(x), memory); x = x + mlp(norm(x)), for one step (run by `FeedbackTransformerModel.step`;
    the layer has no forward of its own, because a step interleaves all layers with the memory). With gradient
    checkpointing on, the MLP block of every step is recomputed in the backward instead of kept."""

    def __init__(self, config: FeedbackTransformerConfig, layer_idx: int):
        super().__init__()
        self.gradient_checkpointing = False
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attention = FeedbackAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        self.dropout = nn.Dropout(config.hidden_dropout)


class FeedbackCacheLayer(MemoryCacheLayer):
    """One key/value set of the feedback memory: τ slots per row (slot = position mod τ), with each slot's position and
    whether it holds a memory."""

    tensor_names = ("keys", "values", "positions", "valid")
    rollback_message = "A Feedback memory cannot be rolled back: its ring buffer overwrites the oldest memories."

    def __repr__(self):
        shape = None if self.keys is None else tuple(self.keys.shape)
        return f"FeedbackCacheLayer(keys={shape}, seen_tokens={self.seen_tokens})"

    def __init__(self):
        super().__init__()
        # True: τ slots with slot = position mod τ (written in place by inference). False: a window of memories in any
        # order (what a training forward leaves), turned into a ring when inference needs one.
        self.ring = False

    @classmethod
    def window_of(cls, keys, values, positions, valid) -> "FeedbackCacheLayer":
        layer = cls()
        layer.keys, layer.values, layer.positions, layer.valid = keys, values, positions, valid
        return layer

    def allocate_ring(self, batch_size: int, config: FeedbackTransformerConfig, dtype, device):
        self.ring = True
        shape = (batch_size, config.num_attention_heads, config.memory_span, config.head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.positions = torch.zeros(batch_size, config.memory_span, dtype=torch.long, device=device)
        self.valid = torch.zeros(batch_size, config.memory_span, dtype=torch.bool, device=device)


class FeedbackCache(MemoryCache):
    """`past_key_values` of the Feedback Transformer: the keys and values of the last τ memories, one set for all
    layers when the projections are shared (a standard Transformer caches L sets), plus per row the position of the
    next real token. Supports beam search, `num_return_sequences` and batch selection."""

    layer_class = FeedbackCacheLayer

    @staticmethod
    def layer_count(config) -> int:
        return config.memory_groups  # one key/value set for all layers when shared

    def memory_bytes(self) -> int:
        """Bytes of the cached keys and values."""
        return sum(
            layer.keys.numel() * layer.keys.element_size() * 2 for layer in self.layers if layer.keys is not None
        )


class FeedbackTransformerPreTrainedModel(RemoteCodeMixin, PreTrainedModel):
    config: FeedbackTransformerConfig
    config_class = FeedbackTransformerConfig
    base_model_prefix = "model"
    # Checkpointing recomputes each step's MLP block (its activations are the largest) in the backward.
    supports_gradient_checkpointing = True
    # Every time step runs every layer (the memory feeds back from the top), reading their weights directly rather
    # than through each layer's forward: the whole stack is one unit for FSDP wrapping and device maps.
    _no_split_modules = ["FeedbackTransformerModel"]
    _skip_keys_device_placement = ["past_key_values"]
    _can_compile_fullgraph = False
    # The ring buffer overwrites its oldest memories, so assisted decoding (which rolls back) is refused.
    _is_stateful = True
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
        elif isinstance(module, FeedbackAttention) and hasattr(module, "relative_bias"):
            init.zeros_(module.relative_bias)
        elif isinstance(module, RotaryEmbedding):
            init.copy_(module.inv_freq, module.compute_inverse_frequencies())


class FeedbackTransformerModel(FeedbackTransformerPreTrainedModel):
    def __init__(self, config: FeedbackTransformerConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [FeedbackDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # Paper Eq. 1: one learned scalar per representation (the embedding and each layer's output).
        self.layer_weights = nn.Parameter(torch.zeros(config.num_hidden_layers + 1))
        self.memory_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if config.share_key_value:
            # Keys and values of a memory computed once per step for all layers (paper Sec. 3.2).
            self.k_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
            self.v_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.rotary_emb = (
            RotaryEmbedding(config.head_dim, config.rope_theta) if config.position_encoding == "rotary" else None
        )
        self.post_init()

    def _recurrent_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The parameters the step loop uses (all but the token embedding and the final norm)."""
        return [(name, parameter) for name, parameter in self.named_parameters()
                if not name.startswith(("embed_tokens.", "norm."))]  # fmt: skip

    def _backward_by_hand(self, inputs_embeds: torch.Tensor, output_hidden_states: bool) -> bool:
        """Whether a training forward runs as `_ThroughTime` (the step loop without autograd and a hand-written
        backward) rather than with autograd through every step (the `"reference"` kernel backend, float16/bfloat16
        or autocast, and outputs of every layer keep autograd)."""
        plain = (FeedbackDecoderLayer, FeedbackAttention, GatedMLP, RMSNorm, RotaryEmbedding, nn.Linear, nn.Dropout,
                 nn.ModuleList)  # fmt: skip
        activations = [layer.mlp.act_fn for layer in self.layers]  # the config's `hidden_act`
        modules = [
            module for name, module in self.named_modules() if name and not name.startswith(("embed_tokens", "norm"))
        ]
        return (
            resolve_backend() != "reference"
            and inputs_embeds.dtype in (torch.float32, torch.float64)
            and not torch.is_autocast_enabled(inputs_embeds.device.type)
            and not output_hidden_states
            # The backward knows the plain modules only: a hook, an adapter (e.g. LoRA) or a quantised linear layer
            # changes what the forward computes, so those keep autograd.
            and all(type(module) in plain or any(module is act for act in activations) for module in modules)
            and not any(module._forward_hooks or module._forward_pre_hooks for module in modules)
            and not (nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks)
        )

    def _memory_bias(self, layer: FeedbackDecoderLayer | None, window, positions: torch.Tensor) -> torch.Tensor:
        """(B, H or 1, W) additive bias of one step: −inf for empty slots and memories outside [t − τ, t − 1], plus
        `layer`'s learned relative bias when configured (`layer=None`: the visibility alone)."""
        _, _, slot_positions, slot_valid = window
        distance = positions[:, None] - slot_positions  # (B, W)
        visible = slot_valid & (distance >= 1) & (distance <= self.config.memory_span)
        if layer is not None and hasattr(layer.attention, "relative_bias"):
            index = (distance - 1).clamp(0, self.config.memory_span - 1)
            bias = layer.attention.relative_bias[:, index].permute(1, 0, 2)  # (B, H, W)
        else:
            bias = torch.zeros(visible.shape[0], 1, visible.shape[1], device=visible.device)
        return bias.to(torch.promote_types(bias.dtype, torch.float32)).masked_fill(~visible[:, None], float("-inf"))

    def _dropout(self, states: torch.Tensor, probability: float, record: "_Recording | None", key) -> torch.Tensor:
        """Dropout with an explicit mask, kept in `record` for the hand-written backward (both training paths draw
        the same masks from the same seed)."""
        if not self.training or probability == 0:
            return states
        mask = torch.empty_like(states).bernoulli_(1 - probability).div_(1 - probability)
        if record is not None:
            record.masks[key] = mask
        return states * mask

    def _feed_forward(self, layer: FeedbackDecoderLayer, residual: torch.Tensor, record=None, key=()):
        """The MLP block's output (before the residual sum); `record` keeps its gate and up projections."""
        mlp = layer.mlp
        normed = layer.post_attention_layernorm(residual)
        if record is None:
            output = mlp(normed)
        else:  # the MLP's lines, to keep its projections (only for plain modules, see `_backward_by_hand`)
            gate, up = F.linear(normed, record.gate_up[key[0]]).split(mlp.gate_proj.out_features, dim=-1)
            if not layer.gradient_checkpointing:
                record.gates[key], record.ups[key] = gate, up
            output = mlp.down_proj(mlp.act_fn(gate) * up)
        return self._dropout(output, layer.dropout.p, record, ("mlp",) + key)

    def step(self, embeddings: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, store, step: int,
             record: "_Recording | None" = None):  # fmt: skip
        """One time step for a batch: embeddings (B, D) of the tokens at `positions` (B,); `valid` (B,) False for
        padding, which writes nothing into the memory. Returns the top layer's output (B, D) and every layer's.
        `record` (training without autograd) keeps what the hand-written backward needs."""
        config = self.config
        batch_size = embeddings.shape[0]
        cos = sin = None
        if self.rotary_emb is not None:
            cos, sin = self.rotary_emb(positions[:, None])  # (B, 1, 1, d)
        states = [embeddings]
        hidden_states = embeddings
        # Every group's slots hold the same positions, so without relative bias one bias serves all layers.
        shared_bias = None
        if config.position_encoding == "rotary":
            shared_bias = self._memory_bias(None, store.window(0, step), positions)
            shared_bias = shared_bias.expand(batch_size, config.num_attention_heads, -1).flatten(0, 1)
        for layer_idx, layer in enumerate(self.layers):
            attention = layer.attention
            key = (layer_idx, step)
            query = attention.q_proj(layer.input_layernorm(hidden_states)).view(batch_size, -1, config.head_dim)
            if cos is not None:
                query = apply_rotary(query[:, :, None], cos, sin)[:, :, 0]
            query = query.reshape(-1, config.head_dim)
            group = 0 if config.share_key_value else layer_idx
            bias = shared_bias
            if bias is None:
                bias = self._memory_bias(layer, store.window(group, step), positions)  # (B, H, W)
                bias = bias.expand(batch_size, config.num_attention_heads, -1).flatten(0, 1)
            context = store.read(group, step, query, bias.to(query.dtype))
            context = self._dropout(context, attention.dropout.p, record, ("context",) + key)
            mixed = self._dropout(attention.o_proj(context.reshape(batch_size, -1)), layer.dropout.p, record,
                                  ("attention",) + key)  # fmt: skip
            residual = hidden_states + mixed
            if layer.gradient_checkpointing and self.training and torch.is_grad_enabled():
                feed_forward = layer._gradient_checkpointing_func(self._feed_forward, layer, residual)
            else:
                feed_forward = self._feed_forward(layer, residual, record, key)
            if record is not None:
                record.inputs[key], record.queries[key], record.weights[key] = hidden_states, query, store.last_weights
                record.contexts[key], record.residuals[key] = context, residual
            hidden_states = residual + feed_forward
            states.append(hidden_states)
        # Paper Eq. 1: the memory of this step mixes the embedding and every layer's output.
        wide = torch.promote_types(self.layer_weights.dtype, torch.float32)
        weights = torch.softmax(self.layer_weights.to(wide), dim=0).to(hidden_states.dtype)
        stack = torch.stack(states)
        mixture = torch.einsum("l,lbd->bd", weights, stack)
        memory = self.memory_norm(mixture)
        if record is not None:
            keys, values = torch.stack([F.linear(memory, weight) for weight in record.key_value]).chunk(2, dim=-1)
        elif config.share_key_value:
            keys, values = self.k_proj(memory)[None], self.v_proj(memory)[None]
        else:
            keys = torch.stack([layer.attention.k_proj(memory) for layer in self.layers])
            values = torch.stack([layer.attention.v_proj(memory) for layer in self.layers])
        keys = keys.view(keys.shape[0], batch_size, -1, config.head_dim)
        values = values.view(values.shape[0], batch_size, -1, config.head_dim)
        if cos is not None:
            keys = apply_rotary(keys[:, :, :, None], cos, sin)[:, :, :, 0]
        store.write(step, keys, values, positions, valid)
        if record is not None:
            record.mixtures[step], record.stacks[step] = mixture, stack
            record.memories[step], record.rotations[step] = memory, (cos, sin)
        return hidden_states, states

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: FeedbackCache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast | tuple:
        r"""
        attention_mask: (B, T) or (B, past + T) padding mask. Padding may sit anywhere in a row: it writes nothing
            into the memory and does not advance the positions, so each row's real tokens give what they give alone.
            (Rows run with their padding moved first, a stable reordering undone on the outputs.)
        position_ids: accepted for 🤗 `generate`; positions are counted from each row's first real token.
        past_key_values: a `FeedbackCache` with the keys and values of the last τ memories.
        """
        check_extra_kwargs(kwargs, type(self).__name__)
        config = self.config
        use_cache = use_cache if use_cache is not None else config.use_cache
        output_hidden_states = (
            output_hidden_states if output_hidden_states is not None else config.output_hidden_states
        )
        return_dict = return_dict if return_dict is not None else config.return_dict
        inputs_embeds = embed_inputs(input_ids, inputs_embeds, self.embed_tokens)
        batch_size, length = inputs_embeds.shape[:2]
        device = inputs_embeds.device

        if past_key_values is not None and not isinstance(past_key_values, FeedbackCache):
            raise TypeError(
                "The Feedback Transformer keeps its memory in a FeedbackCache; got past_key_values of type "
                f"{type(past_key_values).__name__}. Pass None (a cache is created) or the FeedbackCache a previous "
                "call returned."
            )
        cache = past_key_values if past_key_values is not None else FeedbackCache(config)
        cache.check_against(config, batch_size)
        past_length = cache.get_seq_length()
        valid = current_padding_mask(attention_mask, batch_size, length, past_length)
        if valid is None:
            valid = torch.ones(batch_size, length, dtype=torch.bool, device=device)
        else:
            inputs_embeds = zero_padding(inputs_embeds, valid.to(device))
        valid = valid.to(device)
        refuse_packed_documents(position_ids, valid, batch_size, length, "The Feedback Transformer", kwargs)
        order, padding_steps = None, 0
        given_embeds = inputs_embeds
        if attention_mask is not None and (torch.compiler.is_compiling() or not bool(valid.all())):
            # Padding first, real tokens after it in their order: steps then count memories as positions do.
            order = torch.sort(valid.to(torch.uint8), dim=1, stable=True).indices
            inputs_embeds = inputs_embeds.gather(1, order[..., None].expand_as(inputs_embeds))
            valid = valid.gather(1, order)
            if torch.is_grad_enabled():  # the training tape widens its windows by it
                padding_steps = int((~valid).sum(1).max())
        if cache.next_positions is None:
            cache.next_positions = torch.zeros(batch_size, dtype=torch.long, device=device)
        positions = cache.next_positions[:, None] + valid.long().cumsum(1) - 1
        positions = positions.masked_fill(~valid, -1)

        training_graph = torch.is_grad_enabled() and (
            inputs_embeds.requires_grad or any(parameter.requires_grad for parameter in self.parameters())
        )
        store = (
            _Tape(cache.layers, length, config, inputs_embeds, padding_steps)
            if training_graph
            else _RingStore(cache.layers, cache.next_positions, config, inputs_embeds)
        )
        all_states = []
        if training_graph and self._backward_by_hand(inputs_embeds, output_hidden_states):
            parameters = [parameter for _, parameter in self._recurrent_parameters()]
            top = _ThroughTime.apply(self, store, inputs_embeds, positions, valid, *parameters)
        else:
            outputs = []
            # unbind once: indexing step by step would give each step's gradient the size of the whole input.
            step_embeddings, step_positions, step_valid = inputs_embeds.unbind(1), positions.unbind(1), valid.unbind(1)
            for step in range(length):
                hidden_states, states = self.step(
                    step_embeddings[step], step_positions[step], step_valid[step], store, step
                )
                outputs.append(hidden_states)
                if output_hidden_states:
                    all_states.append(states)
            top = torch.stack(outputs, dim=1)

        if training_graph:
            # Carry the last τ memories as a window (detached: truncated back-propagation through time); the next
            # training forward takes it as its prefix, inference lays it out as a ring.
            keys, values, slot_positions, slot_valid = store.last_memories()
            following = cache.next_positions + valid.sum(1)
            slot_valid = slot_valid & (following[:, None] - slot_positions <= config.memory_span)
            for group, layer in enumerate(cache.layers):
                layer.keys, layer.values = keys[group].detach().clone(), values[group].detach().clone()
                layer.positions, layer.valid, layer.ring = slot_positions.clone(), slot_valid, False
        cache.next_positions = cache.next_positions + valid.sum(1)
        for layer in cache.layers:
            layer.seen_tokens += length

        def restored(states: torch.Tensor) -> torch.Tensor:  # back to the caller's order
            if order is None:
                return states
            return states.new_empty(states.shape).scatter(1, order[..., None].expand_as(states), states)

        hidden_states = restored(self.norm(top))
        hidden_states_out = None
        if output_hidden_states:
            # As in 🤗 Llama: the embeddings, each layer's output but the last, and the normed output. The embeddings
            # and the normed output are the very tensors on the path to the loss; a layer's outputs exist step by
            # step only (step t runs before step t + 1 exists), so their stack gets, after a backward, the gradient of
            # each step's output as its `.grad` when `retain_grad()` was called (`_StepGradients`).
            layer_states = []
            for index in range(1, len(self.layers)):
                steps = [states[index] for states in all_states]
                stacked = restored(torch.stack(steps, dim=1))
                if stacked.requires_grad:
                    _StepGradients(stacked, steps, restored)
                layer_states.append(stacked)
            hidden_states_out = (given_embeds, *layer_states, hidden_states)
        output = BaseModelOutputWithPast(
            last_hidden_state=hidden_states,
            past_key_values=cache if use_cache else None,
            hidden_states=hidden_states_out,
        )
        return output if return_dict else output.to_tuple()


class FeedbackTransformerForCausalLM(FeedbackTransformerPreTrainedModel, CountsOwnPositions, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: FeedbackTransformerConfig):
        super().__init__(config)
        self.model = FeedbackTransformerModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: FeedbackCache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast | tuple:
        r"""
        labels: (B, T) token ids; next-token cross-entropy (shifted inside), -100 ignored.
        logits_to_keep: an int keeps the last that many positions (0 keeps all); a tensor selects positions.
        """
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        outputs = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
            output_hidden_states=output_hidden_states, return_dict=True, **kwargs,
        )  # fmt: skip
        logits = self.lm_head(slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep))
        loss = causal_lm_loss(self, logits, labels, kwargs)
        output = CausalLMOutputWithPast(
            loss=loss, logits=logits, past_key_values=outputs.past_key_values, hidden_states=outputs.hidden_states
        )
        return output if return_dict else output.to_tuple()


__all__ = [
    "FeedbackCache",
    "FeedbackTransformerForCausalLM",
    "FeedbackTransformerModel",
    "FeedbackTransformerPreTrainedModel",
]
