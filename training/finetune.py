"""Fine-tune a saved memlm model with the 🤗 Trainer (see `memlm.training.finetune` for what a run does and writes).

python training/finetune.py --model runs/tiny-deltanet --output-dir runs/tuned --data notes.txt
"""

from memlm.cli import script_main
from memlm.training.finetune import main

if __name__ == "__main__":
    script_main(main)  # bad input: one line and exit status 1 (--debug: the traceback)
