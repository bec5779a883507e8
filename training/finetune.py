"""Fine-tune a saved memlm model with the 🤗 Trainer (see `memlm.training.finetune` for what a run does and writes).

python training/finetune.py --model runs/tiny-deltanet --output-dir runs/tuned --data notes.txt
"""

from memlm.training.finetune import main

if __name__ == "__main__":
    main()
