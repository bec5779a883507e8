"""Feedback Transformer configuration (Fan et al., 2021: "Addressing Some Limitations of Transformers with Feedback
Memory"). Options follow SPEC §3; every field is validated when the config is built."""

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
POSITION_ENCODINGS = ("rotary", "relative_bias", "learned_relative")
INITIAL_MEMORIES = ("empty", "zeros")
MEMORY_NORMALIZATIONS = ("mixture", "layer", "none")
MEMORY_CARRIES = ("keys_values", "hidden_states")
ATTENTION_DROPOUT_POSITIONS = ("context", "weights")


class FeedbackTransformerConfig(PreTrainedConfig, BlockLayout):
    r"""
    Configuration of a Feedback Transformer: every layer attends to one shared memory of earlier steps, each memory
    being a learned mix of all layers' outputs at that step (SPEC §3; Fan et al., 2021, Sec. 3.3 and Eq. 1):

        m_t   = Σ_{l=0..L} softmax(w)_l · x_t^l          x^0 = embedding, x^l = output of layer l (Eq. 1)
        z_t^l = Attn(query x_t^l, keys/values of m_{t−τ} … m_{t−1})

    so the computation is sequential in t (m_t needs the top layer at t) and even the first layer sees the past's
    most abstract representations. Every field is checked when the config is built: a bad value raises `ValueError`
    naming the field and what is allowed. The block around the memory read (norm type and position, MLP type and
    biases, output biases, embedding scale, dropouts) is set by the `BlockLayout` fields (`norm_type`,
    `norm_position`, `mlp_type`, ...), shared by memlm's configs; the defaults are memlm's layout. The official model
    of Fan et al. (facebookresearch/transformer-sequential, `models/feedback.py`) is these options together:
    `memlm.conversion.transformer_sequential_feedback` converts its checkpoints.

    Args:
        vocab_size: number of tokens in the vocabulary.
        hidden_size: width of the residual stream; a multiple of `num_attention_heads` unless `head_dim` is given.
        intermediate_size: width of the MLP; `None` (default) takes the multiple of 256 nearest above
            `hidden_size * 8 / 3`.
        num_hidden_layers: number of blocks L (the memory mixes L + 1 representations: the embedding and each layer).
        num_attention_heads: number of attention heads.
        head_dim: width of each head's queries, keys and values; `None` (default) takes `hidden_size /
            num_attention_heads` (which must then divide). The official code sets it independently (`--head-dim`).
        memory_span: τ, how many earlier steps each step attends to.
        share_key_value: True (the paper's efficient form): keys and values of a memory are computed once per step,
            with one projection for all layers, and the cache holds one set for all layers. False: each layer
            projects the memory with its own weights (L sets).
        position_encoding: how attention knows how far back a memory is. `"rotary"` (default): rotary embedding of
            queries and keys by absolute position, so scores depend on the distance t − i; no parameters, any τ.
            `"relative_bias"`: a learned bias per layer, head and distance 1..τ added to the scores (the paper's
            relative position information, in its simplest form). `"learned_relative"`: the official code's learned,
            query-dependent relative positions (`key_pe`; Sukhbaatar et al., 2019: s_tr = q_t · (k_r + p_{t−r})): one
            vector p_d per distance d = 1..τ, shared by the layers and heads, adding q_t · p_d to the score of the
            memory d steps back: softmax((q_t · k_i + q_t · p_{t−i}) / √head_dim).
        initial_memory: `"empty"` (default): a forward that starts without a cache has no memory (the attention term
            of the first step is zero). `"zeros"`: the official initial memory, τ zero hidden states at the positions
            −τ … −1, whose keys and values are computed from those zeros and attended like any memory.
        memory_normalization: where the memory m_t of Eq. 1 is normalised before its key/value projections.
            `"mixture"` (default): one norm of the model over the mix, m_t = norm(Σ_l softmax(w)_l x_t^l).
            `"layer"`: no norm over the mix; each layer passes the memory through its own input norm before its
            projections, k = W_k · norm_l(m) (the official pre-norm code, which normalises keys and values as the
            layer's queries). `"none"`: the projections read the raw mix (the official post-norm code).
        memory_carry: what a cache carries from one forward to the next. `"keys_values"` (default): the keys and
            values of the last τ memories, computed once (the weights they were computed with stay in them, and in
            training they carry no gradient). `"hidden_states"`: the memories' hidden states; every forward recomputes
            their keys and values with the current weights (Transformer-XL's and the official code's training: the
            projections receive gradients through the carried memories; the hidden states themselves are detached).
            Costs a projection of τ memories per forward call (O(τ · hidden_size · head widths), as many as a
            prefill of τ tokens spends on keys and values).
        carry_first_layer_norm: with `memory_carry="hidden_states"` and `memory_normalization="layer"`: the hidden
            states carried to the next forward are the memories after the first layer's input norm (as the official
            pre-norm code stores them), and each layer applies its own norm to them again in the next forward. Keys
            and values of memories made within a forward are computed without that extra norm.
        adaptive_span: a learned attention span per layer and head (Sukhbaatar et al., 2019, "Adaptive Attention
            Span in Transformers": the soft mask m_z and the ℓ1 penalty on z; the paper's enwik8 model uses it): the
            softmax weight of the memory d steps back is multiplied by m(d) = clamp((1 − d + z·τ) / R + 1, 0, 1), z
            the learned span ratio of the head, and the weights renormalised: a' = a·m / (Σ a·m +
            renormalization_epsilon). Its loss, Σ_layers coefficient · τ · mean_heads(z), is the output's `aux_loss`
            (added to `loss` in training). The official trainer clamps z to [0, 1] after every optimizer step;
            so do `memlm train` and `memlm finetune`, and a 🤗 `Trainer` given
            `memlm.training.callbacks.ClampAdaptiveSpans` (`clamp_adaptive_spans(model)` in a loop of your own).
        adaptive_span_ramp: R > 0, the length of the soft mask's ramp (the official `--adapt-span-len`).
        adaptive_span_loss_coefficient: the coefficient of the span loss (the official `--adapt-span-loss`).
        adaptive_span_initial_ratio: the initial span ratio z of every head, in [0, 1] (`--adapt-span-init`).
        adaptive_span_trim_step: `None` (default): every layer reads all τ memories (those beyond a head's span get
            weight 0 from the mask). An integer s: as the official code (`--adapt-span-trim-step`, default 64), each
            forward trims from a layer's window the oldest n = ⌊min(τ − 1, τ − S) / s⌋ · s memories, S =
            min(τ, ⌈max_heads(z) · τ + R⌉) the longest span of the layer with its ramp: they are left out of the
            softmax (which the renormalisation's ε sees), and a cache built without gradients keeps only the
            memories some layer still reads (s = 1: the adaptive span bounds the cache to the longest span).
        renormalization_epsilon: ε >= 0 added to the denominator of the adaptive span's renormalisation; the official
            code uses 1e-8; 0 (default) renormalises exactly.
        attention_dropout_position: where `attention_dropout` applies: `"context"` (default): each head's attention
            output (the context read from the memory); `"weights"`: the attention weights (the official code, after
            the adaptive span's renormalisation).
        rope_theta: base of the rotary embedding (used with `position_encoding="rotary"`).
        compile_step: False (default): the step loop runs eagerly. True: the step's pure functions (a layer's query,
            its block after the memory read, the memory mix of Eq. 1 and its keys/values) run through
            `torch.compile`, which fuses their small element-wise ops, wherever no autograd graph is needed: prefill,
            decoding and the training forward of the hand-written backward, without dropout, hooks or adapters. The
            same numbers up to the order of float operations; the first calls compile (tens of seconds on a CPU).
            Without a compiler (a C++ compiler for the CPU, Triton for GPUs) a warning is logged and the eager step
            runs.
        hidden_dropout: dropout on each block's attention and MLP outputs before the residual sum.
        attention_dropout: dropout on each head's attention output (the context read from the memory) or on the
            attention weights (`attention_dropout_position`).
        hidden_act: activation of the MLP: `"silu"`, `"gelu"`, `"gelu_new"` or `"relu"`.
        rms_norm_eps: epsilon of every RMSNorm (with `norm_type="rmsnorm"`).
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
    # What Trainer.predict leaves out of the predictions (the logits): the memory, under its name from 🤗 Transformers
    # 5.24 and before, and the two parts of the loss.
    keys_to_ignore_at_inference = ["cache", "past_key_values", "lm_loss", "aux_loss"]

    vocab_size: int = 32000
    hidden_size: int = 512
    intermediate_size: int | None = None
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    head_dim: int | None = None
    memory_span: int = 512
    share_key_value: bool = True
    position_encoding: str = "rotary"
    initial_memory: str = "empty"
    memory_normalization: str = "mixture"
    memory_carry: str = "keys_values"
    carry_first_layer_norm: bool = False
    adaptive_span: bool = False
    adaptive_span_ramp: int | float = 32
    adaptive_span_loss_coefficient: float = 0.0
    adaptive_span_initial_ratio: float = 0.0
    adaptive_span_trim_step: int | None = None
    renormalization_epsilon: float = 0.0
    attention_dropout_position: str = "context"
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
        heads = self.num_attention_heads
        if self.head_dim is None and is_positive_int(self.hidden_size) and is_positive_int(heads):
            if self.hidden_size % heads:
                raise ValueError(
                    f"FeedbackTransformerConfig.hidden_size ({self.hidden_size}) must be a multiple of "
                    f"num_attention_heads ({heads}), or head_dim given."
                )
            self.head_dim = self.hidden_size // heads
        self._validate()
        super().__post_init__(**kwargs)

    @property
    def memory_groups(self) -> int:
        """How many key/value sets the memory holds: 1 when the layers share them (shared projections of one
        memory), else one per layer (own projections, or shared ones after each layer's own norm)."""
        shared = self.share_key_value and self.memory_normalization != "layer"
        return 1 if shared else self.num_hidden_layers

    @property
    def attention_width(self) -> int:
        """num_attention_heads · head_dim: the width of the queries, keys and values of a layer."""
        return self.num_attention_heads * self.head_dim

    @property
    def default_step(self) -> bool:
        """Whether the step is memlm's default one (pre-norm RMSNorm blocks, gated MLP without biases, the memory
        normed as a mix, keys and values carried): the one `compile_step` knows (the hand-written backward knows every
        layout)."""
        return (
            self.norm_type == "rmsnorm"
            and self.norm_position == "pre"
            and self.mlp_type == "gated"
            and not self.mlp_bias
            and not self.attention_output_bias
            and self.head_dim * self.num_attention_heads == self.hidden_size
            and self.position_encoding in ("rotary", "relative_bias")
            and self.initial_memory == "empty"
            and self.memory_normalization == "mixture"
            and self.memory_carry == "keys_values"
            and not self.adaptive_span
            and self.attention_dropout_position == "context"
        )

    @property
    def recomputes_carried_memory(self) -> bool:
        """Whether a forward computes keys and values of hidden states it starts from (carried ones, or the zero
        initial memory), which the recurrence's gradients then reach."""
        return self.memory_carry == "hidden_states" or self.initial_memory == "zeros"

    def estimated_parameters(self) -> int:
        """The number of parameters of a `FeedbackTransformerForCausalLM` built from this config (tied embeddings
        counted once), from the sizes alone: nothing is built."""
        hidden, layers, width = self.hidden_size, self.num_hidden_layers, self.attention_width
        key_value = 2 * hidden * width  # the memory's key and value projections: once, or in every layer
        attention = 2 * hidden * width + (0 if self.share_key_value else key_value)  # q and o (+ k and v)
        attention += self.num_attention_heads * self.memory_span if self.position_encoding == "relative_bias" else 0
        attention += self.num_attention_heads if self.adaptive_span else 0  # the span ratios
        layer = attention + self.block_parameters()  # MLP, the two norms, the output projection's bias
        shared = (key_value if self.share_key_value else 0) + (layers + 1)  # (k and v,) w of Eq. 1
        shared += self.norm_parameters(hidden) if self.memory_normalization == "mixture" else 0
        shared += self.memory_span * self.head_dim if self.position_encoding == "learned_relative" else 0
        return layers * layer + self.head_parameters() + shared

    def describe(self) -> list[str]:
        """The configuration in words, one line per aspect (used by the model card)."""
        position = {
            "rotary": f"rotary embedding (base {self.rope_theta:g})",
            "relative_bias": f"learned relative bias per layer, head and distance 1..{self.memory_span}",
            "learned_relative": f"learned query-dependent relative positions q·p_d, d = 1..{self.memory_span}, "
            "shared by the layers",
        }[self.position_encoding]
        norm = {
            "mixture": "the mix normed once",
            "layer": "each layer's input norm applied to the memory before its projections",
            "none": "projections of the raw mix",
        }[self.memory_normalization]
        lines = [
            f"{self.num_hidden_layers} layers, hidden size {self.hidden_size}, {self.num_attention_heads} heads of "
            f"width {self.head_dim}, vocabulary of {self.vocab_size} tokens"
            + (", tied input/output embeddings" if self.tie_word_embeddings else ""),
            self.describe_block_layout(),
            f"Feedback memory: m_t = Σ_l softmax(w)_l x_t^l over the embedding and all {self.num_hidden_layers} "
            f"layers ({norm}); every layer attends to the last τ = {self.memory_span} memories",
            "Key/value projections shared by all layers" if self.share_key_value
            else "Separate key/value projections per layer",
            f"Position information: {position}",
        ]  # fmt: skip
        if self.initial_memory == "zeros":
            lines.append(f"Starts from {self.memory_span} zero memories (the official initial memory)")
        if self.memory_carry == "hidden_states":
            lines.append("Carries the memories' hidden states; their keys and values are recomputed every forward")
        if self.adaptive_span:
            lines.append(
                f"Adaptive attention span per head (ramp {self.adaptive_span_ramp:g}, loss coefficient "
                f"{self.adaptive_span_loss_coefficient:g})"
            )
        return lines

    def _validate(self):
        check_positive_ints(
            self, "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "head_dim", "memory_span",
        )  # fmt: skip
        check_choice(self, "position_encoding", POSITION_ENCODINGS)
        if self.position_encoding == "rotary" and self.head_dim % 2:
            raise ValueError(
                f"FeedbackTransformerConfig: the head width head_dim = {self.head_dim} must be even for "
                "position_encoding='rotary'; use 'relative_bias' or 'learned_relative', or change the sizes."
            )
        check_choice(self, "initial_memory", INITIAL_MEMORIES)
        check_choice(self, "memory_normalization", MEMORY_NORMALIZATIONS)
        check_choice(self, "memory_carry", MEMORY_CARRIES)
        check_choice(self, "attention_dropout_position", ATTENTION_DROPOUT_POSITIONS)
        check_bools(self, "carry_first_layer_norm", "adaptive_span")
        if self.carry_first_layer_norm and (
            self.memory_carry != "hidden_states" or self.memory_normalization != "layer"
        ):  # fmt: skip
            raise ValueError(
                "FeedbackTransformerConfig.carry_first_layer_norm=True needs memory_carry='hidden_states' and "
                f"memory_normalization='layer'; got memory_carry={self.memory_carry!r}, memory_normalization="
                f"{self.memory_normalization!r}."
            )
        check_number(self, "adaptive_span_ramp", minimum=0, strict_minimum=True)
        check_number(self, "adaptive_span_loss_coefficient", minimum=0)
        check_number(self, "adaptive_span_initial_ratio", minimum=0, maximum=1)
        check_number(self, "renormalization_epsilon", minimum=0)
        if self.adaptive_span_trim_step is not None and not is_positive_int(self.adaptive_span_trim_step):
            raise ValueError(
                "FeedbackTransformerConfig.adaptive_span_trim_step must be None or a positive integer, got "
                f"{self.adaptive_span_trim_step!r}."
            )
        self.validate_block_layout()
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
