"""Training memlm models: data sources and batches (`data`), Accelerate pretraining (`pretrain`), presets."""


class TrainingError(ValueError):
    """A training or fine-tuning run that was refused or stopped: the message (one line) says what is wrong and
    what to do. `memlm train` / `memlm finetune` show it as `error: <message>`."""
