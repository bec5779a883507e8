"""Feedback Transformer configuration (Fan et al., 2021: "Addressing Some Limitations of Transformers with Feedback
Memory"). Options follow SPEC §3; every field is validated when the config is built."""

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
POSITION_ENCODINGS = ("rotary", "relative_bias")


class FeedbackTransformerConfig(PreTrainedConfig):
    r"""
    Configuration of a Feedback Transformer: every layer attends to one shared memory of earlier steps, each memory
    being a learned mix of all layers' outputs at that step (SPEC §3; Fan et al., 2021, Sec. 3.3 and Eq. 1):

        m_t   = Σ_{l=0..L} softmax(w)_l · x_t^l          x^0 = embedding, x^l = output of layer l (Eq. 1)
        z_t^l = Attn(query x_t^l, keys/values of m_{t−τ} … m_{t−1})

    so the computation is sequential in t (m_t needs the top layer at t) and even the first layer sees the past's
    most abstract representations. Every field is checked when the config is built: a bad value raises `ValueError`
    naming the field and what is allowed.

    Args:
        vocab_size: number of tokens in the vocabulary.
        hidden_size: width of the residual stream; a multiple of `num_attention_heads`.
        intermediate_size: width of the gated MLP; `None` (default) takes the multiple of 256 nearest above
            `hidden_size * 8 / 3`.
        num_hidden_layers: number of blocks L (the memory mixes L + 1 representations: the embedding and each layer).
        num_attention_heads: number of attention heads.
        memory_span: τ, how many earlier steps each step attends to.
        share_key_value: True (the paper's efficient form): keys and values of a memory are computed once per step,
            with one projection for all layers, and the cache holds one set for all layers. False: each layer
            projects the memory with its own weights (L sets).
        position_encoding: how attention knows how far back a memory is. `"rotary"` (default): rotary embedding of
            queries and keys by absolute position, so scores depend on the distance t − i; no parameters, any τ.
            `"relative_bias"`: a learned bias per layer, head and distance 1..τ added to the scores (the paper's
            relative position information, in its simplest form).
        rope_theta: base of the rotary embedding (used with `position_encoding="rotary"`).
        compile_step: False (default): the step loop runs eagerly. True: the step's pure functions (a layer's query,
            its block after the memory read, the memory mix of Eq. 1 and its keys/values) run through
            `torch.compile`, which fuses their small element-wise ops, wherever no autograd graph is needed: prefill,
            decoding and the training forward of the hand-written backward, without dropout, hooks or adapters. The
            same numbers up to the order of float operations; the first calls compile (tens of seconds on a CPU).
            Without a compiler (a C++ compiler for the CPU, Triton for GPUs) a warning is logged and the eager step
            runs.
        hidden_dropout: dropout on each block's attention and MLP outputs before the residual sum.
        attention_dropout: dropout on each head's attention output (the context read from the memory).
        hidden_act: activation of the gated MLP: `"silu"`, `"gelu"`, `"gelu_new"` or `"relu"`.
        rms_norm_eps: epsilon of every RMSNorm.
        initializer_range: standard deviation of the normal initialisation of linear and embedding weights.
        use_cache: return the memory (a `FeedbackCache`) as the output's `cache`.
        tie_word_embeddings: share the input embedding and the LM head.
        pad_token_id: id of the padding token, or `None`; must lie in `[0, vocab_size)`.
        bos_token_id: id of the beginning-of-text token, or `None`; must lie in `[0, vocab_size)`.
        eos_token_id: id (or list of ids) that ends generation, or `None`; each must lie in `[0, vocab_size)`.

    Example:
        >>> from memlm import FeedbackTransformerConfig
        >>> config = FeedbackTransformerConfig(vocab_size=258, hidden_size=64, num_hidden_layers=2,
        ...                                    num_attention_heads=4, memory_span=128)
        >>> config.memory_groups  # shared keys and values: one set in the cache for all layers
        1
        >>> FeedbackTransformerConfig(position_encoding="alibi")
        Traceback (most recent call last):
        ValueError: FeedbackTransformerConfig.position_encoding must be one of ...
    """

    model_type = "memlm_feedback_transformer"
    # The memory, under its name from 🤗 Transformers 5.24 and before.
    keys_to_ignore_at_inference = ["cache", "past_key_values"]

    vocab_size: int = 32000
    hidden_size: int = 512
    intermediate_size: int | None = None
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    memory_span: int = 512
    share_key_value: bool = True
    position_encoding: str = "rotary"
    rope_theta: float = 10000.0
    compile_step: bool = False
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
    def memory_groups(self) -> int:
        """How many key/value sets the memory holds: 1 when shared by the layers, else one per layer."""
        return 1 if self.share_key_value else self.num_hidden_layers

    def estimated_parameters(self) -> int:
        """The number of parameters of a `FeedbackTransformerForCausalLM` built from this config (tied embeddings
        counted once), from the sizes alone: nothing is built."""
        hidden, layers = self.hidden_size, self.num_hidden_layers
        key_value = 2 * hidden * hidden  # the memory's key and value projections: once, or in every layer
        attention = 2 * hidden * hidden + (0 if self.share_key_value else key_value)  # q and o (+ k and v)
        attention += self.num_attention_heads * self.memory_span if self.position_encoding == "relative_bias" else 0
        layer = attention + 3 * hidden * self.intermediate_size + 2 * hidden  # gated MLP and the two RMSNorms
        embeddings = self.vocab_size * hidden * (1 if self.tie_word_embeddings else 2)
        shared = (key_value if self.share_key_value else 0) + (layers + 1) + 2 * hidden  # w of Eq. 1, two RMSNorms
        return layers * layer + embeddings + shared

    def describe(self) -> list[str]:
        """The configuration in words, one line per aspect (used by the model card)."""
        position = (
            f"rotary embedding (base {self.rope_theta:g})"
            if self.position_encoding == "rotary"
            else f"learned relative bias per layer, head and distance 1..{self.memory_span}"
        )
        return [
            f"{self.num_hidden_layers} layers, hidden size {self.hidden_size}, {self.num_attention_heads} heads, "
            f"gated MLP of width {self.intermediate_size} ({self.hidden_act}), vocabulary of {self.vocab_size} tokens"
            + (", tied input/output embeddings" if self.tie_word_embeddings else ""),
            f"Feedback memory: m_t = Σ_l softmax(w)_l x_t^l over the embedding and all {self.num_hidden_layers} "
            f"layers; every layer attends to the last τ = {self.memory_span} memories",
            "Key/value projections shared by all layers (one memory set cached)"
            if self.share_key_value
            else "Separate key/value projections per layer",
            f"Position information: {position}",
        ]

    def _validate(self):
        check_positive_ints(
            self, "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "memory_span",
        )  # fmt: skip
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"FeedbackTransformerConfig.hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                f"({self.num_attention_heads})."
            )
        check_choice(self, "position_encoding", POSITION_ENCODINGS)
        if self.position_encoding == "rotary" and self.head_dim % 2:
            raise ValueError(
                f"FeedbackTransformerConfig: the head width hidden_size / num_attention_heads = {self.head_dim} must "
                "be even for position_encoding='rotary'; use 'relative_bias' or change the sizes."
            )
        check_number(self, "rope_theta", minimum=0, strict_minimum=True)
        check_number(self, "hidden_dropout", minimum=0, maximum=1, strict_maximum=True)
        check_number(self, "attention_dropout", minimum=0, maximum=1, strict_maximum=True)
        check_number(self, "rms_norm_eps", minimum=0, strict_minimum=True)
        check_number(self, "initializer_range", minimum=0)
        check_bools(self, "share_key_value", "compile_step", "use_cache", "tie_word_embeddings")
        check_choice(self, "hidden_act", HIDDEN_ACTIVATIONS)
        check_token_ids(self)
        check_buildable_size(self)


__all__ = ["FeedbackTransformerConfig"]
