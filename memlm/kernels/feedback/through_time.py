"""The hand-written backward of the Feedback recurrence (the fast path of `memlm.kernels.feedback` in training).

`_ThroughTime` runs the training step loop without autograd, recording what the backward needs (`Recording`), and
`_backward_through_time` walks the steps back by hand. A graph of ~160 small autograd nodes per step costs more than
the step itself on a CPU, and the weight gradients become products of many steps at once (`_WeightGradients`); the
tape's key/value gradients are added block by block (`_TapeGradients`). The tests check it against autograd through
`reference.py` in float64 to 1e-10. With the config's `compile_step` (and no dropout), each layer's lines before and
after its memory read run as two pure functions through `torch.compile` (`block_backward`, `query_backward`).
"""

import functools
import weakref

import torch


def recurrent_parameters(model) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters the step loop uses (all but the token embedding and the final norm)."""
    return [(name, parameter) for name, parameter in model.named_parameters()
            if not name.startswith(("embed_tokens.", "norm."))]  # fmt: skip


def plain_step(model, inputs_embeds: torch.Tensor) -> bool:
    """Whether the step computes only what memlm's code says: float32/float64 without autocast, and only the model's
    plain modules (`model.step_modules`, and the activation of its config) without hooks. A hook, an adapter (e.g.
    LoRA) or a quantised linear layer changes what the forward computes, so those keep autograd."""
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
    )


def covers(model, inputs_embeds: torch.Tensor, keep_states: bool) -> bool:
    """Whether the hand-written backward knows what the forward computes: memlm's default step (not the papers'
    layouts), no per-step outputs kept for the caller, and a `plain_step`."""
    return (
        getattr(model, "default_step", True)  # memlm's default layout (`FeedbackTransformerConfig.default_step`)
        and not keep_states
        and plain_step(model, inputs_embeds)
    )


class Recording:
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
    weight gradients to products of many steps at once."""

    @staticmethod
    def forward(ctx, model, store, inputs_embeds, positions, valid, *parameters):
        record = Recording(model)
        compiled = model.compiled_step_applies(inputs_embeds)  # `compile_step` (autograd is off in here)
        outputs = [
            model.step(embeddings, step_positions, step_valid, store, step, record, compiled)[0]
            for step, (embeddings, step_positions, step_valid) in enumerate(
                zip(inputs_embeds.unbind(1), positions.unbind(1), valid.unbind(1))
            )
        ]
        ctx.model, ctx.store, ctx.record, ctx.positions, ctx.compiled = model, store, record, positions, compiled
        return torch.stack(outputs, dim=1)

    @staticmethod
    def backward(ctx, grad_outputs):
        parameters = recurrent_parameters(ctx.model)
        needed = {name for (name, _), needs in zip(parameters, ctx.needs_input_grad[5:]) if needs}
        grad_embeddings, gradients = _backward_through_time(ctx.model, ctx.store, ctx.record, ctx.positions,
                                                            grad_outputs, needed, ctx.compiled)  # fmt: skip
        grad_embeddings = grad_embeddings if ctx.needs_input_grad[2] else None
        return (None, None, grad_embeddings, None, None) + tuple(gradients.get(name) for name, _ in parameters)


def _backward_through_time(model, store, record, positions, grad_outputs, needed, compiled=False):
    """Back-propagation through the loop of `FeedbackTransformerModel.step`, from the last step to the first; each
    block reverses a line of the step. Returns the gradient of the input embeddings (B, T, D) and {name: gradient}
    of the parameters named in `needed`. `compiled` (`compile_step`, no dropout): the layer's lines before and after
    its memory read run as `block_backward` and `query_backward` through `torch.compile`."""
    config, layers = model.config, model.layers
    compiled = compiled and config.hidden_act in COMPILED_ACTIVATIONS and not record.masks
    if compiled:
        from .compiled import compiled as compiled_function

        block_function, query_function = compiled_function(block_backward), compiled_function(query_backward)
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
            residual = record.residuals[key]
            if key in record.gates:
                gate, up = record.gates[key], record.ups[key]
            else:  # gradient checkpointing: recompute the block's projections
                normed = layer.post_attention_layernorm(residual)
                gate, up = (normed @ gate_up[index].t()).split(config.intermediate_size, dim=-1)
            if compiled:  # the lines below, as one compiled function (no dropout)
                context = record.contexts[key].view(batch_size, -1)
                grad_residual, grad_context, norm_term, activated_up, grad_gate_up, normed = block_function(
                    grad_hidden, residual, gate, up, context, mlp.down_proj.weight, gate_up[index],
                    layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon,
                    attention.o_proj.weight, config.hidden_act,
                )  # fmt: skip
                norm_gradients[prefix + "post_attention_layernorm.weight"].add_(norm_term)
                products.add(prefix + "mlp.down_proj.weight", grad_hidden, activated_up)
                products.add(prefix + "mlp.gate_up.weight", grad_gate_up, normed)
                products.add(prefix + "attention.o_proj.weight", grad_residual, context)
                grad_context = grad_context.view(-1, head_dim)
            else:
                # hidden = residual + dropout(down(act(gate) · up)), [gate, up] = W · post_norm(residual)
                mask = record.masks.get(("mlp",) + key)
                grad_down = grad_hidden if mask is None else grad_hidden * mask
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
            if compiled:  # the lines below, as one compiled function
                grad_hidden, norm_term, grad_query, normed = query_function(
                    grad_query, None if cos is None else cos[:, 0], None if sin is None else sin[:, 0],
                    attention.q_proj.weight, record.inputs[key], layer.input_layernorm.weight,
                    layer.input_layernorm.variance_epsilon, grad_residual, mix[index], grad_mixture,
                )  # fmt: skip
                norm_gradients[prefix + "input_layernorm.weight"].add_(norm_term)
                products.add(prefix + "attention.q_proj.weight", grad_query, normed)
                continue
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
