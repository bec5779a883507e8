"""Expire-Span configuration (Sukhbaatar et al., 2021: "Not All Memories are Created Equal: Learning to Forget by
Expiring"). Options follow SPEC §2; every field is validated when the config is built."""

import math

from transformers import PreTrainedConfig

from .block_layout import BlockLayout
from .validation import (
    check_bools,
    check_buildable_size,
    check_choice,
    check_number,
    check_positive_ints,
    check_token_ids,
    default_intermediate_size,
    is_positive_int,
    reject_misspelled_options,
)

HIDDEN_ACTIVATIONS = ("silu", "gelu", "gelu_new", "relu")
POSITION_ENCODINGS = ("rotary", "learned_relative")
INITIAL_MEMORIES = ("empty", "zeros")
SPAN_LOSS_FORMS = ("span", "remaining_span")


class ExpireSpanConfig(PreTrainedConfig, BlockLayout):
    r"""
    Configuration of an Expire-Span language model: a softmax-attention Transformer whose every memory h_i carries a
    learned lifetime (SPEC §2; Sukhbaatar et al., 2021, Eqs. 3-5):

        e_i  = L · σ(w · h_i / p + b)                  span predicted once per memory, shared by the heads (Eq. 3)
        m_ti = clamp(1 + (e_i − (t − i)) / R, 0, 1)    soft mask with ramp R (Eq. 5)
        a'_ti ∝ m_ti · softmax_i(s_ti)                  = softmax_i(s_ti + log m_ti) (Eq. 4)

    Memories with m = 0 can never come back and are deleted, so the memory follows the learned spans rather than the
    context length. Every field is checked when the config is built: a bad value raises `ValueError` naming the field
    and what is allowed.

    Args:
        vocab_size: number of tokens in the vocabulary.
        hidden_size: width of the residual stream.
        intermediate_size: width of the gated MLP; `None` (default) takes the multiple of 256 nearest above
            `hidden_size * 8 / 3`.
        num_hidden_layers: number of blocks.
        num_attention_heads: number of attention heads (they share each layer's spans).
        head_dim: width of each head's queries, keys and values; `None` (default) takes `hidden_size /
            num_attention_heads` (which must then divide). The official code sets it independently (`--head-dim`).
            Even with rotary positions.
        max_span: L, the longest a memory can live (in tokens).
        ramp: R > 0, the length of the soft mask's ramp; a memory is still read, with a weight falling from 1 to 0,
            for R tokens after its span.
        span_loss_coefficient: α of the auxiliary loss `α · Σ_i e_i / T` (paper Eq. 7, computed where the mask is on
            its ramp as in the paper's "Loss Computation"), added to the language-modelling loss in training.
        span_pre_divisor: p > 0, divides the span predictor's input h_i. The paper divides the predictor's logit by R
            for very long spans (Eq. 8); p = 1 (default) leaves the input as it is.
        initial_span_fraction: in (0, 1); the span predictor's bias starts at logit(fraction) and its weight at 0,
            so every memory starts with span fraction · L (paper: "small initial spans"; official code: 0.1).
        memory_shortening: the paper's regulariser: in training, per forward, draw l ~ U(0, L) and hide memories
            older than l. Never active in eval mode.
        noisy_spans: the official code's `--expire-span-noisy`: in training, per forward, draw u ~ U(0, 1) (one draw
            for all layers) and clamp the spans the mask and the span loss use at u · L (expired memories are still
            deleted by their own spans). Never active in eval mode.
        layer_drop: LayerDrop (Fan et al., 2020; the official `--expire-span-layerdrop`): in training each layer is
            skipped with this probability per forward: its memories are still made and pruned, but its output and its
            span loss are left out. 0 (default) keeps every layer.
        block_size: K; a long input is processed in blocks of K tokens, each attending causally to itself and to the
            memories of earlier blocks, with expired memories deleted before each block. A block larger than L + R is
            allowed: the tokens of one block then see each other only as far back as the spans allow, but the
            block's attention is still computed over all K × K pairs, so it costs more than the memory needs.
        expire_memories: True for Expire-Span; False turns expiration off: every memory is kept exactly L tokens (a
            fixed span, as in Transformer-XL) and the span predictor is unused.
        position_encoding: `"rotary"` (default): rotary embeddings on queries and keys by absolute position;
            `"learned_relative"`: the official code's learned, query-dependent relative positions: one vector p_d per
            distance d = t − i in 1..min(max_span, block_size), shared by the layers, adding q_t · p_d to the score
            of memory i (nothing beyond that distance).
        rope_theta: base of the rotary position embedding on queries and keys (absolute positions).
        attend_to_self: True (default): token t attends to memories i ≤ t; False: to i < t only, as the official
            code (its causal mask leaves out the diagonal).
        initial_memory: `"empty"` (default): a forward that starts without a cache has no memory; `"zeros"`: the
            official initial memory, min(max_span, block_size) zero hidden states at the positions just before the
            first token, attended like any memory (their keys, values and spans computed from those zeros).
        span_loss_form: `"span"` (default): the loss sums the span e_i over the (query, memory) pairs on the ramp,
            α Σ e_i / (R · T); `"remaining_span"`: the official code's value, α Σ (e_i − (t − i)) / (R · T) over
            the same pairs, negative where it lives (the remaining span is on the ramp); both have the same gradient.
        recompute_memory: False (default): the memory carries the keys, values and spans computed when each token
            came (detached; in training the spans are recomputed from the span predictor's inputs so they keep
            learning). True: it carries the layers' input hidden states (detached), and every block recomputes their
            keys, values and spans with the current weights, as Transformer-XL and the official Expire-Span code
            train: the norm, the projections and the span predictor get gradients through the memories, and nothing
            is stale after an update. Costs one more projection of every memory per block (and per decoded token),
            and the memory holds the hidden states beside the keys and values.
        renormalization_epsilon: ε >= 0 added to the denominator of the renormalised attention (Eq. 4):
            a'_ti = m_ti a_ti / (Σ_j m_tj a_tj + ε), with the softmax over the memories with m > 0; the official
            code uses 1e-8. 0 (default) is Eq. 4 exactly.
        hidden_dropout: dropout on each block's attention and MLP outputs before the residual sum.
        attention_dropout: dropout on the attention weights.
        hidden_act: activation of the MLP: `"silu"`, `"gelu"`, `"gelu_new"` or `"relu"`.
        rms_norm_eps: epsilon of every RMSNorm (with `norm_type="rmsnorm"`).
        initializer_range: standard deviation of the normal initialisation of linear and embedding weights.
        use_cache: return the memory (an `ExpireSpanCache`) as the output's `cache`.
        tie_word_embeddings: share the input embedding and the LM head.
        pad_token_id: id of the padding token, or `None`; must lie in `[0, vocab_size)`.
        bos_token_id: id of the beginning-of-text token, or `None`; must lie in `[0, vocab_size)`.
        eos_token_id: id (or list of ids) that ends generation, or `None`; each must lie in `[0, vocab_size)`.

    The block layout (norm type and position, MLP type and biases, output biases, embedding scale, dropouts) is
    `BlockLayout`'s fields, documented there; the defaults are memlm's layout (pre-norm RMSNorm, gated MLP).

    Example:
        >>> from memlm import ExpireSpanConfig
        >>> config = ExpireSpanConfig(vocab_size=258, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        ...                           max_span=1024, ramp=32, block_size=128)
        >>> round(config.initial_span_fraction * config.max_span)  # every memory starts with this span
        102
        >>> ExpireSpanConfig(max_span=1024, ramp=0)
        Traceback (most recent call last):
        ValueError: ExpireSpanConfig.ramp must be ...
    """

    model_type = "memlm_expire_span"
    # What Trainer.predict leaves out of the predictions (the logits): the memory, under its name from 🤗 Transformers
    # 5.24 and before, and the per-batch figures of the span loss and memory size.
    keys_to_ignore_at_inference = [
        "cache",
        "past_key_values",
        "lm_loss",
        "span_loss",
        "aux_loss",
        "memory_size",
        "spans",
    ]

    vocab_size: int = 32000
    hidden_size: int = 512
    intermediate_size: int | None = None
    num_hidden_layers: int = 12
    num_attention_heads: int = 8
    head_dim: int | None = None
    max_span: int = 8192
    ramp: int | float = 128
    span_loss_coefficient: float = 1e-6
    span_pre_divisor: float = 1.0
    initial_span_fraction: float = 0.1
    memory_shortening: bool = False
    noisy_spans: bool = False
    layer_drop: float = 0.0
    block_size: int = 512
    expire_memories: bool = True
    position_encoding: str = "rotary"
    rope_theta: float = 10000.0
    attend_to_self: bool = True
    initial_memory: str = "empty"
    span_loss_form: str = "span"
    recompute_memory: bool = False
    renormalization_epsilon: float = 0.0
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02
    use_cache: bool = True
    tie_word_embeddings: bool = False
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self, **kwargs):
        reject_misspelled_options(self, kwargs)
        if self.intermediate_size is None and is_positive_int(self.hidden_size):
            self.intermediate_size = default_intermediate_size(self.hidden_size)
        heads = self.num_attention_heads
        if self.head_dim is None and is_positive_int(self.hidden_size) and is_positive_int(heads):
            if self.hidden_size % heads:
                raise ValueError(
                    f"ExpireSpanConfig.hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                    f"({heads}), or head_dim given."
                )
            self.head_dim = self.hidden_size // heads
        self._validate()
        super().__post_init__(**kwargs)

    @property
    def num_relative_positions(self) -> int:
        """With `position_encoding="learned_relative"`: the distances 1..min(max_span, block_size) that have a
        learned vector (the official code's `key_pe`, covering the last `mem_sz` steps)."""
        return min(self.max_span, self.block_size)

    @property
    def initial_memory_size(self) -> int:
        """With `initial_memory="zeros"`: how many zero memories a forward without a cache starts from (the
        official `init_hid_cache`: min(attn_lim, mem_sz))."""
        return min(self.max_span, self.block_size)

    @property
    def initial_span_bias(self) -> float:
        """logit(initial_span_fraction): the span predictor's starting bias."""
        return math.log(self.initial_span_fraction / (1 - self.initial_span_fraction))

    def estimated_parameters(self) -> int:
        """The number of parameters of an `ExpireSpanForCausalLM` built from this config (tied embeddings counted
        once), from the sizes alone: nothing is built."""
        hidden, width = self.hidden_size, self.num_attention_heads * self.head_dim
        attention = 4 * hidden * width + (hidden + 1 if self.expire_memories else 0)  # q, k, v, o; span predictor
        layer = attention + self.block_parameters()  # MLP, the two norms, the output bias
        positions = self.num_relative_positions * self.head_dim if self.position_encoding == "learned_relative" else 0
        return self.num_hidden_layers * layer + self.head_parameters() + positions

    def describe(self) -> list[str]:
        """The configuration in words, one line per aspect (used by the model card)."""
        lines = [
            f"{self.num_hidden_layers} layers, hidden size {self.hidden_size}, {self.num_attention_heads} heads of "
            f"width {self.head_dim}, vocabulary of {self.vocab_size} tokens"
            + (", tied input/output embeddings" if self.tie_word_embeddings else ""),
            self.describe_block_layout(),
            f"Rotary positions (base {self.rope_theta:g}) on queries and keys"
            if self.position_encoding == "rotary"
            else f"Learned relative positions q·p_d for distances 1..{self.num_relative_positions}, shared by the "
            "layers",
        ]
        if not self.attend_to_self:
            lines.append("A token attends to earlier tokens only, not to itself")
        if self.recompute_memory:
            lines.append("Memories carried as hidden states, their keys, values and spans recomputed every block")
        if self.initial_memory == "zeros":
            lines.append(f"Starts from {self.initial_memory_size} zero memories (the official initial memory)")
        if self.expire_memories:
            lines += [
                f"Expire-Span memory: spans e_i = L·σ(w·h_i/{self.span_pre_divisor:g} + b) up to L = {self.max_span} "
                f"tokens, soft mask with ramp R = {self.ramp:g}, initial span {self.initial_span_fraction:g}·L",
                f"Span loss coefficient α = {self.span_loss_coefficient:g}"
                + (", official value (remaining spans)" if self.span_loss_form == "remaining_span" else "")
                + (", random memory shortening in training" if self.memory_shortening else "")
                + (", noisy spans in training" if self.noisy_spans else "")
                + (f", layer drop {self.layer_drop:g} in training" if self.layer_drop else ""),
            ]
        else:
            lines.append(f"Expiration off: every memory kept for a fixed span of {self.max_span} tokens")
        lines.append(f"Trained in blocks of {self.block_size} tokens attending to the memories of earlier blocks")
        return lines

    def _validate(self):
        check_positive_ints(
            self, "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "head_dim", "max_span", "block_size",
        )  # fmt: skip
        check_choice(self, "position_encoding", POSITION_ENCODINGS)
        if self.position_encoding == "rotary" and self.head_dim % 2:
            raise ValueError(
                f"ExpireSpanConfig.head_dim ({self.head_dim}) must be even for rotary position embeddings "
                "(position_encoding='rotary')."
            )
        check_number(self, "ramp", minimum=0, strict_minimum=True)
        check_number(self, "span_loss_coefficient", minimum=0)
        check_number(self, "span_pre_divisor", minimum=0, strict_minimum=True)
        check_number(self, "initial_span_fraction", minimum=0, maximum=1, strict_minimum=True, strict_maximum=True)
        check_number(self, "rope_theta", minimum=0, strict_minimum=True)
        check_number(self, "hidden_dropout", minimum=0, maximum=1, strict_maximum=True)
        check_number(self, "attention_dropout", minimum=0, maximum=1, strict_maximum=True)
        check_number(self, "rms_norm_eps", minimum=0, strict_minimum=True)
        check_number(self, "initializer_range", minimum=0)
        check_number(self, "renormalization_epsilon", minimum=0)
        check_number(self, "layer_drop", minimum=0, maximum=1, strict_maximum=True)
        check_bools(
            self, "memory_shortening", "noisy_spans", "expire_memories", "attend_to_self", "recompute_memory",
            "use_cache", "tie_word_embeddings",
        )  # fmt: skip
        check_choice(self, "hidden_act", HIDDEN_ACTIVATIONS)
        check_choice(self, "initial_memory", INITIAL_MEMORIES)
        check_choice(self, "span_loss_form", SPAN_LOSS_FORMS)
        self.validate_block_layout()
        check_token_ids(self)
        check_buildable_size(self)


__all__ = ["ExpireSpanConfig"]
