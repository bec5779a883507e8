"""The shared blocks of memlm/modeling/layers.py."""

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations, parametrize

from memlm.modeling.layers import linear, runs_as_defined


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
