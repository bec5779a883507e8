"""Write one of the papers' synthetic tasks (memlm.training.tasks) as a 🤗 DatasetDict with its tokenizer.

python training/tasks/make_dataset.py corridor --output-dir data/corridor --option max_length=64
python training/tasks/make_dataset.py associative-retrieval --output-dir data/ar2 --option setting=2 --option num_keys=20
"""

from memlm.cli import script_main
from memlm.training.tasks.commands import make_dataset

if __name__ == "__main__":
    script_main(make_dataset)  # bad input: one line and exit status 1 (--debug: the traceback)
