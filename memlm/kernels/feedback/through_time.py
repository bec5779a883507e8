"""The hand-written backward of the Feedback recurrence (the fast path of `memlm.kernels.feedback` in training).

`_ThroughTime` runs the training step loop without autograd, recording what the backward needs (`Recording`), and
`_backward_through_time` walks the steps back by hand. A graph of ~160 small autograd nodes per step costs more than
the step itself on a CPU, and the weight gradients become products of many steps at once (`_WeightGradients`); the
tape's key/value gradients are added block by block (`_TapeGradients`). It knows every layout of the model (the
papers' blocks, positions, memory norms, carried hidden states, adaptive span, dropout: see `covers`). The tests
check it against autograd through `reference.py` in float64 to 1e-10. With the config's `compile_step` (the default
layout, no dropout), each layer's lines before and after its memory read run as two pure functions through
`torch.compile` (`block_backward`, `query_backward`).
"""

import contextlib
import functools
import weakref

import torch

from ...kernels import plain_weights
from .compiled import compiler_available, warn_no_compiler
from .reference import WeightsTransform, adaptive_span_mask, adaptive_span_mask_backward
from .scores import read_bias, weights_dropout_seed
from .tape import attention_weights, renormalizer, transform_backward


def recurrent_parameters(model) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters the step loop uses (all but the token embedding and the final norm), under every name (one
    tensor may serve several, e.g. under `torch.func.functional_call` with tied weights)."""
    return [(name, parameter) for name, parameter in model.named_parameters(remove_duplicate=False)
            if not name.startswith(("embed_tokens.", "norm."))]  # fmt: skip


@contextlib.contextmanager
def parameters_as(model, names: list[str], tensors):
    """The model's parameters `names` replaced by `tensors` while the block runs (a backward reads the weights its
    forward saw: under `torch.func.functional_call` they are not the module's own by then)."""
    swapped = []
    try:
        for name, tensor in zip(names, tensors):
            module_name, _, leaf = name.rpartition(".")
            module = model.get_submodule(module_name)
            if module._parameters[leaf] is not tensor:
                swapped.append((module, leaf, module._parameters[leaf]))
                module._parameters[leaf] = tensor
        yield
    finally:
        for module, leaf, original in reversed(swapped):
            module._parameters[leaf] = original


def plain_step(model, inputs_embeds: torch.Tensor) -> bool:
    """Whether the step computes only what memlm's code says: float32/float64 without autocast, and only the model's
    plain modules (`model.step_modules`, and the activation of its config) without hooks, whose linear layers hold
    ordinary weights. A hook, an adapter (e.g. LoRA) or a quantised linear layer (a module of its own, or a quantized
    weight in an `nn.Linear`) changes what the forward computes, so those keep autograd."""
    activations = [layer.mlp.act_fn for layer in model.layers]
    modules = [
        module for name, module in model.named_modules() if name and not name.startswith(("embed_tokens", "norm"))
    ]
    return (
        inputs_embeds.dtype in (torch.float32, torch.float64)
        and not torch.is_autocast_enabled(inputs_embeds.device.type)
        and all(type(module) in model.step_modules or any(module is act for act in activations) for module in modules)
        and not any(module._forward_hooks or module._forward_pre_hooks for module in modules)
        and not (torch.nn.modules.module._global_forward_hooks or torch.nn.modules.module._global_forward_pre_hooks)
        and plain_weights(*(module for module in modules if type(module) is torch.nn.Linear))
    )


def covers(model, inputs_embeds: torch.Tensor, keep_states: bool) -> bool:
    """Whether the hand-written backward knows what the forward computes: no per-step outputs kept for the caller, and
    a `plain_step`. Every layout is known: pre- and post-norm blocks, RMSNorm and LayerNorm, gated and plain MLPs,
    biases, every position encoding, memory normalisation and carried memory, the adaptive span and dropout on the
    attention weights or their context."""
    return not keep_states and plain_step(model, inputs_embeds)


def compiled_step_applies(model, inputs_embeds: torch.Tensor) -> bool:
    """Whether `model.step` runs compiled (`config.compile_step`): without autograd (inference, and the training
    forward of the hand-written backward), without active dropout, and only for the model's plain modules without
    hooks (`covers`), where a compiler is present; otherwise the eager step runs."""
    if not model.config.compile_step or torch.is_grad_enabled() or torch.compiler.is_compiling():
        return False  # (while the whole step is being compiled, its pieces are not compiled apart)
    if model.training and any(layer.dropout.p > 0 or layer.attention.dropout.p > 0 for layer in model.layers):
        return False
    if not compiler_available(inputs_embeds.device.type):
        warn_no_compiler(inputs_embeds.device.type)
        return False
    return model.default_step and covers(model, inputs_embeds, keep_states=False)


class Recording:
    """What the hand-written backward needs from a training forward run without autograd, by (layer, step): the
    layer's input, rotated query, attention weights, context, the residual after attention, the MLP's gate and up
    projections (not kept under gradient checkpointing: recomputed), the post-norm blocks' sums before their norms,
    the dropout masks; by step: the layer mix, the memory (and its mixture before the memory norm) and the rotation."""

    def __init__(self, model):
        # The products that share an input run as one, with their weights stacked (out, in): keys and values of each
        # key/value set (the shared projections serve every set), the gated MLP's gate and up projections.
        config, layers = model.config, model.layers
        if config.share_key_value:
            self.key_value = [torch.cat([model.k_proj.weight, model.v_proj.weight])] * config.memory_groups
        else:
            self.key_value = [
                torch.cat([layer.attention.k_proj.weight, layer.attention.v_proj.weight]) for layer in layers
            ]
        self.gated = config.mlp_type == "gated"
        self.gate_up = self.gate_up_bias = [None] * len(layers)
        if self.gated:
            self.gate_up = [torch.cat([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight]) for layer in layers]
            if config.mlp_bias:
                self.gate_up_bias = [torch.cat([layer.mlp.gate_proj.bias, layer.mlp.up_proj.bias]) for layer in layers]
        self.dropout_base_seed = model.dropout_base_seed  # this forward's (`weights_dropout_seed`)
        self.inputs, self.queries, self.weights, self.contexts, self.residuals = {}, {}, {}, {}, {}
        self.gates, self.ups, self.masks, self.sums, self.kept = {}, {}, {}, {}, {}
        # The softmax weights over the window (H × W per row, layer and step) are kept while they are no larger than
        # what the step keeps anyway (its input, query, context and residual, and the MLP's projection: about
        # 4·D + I per row); over longer windows the backward builds them again from the query, the keys and the bias
        # (`scores.read_bias`), so that training memory grows with tokens × hidden size, not
        # tokens × window. (Building them again costs about a tenth of a training step at small windows.)
        self.weights_budget = 4 * config.hidden_size + config.intermediate_size
        self.mixtures, self.stacks, self.memories, self.rotations = {}, {}, {}, {}

    def keeps_weights(self, weights: torch.Tensor | None, num_heads: int) -> bool:
        """Whether a read's softmax weights (B·H, W) are kept (see `weights_budget`)."""
        return weights is not None and weights.shape[1] * num_heads <= self.weights_budget


def _rms_norm_backward(grad_output, inputs, norm, weight_gradient):
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


def _norm_backward(norm, grad_output, inputs, accumulated: dict, name: str):
    """dy → dx through the norm module `norm` (memlm's `RMSNorm`, or its `LayerNorm`: the one with a bias) at
    `inputs` (B, D), also returning its output y. The weight's (and bias's) gradient terms are added to
    `accumulated[name + ".weight"]` (and ".bias"): per row (B, D) for RMSNorm, summed (D,) for LayerNorm."""
    if not hasattr(norm, "bias"):
        return _rms_norm_backward(grad_output, inputs, norm, accumulated[name + ".weight"])
    # y = x̂ · w + b, x̂ = (x − mean) / sqrt(var + eps): the op's own backward gives dx, dw and db at once.
    width = inputs.shape[-1:]
    output, mean, reciprocal = torch.native_layer_norm(inputs, width, norm.weight, norm.bias, norm.variance_epsilon)
    grad_inputs, grad_weight, grad_bias = torch.ops.aten.native_layer_norm_backward(
        grad_output, inputs, width, mean, reciprocal, norm.weight, norm.bias, [True, True, True]
    )
    accumulated[name + ".weight"].add_(grad_weight)
    accumulated[name + ".bias"].add_(grad_bias)
    return grad_inputs, output


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


# Activations whose derivative `block_backward` knows as one op (the others run the eager backward).
COMPILED_ACTIVATIONS = ("silu", "gelu", "relu")


def _rms_norm_parts(grad_output, inputs, weight, eps: float):
    """`_rms_norm_backward` as a pure function: (input gradient, output y, the weight gradient's term dy ⊙ x̂)."""
    reciprocal = torch.rsqrt(inputs.pow(2).mean(-1, keepdim=True) + eps)
    normalized = inputs * reciprocal
    grad_normalized = grad_output * weight
    dot = (grad_normalized * normalized).sum(-1, keepdim=True)
    grad_inputs = (grad_normalized - normalized * dot / inputs.shape[-1]) * reciprocal
    return grad_inputs, normalized * weight, grad_output * normalized


def block_backward(grad_hidden, residual, gate, up, context, down_weight, gate_up_weight, norm_weight, eps: float,
                   output_weight, activation: str):  # fmt: skip
    """The backward of a layer's block after its memory read (`step_block`: residual = x + W_o·context, x' = residual
    + down(act(gate)·up), [gate, up] = W·norm(residual)), without dropout, for `compile_step`. Returns the gradient
    of the residual and of the context, the post-attention norm's weight-gradient term, and the operands of the
    weight gradients: (dx' , act(gate)·up) for down, (d[gate, up], norm(residual)) for gate_up, (d residual, context)
    for o_proj."""
    activated = _ACTIVATION_FUNCTIONS[activation](gate)
    grad_product = grad_hidden @ down_weight
    grad_gate = _ACTIVATION_BACKWARDS[activation](grad_product * up, gate)
    grad_gate_up = torch.cat([grad_gate, grad_product * activated], dim=-1)
    grad_normed, normed, norm_term = _rms_norm_parts(grad_gate_up @ gate_up_weight, residual, norm_weight, eps)
    grad_residual = grad_hidden + grad_normed
    grad_context = grad_residual @ output_weight
    return grad_residual, grad_context, norm_term, activated * up, grad_gate_up, normed


def query_backward(grad_query, cos, sin, query_weight, inputs, norm_weight, eps: float, grad_residual, mix,
                   grad_mixture):  # fmt: skip
    """The backward of a layer's query (`step_query`: q = rotate(W_q · norm(x))) and of the paths of its input x into
    the residual and the memory mix, for `compile_step`. Returns dx, the input norm's weight-gradient term and the
    operands (dq, norm(x)) of W_q's gradient."""
    if cos is not None:
        grad_query = _rotary_backward(grad_query, cos, sin)
    grad_query = grad_query.reshape(grad_query.shape[0], -1)
    grad_normed, normed, norm_term = _rms_norm_parts(grad_query @ query_weight, inputs, norm_weight, eps)
    return grad_residual + grad_normed + mix * grad_mixture, norm_term, grad_query, normed


_ACTIVATION_FUNCTIONS = {"silu": torch.nn.functional.silu, "gelu": torch.nn.functional.gelu,
                         "relu": torch.nn.functional.relu}  # fmt: skip
_ACTIVATION_BACKWARDS = {
    "silu": torch.ops.aten.silu_backward,
    "gelu": lambda grad, gate: torch.ops.aten.gelu_backward(grad, gate, approximate="none"),
    "relu": lambda grad, gate: torch.ops.aten.threshold_backward(grad, gate, 0),
}


class _WeightGradients:
    """Σ over steps of (gradient at a product's output)ᵀ · (its input), for every weight named "….weight" (and Σ of
    the gradient's rows for its bias "….bias", when needed). A step's product has only B rows, far below the CPU's
    GEMM speed, so the steps are gathered into buffers (allocated once, reused) and multiplied `steps_per_product` at
    a time."""

    def __init__(self, needed: set[str], steps_per_product: int):
        self.needed, self.steps_per_product = needed, steps_per_product
        self.buffers, self.filled, self.totals = {}, {}, {}

    @staticmethod
    def bias_name(name) -> str | None:
        """The bias of a weight named "….weight" (other keys, e.g. `DeferredWeightGradients`' ints: None)."""
        return name.removesuffix("weight") + "bias" if isinstance(name, str) and name.endswith(".weight") else None

    def add(self, name: str, grad_output: torch.Tensor, inputs: torch.Tensor):
        if name not in self.needed and self.bias_name(name) not in self.needed:
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
        for total_name, total in ((name, grads.t() @ inputs if name in self.needed else None),
                                  (self.bias_name(name), grads.sum(0))):  # fmt: skip
            if total_name not in self.needed:
                continue
            if total_name in self.totals:
                self.totals[total_name].add_(total)
            else:
                self.totals[total_name] = total

    def results(self) -> dict[str, torch.Tensor]:
        for name, filled in self.filled.items():
            if filled:
                self.flush(name)
        return self.totals


class DeferredWeightGradients:
    """The weight gradients of a step loop that runs with autograd (the papers' layouts on the tape, whose steps the
    hand-written backward does not know). Each step's linear layers (`linear`) give their inputs' gradients as
    autograd would, but their weight and bias gradients, an (out × in) product of only B rows per step, are gathered
    (`_WeightGradients`) and multiplied many steps at a time when autograd reaches the start of the loop
    (`_DeferredStart`, which every step's backward precedes). Only for plain `nn.Linear` modules without hooks
    (`applies`)."""

    def __init__(self, model, batch_size: int):
        # Each layer's weight and bias as this forward sees them (under `torch.func.functional_call`, not the
        # module's own parameters), used again in the backward.
        self.linears = {id(module): (module.weight, module.bias) for module in model.modules()
                        if isinstance(module, torch.nn.Linear)}  # fmt: skip
        self.parameters = [parameter for pair in self.linears.values() for parameter in pair
                           if parameter is not None and parameter.requires_grad]  # fmt: skip
        needed = {key for key, (weight, _) in self.linears.items() if weight.requires_grad}
        self.products = _WeightGradients(needed, max(1, 1024 // batch_size))
        self.bias_sums = {}
        self.token = _DeferredStart.apply(self, *self.parameters)

    @staticmethod
    def applies(model, inputs_embeds: torch.Tensor) -> bool:
        """Whether some linear layer learns, the step is a `plain_step`, and no layer recomputes its MLP in the
        backward (gradient checkpointing)."""
        return (
            hasattr(model, "deferred")
            and any(parameter.requires_grad for module in model.modules() if isinstance(module, torch.nn.Linear)
                    for parameter in module.parameters())
            and plain_step(model, inputs_embeds)
            and not any(getattr(layer, "gradient_checkpointing", False) for layer in model.layers)
        )  # fmt: skip

    def linear(self, module: torch.nn.Linear, states: torch.Tensor) -> torch.Tensor:
        return _DeferredLinear.apply(states, self.token, self, id(module))

    def release(self):
        """The step loop is over: drop the token, whose autograd node holds this object (in its context) — a cycle
        through the graph that Python's garbage collector cannot see (see `tape._Tape.release`)."""
        self.token = None

    def add(self, key: int, grad_output: torch.Tensor, states: torch.Tensor):
        self.products.add(key, grad_output, states)
        bias = self.linears[key][1]
        if bias is not None and bias.requires_grad:
            total = self.bias_sums.get(key)
            row_sum = grad_output.sum(0)
            self.bias_sums[key] = row_sum if total is None else total.add_(row_sum)

    def results(self) -> tuple:
        """The gradients of `self.parameters`, in their order (None for a layer no step used)."""
        weights = self.products.results()
        gradients = []
        for key, (weight, bias) in self.linears.items():
            if weight.requires_grad:
                gradients.append(weights.get(key))
            if bias is not None and bias.requires_grad:
                gradients.append(self.bias_sums.get(key))
        return tuple(gradients)


class _DeferredStart(torch.autograd.Function):
    """The start of a step loop whose weight gradients are deferred: its output (a scalar) feeds every step's linear
    layers, so its backward runs after all of theirs and hands autograd the gathered weight gradients."""

    @staticmethod
    def forward(ctx, deferred, *parameters):
        ctx.deferred = deferred
        return parameters[0].new_zeros(())

    @staticmethod
    def backward(ctx, grad_token):
        return (None, *ctx.deferred.results())


class _DeferredLinear(torch.autograd.Function):
    """y = x · Wᵀ + b for one step; the backward gives dx = dy · W and hands (dy, x) to `DeferredWeightGradients`."""

    @staticmethod
    def forward(ctx, states, token, deferred, key):
        ctx.save_for_backward(states)
        ctx.deferred, ctx.key = deferred, key
        weight, bias = deferred.linears[key]
        return torch.nn.functional.linear(states, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        (states,) = ctx.saved_tensors
        ctx.deferred.add(ctx.key, grad_output, states)
        weight = ctx.deferred.linears[ctx.key][0]
        grad_states = grad_output @ weight if ctx.needs_input_grad[0] else None
        return grad_states, grad_output.new_zeros(()), None, None


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
    weight gradients to products of many steps at once. `prefix_keys`, `prefix_values` (G, B, H, P, d): memories the
    tape starts from that carry gradients, which get theirs; else None. `projected`: the `ProjectedMemories` the tape
    starts from (projected into it without autograd), whose projection's parameters get their gradients; else None.
    `parameters`: the `recurrent_parameters` as the forward sees them, named `names`."""

    @staticmethod
    def forward(ctx, model, store, inputs_embeds, positions, valid, prefix_keys, prefix_values, projected, names,
                *parameters):  # fmt: skip
        record = Recording(model)
        compiled = compiled_step_applies(model, inputs_embeds)  # `compile_step` (autograd is off in here)
        outputs = [
            model.step(embeddings, step_positions, step_valid, store, step, record, compiled)[0]
            for step, (embeddings, step_positions, step_valid) in enumerate(
                zip(inputs_embeds.unbind(1), positions.unbind(1), valid.unbind(1))
            )
        ]
        ctx.model, ctx.store, ctx.record, ctx.positions, ctx.compiled = model, store, record, positions, compiled
        ctx.projected, ctx.names = projected, names
        ctx.save_for_backward(*parameters)
        return torch.stack(outputs, dim=1)

    @staticmethod
    def backward(ctx, grad_outputs):
        needed = {name for name, needs in zip(ctx.names, ctx.needs_input_grad[9:]) if needs}
        with parameters_as(ctx.model, ctx.names, ctx.saved_tensors):
            grad_embeddings, gradients, (grad_prefix_keys, grad_prefix_values) = _backward_through_time(
                ctx.model, ctx.store, ctx.record, ctx.positions, grad_outputs, needed, ctx.compiled
            )
            if ctx.projected is not None:
                _projection_backward(ctx.model, ctx.projected, grad_prefix_keys, grad_prefix_values, gradients)
        grad_embeddings = grad_embeddings if ctx.needs_input_grad[2] else None
        grad_prefix_keys = grad_prefix_keys if ctx.needs_input_grad[5] else None
        grad_prefix_values = grad_prefix_values if ctx.needs_input_grad[6] else None
        return (None, None, grad_embeddings, None, None, grad_prefix_keys, grad_prefix_values, None, None) + tuple(
            gradients.get(name) for name in ctx.names
        )


def _projection_backward(model, projected, grad_keys: torch.Tensor, grad_values: torch.Tensor, gradients: dict):
    """Add to `gradients` those of the parameters of `projected.project` (`FeedbackTransformerModel._project_hidden`:
    keys and values (G, B, H, W, d) of hidden states (B, W, D) that need no gradient themselves) given the keys' and
    values' gradients: k = W_k · s, v = W_v · s per key/value set, s the hidden state or (memories normed per layer,
    the official pre-norm code) norm_l of it, the keys rotated by position with rotary embeddings."""
    config = model.config
    if model.rotary_emb is not None:
        cos, sin = model.rotary_emb(projected.positions)  # (B, 1, W, d)
        grad_keys = _rotary_backward(grad_keys, cos, sin)
    groups, batch_size, _, width, _ = grad_keys.shape
    hidden = projected.hidden.reshape(batch_size * width, -1)

    def add(name: str, gradient: torch.Tensor):
        gradients[name] = gradient if gradients.get(name) is None else gradients[name] + gradient

    for group in range(groups):
        # (B·W, 2·H·d): the set's keys and values, as the rows of one product's output
        grad_key_value = torch.cat([grad_keys[group].transpose(1, 2).reshape(batch_size * width, -1),
                                    grad_values[group].transpose(1, 2).reshape(batch_size * width, -1)], dim=-1)  # fmt: skip
        prefix = "" if config.share_key_value else f"layers.{group}.attention."
        projections = model if config.share_key_value else model.layers[group].attention
        source = hidden
        if model.layer_norms_memory:
            norm, name = model.layers[group].input_layernorm, f"layers.{group}.input_layernorm"
            weight = torch.cat([projections.k_proj.weight, projections.v_proj.weight])
            accumulated = {f"{name}.{kind}": torch.zeros_like(getattr(norm, kind))
                           for kind in ("weight", "bias") if hasattr(norm, kind)}  # fmt: skip
            if not hasattr(norm, "bias"):  # RMSNorm: its terms per row
                accumulated[f"{name}.weight"] = hidden.new_zeros(hidden.shape)
            _, source = _norm_backward(norm, grad_key_value @ weight, hidden, accumulated, name)
            for key, gradient in accumulated.items():
                add(key, gradient.sum(0) if gradient.dim() == 2 else gradient)
        grad_keys_weight, grad_values_weight = (grad_key_value.t() @ source).split(config.attention_width)
        add(prefix + "k_proj.weight", grad_keys_weight)
        add(prefix + "v_proj.weight", grad_values_weight)


def _product_name(name: str, gated: bool) -> str:
    """The name under which `_backward_through_time` gathers a parameter's products: a key/value set's keys and values
    as one ("key_value"), a gated MLP's gate and up projections as one ("gate_up")."""
    name = name.replace("k_proj", "key_value").replace("v_proj", "key_value")
    return name.replace("gate_proj", "gate_up").replace("up_proj", "gate_up") if gated else name


def _mlp_backward(layer, index: int, key, record, residual, grad_output, products, norm_gradients, pre: bool,
                  activation: str) -> torch.Tensor:  # fmt: skip
    """The backward of a layer's MLP block, output = down(act(gate) · up) or down(dropout(act(up))) of
    n = post_norm(residual) (pre-norm) or n = residual (post-norm): the gradient `grad_output` at its output → the
    gradient at `residual` through the block; the weights' products go to `products`."""
    mlp, norm, prefix = layer.mlp, layer.post_attention_layernorm, f"layers.{index}."
    normed = None
    if key not in record.ups:  # gradient checkpointing: recompute the block's projections
        normed = norm(residual) if pre else residual
    if record.gated:
        if normed is None:
            gate, up = record.gates[key], record.ups[key]
        else:
            projection = torch.nn.functional.linear(normed, record.gate_up[index], record.gate_up_bias[index])
            gate, up = projection.split(mlp.gate_proj.out_features, dim=-1)
        activated = mlp.act_fn(gate)
        products.add(prefix + "mlp.down_proj.weight", grad_output, activated * up)
        grad_product = grad_output @ mlp.down_proj.weight
        grad_gate = _activation_backward(mlp.act_fn, activation, gate, grad_product * up)
        grad_projection = torch.cat([grad_gate, grad_product * activated], dim=-1)
        name, weight = prefix + "mlp.gate_up.weight", record.gate_up[index]
    else:
        up = record.ups[key] if normed is None else mlp.up_proj(normed)
        activated = mlp.act_fn(up)
        mask = record.masks.get(("activation",) + key)
        products.add(prefix + "mlp.down_proj.weight", grad_output, activated if mask is None else activated * mask)
        grad_activated = grad_output @ mlp.down_proj.weight
        grad_activated = grad_activated if mask is None else grad_activated * mask
        grad_projection = _activation_backward(mlp.act_fn, activation, up, grad_activated)
        name, weight = prefix + "mlp.up_proj.weight", mlp.up_proj.weight
    grad_normed = grad_projection @ weight
    if pre:
        grad_normed, normed = _norm_backward(norm, grad_normed, residual, norm_gradients,
                                             prefix + "post_attention_layernorm")  # fmt: skip
    products.add(name, grad_projection, residual if normed is None else normed)
    return grad_normed


def _backward_through_time(model, store, record, positions, grad_outputs, needed, compiled=False):
    """Back-propagation through the loop of `FeedbackTransformerModel.step`, from the last step to the first; each
    block reverses a line of the step. Returns the gradient of the input embeddings (B, T, D), {name: gradient} of
    the parameters named in `needed`, and the gradients of the tape's prefix (its keys and values (G, B, H, P, d)).
    `compiled` (`compile_step`, the default layout without dropout): the layer's lines before and after its memory
    read run as `block_backward` and `query_backward` through `torch.compile`."""
    config, layers = model.config, model.layers
    compiled = compiled and config.hidden_act in COMPILED_ACTIVATIONS and not record.masks
    if compiled:
        from .compiled import compiled as compiled_function

        block_function, query_function = compiled_function(block_backward), compiled_function(query_backward)
    batch_size, steps, hidden_size = grad_outputs.shape
    num_heads, head_dim, num_layers = config.num_attention_heads, config.head_dim, len(layers)
    scale = head_dim**-0.5
    pre, gated = config.norm_position == "pre", record.gated
    wide = torch.promote_types(model.layer_weights.dtype, torch.float32)
    softmax = torch.softmax(model.layer_weights.to(wide), dim=0)
    mix = softmax.to(grad_outputs.dtype)
    groups = len(record.key_value)
    tape = _TapeGradients(store, reads_per_step=num_layers // groups)
    prefixes = [""] * groups if config.share_key_value else [f"layers.{index}.attention." for index in range(groups)]
    key_value = list(zip(prefixes, record.key_value))
    # (buffers of at most the forward's steps: a longer one would hold rows never filled)
    products = _WeightGradients({_product_name(name, gated) for name in needed},
                                steps_per_product=min(steps, max(1, 1024 // batch_size)))  # fmt: skip
    # The norms' gradients: per row (B, D) for RMSNorm (summed at the end), (D,) for LayerNorm (see `_norm_backward`).
    norm_gradients = {}
    norms = [("memory_norm", model.memory_norm)] + [
        (f"layers.{index}.{kind}", getattr(layer, kind)) for index, layer in enumerate(layers)
        for kind in ("input_layernorm", "post_attention_layernorm")
    ]  # fmt: skip
    for name, norm in norms:
        if norm is None:
            continue
        if hasattr(norm, "bias"):
            norm_gradients[name + ".weight"], norm_gradients[name + ".bias"] = (
                torch.zeros_like(norm.weight), torch.zeros_like(norm.bias)
            )  # fmt: skip
        else:
            norm_gradients[name + ".weight"] = grad_outputs.new_zeros(batch_size, hidden_size)
    grad_mix = torch.zeros(num_layers + 1, dtype=grad_outputs.dtype, device=grad_outputs.device)
    relative_gradients = [
        torch.zeros_like(layer.attention.relative_bias) if hasattr(layer.attention, "relative_bias") else None
        for layer in layers
    ]
    span_gradients = [None] * num_layers  # of each layer's adaptive span ratios, when it has them
    table = model.relative_positions  # the learned relative positions p_1..p_τ (or None)
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
        memory = record.memories[step]
        grad_memory = 0
        for group, (prefix, weight) in enumerate(key_value):
            grad_source, source = grad_key_value[group] @ weight, memory
            if model.layer_norms_memory:  # k = W_k · norm_l(m), the official pre-norm code
                grad_source, source = _norm_backward(layers[group].input_layernorm, grad_source, memory,
                                                     norm_gradients, f"layers.{group}.input_layernorm")  # fmt: skip
            products.add(f"{prefix}key_value.weight", grad_key_value[group], source)
            grad_memory = grad_memory + grad_source
        # Eq. 1: m_t = norm(Σ_l softmax(w)_l x_t^l) (or the mixture itself)
        grad_mixture = grad_memory
        if model.memory_norm is not None:
            grad_mixture, _ = _norm_backward(model.memory_norm, grad_memory, record.mixtures[step], norm_gradients,
                                             "memory_norm")  # fmt: skip
        grad_mix += torch.einsum("bd,lbd->l", grad_mixture, record.stacks[step])
        grad_hidden = grad_outputs[:, step] + mix[num_layers] * grad_mixture
        relative = None  # the step's index of the learned relative positions (B, H, W), the same for every layer
        for index in reversed(range(num_layers)):
            layer, key, prefix = layers[index], (index, step), f"layers.{index}."
            attention = layer.attention
            residual = record.residuals[key]
            if compiled:  # the lines below, as one compiled function (the default layout, no dropout)
                context = record.contexts[key].view(batch_size, -1)
                if key in record.gates:
                    gate, up = record.gates[key], record.ups[key]
                else:  # gradient checkpointing: recompute the block's projections
                    normed = layer.post_attention_layernorm(residual)
                    gate, up = (normed @ record.gate_up[index].t()).split(config.intermediate_size, dim=-1)
                grad_input, grad_context, norm_term, activated_up, grad_gate_up, normed = block_function(
                    grad_hidden, residual, gate, up, context, layer.mlp.down_proj.weight, record.gate_up[index],
                    layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon,
                    attention.o_proj.weight, config.hidden_act,
                )  # fmt: skip
                norm_gradients[prefix + "post_attention_layernorm.weight"].add_(norm_term)
                products.add(prefix + "mlp.down_proj.weight", grad_hidden, activated_up)
                products.add(prefix + "mlp.gate_up.weight", grad_gate_up, normed)
                products.add(prefix + "attention.o_proj.weight", grad_input, context)
                grad_context = grad_context.view(-1, head_dim)
            else:
                # hidden = residual + dropout(mlp(residual)) (post-norm: its norm)
                grad_sum = grad_hidden
                if not pre:
                    grad_sum, _ = _norm_backward(layer.post_attention_layernorm, grad_hidden,
                                                 record.sums[("mlp",) + key], norm_gradients,
                                                 prefix + "post_attention_layernorm")  # fmt: skip
                mask = record.masks.get(("mlp",) + key)
                grad_down = grad_sum if mask is None else grad_sum * mask
                grad_residual = grad_sum + _mlp_backward(layer, index, key, record, residual, grad_down, products,
                                                         norm_gradients, pre, config.hidden_act)  # fmt: skip
                # residual = input + dropout(o_proj(dropout(context))) (post-norm: its norm)
                grad_input = grad_residual
                if not pre:
                    grad_input, _ = _norm_backward(layer.input_layernorm, grad_residual,
                                                   record.sums[("attention",) + key], norm_gradients,
                                                   prefix + "input_layernorm")  # fmt: skip
                mask = record.masks.get(("attention",) + key)
                grad_mixed = grad_input if mask is None else grad_input * mask
                products.add(prefix + "attention.o_proj.weight", grad_mixed, record.contexts[key].view(batch_size, -1))
                grad_context = (grad_mixed @ attention.o_proj.weight).view(-1, head_dim)
                mask = record.masks.get(("context",) + key)
                grad_context = grad_context if mask is None else grad_context * mask
            # context = softmax(q·Kᵀ/√d + bias) · V over the window (`attention_weights`)
            query, group = record.queries[key], 0 if groups == 1 else index
            start, end = store.bounds(step)
            if start == end:  # no memory yet: the attention term was zero
                grad_query = torch.zeros_like(query)
            else:
                keys = store.keys[group, :, :, start:end].flatten(0, 1)
                values = store.values[group, :, :, start:end].flatten(0, 1)
                weights = record.weights.get(key)
                if weights is None:  # the step's weights, as its read computed them
                    bias = read_bias(model, index, store, group, step, positions[:, step], query)
                    weights = attention_weights(query, keys, bias)
                grad_weights = torch.bmm(grad_context.unsqueeze(1), values.transpose(1, 2)).squeeze(1)
                span_ratio, kept = getattr(attention, "span_ratio", None), record.kept.get(key)
                if kept is None and record.dropout_base_seed is not None and attention.dropout.p > 0:
                    seed = weights_dropout_seed(model, index, step, record.dropout_base_seed)  # as the step drew it
                    kept = WeightsTransform(None, 0.0, attention.dropout.p, seed).dropout_mask(weights)
                if span_ratio is None and kept is None:
                    read, grad_scores = weights, torch._softmax_backward_data(grad_weights, weights, -1, weights.dtype)
                else:  # the official layouts' `WeightsTransform`: the adaptive span's mask, dropout on the weights
                    mask = denominator = None
                    if span_ratio is not None:  # m(d) = clamp((1 − d + z·τ)/R + 1, 0, 1); a' = p·m / (Σ p·m + ε)
                        distance = positions[:, step, None] - store.positions[:, start:end]
                        mask = adaptive_span_mask(span_ratio, distance, config.memory_span, config.adaptive_span_ramp)
                        mask = mask.flatten(0, 1).to(weights.dtype)
                        denominator = renormalizer(weights * mask, config.renormalization_epsilon)
                    if kept is not None and kept.dtype == torch.bool:  # as drawn: 1 / (1 − p) where kept
                        kept = kept.to(weights.dtype).div_(1 - attention.dropout.p)
                    needs_span = mask is not None and f"{prefix}attention.span_ratio" in needed
                    read, grad_scores, grad_mask = transform_backward(grad_weights, weights, mask, denominator, kept,
                                                                      needs_span)  # fmt: skip
                    if needs_span:
                        grad_span = adaptive_span_mask_backward(span_ratio, distance, config.memory_span,
                                                                config.adaptive_span_ramp,
                                                                grad_mask.view(batch_size, num_heads, -1))  # fmt: skip
                        span_gradients[index] = grad_span if span_gradients[index] is None else (
                            span_gradients[index] + grad_span
                        )  # fmt: skip
                grad_query = torch.bmm(grad_scores.unsqueeze(1), keys).squeeze(1) * scale
                tape.add(group, start, end, grad_scores, query * scale, read, grad_context)
                if relative_gradients[index] is not None or table is not None:
                    # bias[h, d − 1] or q · p_d / √d at distance d = t − i; invisible slots have dS = 0
                    if relative is None:
                        distance = positions[:, step, None] - store.positions[:, start:end]
                        relative = (distance - 1).clamp(0, config.memory_span - 1)[:, None]
                        relative = relative.expand(batch_size, num_heads, -1)  # (B, H, W)
                    per_head = grad_scores.view(batch_size, num_heads, -1)
                if relative_gradients[index] is not None:
                    relative_gradients[index].index_add_(1, relative[:, 0].flatten(),
                                                         per_head.transpose(0, 1).flatten(1))  # fmt: skip
                if table is not None:  # dq += Σ_i dS_i p_{d_i} / √d; dp_d += Σ dS_i q / √d
                    by_distance = per_head.new_zeros(batch_size, num_heads, table.shape[0])
                    by_distance = by_distance.scatter_add_(-1, relative, per_head).flatten(0, 1).mul_(scale)
                    grad_query = grad_query + by_distance @ table
                    products.add("relative_positions", by_distance, query)
            grad_query = grad_query.view(batch_size, num_heads, head_dim)
            if compiled:  # the lines below, as one compiled function
                grad_hidden, norm_term, grad_query, normed = query_function(
                    grad_query, None if cos is None else cos[:, 0], None if sin is None else sin[:, 0],
                    attention.q_proj.weight, record.inputs[key], layer.input_layernorm.weight,
                    layer.input_layernorm.variance_epsilon, grad_input, mix[index], grad_mixture,
                )  # fmt: skip
                norm_gradients[prefix + "input_layernorm.weight"].add_(norm_term)
                products.add(prefix + "attention.q_proj.weight", grad_query, normed)
                continue
            if cos is not None:
                grad_query = _rotary_backward(grad_query, cos[:, 0], sin[:, 0])
            grad_query = grad_query.reshape(batch_size, -1)
            # query = q_proj(input_norm(input)) (post-norm: of the input); the input also feeds the residual and the
            # memory mix
            grad_attention_input, attention_input = grad_query @ attention.q_proj.weight, record.inputs[key]
            if pre:
                grad_attention_input, attention_input = _norm_backward(
                    layer.input_layernorm, grad_attention_input, attention_input, norm_gradients,
                    prefix + "input_layernorm",
                )  # fmt: skip
            products.add(prefix + "attention.q_proj.weight", grad_query, attention_input)
            grad_hidden = grad_input + grad_attention_input + mix[index] * grad_mixture
        grad_embeddings[step] = grad_hidden
        if step == block_first:
            tape.end_block()

    gradients = {name: gradient.sum(0) if gradient.dim() == 2 else gradient
                 for name, gradient in norm_gradients.items()}  # fmt: skip
    grad_mix = grad_mix.to(wide)  # the softmax's backward for the layer weights
    gradients["layer_weights"] = (softmax * (grad_mix - (softmax * grad_mix).sum())).to(model.layer_weights.dtype)
    for index, (gradient, span_gradient) in enumerate(zip(relative_gradients, span_gradients)):
        gradients[f"layers.{index}.attention.relative_bias"] = gradient
        gradients[f"layers.{index}.attention.span_ratio"] = span_gradient
    for name, gradient in products.results().items():
        if "key_value" in name:
            gradients[name.replace("key_value", "k_proj")], gradients[name.replace("key_value", "v_proj")] = (
                gradient.split(config.attention_width)
            )
        elif gated and "gate_up" in name:
            gradients[name.replace("gate_up", "gate_proj")], gradients[name.replace("gate_up", "up_proj")] = (
                gradient.split(config.intermediate_size)
            )
        else:
            gradients[name] = gradient
    prefix = store.prefix
    return torch.stack(grad_embeddings, dim=1), gradients, (tape.keys[:, :, :, :prefix], tape.values[:, :, :, :prefix])


class StepGradients:
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
