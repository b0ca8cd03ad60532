"""Each CPU matrix product gives F.linear's results at every shape it takes over, leaves the rest
(GPUs, gradients, autocast, wide inputs for the turned-round product), and serves a model's linear
layers only where it measured fastest."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdec_cli.loading import decode_matmul
from specdec_cli.loading.decode_matmul import (
    F_LINEAR,
    MAX_ROWS,
    MKL_FEWEST_ROWS,
    MKL_PACKED,
    MKL_WIDE_ROWS,
    PACKED,
    TRANSPOSED,
    WIDE_ROWS,
    Chosen,
    Linear,
    MatmulChoice,
    SiblingForward,
    copy_for,
    mkl_linear,
    mkl_pack,
    pack,
    packed_linear,
    sibling_groups,
    time_products,
    timed_weights,
    transposed_product,
)

SHAPES = [(1, 1), (1, 2), (1, 5), (2, 3), (1, MAX_ROWS), (1, MAX_ROWS + 1), (1, 40), (7,)]


def operands(shape, with_bias, dtype=torch.float32):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, 24, generator=generator).to(dtype)
    weight = torch.randn(40, 24, generator=generator).to(dtype)
    bias = torch.randn(40, generator=generator).to(dtype) if with_bias else None
    return x, weight, bias


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_turned_round_product_matches_f_linear(shape, with_bias):
    x, weight, bias = operands(shape, with_bias)
    out = transposed_product(x, weight, bias)
    assert out.shape == (*shape, 40) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, weight, bias))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_prepacked_product_matches_f_linear(shape, with_bias, dtype):
    x, weight, bias = operands(shape, with_bias, dtype)
    packed = pack(weight)
    if packed is None:
        pytest.skip("no oneDNN linear for this dtype on this CPU")
    out = packed_linear(x, packed, bias)
    assert out.shape == (*shape, 40) and out.dtype == dtype
    torch.testing.assert_close(out, F.linear(x, weight, bias))


@pytest.mark.parametrize("rows", [1, MKL_FEWEST_ROWS - 1, MKL_FEWEST_ROWS, 5, MAX_ROWS, 9, MKL_WIDE_ROWS, 33, 40])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("wide", [False, True])
def test_the_mkl_packed_product_matches_f_linear_at_every_row_count(rows, with_bias, wide):
    """Rows padded up to the copy's, and the rows outside what the copy serves taken by F.linear,
    in any leading shape."""
    x, weight, bias = operands((rows,), with_bias)
    copy = mkl_pack(weight, MKL_WIDE_ROWS if wide else MAX_ROWS)
    if copy is None:
        pytest.skip("no MKL in this torch")
    strided = torch.cat([x, x], dim=-1)[:, :24]  # rows that are not contiguous
    for shaped in (x, x[None], x.view(rows, 1, 24), strided):
        out = mkl_linear(shaped, copy, weight, bias)
        assert out.shape == (*shaped.shape[:-1], 40) and out.is_contiguous()
        torch.testing.assert_close(out, F.linear(shaped, weight, bias))
    if not MKL_FEWEST_ROWS <= rows <= copy.rows:
        assert torch.equal(mkl_linear(x, copy, weight, bias), F.linear(x, weight, bias))


def test_mkl_packs_float32_only():
    assert mkl_pack(torch.zeros(4, 4, dtype=torch.bfloat16), MAX_ROWS) is None
    assert copy_for(TRANSPOSED, torch.zeros(4, 4), wide=False) is None


def chosen(narrow: str, dtype=torch.float32, wide: str | None = None) -> MatmulChoice:
    choice = MatmulChoice()
    choice.chosen[dtype] = Chosen(narrow, wide or (F_LINEAR if narrow == TRANSPOSED else narrow))
    return choice


def test_what_no_product_was_chosen_for_is_left_to_f_linear():
    x, weight, _ = operands((1, 3), False, torch.bfloat16)
    assert torch.equal(chosen(TRANSPOSED).linear(x, weight), F.linear(x, weight))  # chosen for float32 only
    wide, weight, _ = operands((1, MAX_ROWS + 1), False)
    assert torch.equal(chosen(TRANSPOSED).linear(wide, weight), F.linear(wide, weight))
    assert torch.equal(chosen(TRANSPOSED, wide=PACKED).linear(wide, weight), F.linear(wide, weight))  # no packed copy
    assert chosen(TRANSPOSED, wide=PACKED).name(torch.float32) == f"{TRANSPOSED} up to {MAX_ROWS} rows, {PACKED} above"


def test_a_wide_product_is_never_turned_round():
    assert TRANSPOSED not in time_products([torch.randn(40, 24)], WIDE_ROWS, repeats=1)


@pytest.mark.parametrize("product", [TRANSPOSED, PACKED, MKL_PACKED])
def test_gradients_go_through_f_linear(product):
    x, weight, _ = operands((1, MKL_FEWEST_ROWS), False)
    x.requires_grad_(True)
    copy = copy_for(product, weight, wide=False)
    out = chosen(product).linear(x, weight, None, (copy, copy))
    out.sum().backward()
    torch.testing.assert_close(x.grad, weight.sum(0).expand(1, MKL_FEWEST_ROWS, 24))


def test_a_compiled_forward_takes_f_linear_whose_product_inductor_can_lower():
    """A prepacked weight is an opaque oneDNN tensor that inductor cannot lower: under torch.compile
    the routed layer must hand inductor F.linear (it packs its own weights where freezing is on)."""
    x, weight, bias = operands((1, 3), True)
    if pack(weight) is None:
        pytest.skip("no oneDNN linear on this CPU")
    module = torch.nn.Linear(24, 40).requires_grad_(False)
    module.weight.copy_(weight)
    module.bias.copy_(bias)
    module.forward = Linear(chosen(PACKED), module)
    assert module.forward.copies[0] is not None
    torch._dynamo.reset()
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(module, fullgraph=True)(x), F.linear(x, weight, bias))


def fresh_copy(model: torch.nn.Module) -> torch.nn.Module:
    copy = type(model)(model.config).eval()
    copy.load_state_dict(model.state_dict())
    return copy


def rerouted(model: torch.nn.Module) -> list[bool]:
    """For each linear layer but the sibling projections (always one product): taken over or not."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    return ["forward" in vars(m) for m in linears if not isinstance(vars(m).get("forward"), SiblingForward)]


@pytest.mark.parametrize("product", [TRANSPOSED, PACKED, MKL_PACKED])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("wide", [F_LINEAR, PACKED, MKL_PACKED])
def test_a_model_decodes_the_same_through_each_product(tiny_target, product, dtype, wide):
    for way, is_wide in ((product, False), (wide, True)):
        if way in (PACKED, MKL_PACKED) and copy_for(way, torch.zeros(2, 2, dtype=dtype), is_wide) is None:
            pytest.skip(f"no {way} product for {dtype} on this CPU")
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        model = fresh_copy(tiny_target).to(dtype)
        before = model(input_ids=ids).logits
        chosen(product, dtype, wide).route(model)
        assert all(rerouted(model)) and not any(p.requires_grad for p in model.parameters())
        # another summation order: equal up to rounding
        tolerance = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(model(input_ids=ids).logits, before, atol=tolerance, rtol=tolerance)
        torch.testing.assert_close(model(input_ids=ids[:, :1]).logits, before[:, :1], atol=tolerance, rtol=tolerance)
        for width in (MAX_ROWS + 2, MKL_WIDE_ROWS + 2):  # wide, and wider than MKL's wide copy
            wide_ids = torch.arange(3, 3 + width)[None]
            reference = fresh_copy(tiny_target).to(dtype)(input_ids=wide_ids).logits
            torch.testing.assert_close(model(input_ids=wide_ids).logits, reference, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("product", [F_LINEAR, TRANSPOSED, PACKED, MKL_PACKED])
def test_sibling_projections_share_one_weight_and_each_gets_its_own_product(tiny_target, product):
    model = fresh_copy(tiny_target)
    chosen(product).route(model)
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    for group in ((attention.q_proj, attention.k_proj, attention.v_proj), (mlp.gate_proj, mlp.up_proj)):
        assert len({m.weight.untyped_storage().data_ptr() for m in group}) == 1  # views of one weight
    generator = torch.Generator().manual_seed(1)
    x, y = (torch.randn(1, 3, model.config.hidden_size, generator=generator) for _ in range(2))
    with torch.no_grad():
        outputs = [
            (attention.q_proj(x), attention.q_proj, x),
            (attention.k_proj(y), attention.k_proj, y),  # another input: not x's part
            (attention.v_proj(x), attention.v_proj, x),
            (attention.v_proj(x), attention.v_proj, x),  # twice
            (mlp.up_proj(x), mlp.up_proj, x),  # the second sibling called first
            (mlp.gate_proj(x), mlp.gate_proj, x),
        ]
    for out, module, given in outputs:
        torch.testing.assert_close(out, F.linear(given, module.weight), atol=1e-5, rtol=1e-5)
    attention.k_proj.weight.requires_grad_(True)  # unfrozen for training: gradients reach its own weight
    attention.k_proj(x).sum().backward()
    torch.testing.assert_close(attention.k_proj.weight.grad, x.sum((0, 1)).expand_as(attention.k_proj.weight))


def test_sibling_projections_with_biases_keep_their_own():
    attention = torch.nn.Module()
    for name, width in (("q_proj", 40), ("k_proj", 8), ("v_proj", 8)):
        setattr(attention, name, torch.nn.Linear(24, width))
    expected = {name: (m.weight.clone(), m.bias.clone()) for name, m in attention.named_children()}
    chosen(TRANSPOSED).route(attention)
    x = torch.randn(1, 2, 24)
    with torch.no_grad():
        outputs = {name: getattr(attention, name)(x) for name in ("q_proj", "k_proj", "v_proj")}
    for name, (weight, bias) in expected.items():
        torch.testing.assert_close(outputs[name], F.linear(x, weight, bias))


def test_the_first_model_of_each_dtype_decides_by_measurement(tiny_target):
    weights = [m.weight for m in tiny_target.modules() if isinstance(m, torch.nn.Linear)]
    copies = {way: [copy_for(way, w, wide=False) for w in weights] for way in (PACKED, MKL_PACKED)}
    seconds = time_products(weights, copies=copies, repeats=1)  # every way route may take
    ways = {F_LINEAR, TRANSPOSED, PACKED, MKL_PACKED}
    assert {F_LINEAR, TRANSPOSED} <= set(seconds) <= ways and all(s > 0 for s in seconds.values())
    choice = MatmulChoice()
    assert choice.name(torch.float32) is None
    model = fresh_copy(tiny_target)
    choice.route(model)
    narrow, wide = choice.chosen[torch.float32]
    assert narrow in seconds and wide in (F_LINEAR, PACKED, MKL_PACKED) and choice.name(torch.bfloat16) is None
    routed = (narrow, wide) != (F_LINEAR, F_LINEAR)
    assert all(rerouted(model)) == routed and any(rerouted(model)) == all(rerouted(model))
    # where F.linear measured fastest it stays, for the next model loaded too (no second measurement)
    choice.chosen[torch.float32] = Chosen(F_LINEAR, F_LINEAR)
    other = fresh_copy(tiny_target)
    choice.route(other)
    assert not any(rerouted(other)) and choice.name(torch.float32) == F_LINEAR


def test_the_timing_takes_the_products_a_forward_takes(tiny_target):
    """Sibling projections side by side (as the forward multiplies them), in the model's order, and
    the output head even past the timing's budget."""
    model = fresh_copy(tiny_target)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    groups = sibling_groups(model)
    weights = timed_weights(linears, groups)
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    expected = [
        torch.cat([attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight]),
        attention.o_proj.weight,
        torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
        mlp.down_proj.weight,
    ]
    layers = len(model.model.layers)
    assert len(weights) == 4 * layers + 1
    for weight, want in zip(weights, expected):
        assert torch.equal(weight, want)
    assert torch.equal(weights[-1], model.lm_head.weight)
    first_layer = sum(w.nbytes for w in expected)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(decode_matmul, "TIMED_BYTES", first_layer)
        cut = timed_weights(linears, groups)
    assert len(cut) == 5 and torch.equal(cut[-1], model.lm_head.weight)
