"""PEFT LoRA on the three memlm families, with the real `peft` package: a zero adapter changes nothing, training moves
only the adapter, `generate` through the adapter is the model's own greedy decoding (also on a left-padded batch), and
an adapter saved and loaded again, or merged into the base weights, gives the same logits."""

import pytest

pytest.importorskip("peft")

import torch  # noqa: E402
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402

from tests.clients.models import FAMILIES, tiny_model  # noqa: E402

# peft's own internals, not these tests: `PeftModel.__init__` reads `model.is_gradient_checkpointing` (peft 0.21.2,
# peft/peft_model.py line 184: `if getattr(model, "is_gradient_checkpointing", True)`), a property 🤗 Transformers
# 5.24 deprecates with this FutureWarning. Only that warning is let through. 🤗-facing: also run under the newest and
# the oldest 🤗 releases allowed (`make test-releases`).
pytestmark = [
    pytest.mark.huggingface,
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
]

# Every linear layer of each family but the LM head, by the names the models give them.
LORA_TARGETS = {
    "deltanet": ["q_proj", "k_proj", "v_proj", "beta_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "expire_span": ["q_proj", "k_proj", "v_proj", "o_proj", "span_predictor", "gate_proj", "up_proj", "down_proj"],
    "feedback_transformer": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}

LORA_TARGETS_ALL = {name for names in LORA_TARGETS.values() for name in names}

PROMPTS = ["the quick brown fox jumps", "over"]  # unequal lengths: the batch is padded
NEW_TOKENS = 6


def lora_config(family: str, zero_adapter: bool = True) -> LoraConfig:
    """LoRA on every linear layer of `family`; `zero_adapter=False` draws B at random too, so the adapter acts."""
    return LoraConfig(
        r=4, lora_alpha=8, target_modules=LORA_TARGETS[family], task_type="CAUSAL_LM", init_lora_weights=zero_adapter
    )


def padded_batch(tokenizer):
    return tokenizer(PROMPTS, return_tensors="pt", padding=True, padding_side="left")


def real_logits(model, batch) -> torch.Tensor:
    """The logits at the real (unpadded) positions of `batch`, flattened to (tokens, vocabulary)."""
    with torch.no_grad():
        logits = model(**batch).logits
    return logits[batch["attention_mask"].bool()]


def linear_layers_by_name(model) -> dict[str, int]:
    """How many modules of `model` are linear layers (LoRA on them or not) under each LoRA target name."""
    counts = {}
    for name, module in model.named_modules():
        base = getattr(module, "base_layer", module)
        if name.split(".")[-1] in LORA_TARGETS_ALL and isinstance(base, torch.nn.Linear):
            counts[name.split(".")[-1]] = counts.get(name.split(".")[-1], 0) + 1
    return counts


def adapted_by_name(peft_model) -> dict[str, int]:
    """How many modules of `peft_model` carry a LoRA adapter, under each target name."""
    counts = {}
    for name, module in peft_model.named_modules():
        if hasattr(module, "lora_A"):
            counts[name.split(".")[-1]] = counts.get(name.split(".")[-1], 0) + 1
    return counts


@pytest.mark.parametrize("family", FAMILIES)
def test_zero_adapter_keeps_the_base_logits(family, tokenizer):
    model = tiny_model(family, tokenizer)
    batch = padded_batch(tokenizer)
    base = real_logits(model, batch)
    peft_model = get_peft_model(model, lora_config(family))

    # Each target name is a real linear layer of the model, and every layer under it carries an adapter (the
    # Feedback Transformer shares one key and one value projection between its layers).
    linear_layers = linear_layers_by_name(peft_model)
    assert set(linear_layers) == set(LORA_TARGETS[family])
    assert adapted_by_name(peft_model) == linear_layers
    torch.testing.assert_close(real_logits(peft_model, batch), base, rtol=1e-5, atol=1e-5)

    # Each adapter is on the path the model computes (DeltaNet fuses its q/k/v projections when they are plain
    # linear layers): a non-zero B under any one target name changes the logits.
    for target in LORA_TARGETS[family]:
        adapter_weights = [
            parameter for name, parameter in peft_model.named_parameters() if f".{target}.lora_B." in name
        ]
        assert adapter_weights, target
        with torch.no_grad():
            for parameter in adapter_weights:
                parameter.normal_()
        assert not torch.allclose(real_logits(peft_model, batch), base, rtol=1e-4, atol=1e-4), target
        with torch.no_grad():
            for parameter in adapter_weights:
                parameter.zero_()


@pytest.mark.parametrize("family", FAMILIES)
def test_training_moves_only_the_adapter(family, tokenizer):
    peft_model = get_peft_model(tiny_model(family, tokenizer), lora_config(family)).train()
    trainable = {name for name, parameter in peft_model.named_parameters() if parameter.requires_grad}
    assert trainable and all("lora_A" in name or "lora_B" in name for name in trainable)
    before = {name: parameter.detach().clone() for name, parameter in peft_model.named_parameters()}
    # Every parameter is handed to the optimizer: only peft's freezing keeps the base weights still.
    optimizer = torch.optim.Adam(peft_model.parameters(), lr=1e-2)
    batch = tokenizer(["abcdabcdabcdabcdabcd", "wxyzwxyzwxyzwxyzwxyz"], return_tensors="pt")

    losses = []
    for step in range(4):
        loss = peft_model(**batch, labels=batch["input_ids"]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if step == 0:
            changed = {
                name for name, parameter in peft_model.named_parameters() if not torch.equal(parameter, before[name])
            }
            assert changed <= trainable, f"weights outside the adapter moved: {sorted(changed - trainable)}"
            assert {name for name in trainable if "lora_B" in name} <= changed
    assert all(later < earlier for earlier, later in zip(losses, losses[1:])) and losses[-1] < losses[0] - 0.1, losses


def greedy_by_argmax(model, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    """`steps` tokens after `prompt` (1-D), each the argmax of a full forward pass over everything so far: no cache."""
    tokens = prompt[None]
    with torch.no_grad():
        for _ in range(steps):
            next_token = model(input_ids=tokens).logits[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, next_token], dim=1)
    return tokens[0, prompt.numel() :]


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_through_the_adapter_is_greedy_decoding(family, tokenizer):
    peft_model = get_peft_model(tiny_model(family, tokenizer), lora_config(family, zero_adapter=False)).eval()
    prompts = [torch.tensor(tokenizer(text)["input_ids"]) for text in PROMPTS]
    expected = [greedy_by_argmax(peft_model, prompt, NEW_TOKENS) for prompt in prompts]
    with peft_model.disable_adapter():
        base_expected = greedy_by_argmax(peft_model, prompts[0], NEW_TOKENS)
    assert not torch.equal(expected[0], base_expected), "the adapter should change what the model says"

    alone = peft_model.generate(input_ids=prompts[0][None], max_new_tokens=NEW_TOKENS, do_sample=False)
    assert torch.equal(alone[0, : prompts[0].numel()], prompts[0])
    assert torch.equal(alone[0, prompts[0].numel() :], expected[0])

    batch = padded_batch(tokenizer)
    assert not batch["attention_mask"].all()
    together = peft_model.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert together.shape == (len(PROMPTS), batch["input_ids"].shape[1] + NEW_TOKENS)
    for row, tokens in enumerate(expected):
        assert torch.equal(together[row, -NEW_TOKENS:], tokens), f"row {row} ({PROMPTS[row]!r})"


@pytest.mark.parametrize("family", FAMILIES)
def test_saved_adapter_and_merged_weights_give_the_same_logits(family, tokenizer, tmp_path):
    batch = padded_batch(tokenizer)
    base = real_logits(tiny_model(family, tokenizer), batch)
    peft_model = get_peft_model(tiny_model(family, tokenizer), lora_config(family, zero_adapter=False)).eval()
    adapted = real_logits(peft_model, batch)
    assert not torch.allclose(adapted, base, rtol=1e-3, atol=1e-3)

    peft_model.save_pretrained(tmp_path)
    assert (tmp_path / "adapter_model.safetensors").is_file() and (tmp_path / "adapter_config.json").is_file()
    assert not (tmp_path / "model.safetensors").exists()  # the adapter alone, not the base weights

    loaded = PeftModel.from_pretrained(tiny_model(family, tokenizer), tmp_path).eval()
    torch.testing.assert_close(real_logits(loaded, batch), adapted, rtol=0, atol=0)

    merged = loaded.merge_and_unload()
    assert type(merged) is type(peft_model.get_base_model())
    assert not any(hasattr(module, "lora_A") for module in merged.modules())
    torch.testing.assert_close(real_logits(merged, batch), adapted, rtol=0, atol=1e-5)
