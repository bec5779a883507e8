"""The tiny models the client tests drive (PEFT, lm-eval): one per memlm family, over the byte-level tokenizer."""

import torch

import memlm

FAMILIES = ["deltanet", "expire_span", "feedback_transformer"]


def tiny_model(family: str, tokenizer, **sizes):
    """A tiny model of `family` over the byte-level tokenizer, in eval mode, the same weights on every call. Its LM
    head scores only the lowercase letters (the other rows are zero), so greedy text is printable, never holds a stop
    string made of other characters and never stops early at <|endoftext|>. Its padding token has a non-zero embedding (as where
    padding is <|endoftext|>), so that only the attention mask keeps padding out. Expire-Span's spans start at 16 of
    its 32 tokens, so that its memory reaches back over the padding of a batch. `sizes`: other hidden or MLP widths."""
    torch.manual_seed(0)
    fields = {
        "vocab_size": len(tokenizer),
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        **sizes,
    }
    if family == "deltanet":
        model = memlm.DeltaNetForCausalLM(memlm.DeltaNetConfig.from_preset("fla", chunk_size=8, **fields))
    elif family == "expire_span":
        model = memlm.ExpireSpanForCausalLM(
            memlm.ExpireSpanConfig(max_span=32, ramp=4, block_size=4, initial_span_fraction=0.5, **fields)
        )
    else:
        model = memlm.FeedbackTransformerForCausalLM(memlm.FeedbackTransformerConfig(memory_span=4, **fields))
    letters = torch.zeros(len(tokenizer), dtype=torch.bool)
    letters[ord("a") : ord("z") + 1] = True
    with torch.no_grad():
        model.lm_head.weight[~letters] = 0.0
        model.get_input_embeddings().weight[tokenizer.pad_token_id].normal_()
    return model.eval()
