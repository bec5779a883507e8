"""Pretrain a memlm model with 🤗 Accelerate (see `memlm.training.pretrain` for what a run does and writes).

python training/train.py --preset tiny-deltanet --output-dir runs/tiny-deltanet
accelerate launch --config_file training/accelerate/ddp.yaml training/train.py --preset ... --output-dir ...
"""

from memlm.cli import script_main
from memlm.training.pretrain import main

if __name__ == "__main__":
    script_main(main)  # bad input: one line and exit status 1 (--debug: the traceback)
