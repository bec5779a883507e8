"""Training memlm models: data sources and batches (`data`), Accelerate pretraining (`pretrain`), presets."""
