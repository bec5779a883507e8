"""The language-modelling loss of the three models: labels of the wrong shape are refused in words, a batch whose
labels are all ignored gives 0 and a zero gradient (🤗's Llama gives nan), and otherwise the loss is the mean
cross-entropy of the predicted tokens, exactly."""

import pytest
import torch
import torch.nn.functional as F

from memlm import (
    DeltaNetConfig,
    DeltaNetForCausalLM,
    ExpireSpanConfig,
    ExpireSpanForCausalLM,
    FeedbackTransformerConfig,
    FeedbackTransformerForCausalLM,
)

SIZES = {"vocab_size": 40, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
         "num_attention_heads": 2}  # fmt: skip
MODELS = {
    "deltanet": lambda: DeltaNetForCausalLM(DeltaNetConfig(**SIZES)),
    "expire_span": lambda: ExpireSpanForCausalLM(ExpireSpanConfig(max_span=16, block_size=8, **SIZES)),
    "feedback": lambda: FeedbackTransformerForCausalLM(FeedbackTransformerConfig(memory_span=4, **SIZES)),
}


@pytest.mark.parametrize("family", MODELS)
def test_labels_of_another_shape_are_refused_in_words(family):
    model = MODELS[family]()
    input_ids = torch.randint(0, 40, (2, 5))
    with pytest.raises(ValueError) as error:
        model(input_ids, labels=input_ids[:, :3])
    assert str(error.value) == "labels must have the shape of the inputs (batch, length) = (2, 5), got (2, 3)."
    with pytest.raises(ValueError, match=r"shift_labels must have the shape .* = \(2, 5\), got \(1, 5\)"):
        model(input_ids, shift_labels=input_ids[:1])


@pytest.mark.parametrize("family", MODELS)
def test_all_labels_ignored_give_zero_and_a_zero_gradient(family):
    torch.manual_seed(0)
    model = MODELS[family]()
    input_ids = torch.randint(0, 40, (2, 6))
    labels = torch.full_like(input_ids, -100)
    labels[:, 0] = input_ids[:, 0]  # the first label is never predicted (labels shift inside)
    outputs = model(input_ids, labels=labels)
    lm_loss = getattr(outputs, "lm_loss", None)
    lm_loss = outputs.loss if lm_loss is None else lm_loss
    assert lm_loss.item() == 0.0
    lm_loss.backward()
    for name, parameter in model.named_parameters():
        if parameter.grad is not None:
            assert torch.isfinite(parameter.grad).all() and not parameter.grad.any(), name


@pytest.mark.parametrize("family", MODELS)
def test_the_loss_is_the_mean_cross_entropy_of_the_predicted_tokens(family):
    torch.manual_seed(0)
    model = MODELS[family]().eval()
    input_ids = torch.randint(0, 40, (2, 7))
    labels = input_ids.clone()
    labels[0, 2:4] = -100
    with torch.no_grad():
        outputs = model(input_ids, labels=labels)
    expected = F.cross_entropy(outputs.logits[:, :-1].reshape(-1, 40).float(), labels[:, 1:].reshape(-1))
    lm_loss = getattr(outputs, "lm_loss", None)
    torch.testing.assert_close(outputs.loss if lm_loss is None else lm_loss, expected, rtol=0, atol=0)
