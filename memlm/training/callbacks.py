"""🤗 `Trainer` callbacks that keep memlm's models as their papers train them."""

from transformers import TrainerCallback

from ..modeling.modeling_feedback_transformer import clamp_adaptive_spans


class ClampAdaptiveSpans(TrainerCallback):
    """After every optimizer step, clamp the adaptive span's ratios z to [0, 1], as the official trainer of the
    Feedback Transformer does (`memlm.modeling.modeling_feedback_transformer.clamp_adaptive_spans`); nothing for a
    model without adaptive span. `memlm finetune` adds it; pass it to your own `Trainer`:

    Example:
        >>> from memlm.training.callbacks import ClampAdaptiveSpans
        >>> from transformers import Trainer
        >>> callbacks = [ClampAdaptiveSpans()]  # Trainer(model=model, args=args, ..., callbacks=callbacks)
    """

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if model is not None:
            clamp_adaptive_spans(model)
