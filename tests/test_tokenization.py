"""memlm's tokenizers carry a chat template, and a checkpoint built with one as the README shows stops at the end of
text."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor, LogitsProcessorList

from memlm import DeltaNetConfig, DeltaNetForCausalLM
from memlm.tokenization import CHAT_TEMPLATE, byte_level_tokenizer, train_byte_level_bpe

# 🤗-facing: also run under the newest and the oldest 🤗 releases allowed (`make test-releases`).
pytestmark = pytest.mark.huggingface

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image", "url": "cat.png"}]},
    {"role": "assistant", "content": "Hello"},
]


def test_the_chat_template_writes_roles_between_ends_of_text_and_survives_saving(tmp_path):
    tokenizer = byte_level_tokenizer()
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.chat_template == CHAT_TEMPLATE
    text = loaded.apply_chat_template(CONVERSATION, tokenize=False)
    assert text == "<|endoftext|>system: Be brief.<|endoftext|>user: Hi<|endoftext|>assistant: Hello<|endoftext|>"
    ids = loaded.apply_chat_template(CONVERSATION[:2], add_generation_prompt=True)["input_ids"]
    assert ids == [256, *b"system: Be brief.", 256, *b"user: Hi", 256, *b"assistant: "]


def test_a_trained_bpe_has_the_same_chat_template():
    tokenizer = train_byte_level_bpe(["def add(a, b):\n    return a + b\n"] * 20, vocab_size=270)
    text = tokenizer.apply_chat_template(CONVERSATION[1:], tokenize=False)
    assert text == "<|endoftext|>user: Hi<|endoftext|>assistant: Hello<|endoftext|>"
    assert tokenizer.convert_tokens_to_ids("<|endoftext|>") == tokenizer.eos_token_id == 268


class EndOfTextAt(LogitsProcessor):
    """Makes `<|endoftext|>` the `step`-th new token, as a trained model ends its text; other steps are left alone."""

    def __init__(self, prompt_length: int, step: int, end_of_text: int):
        self.position, self.end_of_text = prompt_length + step - 1, end_of_text

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] != self.position:
            return scores
        forced = torch.full_like(scores, -torch.inf)
        forced[:, self.end_of_text] = 0
        return forced


def test_a_checkpoint_built_as_the_readme_shows_stops_at_the_end_of_text(tmp_path):
    tokenizer = byte_level_tokenizer()
    config = DeltaNetConfig.from_preset(
        "paper", vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    DeltaNetForCausalLM(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    generation_config = model.generation_config
    assert (generation_config.bos_token_id, generation_config.eos_token_id, generation_config.pad_token_id) == (
        256, 256, 257,
    )  # fmt: skip

    prompt = tokenizer("Fast weights", return_tensors="pt")
    length = prompt.input_ids.shape[1]
    end = LogitsProcessorList([EndOfTextAt(length, step=4, end_of_text=256)])
    output = model.generate(**prompt, max_new_tokens=20, do_sample=False, logits_processor=end)
    assert output.shape == (1, length + 4) and int(output[0, -1]) == 256
    # Without the end of text in the generation config, the same end of text does not stop it.
    generation_config.eos_token_id = None
    output = model.generate(**prompt, max_new_tokens=20, do_sample=False, logits_processor=end)
    assert output.shape == (1, length + 20) and int(output[0, length + 3]) == 256
