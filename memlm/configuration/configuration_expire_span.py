"""Expire-Span configuration (Sukhbaatar et al., 2021: "Not All Memories are Created Equal: Learning to Forget by
Expiring"). Options follow SPEC §2; every field is validated when the config is built."""

import math

from transformers import PreTrainedConfig

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


class ExpireSpanConfig(PreTrainedConfig):
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
        hidden_size: width of the residual stream; a multiple of `num_attention_heads` whose head width is even
            (rotary embeddings).
        intermediate_size: width of the gated MLP; `None` (default) takes the multiple of 256 nearest above
            `hidden_size * 8 / 3`.
        num_hidden_layers: number of blocks.
        num_attention_heads: number of attention heads (they share each layer's spans).
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
        block_size: K; a long input is processed in blocks of K tokens, each attending causally to itself and to the
            memories of earlier blocks, with expired memories deleted before each block. A block larger than L + R is
            allowed: the tokens of one block then see each other only as far back as the spans allow, but the
            block's attention is still computed over all K × K pairs, so it costs more than the memory needs.
        expire_memories: True for Expire-Span; False turns expiration off: every memory is kept exactly L tokens (a
            fixed span, as in Transformer-XL) and the span predictor is unused.
        rope_theta: base of the rotary position embedding on queries and keys (absolute positions).
        hidden_dropout: dropout on each block's attention and MLP outputs before the residual sum.
        attention_dropout: dropout on the attention weights.
        hidden_act: activation of the gated MLP: `"silu"`, `"gelu"`, `"gelu_new"` or `"relu"`.
        rms_norm_eps: epsilon of every RMSNorm.
        initializer_range: standard deviation of the normal initialisation of linear and embedding weights.
        use_cache: return the memory (an `ExpireSpanCache`) as the output's `cache`.
        tie_word_embeddings: share the input embedding and the LM head.
        pad_token_id: id of the padding token, or `None`; must lie in `[0, vocab_size)`.
        bos_token_id: id of the beginning-of-text token, or `None`; must lie in `[0, vocab_size)`.
        eos_token_id: id (or list of ids) that ends generation, or `None`; each must lie in `[0, vocab_size)`.

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
    keys_to_ignore_at_inference = ["cache", "past_key_values", "lm_loss", "span_loss", "memory_size", "spans"]

    vocab_size: int = 32000
    hidden_size: int = 512
    intermediate_size: int | None = None
    num_hidden_layers: int = 12
    num_attention_heads: int = 8
    max_span: int = 8192
    ramp: int | float = 128
    span_loss_coefficient: float = 1e-6
    span_pre_divisor: float = 1.0
    initial_span_fraction: float = 0.1
    memory_shortening: bool = False
    block_size: int = 512
    expire_memories: bool = True
    rope_theta: float = 10000.0
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
        self._validate()
        super().__post_init__(**kwargs)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def initial_span_bias(self) -> float:
        """logit(initial_span_fraction): the span predictor's starting bias."""
        return math.log(self.initial_span_fraction / (1 - self.initial_span_fraction))

    def estimated_parameters(self) -> int:
        """The number of parameters of an `ExpireSpanForCausalLM` built from this config (tied embeddings counted
        once), from the sizes alone: nothing is built."""
        hidden = self.hidden_size
        attention = 4 * hidden * hidden + (hidden + 1 if self.expire_memories else 0)  # q, k, v, o; span predictor
        layer = attention + 3 * hidden * self.intermediate_size + 2 * hidden  # gated MLP and the two RMSNorms
        embeddings = self.vocab_size * hidden * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * layer + embeddings + hidden  # + the final RMSNorm

    def describe(self) -> list[str]:
        """The configuration in words, one line per aspect (used by the model card)."""
        lines = [
            f"{self.num_hidden_layers} layers, hidden size {self.hidden_size}, {self.num_attention_heads} heads, "
            f"gated MLP of width {self.intermediate_size} ({self.hidden_act}), vocabulary of {self.vocab_size} tokens"
            + (", tied input/output embeddings" if self.tie_word_embeddings else ""),
            f"Rotary positions (base {self.rope_theta:g}) on queries and keys",
        ]
        if self.expire_memories:
            lines += [
                f"Expire-Span memory: spans e_i = L·σ(w·h_i/{self.span_pre_divisor:g} + b) up to L = {self.max_span} "
                f"tokens, soft mask with ramp R = {self.ramp:g}, initial span {self.initial_span_fraction:g}·L",
                f"Span loss coefficient α = {self.span_loss_coefficient:g}"
                + (", random memory shortening in training" if self.memory_shortening else ""),
            ]
        else:
            lines.append(f"Expiration off: every memory kept for a fixed span of {self.max_span} tokens")
        lines.append(f"Trained in blocks of {self.block_size} tokens attending to the memories of earlier blocks")
        return lines

    def _validate(self):
        check_positive_ints(
            self, "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "max_span", "block_size",
        )  # fmt: skip
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"ExpireSpanConfig.hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                f"({self.num_attention_heads})."
            )
        if self.head_dim % 2:
            raise ValueError(
                f"ExpireSpanConfig: the head width hidden_size / num_attention_heads = {self.head_dim} must be even "
                "for rotary position embeddings."
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
        check_bools(self, "memory_shortening", "expire_memories", "use_cache", "tie_word_embeddings")
        check_choice(self, "hidden_act", HIDDEN_ACTIVATIONS)
        check_token_ids(self)
        check_buildable_size(self)


__all__ = ["ExpireSpanConfig"]
