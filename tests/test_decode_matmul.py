"""The decoding-shaped matmul gives F.linear's results at every shape it takes over, leaves the rest,
and serves a model's linear layers only where it measured faster."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdec_cli.loading.decode_matmul import MAX_ROWS, MatmulChoice, detour, time_products


@pytest.mark.parametrize("shape", [(1, 1), (1, 2), (1, 5), (2, 3), (1, MAX_ROWS), (1, MAX_ROWS + 1), (7,)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_f_linear(shape, with_bias):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, 24, generator=generator)
    weight = torch.randn(40, 24, generator=generator)
    bias = torch.randn(40, generator=generator) if with_bias else None
    out = detour(x, weight, bias)
    assert out.shape == (*shape, 40) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, weight, bias))


def detour_chosen() -> MatmulChoice:
    choice = MatmulChoice()
    choice.detour_is_faster = True
    return choice


def test_half_precision_and_prefill_are_left_to_f_linear():
    choice = detour_chosen()
    x, weight = torch.randn(1, 3, 8, dtype=torch.bfloat16), torch.randn(5, 8, dtype=torch.bfloat16)
    assert torch.equal(choice.linear(x, weight), F.linear(x, weight))
    prefill, weight = torch.randn(1, MAX_ROWS + 1, 8), torch.randn(5, 8)
    assert torch.equal(choice.linear(prefill, weight), F.linear(prefill, weight))


def fresh_copy(model: torch.nn.Module) -> torch.nn.Module:
    copy = type(model)(model.config).eval()
    copy.load_state_dict(model.state_dict())
    return copy


def rerouted(model: torch.nn.Module) -> list[bool]:
    return ["forward" in vars(m) for m in model.modules() if isinstance(m, torch.nn.Linear)]


def test_a_model_decodes_the_same_through_it(tiny_target):
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        before = tiny_target(input_ids=ids).logits
        model = fresh_copy(tiny_target)
        detour_chosen().route(model)
        assert rerouted(model) and all(rerouted(model))
        # another summation order: equal up to float32 rounding
        torch.testing.assert_close(model(input_ids=ids).logits, before, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(model(input_ids=ids[:, :1]).logits, before[:, :1], atol=1e-4, rtol=1e-4)


def test_the_first_model_loaded_decides_by_measurement(tiny_target):
    weights = [m.weight for m in tiny_target.modules() if isinstance(m, torch.nn.Linear)]
    seconds = time_products(weights, repeats=1)
    assert set(seconds) == {"f_linear", "detour"} and all(s > 0 for s in seconds.values())
    choice = MatmulChoice()
    assert choice.name is None
    model = fresh_copy(tiny_target)
    choice.route(model)
    assert isinstance(choice.detour_is_faster, bool) and choice.name in ("W @ x.T", "x @ W.T")
    assert all(rerouted(model)) == choice.detour_is_faster and any(rerouted(model)) == all(rerouted(model))
    # where the detour measured slower, F.linear stays, for the next model loaded too (no second measurement)
    choice.detour_is_faster = False
    other = fresh_copy(tiny_target)
    choice.route(other)
    assert not any(rerouted(other)) and choice.detour_is_faster is False
