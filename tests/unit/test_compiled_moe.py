"""The compiled step's MoE (model.runtime.step_functions.moe, here run as plain Python)
against the eager module (model.moe.MoE) it stands for, in both its forms: with as many
routed slots as experts, every expert on every token, weighted 0 where not routed (three
products over the experts side by side); with fewer, each token's experts' weights
gathered. Both agree with the module to float rounding (they add in other orders)."""

from __future__ import annotations

import pytest
import torch

from model.moe import MoE
from model.runtime.compiled import _stack_experts
from model.runtime.step_functions import moe

pytestmark = pytest.mark.unit

HIDDEN, INTER, EXPERTS, TOP_K = 32, 24, 8, 2


@pytest.fixture(scope="module")
def module() -> MoE:
    torch.manual_seed(7)
    layer = MoE(HIDDEN, INTER, EXPERTS, TOP_K, limit=10.0, scoring_func="sqrtsoftplus", gate_temp=1.0,
                norm_topk_prob=True, scaling=1.5)
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.normal_(0, 0.3)
    layer.eval()
    return layer


def _compiled_form(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    w1, w3, w2 = _stack_experts(layer)  # (as the compiled step stacks them: the experts become views)
    gate, shared = layer.gate, layer.shared_experts
    return moe(x, gate.weight, gate.bias, w1, w3, w2, shared.w1.weight, shared.w3.weight, shared.w2.weight,
               gate.top_k, gate.scoring_func, gate.gate_temp, gate.norm_topk_prob, gate.scaling, shared.limit)


@pytest.mark.parametrize("tokens", [1, 3, 4, 5, 16, 57])
def test_both_forms_compute_the_eager_moe(module, tokens):
    """1 and 3 tokens gather (2 and 6 slots for 8 experts), 4 and more run densely."""
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens))
    with torch.no_grad():
        want = module(x)
        got = _compiled_form(module, x)
    assert got.shape == want.shape == (tokens, HIDDEN)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)  # outputs up to ~20: float32 rounding
    assert (want - module.shared_experts(x)).abs().max() > 0.1  # the routed experts weigh in
