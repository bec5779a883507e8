"""DeltaNet configuration (Schlag, Irie & Schmidhuber, 2021: "Linear Transformers Are Secretly Fast Weight
Programmers"). The options follow SPEC §1: feature map φ, key/query normalisation, update rule, β, short
convolution, output norm and gate. Every field is validated when the config is built."""

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
    is_int,
    is_positive_int,
    reject_misspelled_options,
)

FEATURE_MAPS = ("dpfp", "elu+1", "favor+", "silu", "identity")
# Feature maps whose every component is >= 0, so that dividing by the sum of components is meaningful.
NONNEGATIVE_FEATURE_MAPS = ("dpfp", "elu+1", "favor+")
NORMALIZATIONS = ("sum", "l2", "none")
UPDATE_RULES = ("delta", "sum")
VALUE_ACTIVATIONS = ("identity", "silu")
HIDDEN_ACTIVATIONS = ("silu", "gelu", "gelu_new", "relu")
POSITION_ENCODINGS = ("none", "sinusoidal")

PRESETS = {
    # Schlag et al. (2021), Sec. 4-5: DPFP-1 features, sum-normalised keys and queries, delta rule with learned β.
    "paper": {
        "feature_map": "dpfp",
        "dpfp_nu": 1,
        "query_key_normalization": "sum",
        "update_rule": "delta",
        "use_beta": True,
        "short_convolution": False,
        "output_norm": False,
        "output_gate": False,
        "value_activation": "identity",
        "scale_queries": False,
    },
    # The layout of flash-linear-attention's DeltaNet checkpoints (fla/layers/delta_net.py): SiLU features after a
    # short convolution, L2-normalised keys and queries, SiLU on values, per-head output RMSNorm, queries scaled by
    # d_k^-1/2 inside the kernel.
    "fla": {
        "feature_map": "silu",
        "query_key_normalization": "l2",
        "update_rule": "delta",
        "use_beta": True,
        "short_convolution": True,
        "convolution_size": 4,
        "output_norm": True,
        "output_gate": False,
        "value_activation": "silu",
        "scale_queries": True,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
    },
}


# The official code's model around the fast-weight layer (IDSIA/lmtool-fwp, a Transformer-XL code base; SPEC §8):
# post-norm LayerNorm blocks, a plain biased ReLU feed-forward, no final norm, a biased output layer tied to the
# embedding, the layer's output scaled by 1/√d_head, the attention normaliser with its epsilon, sinusoidal positions.
LMTOOL_FWP_LAYOUT = {
    "norm_type": "layernorm",
    "layer_norm_eps": 1e-5,
    "norm_position": "post",
    "final_norm": False,
    "mlp_type": "plain",
    "mlp_bias": True,
    "hidden_act": "relu",
    "lm_head_bias": True,
    "tie_word_embeddings": True,
    "scale_output": True,
    "attention_normalizer": True,
    "attention_normalizer_eps": 1e-5,
    "position_encoding": "sinusoidal",
    "short_convolution": False,
    "output_norm": False,
    "output_gate": False,
    "value_activation": "identity",
    "scale_queries": False,
}
# The official example scripts of Schlag et al. (2021), example_scripts/2021_linear_transformers_are_secretly_fwps:
# attn_type 24 (delta rule, ELU+1, sum-normalised), the normaliser on as the scripts are written, WikiText-103's
# vocabulary with train.py's adaptive softmax cutoffs, embeddings scaled by √d_model.
WIKITEXT103_VOCABULARY = 267735


def _lmtool_fwp_script(hidden_size: int, head_dim: int, **changes) -> dict:
    return {
        **LMTOOL_FWP_LAYOUT,
        "feature_map": "elu+1",
        "query_key_normalization": "sum",
        "update_rule": "delta",
        "use_beta": True,
        "vocab_size": WIKITEXT103_VOCABULARY,
        "adaptive_softmax_cutoffs": [20000, 40000, 200000],
        "hidden_size": hidden_size,
        "num_hidden_layers": 16,
        "num_attention_heads": 8,
        "key_head_dim": head_dim,
        "value_head_dim": head_dim,
        "intermediate_size": 2048,
        "embedding_scale": hidden_size**0.5,
        **dict.fromkeys(("hidden_dropout", "embedding_dropout", "activation_dropout", "output_dropout"), 0.1),
        **changes,
    }


PRESETS.update(
    {
        "small_linear_fast_weight_memory": _lmtool_fwp_script(128, 16),
        "medium_linear_fast_weight_memory": _lmtool_fwp_script(256, 32),
        # --carry_over_fast_weight --no_pos: the fast weights cross segments (feed the cache), no positions.
        "medium_linear_fast_weight_memory_carry_over_context": _lmtool_fwp_script(256, 32, position_encoding="none"),
    }
)


class DeltaNetConfig(PreTrainedConfig, BlockLayout):
    r"""
    Configuration of a DeltaNet language model: a stack of pre-norm blocks whose token mixer is a fast-weight memory
    `S_t` (one `d_k × d_v` matrix per head) written with the delta rule and read with the queries (SPEC §1; Schlag et
    al., 2021, Eqs. 20-25):

        v̄_t = S_{t-1}ᵀ k_t,   S_t = S_{t-1} + β_t k_t (v_t − v̄_t)ᵀ,   o_t = S_tᵀ q_t

    Presets are one line away: `DeltaNetConfig.from_preset("paper")` (Schlag et al., in memlm's block layout),
    `DeltaNetConfig.from_preset("fla")` (the flash-linear-attention layout, so its checkpoints can be converted), and
    the official example scripts' models as the official code builds them: `"small_linear_fast_weight_memory"`,
    `"medium_linear_fast_weight_memory"` and `"medium_linear_fast_weight_memory_carry_over_context"`.
    Every field is checked when the config is built: a bad value raises `ValueError` naming the field and what is
    allowed. The block around the memory (norms, MLP, biases, embedding scale, dropouts) is set by the `BlockLayout`
    fields (`norm_type`, `norm_position`, `mlp_type`, ...), shared by memlm's configs.

    Args:
        vocab_size: number of tokens in the vocabulary.
        hidden_size: width of the residual stream.
        intermediate_size: width of the gated MLP; `None` (default) takes the multiple of 256 nearest above
            `hidden_size * 8 / 3` (the SwiGLU rule flash-linear-attention uses).
        num_hidden_layers: number of blocks.
        num_attention_heads: number of fast-weight heads.
        key_head_dim: per-head width of the key/query projections before the feature map; `None` (default) takes
            `hidden_size // num_attention_heads`.
        value_head_dim: per-head width of the values; `None` (default) takes `hidden_size // num_attention_heads`.
        feature_map: φ applied to keys and queries: `"dpfp"` (deterministic parameter-free projection, paper Eq. 37,
            width `2 * dpfp_nu * key_head_dim`), `"elu+1"` (Eq. 30), `"favor+"` (Performer positive random features,
            Eqs. 31-32, width `favor_features`), `"silu"` or `"identity"`.
        dpfp_nu: ν of DPFP, one of 1, 2, 3; only used with `feature_map="dpfp"`.
        favor_features: number m of random features of FAVOR+; only used with `feature_map="favor+"`. The random
            projection is redrawn at every training forward, kept fixed in eval mode and saved with the model.
        query_key_normalization: how φ(k) and φ(q) are normalised: `"sum"` (divide by the sum of the components,
            paper Eq. 29; needs a non-negative feature map), `"l2"` or `"none"`.
        update_rule: `"delta"` (the delta rule above) or `"sum"` (plain linear attention, `S_t = S_{t-1} + k_t v_tᵀ`,
            paper Eqs. 17-19).
        attention_normalizer: divide the output by `z_tᵀ q_t + attention_normalizer_eps` with `z_t = Σ_{τ≤t} k_τ`
            (Katharopoulos et al.; paper Eqs. 26-28); needs a non-negative feature map. With the sum rule and β the
            keys in z_t are β-scaled; with the delta rule they are not (the official code's `attn_type` 24/26 with
            its normaliser on: the memory is written and read as without it, only the output is divided). z_t is
            carried in the cache with the fast weights.
        attention_normalizer_eps: the epsilon added to the normaliser `z_tᵀ q_t` (the official code: 1e-5).
        use_beta: learn the writing strength `β_t = σ(w_β · x_t)` per head (paper Eq. 22); when off, β = 1.
        short_convolution: a causal depthwise convolution over time on the projected queries, keys and values
            before the feature map.
        convolution_size: kernel width of the short convolution (>= 2).
        output_norm: RMSNorm over each head's output.
        output_gate: multiply each head's output by `silu(W_g x_t)`.
        value_activation: `"identity"` or `"silu"`, applied to the values (after the convolution).
        scale_queries: multiply queries by `d_k^-1/2` (d_k the feature width) before reading the memory.
        scale_output: multiply each head's output by `key_head_dim^-1/2` before the output projection (the official
            code's `self.scale`; with the attention normaliser this differs from scaling the queries).
        position_encoding: `"none"` (default; the order is in the recurrence) or `"sinusoidal"`: Transformer-XL's
            sinusoidal encoding `[sin(p·f), cos(p·f)]`, `f = 10000^(-2i/hidden_size)`, added to the scaled embeddings
            with positions counting down within each forward call (the call's last token at p = 0, its first at
            T − 1), as the official code applies it to each segment. Decoding token by token thus sees p = 0 at every
            step: such a model gives what the official model gives when fed the same segments, not the same logits
            for a prefill and a token-by-token continuation.
        adaptive_softmax_cutoffs: `None` (default; the LM head is one linear layer) or the increasing cutoffs
            `[c_1, ..., c_n]` (each in `(0, vocab_size)`) of an adaptive softmax output (Grave et al., 2017; the
            official WikiText-103 scripts' `--adaptive`): a head over `[0, c_1)` plus one logit per cluster, each
            cluster `[c_i, c_{i+1})` a softmax over its rows of the output matrix. The logits are then the full
            log-probabilities.
        chunk_size: chunk length of the chunkwise training kernel; does not change the result.
        hidden_act: activation of the gated MLP: `"silu"`, `"gelu"`, `"gelu_new"` or `"relu"`.
        hidden_dropout: dropout on the output of each token mixer and MLP before the residual sum.
        rms_norm_eps: epsilon of every RMSNorm.
        initializer_range: standard deviation of the normal initialisation of linear and embedding weights.
        use_cache: return the memory (a `DeltaNetCache`) as the output's `cache`.
        tie_word_embeddings: share the input embedding and the LM head.
        pad_token_id: id of the padding token, or `None`; must lie in `[0, vocab_size)`.
        bos_token_id: id of the beginning-of-text token, or `None`; must lie in `[0, vocab_size)`.
        eos_token_id: id (or list of ids) that ends generation, or `None`; each must lie in `[0, vocab_size)`.

    Example:
        >>> from memlm import DeltaNetConfig, DeltaNetForCausalLM
        >>> config = DeltaNetConfig.from_preset("paper", vocab_size=258, hidden_size=64, num_hidden_layers=2,
        ...                                     num_attention_heads=2)
        >>> config.feature_map, config.update_rule, config.feature_dim  # DPFP-1 doubles the key width
        ('dpfp', 'delta', 64)
        >>> model = DeltaNetForCausalLM(config)
        >>> sum(parameter.numel() for parameter in model.parameters()) == config.estimated_parameters()
        True
        >>> DeltaNetConfig(feature_map="relu")
        Traceback (most recent call last):
        ValueError: DeltaNetConfig.feature_map must be one of ...
    """

    model_type = "memlm_deltanet"
    # The memory, under its name from 🤗 Transformers 5.24 and before.
    keys_to_ignore_at_inference = ["cache", "past_key_values"]

    vocab_size: int = 32000
    hidden_size: int = 768
    intermediate_size: int | None = None
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    key_head_dim: int | None = None
    value_head_dim: int | None = None
    feature_map: str = "dpfp"
    dpfp_nu: int = 1
    favor_features: int = 64
    query_key_normalization: str = "sum"
    update_rule: str = "delta"
    attention_normalizer: bool = False
    attention_normalizer_eps: float = 1e-6
    use_beta: bool = True
    short_convolution: bool = False
    convolution_size: int = 4
    output_norm: bool = False
    output_gate: bool = False
    value_activation: str = "identity"
    scale_queries: bool = False
    scale_output: bool = False
    position_encoding: str = "none"
    adaptive_softmax_cutoffs: list[int] | None = None
    chunk_size: int = 64
    hidden_act: str = "silu"
    hidden_dropout: float = 0.0
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02
    use_cache: bool = True
    tie_word_embeddings: bool = False
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self, **kwargs):
        reject_misspelled_options(self, kwargs)
        heads = self.num_attention_heads
        if (self.key_head_dim is None or self.value_head_dim is None) and is_positive_int(self.hidden_size):
            if not is_positive_int(heads):
                raise ValueError(f"DeltaNetConfig.num_attention_heads must be a positive integer, got {heads!r}.")
            if self.hidden_size % heads:
                raise ValueError(
                    f"DeltaNetConfig.hidden_size ({self.hidden_size}) is not a multiple of num_attention_heads "
                    f"({heads}); pass key_head_dim and value_head_dim explicitly or change one of them."
                )
            self.key_head_dim = self.hidden_size // heads if self.key_head_dim is None else self.key_head_dim
            self.value_head_dim = self.hidden_size // heads if self.value_head_dim is None else self.value_head_dim
        if self.intermediate_size is None and is_positive_int(self.hidden_size):
            self.intermediate_size = default_intermediate_size(self.hidden_size)
        self._validate()
        super().__post_init__(**kwargs)

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "DeltaNetConfig":
        """A config following one of the named layouts (`PRESETS`: `"paper"`, `"fla"`, the official scripts'
        models), with any field overridden."""
        if name not in PRESETS:
            raise ValueError(f"Unknown DeltaNet preset {name!r}; allowed presets: {', '.join(PRESETS)}.")
        return cls(**{**PRESETS[name], **overrides})

    @property
    def feature_dim(self) -> int:
        """Width d_k of φ(k) per head, i.e. the number of rows of each head's fast-weight matrix."""
        if self.feature_map == "dpfp":
            return 2 * self.dpfp_nu * self.key_head_dim
        if self.feature_map == "favor+":
            return self.favor_features
        return self.key_head_dim

    def estimated_parameters(self) -> int:
        """The number of parameters of a `DeltaNetForCausalLM` built from this config (tied embeddings counted once),
        from the sizes alone: nothing is built. The FAVOR+ projection is a buffer, not a parameter."""
        hidden, heads = self.hidden_size, self.num_attention_heads
        key_width, value_width = heads * self.key_head_dim, heads * self.value_head_dim
        attention = (2 * key_width + 2 * value_width) * hidden  # q, k, v and o projections
        attention += heads * hidden if self.use_beta else 0
        attention += (2 * key_width + value_width) * self.convolution_size if self.short_convolution else 0
        attention += value_width * hidden if self.output_gate else 0
        attention += self.value_head_dim if self.output_norm else 0
        layer = attention + self.block_parameters()  # MLP, the two norms, the output projection's bias
        clusters = len(self.adaptive_softmax_cutoffs or [])
        return self.num_hidden_layers * layer + self.head_parameters() + clusters * (self.hidden_size + 1)

    def describe(self) -> list[str]:
        """The configuration in words, one line per aspect (used by the model card)."""
        feature = {
            "dpfp": f"DPFP-{self.dpfp_nu} (deterministic parameter-free projection, paper Eq. 37)",
            "elu+1": "ELU + 1 (Katharopoulos et al., 2020)",
            "favor+": f"FAVOR+ with {self.favor_features} positive orthogonal random features (Performer)",
            "silu": "SiLU",
            "identity": "identity",
        }[self.feature_map]
        rule = (
            "delta rule: S_t = S_{t-1} + β_t k_t (v_t − S_{t-1}ᵀk_t)ᵀ"
            if self.update_rule == "delta"
            else "sum rule (linear attention): S_t = S_{t-1} + k_t v_tᵀ"
        ) + (", outputs divided by the attention normaliser z_tᵀq_t" if self.attention_normalizer else "")
        lines = [
            f"{self.num_hidden_layers} layers, hidden size {self.hidden_size}, {self.num_attention_heads} heads, "
            f"vocabulary of {self.vocab_size} tokens"
            + (", tied input/output embeddings" if self.tie_word_embeddings else ""),
            self.describe_block_layout(),
            f"Update rule: {rule}",
            f"Feature map φ on keys and queries: {feature}; normalisation: {self.query_key_normalization}",
            f"Fast-weight memory per head: {self.feature_dim} × {self.value_head_dim} "
            f"(key/query projection {self.key_head_dim} per head before φ)",
            "Write strength β_t = σ(w_β·x_t) learned per head" if self.use_beta else "Write strength β = 1",
            f"Short causal convolution of width {self.convolution_size} on queries, keys and values"
            if self.short_convolution
            else "No short convolution",
            "Per-head output: "
            + (
                " and ".join(
                    part for part, on in (("RMSNorm", self.output_norm), ("SiLU gate", self.output_gate)) if on
                )
                or "none"
            ),
            f"Values: {self.value_activation}; queries scaled by d_k^-1/2: {'yes' if self.scale_queries else 'no'}; "
            f"outputs scaled by key_head_dim^-1/2: {'yes' if self.scale_output else 'no'}",
            "Positions: "
            + (
                "Transformer-XL sinusoidal encoding, counting down within each call"
                if self.position_encoding == "sinusoidal"
                else "none (the order is in the recurrence)"
            ),
        ]
        if self.adaptive_softmax_cutoffs:
            lines.append(f"Output: adaptive softmax with cutoffs {self.adaptive_softmax_cutoffs}")
        return lines

    def _validate(self):
        check_positive_ints(
            self, "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "key_head_dim", "value_head_dim", "favor_features", "chunk_size",
        )  # fmt: skip
        check_choice(self, "feature_map", FEATURE_MAPS)
        check_choice(self, "query_key_normalization", NORMALIZATIONS)
        check_choice(self, "update_rule", UPDATE_RULES)
        check_choice(self, "value_activation", VALUE_ACTIVATIONS)
        check_choice(self, "hidden_act", HIDDEN_ACTIVATIONS)
        check_choice(self, "position_encoding", POSITION_ENCODINGS)
        self.validate_block_layout()
        if self.dpfp_nu not in (1, 2, 3) or isinstance(self.dpfp_nu, bool):
            raise ValueError(f"DeltaNetConfig.dpfp_nu must be 1, 2 or 3 (paper Eq. 37), got {self.dpfp_nu!r}.")
        check_bools(
            self, "attention_normalizer", "use_beta", "short_convolution", "output_norm", "output_gate",
            "scale_queries", "scale_output", "use_cache", "tie_word_embeddings",
        )  # fmt: skip
        if not is_int(self.convolution_size) or self.convolution_size < 2:
            raise ValueError(
                f"DeltaNetConfig.convolution_size must be an integer >= 2, got {self.convolution_size!r}."
            )
        check_number(self, "hidden_dropout", minimum=0, maximum=1, strict_maximum=True)
        check_number(self, "rms_norm_eps", minimum=0, strict_minimum=True)
        check_number(self, "attention_normalizer_eps", minimum=0)
        check_number(self, "initializer_range", minimum=0)
        if self.position_encoding == "sinusoidal" and self.hidden_size % 2:
            raise ValueError(
                f"DeltaNetConfig.position_encoding='sinusoidal' needs an even hidden_size (sines and cosines in "
                f"halves), got hidden_size={self.hidden_size}."
            )
        cutoffs = self.adaptive_softmax_cutoffs
        if cutoffs is not None and (
            not isinstance(cutoffs, (list, tuple))
            or not cutoffs
            or not all(is_int(cutoff) for cutoff in cutoffs)
            or list(cutoffs) != sorted(set(cutoffs))
            or cutoffs[0] <= 0
            or cutoffs[-1] >= self.vocab_size
        ):
            raise ValueError(
                "DeltaNetConfig.adaptive_softmax_cutoffs must be None or a non-empty list of increasing integers in "
                f"(0, vocab_size={self.vocab_size}), got {cutoffs!r}."
            )
        if cutoffs is not None:
            self.adaptive_softmax_cutoffs = list(cutoffs)
        # Combinations that make no sense.
        if self.query_key_normalization == "sum" and self.feature_map not in NONNEGATIVE_FEATURE_MAPS:
            raise ValueError(
                f"DeltaNetConfig.query_key_normalization='sum' divides by the sum of the feature components, which "
                f"needs a non-negative feature map ({', '.join(NONNEGATIVE_FEATURE_MAPS)}); feature_map="
                f"{self.feature_map!r} can be negative. Use query_key_normalization='l2' or 'none', or another "
                "feature map."
            )
        if self.attention_normalizer and self.feature_map not in NONNEGATIVE_FEATURE_MAPS:
            raise ValueError(
                "DeltaNetConfig.attention_normalizer=True divides by z_tᵀq_t, which needs a non-negative feature map "
                f"({', '.join(NONNEGATIVE_FEATURE_MAPS)}); got feature_map={self.feature_map!r}."
            )
        check_token_ids(self)
        check_buildable_size(self)


__all__ = ["DeltaNetConfig"]
