"""The decoding-shaped matmul gives F.linear's results at every shape it takes over, and leaves the rest."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdec_cli.models.decode_matmul import MAX_ROWS, linear, use_decode_matmul


@pytest.mark.parametrize("shape", [(1, 1), (1, 2), (1, 5), (2, 3), (1, MAX_ROWS), (1, MAX_ROWS + 1), (7,)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_f_linear(shape, with_bias):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, 24, generator=generator)
    weight = torch.randn(40, 24, generator=generator)
    bias = torch.randn(40, generator=generator) if with_bias else None
    out = linear(x, weight, bias)
    assert out.shape == (*shape, 40) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, weight, bias))


def test_half_precision_is_left_to_f_linear():
    x, weight = torch.randn(1, 3, 8, dtype=torch.bfloat16), torch.randn(5, 8, dtype=torch.bfloat16)
    assert torch.equal(linear(x, weight), F.linear(x, weight))


def test_a_model_decodes_the_same_through_it(tiny_target):
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        before = tiny_target(input_ids=ids).logits
        model = type(tiny_target)(tiny_target.config).eval()
        model.load_state_dict(tiny_target.state_dict())
        use_decode_matmul(model)
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        assert linears and all("forward" in vars(m) for m in linears)  # every one was rerouted
        # another summation order: equal up to float32 rounding
        torch.testing.assert_close(model(input_ids=ids).logits, before, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(model(input_ids=ids[:, :1]).logits, before[:, :1], atol=1e-4, rtol=1e-4)
