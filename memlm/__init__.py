"""memlm: memory-augmented language models (DeltaNet, Expire-Span, Feedback Transformer) for 🤗 Transformers.

Importing memlm registers its configurations and models with AutoConfig, AutoModel and AutoModelForCausalLM.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from .configuration.configuration_deltanet import DeltaNetConfig
from .configuration.configuration_expire_span import ExpireSpanConfig
from .configuration.configuration_feedback_transformer import FeedbackTransformerConfig
from .configuration.validation import name_unknown_memlm_types
from .modeling.modeling_deltanet import DeltaNetCache, DeltaNetForCausalLM, DeltaNetModel, DeltaNetPreTrainedModel
from .modeling.modeling_expire_span import (
    ExpireSpanCache,
    ExpireSpanForCausalLM,
    ExpireSpanModel,
    ExpireSpanPreTrainedModel,
)
from .modeling.modeling_feedback_transformer import (
    FeedbackCache,
    FeedbackTransformerForCausalLM,
    FeedbackTransformerModel,
    FeedbackTransformerPreTrainedModel,
)

__version__ = "0.1.0"

AutoConfig.register(DeltaNetConfig.model_type, DeltaNetConfig, exist_ok=True)
AutoModel.register(DeltaNetConfig, DeltaNetModel, exist_ok=True)
AutoModelForCausalLM.register(DeltaNetConfig, DeltaNetForCausalLM, exist_ok=True)
AutoConfig.register(ExpireSpanConfig.model_type, ExpireSpanConfig, exist_ok=True)
AutoModel.register(ExpireSpanConfig, ExpireSpanModel, exist_ok=True)
AutoModelForCausalLM.register(ExpireSpanConfig, ExpireSpanForCausalLM, exist_ok=True)
AutoConfig.register(FeedbackTransformerConfig.model_type, FeedbackTransformerConfig, exist_ok=True)
AutoModel.register(FeedbackTransformerConfig, FeedbackTransformerModel, exist_ok=True)
AutoModelForCausalLM.register(FeedbackTransformerConfig, FeedbackTransformerForCausalLM, exist_ok=True)
name_unknown_memlm_types(CONFIG_MAPPING)  # config.json with a memlm_* type memlm does not know: memlm's words

__all__ = [
    "DeltaNetCache",
    "DeltaNetConfig",
    "DeltaNetForCausalLM",
    "DeltaNetModel",
    "DeltaNetPreTrainedModel",
    "ExpireSpanCache",
    "ExpireSpanConfig",
    "ExpireSpanForCausalLM",
    "ExpireSpanModel",
    "ExpireSpanPreTrainedModel",
    "FeedbackCache",
    "FeedbackTransformerConfig",
    "FeedbackTransformerForCausalLM",
    "FeedbackTransformerModel",
    "FeedbackTransformerPreTrainedModel",
]
