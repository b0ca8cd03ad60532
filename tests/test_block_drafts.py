"""Drafts that propose a whole block from one forward: Medusa heads (FasterDecoding's pickle and
vLLM's safetensors layout) and DFlash (z-lab's layout), as tiny random checkpoints for the tiny
target, loaded through a YAML config. They decode exactly (greedy output is the target's, sampled
output is distributed as the target's), their logits are the format's forward written out here with
plain torch ops, handing the acceptance test another position's q is caught, and checkpoints that do
not fit the target exit 2 with one line."""

from __future__ import annotations

import json

import pytest
import torch
from block_checkpoints import (
    DFLASH_DRAFT_VOCAB,
    HEADS,
    MASK,
    TARGET,
    WRITERS,
    pair_of,
    write_dflash,
    write_medusa_pt,
    write_medusa_vllm,
)
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from specdec_cli.cli import app
from specdec_cli.commands.verify import checks, statistics
from specdec_cli.decoding.params import SamplingParams
from specdec_cli.errors import EXIT_BAD_INPUT
from specdec_cli.methods.dflash.drafter import BlockDrafter
from specdec_cli.methods.medusa.drafter import MedusaDrafter

runner = CliRunner()
SAMPLED = SamplingParams(temperature=1.0)
PROMPTS = ["Hello there, how are you?", "H", "abc abc abc abc", "Once upon a time, in a land far away"]


# ---------------------------------------------------------------- exactness


@pytest.mark.parametrize(
    "kind",
    ["medusa-pt", "medusa-vllm", "dflash", "dflash-nested", "dflash-speculators", "medusa-vllm+lookup"]
    + ["dflash+lookup"],
)
def test_greedy_output_is_the_targets(kind, tmp_path, write_config):
    WRITERS[kind.split("+")[0]](tmp_path / "draft")
    # num_draft_tokens 5 > 3 heads / 3 block positions: a block drafts what the draft has, no more
    pair = pair_of(write_config, tmp_path / "draft", num_draft_tokens=5, lookup="lookup" in kind)
    assert isinstance(pair.drafter, MedusaDrafter if kind.startswith("medusa") else BlockDrafter)
    assert (pair.lookup is not None) == ("lookup" in kind)
    prompts = [pair.encode(p, raw=True) for p in PROMPTS]
    for ids in prompts:
        assert checks.check_greedy(pair, ids, "p", 24, seed=0).passed
    # a batch: every row decodes as its prompt alone, one row stopping early at an EOS
    alone = pair.decoder(SamplingParams(), speculative=False)
    alone.eos_token_ids = set()
    expected = [alone.generate(ids, 24, 0).token_ids for ids in prompts]
    eos = expected[2][3]
    expected = [e[: e.index(eos) + 1] if eos in e else e for e in expected]
    decoder = pair.decoder(SamplingParams())
    decoder.eos_token_ids = {eos}
    rows = decoder.generate_batch(prompts, 24, 0)
    assert [r.token_ids for r in rows] == expected
    assert len(rows[2].token_ids) <= 4
    model_blocks = [s.drafted for r in rows for s in r.steps if s.drafted <= 3]  # lookup may draft 5
    assert max(model_blocks) == 3


@pytest.mark.parametrize("kind", ["medusa-pt", "dflash-speculators"])
def test_sampled_output_from_a_one_token_prompt_is_the_targets(kind, tmp_path, write_config):
    """The first block has no target state to draft from (the rest of the table: test_exactness.py)."""
    WRITERS[kind](tmp_path / "draft")
    pair = pair_of(write_config, tmp_path / "draft")
    result = checks.check_model(pair, pair.encode("H", raw=True), "p", SAMPLED, 200, 0, 0.01)
    statistics.holm(result, 0.01)
    assert [r.what for r in result if r.status == statistics.FAIL] == [], [(r.check, r.p_value) for r in result]
    accepted, drafted = map(int, result[0].note.split(" draft")[0].split("/"))
    assert 0.03 * drafted < accepted < 0.5 * drafted  # drafts are neither all rejected nor the target's


def hand_over_another_positions_q(drafter, monkeypatch):
    """The bug: tokens drawn from each position's own q, but the acceptance test handed the previous
    position's (the first position gets the last one's)."""
    propose = drafter.propose

    def broken(num_draft_tokens, params, generator):
        drafts, q = propose(num_draft_tokens, params, generator)
        return drafts, q.roll(1, dims=1)

    monkeypatch.setattr(drafter, "propose", broken)


@pytest.mark.parametrize("kind", ["medusa-vllm", "dflash"])
def test_verify_catches_q_from_another_position(kind, tmp_path, write_config, monkeypatch):
    WRITERS[kind](tmp_path / "draft")
    pair = pair_of(write_config, tmp_path / "draft")
    hand_over_another_positions_q(pair.drafter, monkeypatch)
    result = checks.check_model(pair, pair.encode(PROMPTS[0], raw=True), "p", SAMPLED, 200, 0, 0.01, batch_size=4)
    statistics.holm(result, 0.01)
    assert [r.check for r in result if r.status == statistics.FAIL]


# ---------------------------------------------------------------- the formats' forward, written out


def target_states(model, ids: list[int], layers) -> torch.Tensor:
    """[len(ids), taps * H]: transformers' hidden_states[i] for i in layers at every token."""
    with torch.no_grad():
        hidden = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    return torch.cat([hidden[i][0] for i in layers], dim=-1)


def padded(rows: list[torch.Tensor]) -> torch.Tensor:
    out = torch.zeros(len(rows), max(len(r) for r in rows), rows[0].shape[-1])
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


def medusa_reference(blocks, heads, token_map, state: torch.Tensor) -> torch.Tensor:
    """Head i: x + SiLU(W x + b) per layer, then its linear map; a token map scores only its ids."""
    logits = []
    for block, head in zip(blocks, heads):
        x = state
        for weight, bias in block:
            x = x + torch.nn.functional.silu(x @ weight.T + bias)
        if token_map is None:
            logits.append(x @ head.T)
        else:
            full = torch.full((head.shape[0],), float("-inf"))
            full[token_map] = x @ head[token_map].T
            logits.append(full)
    return torch.stack(logits)


@pytest.mark.parametrize("layout", ["pt", "vllm", "vllm-token-map"])
def test_medusa_logits_are_the_heads_on_the_last_verified_state(layout, tmp_path, write_config):
    if layout == "pt":
        blocks, heads, token_map = write_medusa_pt(tmp_path / "draft")
    else:
        token_map = torch.randperm(258, generator=torch.Generator().manual_seed(3))[:100] if "map" in layout else None
        blocks, heads, token_map = write_medusa_vllm(tmp_path / "draft", token_map=token_map)
    pair = pair_of(write_config, tmp_path / "draft")
    drafter, target = pair.drafter, pair.target.model
    prompts = [pair.encode(p, raw=True) for p in (PROMPTS[0], PROMPTS[3], "Hi")]
    states = [target_states(target, p, (-1,)) for p in prompts]
    drafter.start(prompts, 64, padded([s[:-1] for s in states]))
    with torch.no_grad():
        got = drafter.logits(HEADS)
        # the state at the prompt's next-to-last token: its last token is the target's, then head 0's
        for row, s in enumerate(states):
            torch.testing.assert_close(got[row], medusa_reference(blocks, heads, token_map, s[-2]))
        # after a block: the state at the last accepted input (the target drew its next token there)
        drafts, accepted, next_tokens = [[70, 71, 72]] * 3, [2, 0, 3], [80, 81, 82]
        grown = [p + d for p, d in zip(prompts, drafts)]
        block_states = padded([target_states(target, g, (-1,))[len(p) - 1 :] for p, g in zip(prompts, grown)])
        drafter.commit(drafts, accepted, next_tokens, block_states)
        got = drafter.logits(2)
        for row, (p, a) in enumerate(zip(prompts, accepted)):
            state = target_states(target, grown[row], (-1,))[len(p) - 1 + a]
            torch.testing.assert_close(got[row], medusa_reference(blocks, heads, token_map, state)[:2])
    if token_map is not None:
        assert torch.isinf(got[:, :, [i for i in range(258) if i not in set(token_map.tolist())]]).all()


def dflash_reference(tensors: dict, config: dict, target, ids: list[int], wrong: str = "") -> torch.Tensor:
    """z-lab's forward for one row: context = all of `ids` but the last, the block = [its last, MASK...];
    in the speculators layout (speculators/models/dflash/core.py) with the draft's own embedding and
    its head's rows put at target ids i + d2t[i], -inf elsewhere. `wrong` names one deliberately
    wrong reading (`DFLASH_WRONG_READINGS`)."""
    speculators = "transformer_layer_config" in config
    layer = config["transformer_layer_config"] if speculators else config
    dflash = config.get("dflash_config", {})
    n, eps = len(ids) - 1, layer["rms_norm_eps"]
    size = config["block_size"] if speculators else dflash.get("block_size", config.get("block_size"))
    mask_token = config["mask_token_id"] if speculators else dflash["mask_token_id"]
    heads, kv_heads, dim = layer["num_attention_heads"], layer["num_key_value_heads"], layer["head_dim"]
    # the states read: speculators' ids are layer inputs (hidden_states[id]); z-lab's layer outputs
    states = config["aux_hidden_state_layer_ids"] if speculators else [i + 1 for i in dflash["target_layer_ids"]]
    if wrong == "taps off by one":
        states = [i - 1 for i in states]
    own = "embed_tokens.weight" in tensors and wrong != "the target's embedding"
    embedding = tensors["embed_tokens.weight"] if own else target.get_input_embeddings().weight

    def norm(x, weight):
        return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    def rope(x, positions):  # x [n, heads, dim], rotate-half layout
        if wrong == "no rope":
            return x
        angles = positions[:, None].float() / layer["rope_theta"] ** (torch.arange(0, dim, 2).float() / dim)
        cos, sin = angles.cos().repeat(1, 2)[:, None], angles.sin().repeat(1, 2)[:, None]
        return x * cos + torch.cat([-x[..., dim // 2 :], x[..., : dim // 2]], -1) * sin

    taps = target_states(target, ids, states)[:n]
    context = norm(taps @ tensors["fc.weight"].T, tensors["hidden_norm.weight"])
    x = embedding[[ids[-1]] + [mask_token] * (size - 1)]
    positions = torch.arange(n + size)
    causal = torch.ones(size, n + size, dtype=torch.bool).tril(n)  # the wrong reading's mask
    for i in range(layer["num_hidden_layers"]):
        w = {k.removeprefix(f"layers.{i}."): v for k, v in tensors.items() if k.startswith(f"layers.{i}.")}
        h = norm(x, w["input_layernorm.weight"])
        both = torch.cat([context, h])  # keys and values: the context (no input norm) and the block
        q = (h @ w["self_attn.q_proj.weight"].T).view(size, heads, dim)
        k = (both @ w["self_attn.k_proj.weight"].T).view(n + size, kv_heads, dim)
        v = (both @ w["self_attn.v_proj.weight"].T).view(n + size, kv_heads, dim)
        if "self_attn.q_norm.weight" in w:
            q, k = norm(q, w["self_attn.q_norm.weight"]), norm(k, w["self_attn.k_norm.weight"])
        q, k = rope(q, positions[n:]), rope(k, positions)
        k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / dim**0.5  # no mask: not causal
        if wrong == "causal block":
            scores = scores.masked_fill(~causal, float("-inf"))
        x = (
            x
            + torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(size, heads * dim)
            @ w["self_attn.o_proj.weight"].T
        )
        h = norm(x, w["post_attention_layernorm.weight"])
        x = (
            x
            + (torch.nn.functional.silu(h @ w["mlp.gate_proj.weight"].T) * (h @ w["mlp.up_proj.weight"].T))
            @ w["mlp.down_proj.weight"].T
        )
    out = norm(x, tensors["norm.weight"])[1:]
    if "lm_head.weight" not in tensors:
        return out @ target.get_output_embeddings().weight.T
    logits = torch.full((size - 1, target.get_output_embeddings().weight.shape[0]), float("-inf"))
    d2t = tensors["d2t"]
    logits[:, d2t if wrong == "d2t as ids" else torch.arange(len(d2t)) + d2t] = out @ tensors["lm_head.weight"].T
    return logits


def dflash_two_blocks(pair) -> list[tuple[torch.Tensor, list[list[int]]]]:
    """The loaded draft's logits for three rows at two blocks, and each row's tokens so far: the
    prompts, then (after a block whose drafts were accepted in part) the context grown by the
    block's first token and the accepted drafts, the next block starting with the target's token."""
    drafter, target = pair.drafter, pair.target.model
    states = pair.target.state_layers
    prompts = [pair.encode(p, raw=True) for p in (PROMPTS[0], PROMPTS[3], "H")]
    drafter.start(prompts, 64, padded([target_states(target, p, states)[:-1] for p in prompts]))
    blocks = [(drafter.logits(), prompts)]
    drafts, accepted, next_tokens = [[70, 71, 72]] * 3, [2, 0, 3], [80, 81, 82]
    grown = [p + d for p, d in zip(prompts, drafts)]
    block_states = padded([target_states(target, g, states)[len(p) - 1 :] for p, g in zip(prompts, grown)])
    drafter.commit(drafts, accepted, next_tokens, block_states)  # the accepted drafts' K/V come from the store
    contexts = [p + d[:a] + [t] for p, d, a, t in zip(prompts, drafts, accepted, next_tokens)]
    return blocks + [(drafter.logits(), contexts)]


DFLASH_LAYOUTS = {  # name: (writer arguments, the hidden states it reads)
    "llama": ({"layers": 2}, (1, 2)),  # outputs of layers 0 and 1
    "qwen3": ({"layers": 2, "qk_norm": True, "head_dim": 32}, (1, 2)),
    "qwen3 nested": ({"layers": 2, "qk_norm": True, "head_dim": 32, "layout": "z-lab nested"}, (1, 2)),
    "speculators": ({"layers": 2, "qk_norm": True, "head_dim": 32, "layout": "speculators"}, (1, 2)),
}
DFLASH_WRONG_READINGS = {
    "llama": ["no rope", "causal block"],
    "speculators": ["taps off by one", "d2t as ids", "the target's embedding", "causal block"],
}


def dflash_layout(name: str, tmp_path, write_config):
    arguments, states = DFLASH_LAYOUTS[name]
    tensors, config = write_dflash(tmp_path / "draft", **arguments)
    pair = pair_of(write_config, tmp_path / "draft")
    assert pair.target.state_layers == states
    with torch.no_grad():
        return tensors, config, pair.target.model, dflash_two_blocks(pair)


@pytest.mark.parametrize("layout", DFLASH_LAYOUTS)
def test_dflash_logits_are_the_blocks_forward(layout, tmp_path, write_config):
    tensors, config, target, blocks = dflash_layout(layout, tmp_path, write_config)
    with torch.no_grad():
        for got, contexts in blocks:
            for row, context in enumerate(contexts):
                expected = dflash_reference(tensors, config, target, context)
                torch.testing.assert_close(got[row], expected, atol=1e-4, rtol=1e-4)
    assert (got[:, 0].argmax(-1) != got[:, 1].argmax(-1)).any()  # positions draft different tokens


@pytest.mark.parametrize("layout, wrong", [(k, w) for k, ws in DFLASH_WRONG_READINGS.items() for w in ws])
def test_the_blocks_comparison_catches_a_wrong_reading(layout, wrong, tmp_path, write_config):
    tensors, config, target, blocks = dflash_layout(layout, tmp_path, write_config)
    with torch.no_grad():
        misread = [
            torch.allclose(got[row], dflash_reference(tensors, config, target, context, wrong), atol=1e-4, rtol=1e-4)
            for got, contexts in blocks
            for row, context in enumerate(contexts)
        ]
    assert not all(misread)


# ---------------------------------------------------------------- checkpoints that do not fit


class NotATensor:
    pass


def pickle_of_objects(folder):
    """A pickle that would build an object of a class when loaded: refused unread."""
    folder.mkdir()
    torch.save({"0.0.linear.weight": NotATensor()}, folder / "medusa_lm_head.pt")
    (folder / "config.json").write_text(json.dumps({"medusa_num_heads": 1}))


def drop_tensor(folder, name):
    tensors = load_file(folder / "model.safetensors")
    del tensors[name]
    save_file(tensors, folder / "model.safetensors")


def edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({k: v for k, v in (config | changes).items() if v is not None}))


def speculators_draft(folder, **changes):
    write_dflash(folder, qk_norm=True, head_dim=32, layout="speculators")
    edit_config(folder, **changes)


BAD = {
    "medusa width": (lambda f: write_medusa_vllm(f, width=32), "target's hidden size is 64"),
    "medusa vocabulary": (lambda f: write_medusa_pt(f, vocab=250), "scores 250 tokens, the target's vocabulary has"),
    "medusa missing head": (
        lambda f: (write_medusa_vllm(f), drop_tensor(f, "lm_heads.2.weight")),
        "missing tensors for 3 heads of 2 layers: ['lm_heads.2.weight']",
    ),
    "medusa pickle of objects": (pickle_of_objects, "not a pickle of plain tensors"),
    "dflash layer ids": (
        lambda f: write_dflash(f, dflash_config={"target_layer_ids": [0, 2], "mask_token_id": MASK}),
        "target_layer_ids [0, 2] (hidden states [1, 3]) do not fit a target of 2 layers",
    ),
    "dflash target depth": (lambda f: write_dflash(f, num_target_layers=36), "made for a target of 36 layers"),
    "dflash width": (lambda f: write_dflash(f, hidden_size=32), "hidden size 32, the target's is 64"),
    "dflash vocabulary": (lambda f: write_dflash(f, vocab_size=151936), "vocabulary of 151936 tokens"),
    "dflash mask token": (
        lambda f: write_dflash(f, dflash_config={"target_layer_ids": [0, 1]}),
        "mask_token_id None is not a token",
    ),
    "dflash missing tensor": (
        lambda f: (write_dflash(f), drop_tensor(f, "layers.0.mlp.up_proj.weight")),
        "missing ['layers.0.mlp.up_proj.weight']",
    ),
    "dflash speculators anchor": (
        lambda f: speculators_draft(f, sample_from_anchor=True),
        "sample_from_anchor (drafting the anchor position too) is not supported",
    ),
    "dflash speculators mask token": (
        lambda f: speculators_draft(f, mask_token_id=None),
        "config needs transformer_layer_config, aux_hidden_state_layer_ids and mask_token_id",
    ),
    "dflash speculators head": (
        lambda f: (speculators_draft(f), drop_tensor(f, "lm_head.weight")),
        f"missing tensors lm_head.weight (for its draft vocabulary of {DFLASH_DRAFT_VOCAB} tokens)",
    ),
    "dflash speculators d2t": (
        lambda f: (speculators_draft(f), drop_tensor(f, "d2t")),
        "missing tensors d2t",
    ),
    "dflash taps": (
        lambda f: write_dflash(f, dflash_config={"target_layer_ids": [1], "mask_token_id": MASK}),  # fc reads 2
        "fc.weight is [64, 128], but 1 target layers of width 64 need [64, 64]",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_checkpoint_that_does_not_fit_exits_2(case, tmp_path, write_config):
    make, message = BAD[case]
    make(tmp_path / "draft")
    config = write_config({"target": TARGET, "draft": {"checkpoint": str(tmp_path / "draft")}})
    run = runner.invoke(app, ["generate", "-c", str(config), "-p", "Hello"])
    assert run.exit_code == EXIT_BAD_INPUT, run.output
    [line] = [line for line in run.output.splitlines() if line.startswith("Error:")]
    assert message in line, line
