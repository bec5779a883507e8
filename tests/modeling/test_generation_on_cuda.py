"""On a GPU, greedy generation gives the tokens the CPU gives, for each family and each kernel backend that runs it
there: memlm's Triton kernels and flash-linear-attention's for DeltaNet, memlm's Triton attention for Expire-Span,
PyTorch's step loop for the Feedback Transformer (tests marked gpu: `make gpu-check` runs them).

float32 weights, a prompt of 100 tokens (two chunks of DeltaNet's 64, four of Expire-Span's blocks of 32, past the
Feedback Transformer's memory span of 32) and 12 new tokens. The GPU's delta rule multiplies float32 in TF32, so its
logits differ from the CPU's in the third or fourth digit: each prompt was drawn (seeded) so that the CPU's best token
leads the second by more than MARGIN at every step, many times that difference, and the tokens must then agree."""

import copy

import pytest
import torch

from memlm import (
    DeltaNetConfig,
    DeltaNetForCausalLM,
    ExpireSpanConfig,
    ExpireSpanForCausalLM,
    FeedbackTransformerConfig,
    FeedbackTransformerForCausalLM,
)
from memlm.compat import output_cache
from memlm.kernels import flash_linear_attention_available

SIZES = {
    "vocab_size": 258,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "eos_token_id": 256,
    "bos_token_id": 256,
    "pad_token_id": 257,
}
BUILDERS = {
    "deltanet": lambda: DeltaNetForCausalLM(DeltaNetConfig.from_preset("fla", chunk_size=64, **SIZES)),
    "expire_span": lambda: ExpireSpanForCausalLM(ExpireSpanConfig(max_span=64, ramp=16, block_size=32, **SIZES)),
    "feedback": lambda: FeedbackTransformerForCausalLM(FeedbackTransformerConfig(memory_span=32, **SIZES)),
}
# (family, backend on the GPU, seed of the prompt).
CASES = {
    "deltanet_triton": ("deltanet", "triton", 25),
    "deltanet_fla": ("deltanet", "fla", 25),
    "expire_span_triton": ("expire_span", "triton", 2),
    "feedback_torch": ("feedback", "torch", 0),
}
PROMPT_LENGTH, NEW_TOKENS = 100, 12
MARGIN = 0.1  # logits of about 1.2 (Feedback) to 2.4 RMS
LOGITS_TOLERANCE = 5e-3  # relative RMS error of each step's logits: float32 on the GPU (TF32 products) allows 5e-3
# How far each family's weights are spread past their initialisation (randn · SPREAD added), for logits of a few
# units. The Feedback Transformer's recurrence through its memory amplifies differences when its weights are wider:
# at 0.2, a change of 1e-6 in the weights changed its logits by O(1) after the 100-token prompt (seen here, so the
# GPU's rounding alone changed tokens on an H200); at 0.1 float32 is within 3e-6 of float64 on the CPU.
SPREAD = {"deltanet": 0.2, "expire_span": 0.2, "feedback": 0.1}


def _model(family: str):
    """The family's model with weights spread wider than at initialisation (SPREAD), seed 0."""
    torch.manual_seed(0)
    model = BUILDERS[family]()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * SPREAD[family])
    return model.eval()


def _generate(model, prompt):
    return model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, pad_token_id=SIZES["pad_token_id"])  # fmt: skip


def _relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    return ((value.double() - reference.double()).norm() / reference.double().norm()).item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_generation_on_cuda_equals_the_cpu_s(case, monkeypatch):
    family, backend, seed = CASES[case]
    if backend == "fla" and not flash_linear_attention_available():
        pytest.skip("flash-linear-attention >= 0.6 is not installed")
    model = _model(family)
    prompt = torch.randint(0, 256, (2, PROMPT_LENGTH), generator=torch.Generator().manual_seed(seed))
    monkeypatch.setenv("MEMLM_KERNELS", "torch")
    expected = _generate(model, prompt)
    best_two = torch.stack(expected.logits).topk(2, dim=-1).values
    assert (best_two[..., 0] - best_two[..., 1]).min() > MARGIN  # the greedy choices are clear on the CPU
    monkeypatch.setenv("MEMLM_KERNELS", backend)
    generated = _generate(copy.deepcopy(model).cuda(), prompt.cuda())
    assert torch.equal(generated.sequences.cpu(), expected.sequences)
    assert len(generated.logits) == len(expected.logits) == NEW_TOKENS
    for step, (logits, reference) in enumerate(zip(generated.logits, expected.logits)):
        assert _relative_error(logits.cpu(), reference) < LOGITS_TOLERANCE, step


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", list(CASES))
def test_a_non_finite_input_stays_in_place_on_cuda(case, monkeypatch):
    """Issue 33 on a GPU, where the operations are not checked at every call: with a NaN or inf at position t, in a
    forward that continues a memory, every logit before t equals the logit without it, the other row is untouched, and
    the memory goes on as the per-call-checked path leaves it (one read-back per forward, then a checked rerun)."""
    family, backend, seed = CASES[case]
    if backend == "fla" and not flash_linear_attention_available():
        pytest.skip("flash-linear-attention >= 0.6 is not installed")
    monkeypatch.setenv("MEMLM_KERNELS", backend)
    model = _model(family).cuda()
    generator = torch.Generator().manual_seed(seed)
    prefix, tokens, follow = (torch.randint(0, 256, (2, length), generator=generator).cuda() for length in (40, 90, 8))
    clean = model.get_input_embeddings()(tokens).detach()

    def run(embeddings):
        with torch.no_grad():
            cache = output_cache(model(prefix, use_cache=True))
            logits = model(inputs_embeds=embeddings, cache=cache).logits
            return logits, model(follow, cache=cache).logits

    expected, expected_after = run(clean)
    for position, value in ((70, float("nan")), (9, float("inf"))):
        poisoned = clean.clone()
        poisoned[1, position, 5] = value
        logits, after = run(poisoned)
        assert torch.isfinite(logits[1, :position]).all(), (position, value)
        assert _relative_error(logits[1, :position].cpu(), expected[1, :position].cpu()) < LOGITS_TOLERANCE
        assert _relative_error(logits[0].cpu(), expected[0].cpu()) < LOGITS_TOLERANCE
        assert _relative_error(after[0].cpu(), expected_after[0].cpu()) < LOGITS_TOLERANCE
