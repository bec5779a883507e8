"""The shared blocks of memlm/modeling/layers.py."""

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations, parametrize

from memlm.modeling.layers import LayerNorm, RMSNorm, layer_runs_as_defined, linear, own_parameter, runs_as_defined


class _Doubled(nn.Module):
    def forward(self, tensor):
        return 2 * tensor


def _linear(case: str) -> nn.Linear:
    torch.manual_seed(0)
    module = nn.Linear(6, 4, bias=case != "no_bias")
    if case == "weight_norm":  # a parametrized weight: kept in module.parametrizations, not in its parameters
        parametrizations.weight_norm(module)
    elif case == "parametrized_bias":
        parametrize.register_parametrization(module, "bias", _Doubled())
    return module


@pytest.mark.parametrize("case", ["bias", "no_bias", "weight_norm", "parametrized_bias", "hooked"])
def test_linear_is_the_modules_call(case):
    """`linear` (a decoding step's product without the module call) gives what calling the module gives: with and
    without a bias, with a parametrized weight or bias (which live outside the module's parameters), and with a hook,
    which then sees the call."""
    module, inputs = _linear(case), torch.randn(2, 3, 6)
    calls = []
    if case == "hooked":
        module.register_forward_hook(lambda *_: calls.append(1))
    expected = module(inputs)
    calls.clear()
    with torch.no_grad():
        assert torch.equal(linear(module, inputs), expected.detach())
    assert calls == ([1] if case == "hooked" else [])
    assert runs_as_defined(module) == (case != "hooked")


@pytest.mark.parametrize("norm_class", [LayerNorm, RMSNorm])
def test_norms_read_a_parametrized_weight(norm_class):
    """The norms read their parameters from `_parameters` (`own_parameter`), and a parametrized weight, which lives
    elsewhere, as the attribute: a doubled weight doubles the output."""
    norm, inputs = norm_class(6), torch.randn(2, 3, 6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    expected = norm(inputs) * 2 if norm_class is RMSNorm else (norm(inputs) - norm.bias) * 2 + norm.bias
    parametrize.register_parametrization(norm, "weight", _Doubled())
    assert own_parameter(norm, "weight") is not None and "weight" not in norm._parameters
    torch.testing.assert_close(norm(inputs), expected)


def test_layer_runs_as_defined_looks_at_children_and_theirs():
    """`layer_runs_as_defined` (a decoding step's one check per layer) is False when the layer, a child or a child's
    child has a hook or a forward of its own, True otherwise; after it, `linear(..., checked=True)` runs a module
    that is not a plain linear layer by its forward."""
    layer = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.LayerNorm(4))
    assert layer_runs_as_defined(layer)
    for module in (layer, layer[0], layer[1], layer[0][0], layer[0][1]):
        handle = module.register_forward_pre_hook(lambda *_: None)
        assert not layer_runs_as_defined(layer)
        handle.remove()
    layer[0][1].forward = lambda inputs: inputs
    assert not layer_runs_as_defined(layer)
    del layer[0][1].forward
    assert layer_runs_as_defined(layer)
    inputs = torch.randn(2, 4)
    assert torch.equal(linear(layer[1], inputs, checked=True), layer[1](inputs))
    # `checked` trusts the caller's check: a hook added after it is not looked for again (nor called).
    calls = []
    layer[0][0].register_forward_hook(lambda *_: calls.append(1))
    assert torch.equal(linear(layer[0][0], inputs, checked=True), layer[0][0](inputs)) and calls == [1]
    assert torch.equal(linear(layer[0][0], inputs), layer[0][0](inputs)) and calls == [1, 1, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("size", [256, 200])
def test_rms_norm_on_a_cpu_is_torch_s_rms_norm(size, dtype):
    """`RMSNorm` computes ε + Σx²·(1/D) itself on a CPU tensor (five ops where `F.rms_norm` runs about twenty): the
    values of `F.rms_norm` bit for bit where 1/D is exact (D a power of two), within a few ulps otherwise (1/D
    rounded once more), and its gradients to the input and the weight; a float16 input is still normed in float32
    by `F.rms_norm`. A new ε is read, not the cached one."""
    import torch.nn.functional as F

    from memlm.modeling.layers import RMSNorm

    torch.manual_seed(0)
    norm = RMSNorm(size, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.normal_()
    inputs = (torch.randn(3, 5, size, dtype=dtype) * 4).requires_grad_()
    output = norm(inputs)
    expected = F.rms_norm(inputs, (size,), norm.weight, 1e-5)
    tolerance = {"atol": 0, "rtol": 0} if size & (size - 1) == 0 else {"atol": 0, "rtol": 4 * torch.finfo(dtype).eps}
    torch.testing.assert_close(output, expected, **tolerance)
    gradient = torch.randn_like(output)
    grads = torch.autograd.grad(output, (inputs, norm.weight), gradient)
    expected_grads = torch.autograd.grad(expected, (inputs, norm.weight), gradient)
    for grad, expected_grad in zip(grads, expected_grads):  # (the weight's sums 15 terms: rounding, to their scale)
        scale = 64 * torch.finfo(dtype).eps
        torch.testing.assert_close(grad, expected_grad, atol=scale * expected_grad.abs().max(), rtol=scale)
    norm.variance_epsilon = 0.5  # a new ε is read, not the cached one
    torch.testing.assert_close(norm(inputs), F.rms_norm(inputs, (size,), norm.weight, 0.5), **tolerance)
    half = torch.randn(2, size, dtype=torch.float16)
    expected_half = F.rms_norm(half.float(), (size,), norm.weight.float(), 0.5).to(torch.float16)
    torch.testing.assert_close(norm.float()(half), expected_half, atol=0, rtol=0)
