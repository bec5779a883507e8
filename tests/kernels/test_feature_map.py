"""DeltaNet's DPFP feature map with its normalisation (memlm/kernels/delta_rule/feature_map.py) against the readable
definition, forward and backward, in every normalisation, ν and dtype DeltaNet uses."""

import pytest
import torch

from memlm import DeltaNetConfig, DeltaNetForCausalLM
from memlm.kernels.delta_rule import feature_map
from memlm.kernels.delta_rule.feature_map import dpfp, dpfp_reference

EPS = 1e-6


def _inputs(dtype, shape=(2, 3, 5, 8), seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(dtype).requires_grad_()


@pytest.mark.parametrize("normalization", ["none", "sum", "l2"])
@pytest.mark.parametrize("nu", [1, 2, 3])
def test_float64_gradcheck_and_equal_to_the_reference(normalization, nu):
    inputs = _inputs(torch.float64)
    assert torch.autograd.gradcheck(lambda x: dpfp(x, nu, normalization, EPS), (inputs,))
    output = dpfp(inputs, nu, normalization, EPS)
    expected = dpfp_reference(inputs, nu, normalization, EPS)
    torch.testing.assert_close(output, expected, rtol=1e-12, atol=1e-14)
    upstream = torch.randn_like(output)
    (grad,) = torch.autograd.grad(output, inputs, upstream)
    (expected_grad,) = torch.autograd.grad(expected, inputs, upstream)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("normalization", ["none", "sum", "l2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_lower_precisions_match_the_float64_reference(normalization, dtype):
    """float32 to float32 rounding; half inputs are computed in float32 and rounded once, so they are at least as
    close to the exact result as the op-by-op reference in that dtype."""
    inputs = _inputs(dtype, shape=(4, 2, 33, 16))
    exact_inputs = inputs.detach().double().requires_grad_()
    output = dpfp(inputs, 1, normalization, EPS)
    exact = dpfp_reference(exact_inputs, 1, normalization, EPS)
    reference = dpfp_reference(inputs, 1, normalization, EPS)
    assert output.dtype == dtype
    upstream = torch.randn(exact.shape, dtype=torch.float64)
    (grad,) = torch.autograd.grad(output, inputs, upstream.to(dtype))
    (exact_grad,) = torch.autograd.grad(exact, exact_inputs, upstream)
    (reference_grad,) = torch.autograd.grad(reference, inputs, upstream.to(dtype))
    for value, expected_value, op_by_op in ((output, exact, reference), (grad, exact_grad, reference_grad)):
        error = (value.double() - expected_value).abs().max()
        reference_error = (op_by_op.double() - expected_value).abs().max()
        bound = 1e-5 * expected_value.abs().max() if dtype == torch.float32 else reference_error
        assert error <= bound * 1.01 + 1e-12, (error, reference_error)


@pytest.mark.parametrize("normalization", ["none", "sum", "l2"])
@pytest.mark.parametrize("nu", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_few_vectors_take_fewer_ops_for_the_same_numbers(normalization, nu, dtype, monkeypatch):
    """Without gradients, a decoding step's few vectors run in the fewest ops, large inputs write in place: the two give
    the same bits (the same products and the same sums), zeros and negative zeros included."""
    inputs = _inputs(dtype, shape=(2, 8, 1, 16)).detach()
    inputs[0, 0, 0, :4] = torch.tensor([0.0, -0.0, 0.0, -0.0])
    assert inputs.numel() <= feature_map.FEW_NUMBERS < 64 * 16 * 128 * 64  # decoding: few; a prefill: sparing
    with torch.no_grad():
        few = dpfp(inputs, nu, normalization, EPS)
        monkeypatch.setattr(feature_map, "FEW_NUMBERS", 0)  # every input takes the memory-sparing path
        sparing = dpfp(inputs, nu, normalization, EPS)
    assert few.dtype == sparing.dtype == dtype
    assert torch.equal(few, sparing)


def test_sum_normalisation_of_an_all_zero_vector_is_clamped():
    """A vector whose features sum to 0 (here x = 0, so r = 0) divides by ε: features and gradients stay finite,
    as in the reference."""
    inputs = torch.zeros(1, 4, dtype=torch.float64, requires_grad=True)
    output = dpfp(inputs, 1, "sum", EPS)
    output.sum().backward()
    assert torch.equal(output, torch.zeros_like(output)) and torch.isfinite(inputs.grad).all()
    expected = torch.zeros(1, 4, dtype=torch.float64, requires_grad=True)
    dpfp_reference(expected, 1, "sum", EPS).sum().backward()
    torch.testing.assert_close(inputs.grad, expected.grad)


def test_bad_arguments_say_what_is_allowed():
    with pytest.raises(ValueError, match=r"normalization='max' is not one of \('none', 'sum', 'l2'\)"):
        dpfp(torch.randn(2, 4), 1, "max")
    with pytest.raises(ValueError, match=r"nu=8 must be between 1 and 2·d − 1 = 7"):
        dpfp(torch.randn(2, 4), 8)


@pytest.mark.parametrize("normalization", ["sum", "l2", "none"])
def test_deltanet_with_dpfp_gives_the_reference_feature_map_results(normalization, monkeypatch):
    """The model's logits and gradients are those of the op-by-op feature map."""
    import memlm.modeling.modeling_deltanet as modeling

    config = DeltaNetConfig.from_preset("paper", vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, dpfp_nu=2,
                                        query_key_normalization=normalization)  # fmt: skip
    torch.manual_seed(0)
    model = DeltaNetForCausalLM(config).double()
    tokens = torch.randint(0, 64, (2, 19))
    loss = model(tokens, labels=tokens).loss
    grads = torch.autograd.grad(loss, list(model.parameters()))
    monkeypatch.setattr(modeling, "dpfp", dpfp_reference)
    expected_loss = model(tokens, labels=tokens).loss
    expected_grads = torch.autograd.grad(expected_loss, list(model.parameters()))
    torch.testing.assert_close(loss, expected_loss, rtol=1e-12, atol=0)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, expected_grad, rtol=1e-9, atol=1e-12)
