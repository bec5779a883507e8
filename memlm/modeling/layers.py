"""Blocks shared by memlm's models (SPEC: every model is a stack of pre-norm blocks with an MLP; SPEC §8: the papers'
official blocks, chosen by the config's `BlockLayout` fields)."""

import functools

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from ..kernels import plain_tensor
from ..kernels.expire_attention.one_query import padded_position_table
from ..kernels.expire_attention.reference import relative_position_scores

# The dtypes a norm computes in as they are (narrower ones are computed in float32).
WIDE = (torch.float32, torch.float64)


def compile_region(forward):
    """A layer's `forward` as a `torch.compiler.nested_compile_region` (`torch.compile` traces and compiles it once for
    all the layers, which differ only in their weights), except under `torch.export`: there torch would run each call
    of a region through Dynamo inside the export's own tracing, which made exports several times longer for the same
    graph."""
    region = torch.compiler.nested_compile_region(forward)

    @functools.wraps(forward)
    def layer_forward(*args, **kwargs):
        if torch.compiler.is_exporting():
            return forward(*args, **kwargs)
        return region(*args, **kwargs)

    return layer_forward


# RMSNorm's ε as a 0-dim CPU tensor per (dtype, ε), shared by every norm (read, never written).
_CPU_EPSILONS = {}


def own_parameter(module: nn.Module, name: str) -> torch.Tensor | None:
    """`getattr(module, name)` for a parameter, read from the module's `_parameters`: an attribute read of a parameter
    or a child module raises and catches an AttributeError before `nn.Module.__getattr__` finds it, thousands of
    instructions each, for every child and parameter a decoding step uses. A parametrized one, which lives elsewhere,
    is read as the attribute."""
    parameter = module._parameters.get(name)
    return parameter if parameter is not None else getattr(module, name)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 or wider: y = x / sqrt(mean(x²) + eps) · w."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weight = own_parameter(self, "weight")
        if hidden_states.dtype == weight.dtype and weight.dtype in WIDE:  # nothing to convert
            if hidden_states.is_cpu and not torch.compiler.is_compiling():
                # On a CPU F.rms_norm runs as ~20 small ops, a decoding step's norms as many µs: its formula in five
                # (ε + Σx² · (1/D), its rsqrt, x·r·w; F.rms_norm's numbers where 1/D is exact, a power of two, else
                # within an ulp). ε as a tensor: a Python number would cost a conversion at every call.
                key = (hidden_states.dtype, self.variance_epsilon)
                epsilon = _CPU_EPSILONS.get(key)
                if epsilon is None:
                    epsilon = _CPU_EPSILONS[key] = torch.tensor(key[1], dtype=key[0], device="cpu")
                squares = hidden_states.square().sum(-1, keepdim=True)
                scale = torch.add(epsilon, squares, alpha=1 / hidden_states.shape[-1]).rsqrt_()
                return torch.mul(hidden_states, scale) * weight
            return F.rms_norm(hidden_states, weight.shape, weight, self.variance_epsilon)  # (one fused op on a GPU)
        dtype = torch.promote_types(hidden_states.dtype, torch.float32)
        normed = F.rms_norm(hidden_states.to(dtype), weight.shape, weight.to(dtype), self.variance_epsilon)
        return normed.to(hidden_states.dtype)


class LayerNorm(nn.Module):
    """LayerNorm with weight and bias, computed in float32 or wider (as `RMSNorm`)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weight, bias = own_parameter(self, "weight"), own_parameter(self, "bias")
        if hidden_states.dtype == weight.dtype == bias.dtype and weight.dtype in WIDE:  # nothing to convert
            return F.layer_norm(hidden_states, weight.shape, weight, bias, self.variance_epsilon)
        dtype = torch.promote_types(hidden_states.dtype, torch.float32)
        normed = F.layer_norm(
            hidden_states.to(dtype), weight.shape, weight.to(dtype), bias.to(dtype), self.variance_epsilon
        )
        return normed.to(hidden_states.dtype)


def runs_as_defined(*modules: nn.Module) -> bool:
    """Whether calling each of `modules` runs only its class's `forward`: no hook of its own nor a global one, no
    forward set on the instance (🤗 kernels' `kernelize`, 🤗 Accelerate's device hooks) and no JIT trace, so that a
    step may compute with the modules' weights directly or skip a module's call."""
    hooks = nn.modules.module
    if (
        hooks._global_forward_hooks or hooks._global_forward_pre_hooks or hooks._global_backward_hooks
        or hooks._global_backward_pre_hooks or torch._C._get_tracing_state()
    ):  # fmt: skip
        return False
    for module in modules:  # (a loop, not a generator: a decoding step asks this for every product)
        if (
            module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks
            or "forward" in module.__dict__
        ):  # fmt: skip
            return False
    return True


def layer_runs_as_defined(layer: nn.Module) -> bool:
    """`runs_as_defined` for a decoder layer, its children (mixer, norms, MLP) and theirs (products, activations): what
    a decoding step checks once per layer, after which it calls those modules' forwards and products directly
    (`linear(..., checked=True)`, `module.forward`): a dozen checks and module calls fewer per layer and token."""
    children = [child for child in layer._modules.values() if child is not None]
    grandchildren = [module for child in children for module in child._modules.values() if module is not None]
    return runs_as_defined(layer, *children, *grandchildren)


def linear(module: nn.Module, inputs: torch.Tensor, checked: bool = False) -> torch.Tensor:
    """`module(inputs)`, as the product itself when `module` is a linear layer whose call would run only `nn.Linear`'s
    forward (an adapter or a quantized layer defines its own; hooks, see `runs_as_defined`): a decoding step makes
    about eight such calls per layer, and on a CPU the call's machinery costs microseconds each. The weight and bias
    are read from the module's parameters (a module attribute read costs about as much again); a parametrized weight,
    which lives elsewhere, goes through the module's call, and a parametrized bias is read as the call reads it.
    `checked`: the caller has seen `runs_as_defined(module)` (`layer_runs_as_defined`); a module that is not a plain
    linear layer then runs its forward without the call's machinery."""
    if type(module).forward is nn.Linear.forward and (checked or runs_as_defined(module)):
        parameters = module._parameters
        weight = parameters.get("weight")
        if weight is not None:
            return F.linear(inputs, weight, parameters["bias"] if "bias" in parameters else module.bias)
    return module.forward(inputs) if checked else module(inputs)


def dropout(module: nn.Dropout, states: torch.Tensor) -> torch.Tensor:
    """`module(states)`, without the module call when it does nothing (evaluation or p = 0): a decoding step calls
    several per layer, and each call costs microseconds for nothing."""
    return module(states) if module.training and module.p > 0 else states


# The projections with a handful of outputs (DeltaNet's β, Expire-Span's span predictor) that 🤗's loading keeps out
# of quantization and, for a float16 checkpoint, in float32 (a model's `_keep_in_fp32_modules`): an int8 or 4-bit
# product gains nothing on a few rows, the CPU 4-bit kernel of bitsandbytes packs rows by 32, and a span or a gate
# read through float8 or 4 bits moves far. Their outputs are read in float32 anyway.
SMALL_PROJECTIONS = ("beta_proj", "span_predictor")
# The same as 🤗's patterns, which must match a module's name (bitsandbytes, quanto) and its weight's too (torchao
# matches "model.layers.0.attention.beta_proj.weight" from its start), and serve as globs for the float16 upcast.
KEEP_IN_FLOAT32 = [rf".*\.{name}" for name in SMALL_PROJECTIONS]


def small_projection(module: nn.Linear, inputs: torch.Tensor, checked: bool = False) -> torch.Tensor:
    """`module(inputs)` for one of `SMALL_PROJECTIONS`, whose weight may be float32 in a half-precision model: the
    inputs are converted to the weight's floating dtype (a quantized weight's integer storage is left to its
    module). `checked` as for `linear`."""
    dtype = own_parameter(module, "weight").dtype
    if dtype != inputs.dtype and dtype.is_floating_point:
        inputs = inputs.to(dtype)
    return linear(module, inputs, checked)


def make_norm(config, width: int | None = None) -> nn.Module:
    """The norm the config's `norm_type` names, over `width` features (default: hidden_size)."""
    width = config.hidden_size if width is None else width
    if getattr(config, "norm_type", "rmsnorm") == "layernorm":
        return LayerNorm(width, config.layer_norm_eps)
    return RMSNorm(width, config.rms_norm_eps)


class GatedMLP(nn.Module):
    """Gated MLP: down(act(gate(x)) · up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = ACT2FN[hidden_act]

    def forward(self, hidden_states: torch.Tensor, checked: bool = False) -> torch.Tensor:
        """`checked`: the caller has seen `runs_as_defined` of this module's children (`layer_runs_as_defined`)."""
        modules = self._modules  # (see `own_parameter`)
        gate, up, down, activation = modules["gate_proj"], modules["up_proj"], modules["down_proj"], modules["act_fn"]
        activation = activation.forward if checked else activation
        gated = activation(linear(gate, hidden_states, checked)) * linear(up, hidden_states, checked)
        return linear(down, gated, checked)


class PlainMLP(nn.Module):
    """The official code's feed-forward: down(dropout(act(up(x)))) (Vaswani et al., 2017, Eq. 2 with ReLU)."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool, dropout: float):
        super().__init__()
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = ACT2FN[hidden_act]
        self.dropout = nn.Dropout(dropout)

    def forward(self, hidden_states: torch.Tensor, checked: bool = False) -> torch.Tensor:
        """`checked` as for `GatedMLP`."""
        modules = self._modules  # (see `own_parameter`)
        up, down = modules["up_proj"], modules["down_proj"]
        activation, activation_dropout = modules["act_fn"], modules["dropout"]
        activation = activation.forward if checked else activation
        activated = dropout(activation_dropout, activation(linear(up, hidden_states, checked)))
        return linear(down, activated, checked)


def make_mlp(config) -> nn.Module:
    """The MLP the config's `mlp_type` names (gated by default)."""
    if getattr(config, "mlp_type", "gated") == "plain":
        return PlainMLP(
            config.hidden_size, config.intermediate_size, config.hidden_act, config.mlp_bias,
            config.activation_dropout,
        )  # fmt: skip
    return GatedMLP(
        config.hidden_size, config.intermediate_size, config.hidden_act, getattr(config, "mlp_bias", False)
    )


def sublayer_input(hidden_states: torch.Tensor, norm: nn.Module, norm_position: str) -> torch.Tensor:
    """What a block's sublayer (mixer or MLP) reads: the normed residual stream (pre-norm) or the stream itself."""
    return norm(hidden_states) if norm_position == "pre" else hidden_states


def add_sublayer_output(hidden_states, output, norm: nn.Module, norm_position: str) -> torch.Tensor:
    """The residual sum after a sublayer: x + f(·) (pre-norm) or norm(x + f(x)) (post-norm)."""
    hidden_states = hidden_states + output
    return norm(hidden_states) if norm_position == "post" else hidden_states


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (Su et al., 2021) by absolute position."""

    def __init__(self, head_dim: int, rope_theta: float):
        super().__init__()
        self.head_dim = head_dim
        self.rope_theta = rope_theta
        self.register_buffer("inv_freq", self.compute_inverse_frequencies(), persistent=False)

    def compute_inverse_frequencies(self) -> torch.Tensor:
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim
        return 1.0 / (self.rope_theta**exponents)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (B, T) → cos, sin (B, 1, T, head_dim) in float32, to rotate (B, H, T, head_dim) states."""
        angles = positions[..., None].float() * self.inv_freq.float()
        angles = torch.cat([angles, angles], dim=-1)[:, None]
        return angles.cos(), angles.sin()


def apply_rotary(states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """states (…, d) rotated by cos and sin (float32), computed in float32 or wider."""
    half = states.shape[-1] // 2
    rotated = torch.cat([-states[..., half:], states[..., :half]], dim=-1)
    if states.dtype in WIDE:  # no conversion call (decoding calls this twice per layer and token)
        return states * cos + rotated * sin
    return (states.float() * cos + rotated.float() * sin).to(states.dtype)


class PaddedPositions:
    """A learned relative positions' table (P, d) as a decoding step reads it (`padded_position_table`:
    [0; p_1..p_P; 0] in a dtype), without gradient, kept by the module that holds the weight and padded again only when
    the weight changed (written in place, replaced, moved) or the dtype is another, not copied whole at every step. A
    copy or a pickle of the module keeps none of it (padded again at the next step)."""

    def __init__(self):
        self.table = self.source = None

    def __reduce__(self):
        return (PaddedPositions, ())

    def of(self, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The padded table of `weight` in `dtype`. A weight that is not a plain tensor (sharded, quantized), or one
        read while compiling, is padded at every call."""
        if torch.compiler.is_compiling() or not plain_tensor(weight):
            return padded_position_table(weight.detach(), dtype)
        state = (weight._version, weight.data_ptr(), weight.device, dtype)
        source = self.source
        if source is None or source[0] is not weight or source[1:] != state:
            self.table = padded_position_table(weight.detach(), dtype)
            self.source = (weight, *state)  # (the weight held: its identity cannot pass to another)
        return self.table


class LearnedRelativePositions(nn.Module):
    """The learned, query-dependent relative positions of the official Feedback Transformer and Expire-Span code
    (facebookresearch/transformer-sequential, `key_pe`; Sukhbaatar et al., 2019, "Adaptive Attention Span", Sec. 3):
    one vector p_d per distance d = t − i in 1..num_positions, shared by the layers, adding q_t · p_d to the score of
    key i. Keys at other distances (the token itself, farther ones) get no position term."""

    def __init__(self, num_positions: int, head_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_positions, head_dim))  # row d − 1 is p_d
        self._padded = PaddedPositions()

    def forward(self, query: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        """query (B, H, T, d), positions (B, T) and (B, N) → the scores q_t · p_{t−i}, (B, H, T, N)."""
        distance = query_positions[:, None, :, None] - key_positions[:, None, None, :]  # (B, 1, T, N)
        return relative_position_scores(self.weight, query, distance)

    def padded(self, dtype: torch.dtype) -> torch.Tensor:
        """The table as a decoding step reads it (`PaddedPositions`)."""
        return self._padded.of(own_parameter(self, "weight"), dtype)
