"""Train a memlm model (or a same-size 🤗 Llama) on a folder written by make_dataset.py, report its accuracy and save it.

python training/tasks/train_task.py --data data/corridor --model expire-span --output-dir runs/corridor \
    --config '{"max_span": 128, "span_loss_coefficient": 0.001}' --steps 600
"""

from memlm.cli import script_main
from memlm.training.tasks.commands import train_task

if __name__ == "__main__":
    script_main(train_task)  # bad input: one line and exit status 1 (--debug: the traceback)
