"""Quantized weights (runtime.weights int8 / int4): the products against the weights they stand for,
and the quantized target as the law every exactness check tests."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import failing

from specdec_cli.commands.verify import checks, statistics
from specdec_cli.config import ModelSpec, TinyModel, load_config, parse_config
from specdec_cli.decoding.params import SamplingParams
from specdec_cli.errors import SpecdecError
from specdec_cli.loading import quantized
from specdec_cli.loading.checkpoints import build_tiny
from specdec_cli.pair import load_pair, resolve_weights

PROMPT = "Hello there, how are you?"
SIGNIFICANCE = 0.01


@pytest.fixture(autouse=True)
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)  # load_pair set it process-wide


def int4_weight(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """(q - 8) * scale + zero per group of 32 along the input, scales and zeros as the kernel keeps them."""
    scale, zero = (t.to(torch.bfloat16).float().repeat_interleave(quantized.GROUP, dim=1) for t in (scale, zero))
    return (q.float() - 8) * scale + zero


@pytest.mark.parametrize("rows", [48, 258])  # 258: not a multiple of the kernel's 16-row tiles
def test_int4_groups_multiply_as_the_weight_they_stand_for(rows):
    torch.manual_seed(0)
    columns = 96
    q = torch.randint(0, 16, (rows, columns))
    scale = torch.rand(rows, columns // 32) * 0.1 + 0.01
    zero = torch.randn(rows, columns // 32) * 0.1
    x = torch.randn(3, 5, columns)
    out = quantized.product(x, quantized.int4_from_groups(q, scale, zero))
    expected = F.linear(x.to(torch.bfloat16).float(), int4_weight(q, scale, zero))
    assert out.shape == (3, 5, rows) and out.dtype == x.dtype
    torch.testing.assert_close(out, expected, rtol=0.02, atol=0.02)  # the kernel's bfloat16 output


@pytest.mark.parametrize("kind, tolerance", [("int8", 0.01), ("int4", 0.12)])
def test_quantized_products_stay_near_the_float_product(kind, tolerance):
    torch.manual_seed(0)
    weight, x = torch.randn(64, 128), torch.randn(4, 128)
    bias = torch.randn(64)
    out = quantized.product(x, quantized.quantize(weight, kind), bias)
    exact = F.linear(x, weight, bias)
    error = (out - exact).norm() / exact.norm()
    assert error < tolerance, error
    assert error > 1e-4  # quantized indeed: not the float weight


def test_an_input_width_int4_cannot_group_is_taken_in_int8():
    assert quantized.quantize(torch.randn(16, 40), "int4").kind == "int8"


def test_int4_recovers_values_whose_groups_span_0_to_15():
    """A group whose smallest value is q = 0 and largest q = 15 (as GGUF's Q4_1 writes every group) comes
    back as the same 4-bit values."""
    torch.manual_seed(0)
    q = torch.randint(0, 16, (16, 64))
    q[:, ::32], q[:, 1::32] = 0, 15
    scale, low = torch.rand(16, 2) * 0.1 + 0.01, torch.randn(16, 2)
    weight = q * scale.repeat_interleave(32, dim=1) + low.repeat_interleave(32, dim=1)
    again = quantized.quantize(weight, "int4")
    expected = quantized.int4_from_groups(q, scale, low + 8 * scale)
    assert torch.equal(again.data, expected.data)


def test_auto_weights_are_the_checkpoints_own_on_a_cpu_and_quantized_weights_run_on_a_cpu_only():
    builtin, tiny = ModelSpec(checkpoint="smollm2-135m-instruct"), ModelSpec(tiny=TinyModel())
    assert resolve_weights("auto", torch.device("cpu"), builtin) == "int4"  # its GGUF is Q4_1
    assert resolve_weights("auto", torch.device("cuda"), builtin) == "float"
    assert resolve_weights("auto", torch.device("cpu"), tiny) == "float"
    assert resolve_weights("int8", torch.device("cpu"), tiny) == "int8"
    with pytest.raises(SpecdecError, match="runs on a CPU"):
        resolve_weights("int4", torch.device("cuda"), tiny)


@pytest.fixture(params=["int8", "int4"])
def quantized_pair(request, write_config):
    return load_pair(load_config(str(write_config({"runtime": {"threads": 1, "weights": request.param}}))))


def float_logits(context: list[int]) -> torch.Tensor:
    """The tiny target's next-token logits with its float weights (the same seed builds the same model)."""
    with torch.no_grad():
        return build_tiny(TinyModel(seed=0))(torch.tensor([context])).logits[0, -1]


def test_a_quantized_pair_decodes_through_its_quantized_weights(quantized_pair):
    assert quantized_pair.describe()["weights"] in quantized.KINDS
    ids = quantized_pair.encode(PROMPT)
    reference, used = float_logits(ids), checks.next_logits(quantized_pair, ids)
    assert not torch.equal(used, reference)  # quantized indeed
    assert F.cosine_similarity(used, reference, dim=0) > 0.8  # and still the same model's


def test_weight_bytes_count_what_the_products_read(quantized_pair, write_config):
    """Float: every linear weight once (the fused q/k/v and gate/up too), the embedding left out; int8:
    a byte a weight plus a scale per row; int4: half a byte a weight plus a scale and zero per group."""
    float_pair = load_pair(load_config(str(write_config({"runtime": {"threads": 1, "weights": "float"}}))))
    model = float_pair.target.model
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert float_pair.describe()["target_weight_bytes"] == sum(m.weight.nbytes for m in linears)
    kind = quantized_pair.describe()["weights"]
    count = sum(m.weight.numel() for m in linears)
    rows = sum(m.weight.shape[0] for m in linears)
    got = quantized_pair.describe()["target_weight_bytes"]
    if kind == "int8":
        assert got == count + 2 * rows  # bfloat16 scales
    else:  # rows padded to the kernel's tiles, a bfloat16 scale and zero per group
        assert count / 2 + count / quantized.GROUP * 4 <= got < 1.3 * (count / 2 + count / quantized.GROUP * 4)


def test_greedy_identity_holds_with_quantized_weights(quantized_pair):
    assert checks.check_greedy(quantized_pair, quantized_pair.encode(PROMPT), "p", 32, seed=0).passed


def quantized_rows(pair) -> list[statistics.Row]:
    ids = pair.encode(PROMPT)
    found = checks.check_model(pair, ids, "p", SamplingParams(temperature=0.6), 300, 0, SIGNIFICANCE, blocks=1)
    statistics.holm(found, SIGNIFICANCE)
    return found


def test_the_checks_pass_on_the_quantized_target(quantized_pair):
    assert failing(quantized_rows(quantized_pair)) == []


def test_the_checks_fail_against_the_float_law_the_int4_target_does_not_sample(write_config, monkeypatch):
    """The speculative loop and the target-only baseline read the int4 weights: judged against the
    float model's law instead, the first token fails (the checks see what quantizing changed)."""
    pair = load_pair(load_config(str(write_config({"runtime": {"threads": 1, "weights": "int4"}}))))
    monkeypatch.setattr(checks, "next_logits", lambda pair, context: float_logits(context))
    assert "2 first token: p: token 1 vs the warped target" in failing(quantized_rows(pair))


def test_a_verification_block_gives_the_single_steps_logits_bit_for_bit():
    """Quantized products give a row the same result whatever rows stand beside it, and the attention
    reads the cache's keys in whole steps (SDPA's result depends on how many keys it is given, masked
    ones too, otherwise), so a block of 6 tokens and 6 single-token forwards agree exactly, wherever
    the block starts: greedy speculative output is the target alone's. Heads of 64 dimensions, as
    SmolLM2's, where key counts that are not whole steps change the result."""
    tiny = {"seed": 0, "hidden_size": 192, "num_heads": 3, "num_kv_heads": 1, "intermediate_size": 384}
    runtime = {"device": "cpu", "dtype": "float32", "threads": 2, "weights": "int8"}
    pair = load_pair(parse_config({"name": "t", "target": {"tiny": tiny}, "draft": {"ngram": {}}, "runtime": runtime}))
    target = pair.target
    for start in range(40, 140, 7):
        ids = list(range(3, 3 + start)) + list(range(100, 106))

        def logits(widths: list[int], ids=ids, start=start) -> torch.Tensor:
            target.reset(len(ids) + 8)
            target.forward(torch.tensor([ids[:start]]), logits="none")
            found, at = [], start
            for width in widths:
                found.append(target.forward(torch.tensor([ids[at : at + width]])).logits[0])
                at += width
            return torch.cat(found)

        assert torch.equal(logits([1] * 6), logits([6])), start


@pytest.mark.parametrize("kind, weights", [("Q4_1", "int4"), ("Q8_0", "int8"), ("F32", "float")])
def test_auto_weights_follow_a_gguf_files_own_type(tmp_path, kind, weights):
    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    block_type = gguf.GGMLQuantizationType[kind]
    block, size = gguf.GGML_QUANT_SIZES[block_type]
    for name in ("blk.0.ffn_up.weight", "blk.0.ffn_down.weight"):
        writer.add_tensor(name, np.zeros((64, 64 // block * size), dtype=np.uint8), raw_dtype=block_type)
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert resolve_weights("auto", torch.device("cpu"), ModelSpec(checkpoint=str(path))) == weights
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(SpecdecError, match="cannot read GGUF file"):
        resolve_weights("auto", torch.device("cpu"), ModelSpec(checkpoint=str(path)))
