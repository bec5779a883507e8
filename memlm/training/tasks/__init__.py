"""The papers' synthetic tasks as deterministic generators of 🤗 `datasets` (SPEC §7), with the shared tokenizer,
example format, brute-force check and training loop in `common`."""
