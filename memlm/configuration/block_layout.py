"""The layout of a decoder block around its token mixer, shared by memlm's configs (SPEC §8).

memlm's default is the layout of 🤗 Llama: pre-norm RMSNorm blocks, a gated MLP without biases, a final norm. The
papers' official code builds its blocks otherwise (Transformer-XL for DeltaNet; facebookresearch/
transformer-sequential for Expire-Span and the Feedback Transformer): LayerNorm with a bias, norms after the residual
sum, a plain biased ReLU feed-forward, a bias on the output layer, dropout in more places. `BlockLayout` holds those
choices once; a config inherits it next to `PreTrainedConfig` and calls `validate_block_layout` from its checks.
"""

from dataclasses import dataclass

from .validation import check_bools, check_choice, check_number

NORM_TYPES = ("rmsnorm", "layernorm")
NORM_POSITIONS = ("pre", "post")
MLP_TYPES = ("gated", "plain")


@dataclass(kw_only=True)
class BlockLayout:
    r"""
    Block layout fields, shared by `DeltaNetConfig` (and, as they learn them, the other configs). The defaults are
    memlm's layout; the papers' official models set them as "The papers' models" in the docs lists.

    Args:
        norm_type: `"rmsnorm"` (default; a weight, no bias) or `"layernorm"` (LayerNorm with weight and bias, as the
            official code of all three papers).
        layer_norm_eps: epsilon of every LayerNorm (with `norm_type="layernorm"`); `rms_norm_eps` is the RMSNorm's.
        norm_position: `"pre"` (default): `x + f(norm(x))`; `"post"`: `norm(x + f(x))`, the official default of
            Transformer-XL and transformer-sequential.
        final_norm: a norm after the last block, before the LM head (pre-norm models need one; the official
            post-norm models have none).
        mlp_type: `"gated"` (default): `down(act(gate(x)) · up(x))`; `"plain"`: `down(dropout(act(up(x))))`, the
            official feed-forward (with `hidden_act="relu"` and `mlp_bias=True`).
        mlp_bias: biases on the MLP's linear layers.
        attention_output_bias: a bias on the token mixer's output projection.
        lm_head_bias: a bias on the LM head (also when its weight is tied to the embedding).
        embedding_scale: the token embeddings are multiplied by this number (Transformer-XL: `sqrt(hidden_size)`);
            applies to `inputs_embeds` passed in as well.
        embedding_dropout: dropout on the (scaled, position-encoded) embeddings entering the first block.
        activation_dropout: dropout after the MLP's activation (the official code's dropout inside the feed-forward).
        output_dropout: dropout on the last hidden states before the LM head (Transformer-XL).
    """

    norm_type: str = "rmsnorm"
    layer_norm_eps: float = 1e-5
    norm_position: str = "pre"
    final_norm: bool = True
    mlp_type: str = "gated"
    mlp_bias: bool = False
    attention_output_bias: bool = False
    lm_head_bias: bool = False
    embedding_scale: float = 1.0
    embedding_dropout: float = 0.0
    activation_dropout: float = 0.0
    output_dropout: float = 0.0

    def validate_block_layout(self):
        check_choice(self, "norm_type", NORM_TYPES)
        check_choice(self, "norm_position", NORM_POSITIONS)
        check_choice(self, "mlp_type", MLP_TYPES)
        check_bools(self, "final_norm", "mlp_bias", "attention_output_bias", "lm_head_bias")
        check_number(self, "layer_norm_eps", minimum=0, strict_minimum=True)
        check_number(self, "embedding_scale", minimum=0, strict_minimum=True)
        for field in ("embedding_dropout", "activation_dropout", "output_dropout"):
            check_number(self, field, minimum=0, maximum=1, strict_maximum=True)

    def norm_parameters(self, width: int) -> int:
        """Parameters of one norm over `width` features."""
        return width * (2 if self.norm_type == "layernorm" else 1)

    def block_parameters(self) -> int:
        """Parameters of one block outside its token mixer: the MLP, the two norms and the mixer's output bias."""
        hidden, inner = self.hidden_size, self.intermediate_size
        if self.mlp_type == "gated":
            mlp = 3 * hidden * inner + (2 * inner + hidden if self.mlp_bias else 0)
        else:
            mlp = 2 * hidden * inner + (inner + hidden if self.mlp_bias else 0)
        return mlp + 2 * self.norm_parameters(hidden) + (hidden if self.attention_output_bias else 0)

    def head_parameters(self) -> int:
        """Parameters around the blocks: embeddings, LM head (and its bias), final norm."""
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        final = self.norm_parameters(self.hidden_size) if self.final_norm else 0
        return embeddings + final + (self.vocab_size if self.lm_head_bias else 0)

    def describe_block_layout(self) -> str:
        """The block layout in words (one model-card line)."""
        norm = "RMSNorm" if self.norm_type == "rmsnorm" else "LayerNorm"
        mlp = (
            f"gated MLP of width {self.intermediate_size} ({self.hidden_act})"
            if self.mlp_type == "gated"
            else f"plain MLP of width {self.intermediate_size} ({self.hidden_act})"
        )
        parts = [
            f"{self.norm_position}-norm {norm} blocks",
            mlp + (" with biases" if self.mlp_bias else ""),
            "a final norm" if self.final_norm else "no final norm",
        ]
        if self.lm_head_bias:
            parts.append("a biased LM head")
        if self.embedding_scale != 1:
            parts.append(f"embeddings scaled by {self.embedding_scale:g}")
        return "Blocks: " + ", ".join(parts)


__all__ = ["BlockLayout"]
