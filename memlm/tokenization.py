"""A byte-level tokenizer built with 🤗 `tokenizers`: no download and no training, so every machine can make it.

Token id b (0-255) is the byte b; then come the special tokens. Any text round-trips exactly.

Both tokenizers here carry a chat template (`CHAT_TEMPLATE`), so that chat pipelines, `apply_chat_template` and the
chat endpoints of `memlm serve` / `transformers serve` take them. It adds no token: a conversation is a document that
starts with `<|endoftext|>`, and each message is its role, a colon and a space, its text, then `<|endoftext|>`:

    <|endoftext|>system: Be brief.<|endoftext|>user: Hi<|endoftext|>assistant: Hello<|endoftext|>

With `add_generation_prompt=True` it ends with `assistant: `; the model's answer ends where it writes
`<|endoftext|>`, its end of text, at which `generate` stops when the model's config has `eos_token_id` (build configs
with the tokenizer's `bos_token_id`, `eos_token_id` and `pad_token_id`, as `memlm train` does).
"""

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

END_OF_TEXT = "<|endoftext|>"
PADDING = "<|pad|>"
# A message's content is a string, or a list of parts of which the text ones count (OpenAI's and 🤗's chat formats).
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{- message['role'] + ': ' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] if part['type'] == 'text' -%}{{- part['text'] -}}{%- endfor -%}"
    "{%- endif -%}"
    "{{- eos_token -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- 'assistant: ' -}}{%- endif -%}"
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable characters (what ByteLevel pre-tokenizes to)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    characters = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            characters.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, characters)))


def byte_level_tokenizer(model_max_length: int = 1_000_000) -> PreTrainedTokenizerFast:
    """A `PreTrainedTokenizerFast` with 258 tokens: the 256 bytes, `<|endoftext|>` (256, also BOS) and `<|pad|>`
    (257), with the chat template `CHAT_TEMPLATE`. Save it beside a model with `save_pretrained`;
    `AutoTokenizer.from_pretrained` loads it back.

    Example:
        >>> from memlm.tokenization import byte_level_tokenizer
        >>> tokenizer = byte_level_tokenizer()
        >>> len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
        (258, 256, 256, 257)
        >>> tokenizer("é!").input_ids  # UTF-8 bytes: é is two
        [195, 169, 33]
        >>> tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
        '<|endoftext|>user: Hi<|endoftext|>assistant: '
    """
    byte_to_char = _bytes_to_unicode()
    vocabulary = {byte_to_char[byte]: byte for byte in range(256)}
    tokenizer = Tokenizer(models.BPE(vocab=vocabulary, merges=[], fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([END_OF_TEXT, PADDING])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=END_OF_TEXT,
        eos_token=END_OF_TEXT,
        pad_token=PADDING,
        model_max_length=model_max_length,
        chat_template=CHAT_TEMPLATE,
    )


def train_byte_level_bpe(texts, vocab_size: int, model_max_length: int = 1_000_000) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on `texts` with 🤗 `tokenizers`: the 256 bytes first (so any text still
    round-trips), then merges up to `vocab_size` tokens, then `<|endoftext|>` and `<|pad|>` and the chat template as
    in `byte_level_tokenizer`. Deterministic for the same texts."""
    from tokenizers import trainers

    if vocab_size < 258:
        raise ValueError(f"vocab_size must be at least 258 (256 bytes and 2 special tokens), got {vocab_size}.")
    byte_to_char = _bytes_to_unicode()
    tokenizer = Tokenizer(models.BPE(fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 2,
        initial_alphabet=[byte_to_char[byte] for byte in range(256)],
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.add_special_tokens([END_OF_TEXT, PADDING])
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=END_OF_TEXT,
        eos_token=END_OF_TEXT,
        pad_token=PADDING,
        model_max_length=model_max_length,
        chat_template=CHAT_TEMPLATE,
    )
