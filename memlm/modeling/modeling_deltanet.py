"""DeltaNet: a causal language model whose token mixer is a fast-weight memory written with the delta rule.

Schlag, Irie & Schmidhuber (ICML 2021), "Linear Transformers Are Secretly Fast Weight Programmers". Per head and
step t, with the fast-weight matrix S_t (d_k × d_v), SPEC §1 / paper Eqs. 23-25:

    k_t = φ(W_k x_t),  q_t = φ(W_q x_t),  v_t = W_v x_t,  β_t = σ(w_β · x_t)
    S_t = S_{t-1} + β_t k_t (v_t − S_{t-1}ᵀ k_t)ᵀ,       o_t = S_tᵀ q_t

The file reads top to bottom: small blocks (short convolution, feature map; norm and MLP in layers.py) → the fast-weight attention
→ the decoder layer → the cache (`cache`) → PreTrainedModel → DeltaNetModel → DeltaNetForCausalLM.
"""

import dataclasses
import math
from dataclasses import dataclass

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
from ..configuration.configuration_deltanet import DeltaNetConfig
from ..export import RemoteCodeMixin
from ..kernels import describe_backend, in_dtype, plain_weights, resolve_backend
from ..kernels.delta_rule import delta_rule, sum_rule
from ..kernels.delta_rule.chunk import delta_rule_step, sum_rule_step
from ..kernels.delta_rule.feature_map import dpfp
from ..kernels.delta_rule.hub_function import chunk_gated_delta_rule, swapped_kernel
from ..kernels.delta_rule.packing import PaddingPacker
from ..kernels.hub import HubKernelsMixin, HubLayerMixin, use_kernel_forward_from_hub, use_kernelized_func
from .layers import (
    KEEP_IN_FLOAT32,
    WIDE,
    RMSNorm,
    add_sublayer_output,
    compile_region,
    dropout,
    linear,
    make_mlp,
    make_norm,
    runs_as_defined,
    small_projection,
    sublayer_input,
)
from .memory import (
    CountsOwnPositions,
    MemoryCache,
    Rollback,
    StaticMemoryCacheLayer,
    causal_lm_loss,
    check_extra_kwargs,
    check_fits_in_memory,
    current_padding_mask,
    document_starts,
    embed_inputs,
    keeps_non_finite_in_place,
    past_length_to_check,
    writes_in_place,
    zero_padding,
)

logger = logging.get_logger(__name__)

# Epsilons of the key/query normalisations; l2 matches flash-linear-attention's l2norm (x / sqrt(Σx² + eps)).
L2_NORM_EPS = 1e-6
SUM_NORM_EPS = 1e-6
# From this many tokens in a call (batch × length) the q/k/v projections run as one product over their weights side by
# side; below it (decoding) as three, since copying the weights together would cost more than the products.
FUSED_PROJECTION_TOKENS = 64


class DeltaNetShortConvolution(nn.Module):
    """Causal depthwise convolution over time (kernel `convolution_size`), applied to the concatenated query, key and
    value projections. It keeps the last `convolution_size - 1` inputs as its state, so decoding a token costs O(1)."""

    def __init__(self, channels: int, kernel_size: int):
        super().__init__()
        self.kernel_size = kernel_size
        # Same layout as a depthwise nn.Conv1d: (channels, 1, kernel); weight[:, 0, -1] multiplies the current input.
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))

    def forward(
        self,
        inputs: torch.Tensor,
        tail: torch.Tensor | None,
        lengths: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """inputs (B, T, C), tail (B, kernel-1, C) or None (zeros) → outputs (B, T, C), new tail (B, kernel-1, C).

        lengths (B,): rows hold their real tokens first and padding after; each new tail ends at its row's last real
        input. cu_seqlens (S + 1,): inputs (1, N, C) hold S sequences back to back, each behind its own tail (S, ...).
        """
        if cu_seqlens is not None:
            return self._forward_packed(inputs, tail, cu_seqlens)
        batch_size, _, channels = inputs.shape
        width = self.kernel_size - 1
        if tail is None:
            tail = inputs.new_zeros(batch_size, width, channels)
        window = torch.cat([in_dtype(tail, inputs.dtype), inputs], dim=1)
        if inputs.shape[1] == 1:
            # One token (decoding): its output is the window times the kernel, summed over time. A depthwise conv1d
            # call costs ten times these two ops on a CPU.
            outputs = torch.linalg.vecdot(window.transpose(1, 2), self.weight[:, 0])[:, None]
        else:
            outputs = F.conv1d(window.transpose(1, 2), self.weight, groups=channels).transpose(1, 2)
        if lengths is None:
            return outputs, window[:, -width:]
        # In `window` a row's last real input sits at width + length - 1, so its tail starts at `length`.
        positions = lengths[:, None] + torch.arange(width, device=inputs.device)
        return outputs, window.gather(1, positions[..., None].expand(-1, -1, channels))

    def _forward_packed(self, inputs, tail, cu_seqlens):
        _, total, channels = inputs.shape
        width = self.kernel_size - 1
        lengths = cu_seqlens.diff().long()
        count = lengths.numel()
        if tail is None:
            tail = inputs.new_zeros(count, width, channels)
        # One row [tail_0, x_0, tail_1, x_1, ...] to slide the kernel over: every real input's window stays inside
        # its own block, so sequences never see each other.
        blocks = lengths + width
        block_ends = blocks.cumsum(0)
        block_starts = block_ends - blocks
        block = torch.repeat_interleave(
            torch.arange(count, device=inputs.device), blocks, output_size=total + count * width
        )
        local = torch.arange(total + count * width, device=inputs.device) - block_starts[block]
        from_tail = local < width
        source = torch.where(
            from_tail, block * width + local, count * width + cu_seqlens.long()[block] + local - width
        )
        rows = torch.cat([tail.to(inputs.dtype).reshape(count * width, channels), inputs[0]])[source]
        slid = F.conv1d(rows.T[None], self.weight, groups=channels)[0].T  # window ending at row j + width
        # Token p of sequence s sits at row p + (s + 1)·width; its window ends there.
        token_sequence = torch.repeat_interleave(torch.arange(count, device=inputs.device), lengths, output_size=total)
        outputs = slid[torch.arange(total, device=inputs.device) + token_sequence * width]
        new_tail = rows[block_ends[:, None] - width + torch.arange(width, device=inputs.device)]
        return outputs[None], new_tail


class DeltaNetFeatureMap(nn.Module):
    """φ applied per head to keys and queries (SPEC §1), followed by the key/query normalisation."""

    def __init__(self, config: DeltaNetConfig):
        super().__init__()
        self.kind = config.feature_map
        self.nu = config.dpfp_nu
        self.normalization = config.query_key_normalization
        if self.kind == "favor+":
            # Performer's positive random features: one (m × d) projection per layer, shared by the heads, redrawn by
            # `redraw_projection` at every training forward, fixed in eval mode and saved with the weights.
            self.register_buffer("projection", torch.empty(config.favor_features, config.key_head_dim))

    @torch.no_grad()
    def redraw_projection(self):
        """Orthogonal random features (Choromanski et al., 2021, Sec. 2.4): Gaussian rows orthogonalised in blocks and
        rescaled to chi-distributed norms."""
        features, dim = self.projection.shape
        blocks = []
        for start in range(0, features, dim):
            gaussian = torch.randn(dim, dim, device=self.projection.device, dtype=torch.float32)
            orthogonal, _ = torch.linalg.qr(gaussian)
            blocks.append(orthogonal.T[: min(dim, features - start)])
        norms = torch.randn(features, dim, device=self.projection.device, dtype=torch.float32).norm(dim=1)
        init.copy_(self.projection, (torch.cat(blocks) * norms[:, None]).to(self.projection.dtype))

    def forward(self, hidden_states: torch.Tensor, activated: bool = False) -> torch.Tensor:
        """φ, then the normalisation; `activated`: hidden_states hold φ's SiLU features already (the attention applied
        SiLU to queries, keys and values in one op), only the normalisation is left."""
        if activated:
            return self.normalize(hidden_states)
        if self.kind == "dpfp":
            # Paper Eq. 37 and the normalisation as one operation with a hand-written backward (feature_map.py).
            eps = SUM_NORM_EPS if self.normalization == "sum" else L2_NORM_EPS
            return dpfp(hidden_states, self.nu, self.normalization, eps)
        if self.kind == "elu+1":
            features = F.elu(hidden_states) + 1
        elif self.kind == "silu":
            features = F.silu(hidden_states)
        elif self.kind == "identity":
            features = hidden_states
        else:  # favor+: φ(x) = exp(ωᵀx' − |x'|²/2) / sqrt(m) with x' = x · d^-1/4 (Performer, Eq. for FAVOR+).
            scaled = hidden_states.float() * hidden_states.shape[-1] ** -0.25
            exponent = scaled @ self.projection.float().T - scaled.pow(2).sum(-1, keepdim=True) / 2
            if self.normalization != "none":
                # Both normalisations divide out a positive per-vector factor, so subtracting the max is exact.
                exponent = exponent - exponent.amax(-1, keepdim=True).detach()
            features = (torch.exp(exponent) / math.sqrt(self.projection.shape[0])).to(hidden_states.dtype)
        return self.normalize(features)

    def normalize(self, features: torch.Tensor) -> torch.Tensor:
        """The key/query normalisation of φ's features (sum, L2 or none)."""
        if self.normalization == "sum":
            # Paper Sec. 4.2 (sum normalisation): φ(x) / Σ_j φ(x)_j.
            return features / features.sum(-1, keepdim=True).clamp_min(SUM_NORM_EPS)
        if self.normalization == "l2":
            wide = features if features.dtype in WIDE else features.float()  # float64 stays float64
            normed = wide * torch.rsqrt(wide.pow(2).sum(-1, keepdim=True) + L2_NORM_EPS)
            return in_dtype(normed, features.dtype)
        return features


def running_key_sums(
    key: torch.Tensor, initial: torch.Tensor | None, cu_seqlens: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """z_t = z_0 + Σ_{τ≤t} k_τ for keys (B, H, T, d_k) in float32 or wider, and the last z of each sequence (B, H, d_k).
    With cu_seqlens, key (1, H, N, d_k) holds S sequences back to back, each with its own z_0 (S, H, d_k)."""
    sums = key.to(torch.promote_types(key.dtype, torch.float32)).cumsum(2)
    if cu_seqlens is None:
        if initial is not None:
            sums = sums + initial[:, :, None].to(sums.dtype)
        return sums, sums[:, :, -1]
    lengths = cu_seqlens.diff().long()
    sequence = torch.repeat_interleave(torch.arange(lengths.numel(), device=key.device), lengths)
    before = F.pad(sums, (0, 0, 1, 0))[:, :, cu_seqlens[:-1].long()]  # the running sum before each sequence starts
    sums = sums - before[:, :, sequence]
    if initial is not None:
        sums = sums + initial.transpose(0, 1)[None, :, sequence].to(sums.dtype)
    last = sums[0, :, (cu_seqlens[1:].long() - 1).clamp_min(0)].transpose(0, 1)
    # A sequence without tokens (a row all padding) keeps its z_0, not the sum of the sequence before it.
    empty = (lengths == 0)[:, None, None]
    kept = initial.to(sums.dtype) if initial is not None else torch.zeros((), dtype=sums.dtype, device=sums.device)
    return sums, torch.where(empty, kept, last)


@use_kernel_forward_from_hub("DeltaNetAttention")
@use_kernelized_func(chunk_gated_delta_rule)  # 🤗's name for the gated delta rule: a Hub FLA kernel can take the rule
class DeltaNetAttention(HubLayerMixin, nn.Module):
    """The fast-weight memory of one layer: projections → short convolution → φ and normalisation → delta (or sum)
    rule → per-head output norm and gate → output projection."""

    def __init__(self, config: DeltaNetConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.key_head_dim = config.key_head_dim
        self.value_head_dim = config.value_head_dim
        self.feature_dim = config.feature_dim
        # The options read at every forward, as plain attributes: a config's attribute read costs ~1.6 µs (🤗's
        # `__getattribute__`), tens of µs in a decoding step whose caches the weights have just flushed.
        self.update_rule = config.update_rule
        self.value_activation = config.value_activation
        self.scale_queries = config.scale_queries
        self.scale_output = config.scale_output
        self.attention_normalizer = config.attention_normalizer
        self.attention_normalizer_eps = config.attention_normalizer_eps
        key_width = self.num_heads * self.key_head_dim
        value_width = self.num_heads * self.value_head_dim

        self.q_proj = nn.Linear(config.hidden_size, key_width, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, key_width, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, value_width, bias=False)
        self.beta_proj = nn.Linear(config.hidden_size, self.num_heads, bias=False) if config.use_beta else None
        self.convolution = (
            DeltaNetShortConvolution(2 * key_width + value_width, config.convolution_size)
            if config.short_convolution
            else None
        )
        self.feature_map = DeltaNetFeatureMap(config)
        self.g_proj = nn.Linear(config.hidden_size, value_width, bias=False) if config.output_gate else None
        self.output_norm = RMSNorm(self.value_head_dim, config.rms_norm_eps) if config.output_norm else None
        self.o_proj = nn.Linear(value_width, config.hidden_size, bias=config.attention_output_bias)

    def extra_repr(self) -> str:
        """Which kernel runs this layer's rule for its weights' device and dtype (as `memlm info` says), and the
        kernel repository whose forward runs once `kernels.kernelize` swapped one in."""
        operation = "delta_rule" if self.config.update_rule == "delta" else "sum_rule"
        weight = self.o_proj.weight
        try:
            text = f"kernels={describe_backend(operation, weight.device, weight.dtype)!r}"
        except ValueError as error:  # e.g. an unknown MEMLM_KERNELS: the repr says so instead of failing
            text = f"kernels=<{error}>"
        return ", ".join(part for part in (text, super().extra_repr()) if part)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        fast_weights: torch.Tensor | None = None,
        convolution_tail: torch.Tensor | None = None,
        return_state: bool = False,
        cu_seqlens: torch.Tensor | None = None,
        cu_seqlens_cpu: list[int] | None = None,
        key_sum: torch.Tensor | None = None,
        return_writes: bool = False,
        state_in_place: bool = False,
        rule_step: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, tuple | None]:
        """hidden_states (B, T, D); attention_mask (B, T), 1 for each row's real tokens, which come first, and 0 for
        the padding after them, which writes nothing into the memory; fast_weights (B, H, d_k, d_v[+1]) float32,
        convolution_tail (B, kernel-1, C) and key_sum (B, H, d_k), the delta rule's attention normaliser z, carried
        from earlier tokens; returns the output and the three states after the input. With cu_seqlens (S + 1 offsets),
        hidden_states (1, N, D) hold S sequences back to back (`PaddingPacker`) and nothing is padded; cu_seqlens_cpu
        is the same offsets on the host, so that the kernels read nothing back from the device. `return_writes`
        (a cache recording its past): also return what the input wrote, the short convolution's inputs and the keys,
        values and β as the rule took them (see `DeltaNetWrites`); else None in its place. `state_in_place`: the
        rule may write the new fast weights into `fast_weights` and return them (a decoding cache's own tensor)."""
        batch_size, length, _ = hidden_states.shape
        key_width = self.num_heads * self.key_head_dim
        projections = (self.q_proj, self.k_proj, self.v_proj)
        if (
            # (an exported graph takes any batch size: its choice may not depend on one)
            (torch.compiler.is_exporting() or batch_size * length >= FUSED_PROJECTION_TOKENS)
            and all(
                type(projection) is nn.Linear and projection.bias is None and runs_as_defined(projection)
                for projection in projections
            )
            and plain_weights(*projections)
        ):
            # The three projections as one matrix product (their weights side by side): one pass over the activations
            # and no concatenation of (B, T, ·) outputs, forward or backward. Not for a few tokens (decoding), where
            # copying the weights side by side costs more than the products.
            projected = F.linear(hidden_states, torch.cat([projection.weight for projection in projections]))
        else:  # a few tokens, an adapter (e.g. LoRA), a quantised layer or weight, a hook: each module runs as it is
            projected = torch.cat([linear(projection, hidden_states) for projection in projections], dim=-1)
        keep = lengths = None
        if attention_mask is not None:
            keep = attention_mask[:, :, None].bool()
            lengths = attention_mask.sum(1)
            projected = projected.masked_fill(~keep, 0.0)  # padding enters neither the convolution nor the memory
        convolution_inputs = projected if self.convolution is not None else None
        new_tail = None
        if self.convolution is not None:
            projected, new_tail = self.convolution(projected, convolution_tail, lengths, cu_seqlens)
        # SiLU features and SiLU values (the fla layout) when decoding: one op over queries, keys and values (longer
        # inputs keep to the parts' own calls, each output half the size; see below).
        activated = length == 1 and self.feature_map.kind == "silu" and self.value_activation == "silu"
        if activated:
            projected = F.silu(projected)
        query_key, value = projected.split_with_sizes([2 * key_width, projected.shape[-1] - 2 * key_width], dim=-1)

        # φ acts on each head's vector alone: one call for queries and keys (2H heads) when decoding, where the op
        # count matters; two calls for longer inputs, where each call's tensors are half the size, which keeps them
        # below glibc's 32 MiB mmap threshold for longer (at B·T = 8192 and 4 heads of DPFP width 128, one call's are
        # exactly 32 MiB, and every such allocation is fresh pages, faulted in and zeroed: about 20 ms per layer of a
        # training step on a 2-core machine).
        heads = query_key.view(batch_size, length, 2 * self.num_heads, -1).transpose(1, 2)
        if length == 1:
            query, key = self.feature_map(heads, activated).chunk(2, dim=1)
        else:
            query, key = (self.feature_map(part, activated) for part in heads.split(self.num_heads, dim=1))
        value = value.view(batch_size, length, self.num_heads, -1).transpose(1, 2)
        if self.value_activation == "silu" and not activated:
            value = F.silu(value)
        if keep is not None:
            key = torch.where(keep[:, None], key, torch.zeros((), dtype=key.dtype, device=key.device))
        if self.scale_queries:
            query = query * self.feature_dim**-0.5
        beta = None
        if self.beta_proj is not None:
            # σ in float32 or wider (float64 stays float64).
            logits = small_projection(self.beta_proj, hidden_states)
            beta = torch.sigmoid(logits if logits.dtype in WIDE else logits.float()).transpose(1, 2)
            beta = in_dtype(beta, value.dtype)

        new_key_sum = None
        # A decoding step that updates the cache's fast weights where they lie, on PyTorch's backend: the rule's step
        # itself, as `delta_rule`/`sum_rule` would run it, without their checks of user inputs and backend choice
        # (more time than the step's arithmetic on a CPU); the model built these inputs.
        direct = rule_step and state_in_place and length == 1 and cu_seqlens is None and swapped_kernel(self) is None
        if self.update_rule == "delta":
            writes = (convolution_inputs, key, value, beta) if return_writes else None
            if direct:
                output, new_state = delta_rule_step(query, key, value, beta, fast_weights, return_state, in_place=True)
            else:
                output, new_state = delta_rule(
                    query, key, value, beta, initial_state=fast_weights, output_final_state=return_state,
                    chunk_size=self.config.chunk_size, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                    hub_kernel=swapped_kernel(self), in_place=state_in_place,
                )  # fmt: skip
            if self.attention_normalizer:
                # Paper Eqs. 26-28 on the output only (the official attn_type 24/26): o_t / (z_tᵀq_t + eps).
                key_sums, new_key_sum = running_key_sums(key, key_sum, cu_seqlens)
                denominator = (query.to(key_sums.dtype) * key_sums).sum(-1, keepdim=True)
                output = output / (denominator + self.attention_normalizer_eps).to(output.dtype)
        else:
            if beta is not None:
                key = key * beta[..., None]  # with the sum rule, β scales each write
            if self.attention_normalizer:
                # Appending a constant 1 to the values makes the last column of S the normaliser z_t = Σ k_τ.
                value = torch.cat([value, value.new_ones(*value.shape[:-1], 1)], dim=-1)
            writes = (convolution_inputs, key, value, None) if return_writes else None
            if direct:
                output, new_state = sum_rule_step(query, key, value, fast_weights, return_state, in_place=True)
            else:
                output, new_state = sum_rule(
                    query, key, value, initial_state=fast_weights, output_final_state=return_state,
                    chunk_size=self.config.chunk_size, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                    in_place=state_in_place,
                )  # fmt: skip
            if self.attention_normalizer:
                output = output[..., :-1] / (output[..., -1:] + self.attention_normalizer_eps)

        output = output.transpose(1, 2)  # (B, T, H, d_v)
        if self.output_norm is not None:
            output = self.output_norm(output)
        if self.g_proj is not None:
            gate = linear(self.g_proj, hidden_states).view(batch_size, length, self.num_heads, self.value_head_dim)
            output = output * F.silu(gate)
        if self.scale_output:
            output = output * self.key_head_dim**-0.5  # the official code's `self.scale`
        output = linear(self.o_proj, output.reshape(batch_size, length, -1))
        return output, new_state, new_tail, new_key_sum, writes

    @staticmethod
    def runs_rule_step(device) -> bool:
        """Whether the rule runs PyTorch's one-token step on `device` (no autocast, the "torch" backend) in a layer
        without a hub kernel, so that a decoding step may call it itself (`rule_step`)."""
        return not torch.is_autocast_enabled(device.type) and resolve_backend(None, device, "delta_rule") == "torch"


class DeltaNetDecoderLayer(GradientCheckpointingLayer):
    """x = x + attention(norm(x)); x = x + mlp(norm(x)) (pre-norm), or x = norm(x + attention(x));
    x = norm(x + mlp(x)) (post-norm, the official code's default). The memory enters and leaves as tensors (not
    through the cache object), so gradient checkpointing recomputes the layer from the same state, and `torch.compile`
    compiles the layer once for all layers (`compile_region`)."""

    def __init__(self, config: DeltaNetConfig, layer_idx: int):
        super().__init__()
        self.norm_position = config.norm_position
        self.input_layernorm = make_norm(config)
        self.attention = DeltaNetAttention(config, layer_idx)
        self.post_attention_layernorm = make_norm(config)
        self.mlp = make_mlp(config)
        self.dropout = nn.Dropout(config.hidden_dropout)

    @compile_region
    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        fast_weights: torch.Tensor | None = None,
        convolution_tail: torch.Tensor | None = None,
        return_state: bool = False,
        cu_seqlens: torch.Tensor | None = None,
        cu_seqlens_cpu: list[int] | None = None,
        key_sum: torch.Tensor | None = None,
        return_writes: bool = False,
        state_in_place: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, tuple | None]:
        mixed, fast_weights, convolution_tail, key_sum, writes = self.attention(
            sublayer_input(hidden_states, self.input_layernorm, self.norm_position), attention_mask, fast_weights,
            convolution_tail, return_state, cu_seqlens, cu_seqlens_cpu, key_sum, return_writes, state_in_place,
        )  # fmt: skip
        hidden_states = add_sublayer_output(
            hidden_states, dropout(self.dropout, mixed), self.input_layernorm, self.norm_position
        )
        mlp_output = self.mlp(sublayer_input(hidden_states, self.post_attention_layernorm, self.norm_position))
        hidden_states = add_sublayer_output(
            hidden_states, dropout(self.dropout, mlp_output), self.post_attention_layernorm, self.norm_position
        )
        return hidden_states, fast_weights, convolution_tail, key_sum, writes

    def step(self, hidden_states: torch.Tensor, cache_layer: "DeltaNetCacheLayer", rule_step: bool) -> torch.Tensor:
        """A decoding step (`DeltaNetModel.steps_one_token`: one real token per row, no gradients, evaluation, a cache
        that does not record): the forward's output, the cache layer's states updated (the fast weights where they
        lie). The attention's forward is called without its module call, and the layer's body runs here, unless a
        hook or a kernel would see the layer or the attention run (`runs_as_defined`): then the layer's forward.
        `rule_step`: `DeltaNetAttention.runs_rule_step`, read once for all layers."""
        state_in_place = writes_in_place(cache_layer.fast_weights, cache_layer.fast_weights)
        states = (cache_layer.fast_weights, cache_layer.convolution_tail, True, None, None, cache_layer.key_sum)
        if not runs_as_defined(self, self.attention):
            hidden_states, fast_weights, convolution_tail, key_sum, _ = self(
                hidden_states, None, *states, False, state_in_place
            )
        else:
            mixed, fast_weights, convolution_tail, key_sum, _ = self.attention.forward(
                sublayer_input(hidden_states, self.input_layernorm, self.norm_position), None, *states, False,
                state_in_place, rule_step,
            )  # fmt: skip
            hidden_states = add_sublayer_output(hidden_states, mixed, self.input_layernorm, self.norm_position)
            mlp_output = self.mlp(sublayer_input(hidden_states, self.post_attention_layernorm, self.norm_position))
            hidden_states = add_sublayer_output(
                hidden_states, mlp_output, self.post_attention_layernorm, self.norm_position
            )
        cache_layer.update(fast_weights, convolution_tail, 1, key_sum)
        return hidden_states


class AdaptiveLogSoftmaxHead(nn.Module):
    """The adaptive softmax output of Grave et al. (2017) as Transformer-XL builds it (one shared output matrix,
    `div_val` 1, as the official DeltaNet WikiText-103 scripts train it): a head over the shortlist `[0, c_1)` and one
    logit per tail cluster, and per cluster `[c_i, c_{i+1})` a softmax over its rows of the same output matrix;
    log p(v) = log p_head(cluster of v) + log p_cluster(v). Returns the full (…, V) log-probabilities, which 🤗's
    `generate`, losses and samplers take as logits (a log-softmax of log-probabilities is themselves)."""

    def __init__(self, hidden_size: int, vocab_size: int, cutoffs: list[int], bias: bool):
        super().__init__()
        self.cutoffs = list(cutoffs)
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))  # tied to the embedding when configured
        self.bias = nn.Parameter(torch.zeros(vocab_size)) if bias else None
        self.cluster_weight = nn.Parameter(torch.zeros(len(cutoffs), hidden_size))
        self.cluster_bias = nn.Parameter(torch.zeros(len(cutoffs)))

    def extra_repr(self) -> str:
        return f"vocab_size={self.weight.shape[0]}, cutoffs={self.cutoffs}"

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        clusters = len(self.cutoffs)
        bounds = [*self.cutoffs, self.weight.shape[0]]
        bias = self.bias if self.bias is not None else self.weight.new_zeros(self.weight.shape[0])
        dtype = torch.promote_types(hidden_states.dtype, torch.float32)
        head_weight = torch.cat([self.weight[: bounds[0]], self.cluster_weight])
        head_bias = torch.cat([bias[: bounds[0]], self.cluster_bias])
        head = F.linear(hidden_states, head_weight, head_bias).to(dtype).log_softmax(-1)
        parts = [head[..., : bounds[0]]]
        for index in range(1, clusters + 1):
            start, end = bounds[index - 1], bounds[index]
            tail = F.linear(hidden_states, self.weight[start:end], bias[start:end]).to(dtype).log_softmax(-1)
            # Cluster i's logit is the head's i-th column from the end (Transformer-XL's `head_logprob[:, -i]`).
            column = bounds[0] + clusters - index
            parts.append(head[..., column : column + 1] + tail)
        return torch.cat(parts, dim=-1).to(hidden_states.dtype)


@dataclass
class DeltaNetWrites:
    """What one forward wrote into a layer's memory, kept while its cache records its past (speculative decoding), so
    that `crop` rebuilds the memory after any prefix of the forward's tokens without the model: the short convolution's
    inputs (B, T, C) (None without it), and the keys (B, H, T, d_k), values (B, H, T, d_v) and β (B, H, T) (None: β = 1)
    as the rule took them, each row's real tokens first and its padding (zero keys, which write nothing) after them.
    T·(2·d_k + d_v) numbers per head instead of a d_k × d_v state per token; a cut inside the forward replays only the
    kept tokens, with the kernel the forward ran."""

    inputs: torch.Tensor | None
    key: torch.Tensor
    value: torch.Tensor
    beta: torch.Tensor | None
    update_rule: str
    chunk_size: int
    sums_keys: bool  # the delta rule's attention normaliser z is carried too
    convolution_width: int  # how many inputs the convolution's tail keeps (kernel − 1)
    hub_kernel: object = None

    def in_rows(self, padding: PaddingPacker | None) -> "DeltaNetWrites":
        """The writes of a packed forward (one row of sequences back to back) as rows, real tokens first."""
        if padding is None or padding.cu_seqlens is None:
            return self
        key, value = padding.as_rows(self.key, 2), padding.as_rows(self.value, 2)
        beta = None if self.beta is None else padding.as_rows(self.beta, 2)
        inputs = None if self.inputs is None else padding.as_rows(self.inputs, 1)
        return dataclasses.replace(self, inputs=inputs, key=key, value=value, beta=beta)

    def states_after(self, kept: int, real: torch.Tensor | None, fast_weights, convolution_tail, key_sum):
        """The fast weights, convolution tail and key sum after the forward's first `kept` tokens (in the caller's
        order), of which `real` (B,) are real in each row (None: all), from those before the forward."""
        key, value = self.key[:, :, :kept], self.value[:, :, :kept]
        beta = None if self.beta is None else self.beta[:, :, :kept]
        if real is not None:  # a row's tokens past its kept real ones are rolled back: they write nothing
            written = torch.arange(kept, device=key.device) < real.to(key.device)[:, None]
            key = torch.where(written[:, None, :, None], key, torch.zeros((), dtype=key.dtype, device=key.device))
        if self.update_rule == "delta":
            _, fast_weights = delta_rule(
                key, key, value, beta, initial_state=fast_weights, output_final_state=True,
                chunk_size=self.chunk_size, hub_kernel=self.hub_kernel,
            )  # fmt: skip
        else:
            _, fast_weights = sum_rule(
                key, key, value, initial_state=fast_weights, output_final_state=True, chunk_size=self.chunk_size
            )
        if self.sums_keys:
            _, key_sum = running_key_sums(key, key_sum, None)
        if self.inputs is not None:  # the tail ends at each row's last kept real input, as the convolution's does
            inputs = self.inputs[:, :kept]
            batch_size, _, channels = inputs.shape
            width = self.convolution_width
            if convolution_tail is None:
                convolution_tail = inputs.new_zeros(batch_size, width, channels)
            window = torch.cat([convolution_tail.to(inputs.dtype), inputs], dim=1)
            ends = torch.full((batch_size,), kept, device=inputs.device) if real is None else real.to(inputs.device)
            positions = ends[:, None] + torch.arange(width, device=inputs.device)
            convolution_tail = window.gather(1, positions[..., None].expand(-1, -1, channels))
        return fast_weights, convolution_tail, key_sum


class DeltaNetCacheLayer(StaticMemoryCacheLayer):
    """The memory of one layer: fast weights S (B, H, d_k, d_v) in float32, the short convolution's last inputs
    (B, kernel-1, C), the delta rule's attention normaliser z (B, H, d_k), and the number of tokens seen. Its size is
    fixed, so a compiled decoding step captures it (`StaticMemoryCacheLayer`). While the cache records its past, each
    forward keeps the states before it (then replaced, never written in place) and its writes (`DeltaNetWrites`), from
    which `roll_back` replays the kept tokens."""

    tensor_names = ("fast_weights", "convolution_tail", "key_sum")

    def __repr__(self):
        shape = None if self.fast_weights is None else tuple(self.fast_weights.shape)
        return f"DeltaNetCacheLayer(fast_weights={shape}, seen_tokens={self.seen_tokens})"

    @property
    def batch_size(self) -> int:
        return -1 if self.fast_weights is None else self.fast_weights.shape[0]

    def update(
        self,
        fast_weights: torch.Tensor | None,
        convolution_tail: torch.Tensor | None,
        num_tokens: int,
        key_sum: torch.Tensor | None = None,
        writes: DeltaNetWrites | None = None,
    ):
        if self.record_past:
            self.recorded.append((self.fast_weights, self.convolution_tail, self.key_sum, writes))
        # Written in place without autograd and without a recording; else replaced (a gradient-checkpointed layer
        # recomputes from the states it was given, a recording keeps the states before each forward). The tail, a slice
        # of the whole input's projection, is stored as a copy either way (`store`).
        self.store("fast_weights", fast_weights)
        self.store("key_sum", key_sum)
        self.store("convolution_tail", convolution_tail)
        self.count_tokens(num_tokens)

    def roll_back(self, rollback: Rollback):
        """The states before the forward the cut falls in, then its kept tokens replayed (none at a forward's start)."""
        if not rollback.removes_tokens:
            return
        fast_weights, convolution_tail, key_sum, writes = self.recorded[rollback.forward]
        if rollback.kept:
            real = rollback.forwards[rollback.forward].real_tokens(rollback.kept)
            fast_weights, convolution_tail, key_sum = writes.states_after(
                rollback.kept, real, fast_weights, convolution_tail, key_sum
            )
        self.fast_weights, self.convolution_tail, self.key_sum = fast_weights, convolution_tail, key_sum


class DeltaNetCache(MemoryCache):
    """The cache of DeltaNet: per layer the fast weights, the short-convolution tail and the step count.
    Memory is O(1) in the context length. Supports beam search (`reorder_cache`), `num_return_sequences`
    (`batch_repeat_interleave`) and batch selection (`batch_select_indices`)."""

    layer_class = DeltaNetCacheLayer


class DeltaNetPreTrainedModel(HubKernelsMixin, RemoteCodeMixin, PreTrainedModel):
    config: DeltaNetConfig
    config_class = DeltaNetConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DeltaNetDecoderLayer"]
    _keep_in_fp32_modules = KEEP_IN_FLOAT32
    _skip_keys_device_placement = list(CACHE_NAMES)
    # A decoding step compiles to one graph over a memory of fixed size (with the PyTorch kernels, which CPUs run:
    # tests/modeling/test_compile.py).
    _can_compile_fullgraph = True
    _supports_sdpa = False
    _supports_flash_attn = False
    # The memory rolls back (`DeltaNetCache.crop`), so 🤗's assisted and prompt-lookup decoding run.
    _is_stateful = False
    hub_card_template = "deltanet.md"

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # `generate` must not build a DynamicCache: the model creates its own DeltaNetCache on the first forward.
        return False

    @torch.no_grad()
    def _init_weights(self, module: nn.Module):
        super()._init_weights(module)
        if isinstance(module, DeltaNetShortConvolution):
            # nn.Conv1d's default: uniform in ±1/sqrt(fan_in) with fan_in = kernel size for a depthwise convolution.
            bound = 1 / math.sqrt(module.kernel_size)
            init.uniform_(module.weight, -bound, bound)
        elif isinstance(module, DeltaNetFeatureMap) and module.kind == "favor+":
            module.redraw_projection()
        elif isinstance(module, AdaptiveLogSoftmaxHead):
            init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
            if module.bias is not None:
                init.zeros_(module.bias)
            init.zeros_(module.cluster_weight)  # as Transformer-XL's ProjectedAdaptiveLogSoftmax
            init.zeros_(module.cluster_bias)


class DeltaNetModel(DeltaNetPreTrainedModel):
    def __init__(self, config: DeltaNetConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        check_fits_in_memory(config, self.embed_tokens.weight)  # before the layers are built
        self.layers = nn.ModuleList(
            [DeltaNetDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = make_norm(config) if config.final_norm else nn.Identity()
        self.embedding_dropout = nn.Dropout(config.embedding_dropout)
        self.output_dropout = nn.Dropout(config.output_dropout)
        self.gradient_checkpointing = False
        self._last_positions = None  # (length, dtype, device, inference mode) and its `sinusoidal_positions`
        self.post_init()

    def sinusoidal_positions(self, length: int, like: torch.Tensor) -> torch.Tensor:
        """Transformer-XL's encoding of positions T-1, …, 0 (counting down to the call's last token): (T, D) with
        [sin(p·f), cos(p·f)], f = 1 / 10000^(2i/D), computed in float64 and cast to the embeddings' dtype. The last
        table is kept (eagerly): decoding steps all ask for T = 1, ten operations each time otherwise, whose sine
        and cosine go through a CPU's threaded kernels."""
        key = (length, like.dtype, like.device, torch.is_inference_mode_enabled())  # (inference mode: its own table)
        last = self._last_positions
        if last is not None and last[0] == key and not torch.compiler.is_compiling():
            return last[1]
        width = self.config.hidden_size
        inverse_frequencies = 1 / (10000 ** (torch.arange(0.0, width, 2.0, dtype=torch.float64) / width))
        positions = torch.arange(length - 1, -1, -1.0, dtype=torch.float64)
        angles = torch.outer(positions, inverse_frequencies)
        table = torch.cat([angles.sin(), angles.cos()], dim=-1).to(device=like.device, dtype=like.dtype)
        if not torch.compiler.is_compiling():
            self._last_positions = (key, table)
        return table

    def recorded_writes(self, attention: DeltaNetAttention, writes: tuple, padding) -> DeltaNetWrites:
        """A layer's writes (`DeltaNetAttention.forward(return_writes=True)`) as a recording cache keeps them."""
        config = self.config
        return DeltaNetWrites(
            *writes, update_rule=config.update_rule, chunk_size=config.chunk_size,
            sums_keys=config.update_rule == "delta" and config.attention_normalizer,
            convolution_width=config.convolution_size - 1, hub_kernel=swapped_kernel(attention),
        ).in_rows(padding)  # fmt: skip

    def packs_padding(self, attention_mask: torch.Tensor) -> bool:
        """Whether a padded batch runs packed (`cu_seqlens`): with the delta rule on the Triton or FLA backend, and when
        some token is real. The PyTorch backend masks instead, keeping all rows in one batched call (its packed path runs
        the sequences one at a time), and so does any backend under `torch.compile`: the packed layout's size is data."""
        return (
            self.config.update_rule == "delta"
            and not torch.compiler.is_compiling()
            and resolve_backend(None, attention_mask.device, operation="delta_rule") in ("triton", "fla")
            and bool(attention_mask.any())
        )

    @keeps_non_finite_in_place
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: DeltaNetCache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        past_key_values: DeltaNetCache | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast | tuple:
        r"""
        position_ids: DeltaNet has no positional encoding (the order is in the recurrence). Where they restart inside
            a row (documents packed back to back, as 🤗's DataCollatorWithFlattening builds them), each document
            starts from an empty memory; otherwise they are not used (🤗 `generate` passes them).
        cache: a `DeltaNetCache` carrying each layer's fast weights from earlier tokens (`past_key_values` is its
            name before 🤗 Transformers 5.24, still accepted).
        attention_mask: (B, T) or (B, past + T); positions with 0 are padding, anywhere in a row: they are skipped
            (see `PaddingPacker`), so each row's real tokens give what they give alone.
        """
        check_extra_kwargs(kwargs, type(self).__name__)
        cache = resolve_cache_argument(cache, past_key_values, type(self).__name__)
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        output_hidden_states = (
            output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        )
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        inputs_embeds = embed_inputs(input_ids, inputs_embeds, self.embed_tokens)
        batch_size, length = inputs_embeds.shape[:2]
        if self.config.embedding_scale != 1:
            inputs_embeds = inputs_embeds * self.config.embedding_scale  # Transformer-XL: √d
        if self.config.position_encoding == "sinusoidal":
            inputs_embeds = inputs_embeds + self.sinusoidal_positions(length, inputs_embeds)
        inputs_embeds = dropout(self.embedding_dropout, inputs_embeds)

        if cache is not None and not isinstance(cache, DeltaNetCache):
            raise TypeError(
                f"DeltaNet keeps its memory in a DeltaNetCache; got a cache of type "
                f"{type(cache).__name__}. Pass None (a cache is created) or the DeltaNetCache a previous "
                "call returned."
            )
        if use_cache and cache is None:
            cache = DeltaNetCache(self.config)
        if cache is not None:
            cache.check_against(self.config, batch_size)
        attention_mask = current_padding_mask(attention_mask, batch_size, length, past_length_to_check(cache))
        starts = document_starts(position_ids, attention_mask, batch_size, length, kwargs)
        if starts is not None and cache is not None and cache.get_seq_length() > 0:
            raise ValueError(
                "A row holds packed documents (position_ids restarting at 0, seq_idx or cu_seq_lens), which each "
                "start from an empty memory; they "
                f"cannot continue a cache that has seen {cache.get_seq_length()} tokens. Pass them without a cache."
            )
        recording = cache is not None and cache.recording
        if recording:
            if starts is not None:
                raise ValueError(
                    "A row holds packed documents (position_ids restarting at 0, seq_idx or cu_seq_lens); a cache that "
                    "records its past for rolling back (activate_past_recording) takes one sequence per row."
                )
            cache.record_forward(length, attention_mask)
        if self.steps_one_token(length, cache, recording, attention_mask, starts):
            return self.step(inputs_embeds, cache, use_cache, output_hidden_states, return_dict)
        padding = None
        # Whether a mask holds padding reads it, which torch.compile cannot trace: compiled, any mask runs the padded
        # path (with no padding it reorders nothing and masks nothing).
        if starts is not None or (
            attention_mask is not None and (torch.compiler.is_compiling() or not bool(attention_mask.all()))
        ):
            if attention_mask is None:
                attention_mask = torch.ones(batch_size, length, dtype=torch.bool, device=inputs_embeds.device)
            padding = PaddingPacker(attention_mask, self.packs_padding(attention_mask), starts)
            inputs_embeds = zero_padding(inputs_embeds, attention_mask)

        if self.training:
            for layer in self.layers:
                if layer.attention.feature_map.kind == "favor+":
                    # Redrawn here, outside the (possibly checkpointed) layers, so a recomputation sees the same draw.
                    layer.attention.feature_map.redraw_projection()

        hidden_states = inputs_embeds if padding is None else padding.gather(inputs_embeds)
        all_hidden_states = (inputs_embeds,) if output_hidden_states else None
        for layer_idx, decoder_layer in enumerate(self.layers):
            cache_layer = cache.layers[layer_idx] if cache is not None else None
            hidden_states, fast_weights, convolution_tail, key_sum, writes = decoder_layer(
                hidden_states,
                attention_mask=None if padding is None else padding.attention_mask,
                fast_weights=cache_layer.fast_weights if cache_layer is not None else None,
                convolution_tail=cache_layer.convolution_tail if cache_layer is not None else None,
                return_state=cache_layer is not None,
                cu_seqlens=None if padding is None else padding.cu_seqlens,
                cu_seqlens_cpu=None if padding is None else padding.cu_seqlens_cpu,
                key_sum=cache_layer.key_sum if cache_layer is not None else None,
                return_writes=recording,
                # Decoding in eager mode: the rule updates the cache's fast weights where they lie (no new state
                # to copy back); compiled, the cache copies them as any other state.
                state_in_place=cache_layer is not None
                and not recording
                and not torch.compiler.is_compiling()
                and writes_in_place(cache_layer.fast_weights, cache_layer.fast_weights),
            )
            if cache_layer is not None:
                if padding is not None:  # packed documents: a row keeps its last document's memory
                    fast_weights, convolution_tail, key_sum = (
                        padding.row_states(fast_weights),
                        padding.row_states(convolution_tail),
                        padding.row_states(key_sum),
                    )
                if writes is not None:
                    writes = self.recorded_writes(decoder_layer.attention, writes, padding)
                cache_layer.update(fast_weights, convolution_tail, length, key_sum, writes)
            if output_hidden_states:
                if padding is not None:
                    # The next layer runs on this very tensor (gathered back), so it lies on the path to the loss.
                    scattered = padding.scatter(hidden_states)
                    hidden_states = padding.gather(scattered)
                all_hidden_states += (hidden_states if padding is None else scattered,)

        hidden_states = dropout(self.output_dropout, self.norm(hidden_states))
        if padding is not None:
            hidden_states = padding.scatter(hidden_states)
        return self.output(hidden_states, cache if use_cache else None, all_hidden_states, return_dict)

    @staticmethod
    def output(hidden_states, cache, all_hidden_states, return_dict):
        """The forward's output: `hidden_states` after the final norm, also the last of `all_hidden_states` (the
        input and each layer's output, or None) as in 🤗 Llama."""
        if all_hidden_states is not None:
            all_hidden_states = all_hidden_states[:-1] + (hidden_states,)
        output = model_output(
            BaseModelOutputWithPast,
            last_hidden_state=hidden_states,
            **with_cache(cache),
            hidden_states=all_hidden_states,
        )
        return output if return_dict else output.to_tuple()

    def steps_one_token(self, length, cache, recording, attention_mask, starts) -> bool:
        """Whether this forward is a decoding step `step` computes: one real token per row, continuing a cache whose
        layers hold fast weights and that does not record, without gradients, in evaluation, eagerly."""
        if (
            length != 1 or cache is None or recording or starts is not None or self.training
            or torch.is_grad_enabled() or torch.compiler.is_compiling() or is_exporting()
        ):  # fmt: skip
            return False
        if any(layer.fast_weights is None for layer in cache.layers):
            return False
        return attention_mask is None or bool(attention_mask.all())

    def step(self, hidden_states, cache, use_cache, output_hidden_states, return_dict):
        """The forward of a decoding step (`steps_one_token`): each layer's `step`, without the forward's work for
        padding, packed documents and recording."""
        all_hidden_states = (hidden_states,) if output_hidden_states else None
        rule_step = DeltaNetAttention.runs_rule_step(hidden_states.device)
        for layer, cache_layer in zip(self.layers, cache.layers):
            hidden_states = layer.step(hidden_states, cache_layer, rule_step)
            if output_hidden_states:
                all_hidden_states += (hidden_states,)
        return self.output(self.norm(hidden_states), cache if use_cache else None, all_hidden_states, return_dict)


class DeltaNetForCausalLM(DeltaNetPreTrainedModel, CountsOwnPositions, GenerationMixin):
    cache_class = DeltaNetCache
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def draft_verification_problem(self) -> str | None:
        if self.config.position_encoding == "sinusoidal":
            return (
                "This DeltaNet has position_encoding='sinusoidal', whose positions count down within each forward "
                "call: verifying several drafted tokens in one forward gives other logits than decoding them one by "
                "one, so assisted and prompt-lookup decoding would not give plain decoding's tokens. Decode without "
                "assistant_model / prompt_lookup_num_tokens (such a model may still draft for another one)."
            )
        return None

    def __init__(self, config: DeltaNetConfig):
        super().__init__(config)
        self.model = DeltaNetModel(config)
        self.vocab_size = config.vocab_size
        if config.adaptive_softmax_cutoffs:
            self.lm_head = AdaptiveLogSoftmaxHead(
                config.hidden_size, config.vocab_size, config.adaptive_softmax_cutoffs, config.lm_head_bias
            )
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=config.lm_head_bias)
        self.post_init()

    def allocated_memory(self, batch_size: int = 1) -> DeltaNetCache:
        """The memory before any token with every tensor allocated, zero: fast weights, normaliser and convolution
        tail at their fixed sizes (`DeltaNetCacheLayer`), as a memory of explicit inputs needs them (an exported
        graph: `memlm.onnx_export`). A forward from it gives what a forward without a cache gives."""
        cache = DeltaNetCache(self.config)
        device = self.model.embed_tokens.weight.device
        probe = torch.zeros(batch_size, 1, dtype=torch.long, device=device)
        with torch.no_grad(), torch.random.fork_rng(devices=[]):  # (the shapes of one token's memory, then zeroed)
            self.model(input_ids=probe, cache=cache, use_cache=True)
        for layer in cache.layers:
            layer.map(torch.zeros_like)
            layer.seen_tokens = 0
        return cache

    def resize_token_embeddings(self, *args, **kwargs):
        if self.config.adaptive_softmax_cutoffs:
            raise ValueError(
                "This DeltaNet's output is an adaptive softmax with cutoffs "
                f"{self.config.adaptive_softmax_cutoffs}: its clusters are fixed ranges of the vocabulary, so its "
                "token embeddings cannot be resized."
            )
        return super().resize_token_embeddings(*args, **kwargs)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: DeltaNetCache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        past_key_values: DeltaNetCache | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast | tuple:
        r"""
        labels: (B, T) token ids; the loss is the next-token cross-entropy (labels are shifted inside), -100 ignored.
        logits_to_keep: an int keeps the last that many positions (0 keeps all); a tensor selects positions.

        Example:

        ```python
        >>> import memlm
        >>> from transformers import AutoModelForCausalLM
        >>> model = memlm.DeltaNetForCausalLM(memlm.DeltaNetConfig.from_preset("paper", vocab_size=256,
        ...     hidden_size=64, num_hidden_layers=2, num_attention_heads=2))
        >>> output = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=5, do_sample=False)
        ```"""
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        cache = resolve_cache_argument(cache, past_key_values, type(self).__name__)
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_hidden_states=output_hidden_states,
            return_dict=True,
            **kwargs,
        )
        hidden_states = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
        logits = self.lm_head(hidden_states)

        loss = causal_lm_loss(self, logits, labels, kwargs)

        output = model_output(
            CausalLMOutputWithPast,
            loss=loss,
            logits=logits,
            **with_cache(outputs.cache),
            hidden_states=outputs.hidden_states,
        )
        return output if return_dict else output.to_tuple()


__all__ = ["DeltaNetCache", "DeltaNetForCausalLM", "DeltaNetModel", "DeltaNetPreTrainedModel"]
