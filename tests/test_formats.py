"""Public draft formats (EAGLE-1/2, EAGLE-3): tiny random checkpoints written in each format's own
layout (config.json and model.safetensors with its tensor names, no tokenizer, no embedding) load
against a tiny target, decode exactly, and compute what the format says they compute: the test
computes each format's forward itself with plain torch ops and compares the loaded draft's
distributions with it, so a mix-up of taps, norms, d2t or residual fails. A hub id loads such a
folder the same way (the download replaced by a copy of it); a hub that is out of reach is one line."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

import huggingface_hub
import pytest
import torch
import torch.nn.functional as F
import yaml
from feature_checkpoints import (
    DRAFT_VOCAB,
    EPS,
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    LAYERS,
    TARGET,
    VOCAB,
    H,
    eagle3_checkpoint,
    eagle_checkpoint,
    write_folder,
)
from huggingface_hub.utils import filter_repo_objects
from safetensors.torch import save_file
from typer.testing import CliRunner

from specdec_cli.cli import app
from specdec_cli.commands.verify import checks, statistics
from specdec_cli.config import TinyModel, load_config
from specdec_cli.decoding.params import SamplingParams
from specdec_cli.errors import EXIT_BAD_INPUT
from specdec_cli.loading.checkpoints import build_tiny, byte_tokenizer
from specdec_cli.methods.feature.parts import FEATURES
from specdec_cli.methods.formats import DRAFT_FORMAT, load_format
from specdec_cli.pair import load_pair

runner = CliRunner()

PROMPT = "Hello there, how are"


@pytest.fixture(scope="module")
def target():
    return build_tiny(TinyModel(seed=0, num_layers=LAYERS)).eval()


def write_pair(tmp_path, draft_folder, name: str = "pair.yaml", draft: dict | None = None):
    path = tmp_path / name
    data = {
        "name": "format-pair",
        "target": TARGET,
        "draft": draft or {"checkpoint": str(draft_folder)},
        "speculation": {"num_draft_tokens": 3},
        "generation": {"max_new_tokens": 24, "ignore_eos": True},
        "runtime": {"device": "cpu", "dtype": "float32", "threads": 1},
    }
    path.write_text(yaml.safe_dump(data))
    return path


# ---------------------------------------------------------------- the formats by hand


def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight


def rope(x: torch.Tensor) -> torch.Tensor:
    """x [heads, n, d] at positions 0 .. n - 1, rotating half against half (Llama's layout)."""
    d = x.shape[-1]
    angles = torch.arange(x.shape[1]).float()[:, None] / 10000 ** (torch.arange(0, d, 2).float() / d)
    cos, sin = angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)
    return x * cos + torch.cat([-x[..., d // 2 :], x[..., : d // 2]], dim=-1) * sin


def attention(x: torch.Tensor, w: dict, prefix: str, wrong: str = "") -> torch.Tensor:
    """Causal multi-head attention over x [n, width] with grouped key/value heads; Qwen3's per-head
    q and k norms where the layer has them (`wrong`: "no rope", "no qk norm")."""
    n = x.shape[0]
    q = (x @ w[f"{prefix}q_proj.weight"].T).view(n, HEADS, HEAD_DIM)
    k = (x @ w[f"{prefix}k_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM)
    if f"{prefix}q_norm.weight" in w and wrong != "no qk norm":
        q, k = rms(q, w[f"{prefix}q_norm.weight"]), rms(k, w[f"{prefix}k_norm.weight"])
    q, k = q.transpose(0, 1), k.transpose(0, 1)
    v = (x @ w[f"{prefix}v_proj.weight"].T).view(n, KV_HEADS, HEAD_DIM).transpose(0, 1)
    if wrong != "no rope":
        q, k = rope(q), rope(k)
    k, v = k.repeat_interleave(HEADS // KV_HEADS, 0), v.repeat_interleave(HEADS // KV_HEADS, 0)
    scores = (q @ k.transpose(1, 2)) / HEAD_DIM**0.5
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, H) @ w[f"{prefix}o_proj.weight"].T


def mlp(x: torch.Tensor, w: dict, prefix: str) -> torch.Tensor:
    return (F.silu(x @ w[f"{prefix}gate_proj.weight"].T) * (x @ w[f"{prefix}up_proj.weight"].T)) @ w[
        f"{prefix}down_proj.weight"
    ].T


def eagle_forward(w: dict, target, embeds: torch.Tensor, states: torch.Tensor):
    """EAGLE-1/2: x = fc([embedding, state]); a layer with no input norm; no final norm; the
    target's head. Returns (the state fed back, logits) per position."""
    x = torch.cat([embeds, states], dim=-1) @ w["fc.weight"].T + w["fc.bias"]
    h = x + attention(x, w, "layers.0.self_attn.")
    out = h + mlp(rms(h, w["layers.0.post_attention_layernorm.weight"]), w, "layers.0.mlp.")
    return out, out @ target.lm_head.weight.T


def eagle3_forward(w: dict, config: dict, target, embeds: torch.Tensor, states: torch.Tensor, wrong: str = ""):
    """EAGLE-3's midlayer (`layers.0` in the speculators layout): attention over
    [input_layernorm(embedding), hidden_norm(state)], the state as residual (its normed form with
    norm_before_residual, which vLLM takes as true where a speculators config leaves it out), MLP;
    logits = lm_head(norm(out)) put at target ids i + d2t[i], -inf elsewhere (without an lm_head,
    over all ids: the draft's embedding with tie_word_embeddings, else the target's head). The state
    fed back is `out` before `norm`, after it with `norm_output` (EAGLE-3.1). `wrong` names one
    deliberately wrong reading (`WRONG_READINGS`)."""
    speculators = "transformer_layer_config" in config
    p = "layers.0." if speculators else "midlayer."
    normed = rms(states, w[f"{p}hidden_norm.weight"])
    x = torch.cat([rms(embeds, w[f"{p}input_layernorm.weight"]), normed], dim=-1)
    before_residual = config.get("norm_before_residual", speculators)
    if wrong == "norm_before_residual as the flat default":
        before_residual = config.get("norm_before_residual", False)
    residual = normed if before_residual else states
    h = residual + attention(x, w, f"{p}self_attn.", wrong)
    out = h + mlp(rms(h, w[f"{p}post_attention_layernorm.weight"]), w, f"{p}mlp.")
    post = rms(out, w["norm.weight"])
    fed = post if config.get("norm_output") and wrong != "fed back before norm" else out
    if "lm_head.weight" not in w:
        tied = config.get("tie_word_embeddings") and wrong != "the target's head"
        head = w.get("embed_tokens.weight", target.model.embed_tokens.weight) if tied else target.lm_head.weight
        return fed, post @ head.T
    scores = post @ w["lm_head.weight"].T
    logits = torch.full((len(out), VOCAB), float("-inf"))
    ids = w["d2t"] if wrong == "d2t as ids" else torch.arange(DRAFT_VOCAB) + w["d2t"]
    logits[:, ids] = scores
    return fed, logits


def captured(target, ids: list[int], layers: list[int], where: str) -> torch.Tensor:
    """The target's residual stream at the inputs or outputs of `layers` (hooks, not its
    hidden_states indices), side by side [n, len(layers) * H]; `where="norm"`: after its final norm."""
    seen, hooks = {}, []
    for i in layers:
        module = target.model.norm if where == "norm" else target.model.layers[i]
        if where == "input":
            hooks.append(module.register_forward_pre_hook(lambda m, args, i=i: seen.__setitem__(i, args[0])))
        else:
            hooks.append(module.register_forward_hook(lambda m, args, out, i=i: seen.__setitem__(i, out)))
    with torch.no_grad():
        target(torch.tensor([ids]))
    for hook in hooks:
        hook.remove()
    return torch.cat([seen[i][0] for i in layers], dim=-1)


def eagle3_layout(name: str) -> tuple[dict, dict, list[int], str]:
    """A tiny EAGLE-3 checkpoint as one project writes it: (config, tensors, the target layers it
    reads, whether at their "input" or "output")."""
    unmapped = ("lm_head.weight", "d2t", "t2d")
    if name == "eagle_config":  # SpecForge/SGLang: eagle_config ids are layer outputs
        return *eagle3_checkpoint(eagle_config={"eagle_aux_hidden_state_layer_ids": [5, 1, 3]}), [1, 3, 5], "output"
    if name == "vllm":  # vLLM / speculators: top-level ids are layer inputs
        config, w = eagle3_checkpoint(eagle_aux_hidden_state_layer_ids=[1, 3, 5], norm_before_residual=True)
        return config, w, [1, 3, 5], "input"
    if name == "default":  # none named: the inputs of layers 2, L//2, L-3
        return *eagle3_checkpoint(), [2, LAYERS // 2, LAYERS - 3], "input"
    if name == "eagle3.1":  # SpecForge's EAGLE-3.1 config: a norm per tap, the normed output fed back
        return *eagle3_checkpoint(fc_norm=True, norm_output=True), [2, LAYERS // 2, LAYERS - 3], "input"
    if name == "target head":  # draft_vocab_size null, no lm_head: SGLang and vLLM use the target's head
        config, w = eagle3_checkpoint(draft_vocab_size=None)
        return config, {k: v for k, v in w.items() if k not in unmapped}, [2, LAYERS // 2, LAYERS - 3], "input"
    if name == "tied":  # tie_word_embeddings and no lm_head: SGLang's head is the draft's embedding
        config, w = eagle3_checkpoint(tie_word_embeddings=True)
        del config["draft_vocab_size"]
        w = {k: v for k, v in w.items() if k not in unmapped}
        w["embed_tokens.weight"] = torch.randn(VOCAB, H, generator=torch.Generator().manual_seed(7))
        return config, w, [2, LAYERS // 2, LAYERS - 3], "input"
    qwen3, eagle31 = name == "speculators qwen3", name == "speculators eagle3.1"
    config, w = eagle3_checkpoint(layout="speculators", qwen3=qwen3, fc_norm=eagle31)
    config["norm_output"], config["norm_before_residual"] = eagle31, not qwen3
    if name == "speculators":  # norm_before_residual left out: vLLM reads it as true
        del config["norm_before_residual"]
    return config, w, [1, 3, 5], "input"


EAGLE3_LAYOUTS = [
    "eagle_config",
    "vllm",
    "default",
    "eagle3.1",
    "target head",
    "tied",
    "speculators",
    "speculators qwen3",
    "speculators eagle3.1",
]


def draft_steps(pair, prompt_ids: list[int], steps: int):
    """Drive the pair's FeatureDrafter as the engine does at T = 1: `steps` draft tokens and their q."""
    pair.target.reset(len(prompt_ids) + 8)
    states = pair.target.forward(torch.tensor([prompt_ids]), hidden=True).hidden
    pair.drafter.start([prompt_ids], len(prompt_ids) + 8, states)
    drafts, q = pair.drafter.propose(steps, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
    return drafts[0].tolist(), q[0]


def eagle3_reference(w, config, target, ids, drafts, taps, where, wrong="") -> list[torch.Tensor]:
    """The format's logits at each draft step, computed from scratch: the target's states at the
    prompt's tokens, then the draft's own fed-back state at each token it drafted."""
    embed = target.model.embed_tokens.weight if wrong == "the target's embedding" else None
    embed = w.get("embed_tokens.weight", target.model.embed_tokens.weight) if embed is None else embed
    if wrong == "taps off by one":
        where = "output" if where == "input" else "input"
    tapped = captured(target, ids, taps, where)[:-1]  # the state at token j sits beside token j + 1
    if config.get("fc_norm") and wrong != "no fc_norm":
        tapped = torch.cat([rms(c, w[f"fc_norm.{i}.weight"]) for i, c in enumerate(tapped.chunk(3, -1))], -1)
    states, tokens, logits, fed = tapped @ w["fc.weight"].T, ids[1:], [], None
    for drafted in [None, *drafts[:-1]]:
        if drafted is not None:
            tokens, states = tokens + [drafted], torch.cat([states, fed[-1:]])
        fed, step = eagle3_forward(w, config, target, embed[tokens], states, wrong)
        logits.append(step[-1])
    return logits


def same_distribution(q: torch.Tensor, logits: torch.Tensor) -> bool:
    expected = logits.softmax(-1)
    return torch.equal(q == 0, expected == 0) and torch.allclose(q, expected, atol=2e-5, rtol=1e-4)


def assert_same_distribution(q: torch.Tensor, logits: torch.Tensor) -> None:
    assert same_distribution(q, logits), (q - logits.softmax(-1)).abs().max()  # the same support too (d2t's ids)
    assert q.max() < 0.95  # a distribution the computation decides, not one token regardless


def load_layout(tmp_path, layout: str):
    config, w, taps, where = eagle3_layout(layout)
    pair = load_pair(load_config(str(write_pair(tmp_path, write_folder(tmp_path / "eagle3", config, w)))))
    return pair, config, w, taps, where


@pytest.mark.parametrize("layout", EAGLE3_LAYOUTS)
def test_eagle3_draft_computes_the_formats_forward(tmp_path, target, layout, capsys):
    pair, config, w, taps, where = load_layout(tmp_path, layout)
    assert "eagle3 draft reads target hidden states" in capsys.readouterr().err  # the taps, said aloud
    ids = pair.encode(PROMPT, raw=True)
    drafts, q = draft_steps(pair, ids, 3)
    for step, logits in enumerate(eagle3_reference(w, config, target, ids, drafts, taps, where)):
        assert_same_distribution(q[step], logits)


# each layout's deliberately wrong readings, which the comparison above must tell from the right one
WRONG_READINGS = {
    "vllm": ["taps off by one", "no rope"],
    "eagle_config": ["taps off by one", "d2t as ids"],
    "eagle3.1": ["no fc_norm", "fed back before norm"],
    "tied": ["the target's head"],
    "speculators": ["norm_before_residual as the flat default", "the target's embedding", "d2t as ids"],
    "speculators qwen3": ["no qk norm"],
    "speculators eagle3.1": ["no fc_norm", "fed back before norm"],
}


@pytest.mark.parametrize("layout, wrong", [(k, w) for k, ws in WRONG_READINGS.items() for w in ws])
def test_the_comparison_catches_a_wrong_reading(tmp_path, target, layout, wrong):
    pair, config, w, taps, where = load_layout(tmp_path, layout)
    ids = pair.encode(PROMPT, raw=True)
    drafts, q = draft_steps(pair, ids, 3)
    misread = eagle3_reference(w, config, target, ids, drafts, taps, where, wrong)
    assert not all(same_distribution(q[step], logits) for step, logits in enumerate(misread))


def test_eagle_draft_computes_the_formats_forward(tmp_path, target):
    config, w = eagle_checkpoint()
    pair = load_pair(load_config(str(write_pair(tmp_path, write_folder(tmp_path / "eagle", config, w)))))
    ids = pair.encode(PROMPT, raw=True)
    (first, _), q = draft_steps(pair, ids, 2)

    embed = target.model.embed_tokens.weight
    states = captured(target, ids, [0], "norm")[:-1]  # the target's last state, after its final norm
    out, logits = eagle_forward(w, target, embed[ids[1:]], states)
    assert_same_distribution(q[0], logits[-1])
    _, logits = eagle_forward(w, target, embed[ids[1:] + [first]], torch.cat([states, out[-1:]]))
    assert_same_distribution(q[1], logits[-1])


# ---------------------------------------------------------------- exact decoding


@pytest.fixture(scope="module", params=["eagle", "eagle3", "eagle3.1", "target head", "tied", *EAGLE3_LAYOUTS[-3:]])
def pair_config(request, tmp_path_factory):
    """(format, the pair's config file, the states its draft reads as `generate` says them)."""
    tmp = tmp_path_factory.mktemp("draft")
    if request.param == "eagle":
        return "eagle", write_pair(tmp, write_folder(tmp / "eagle", *eagle_checkpoint())), "last hidden state"
    config, weights, taps, where = eagle3_layout("default" if request.param == "eagle3" else request.param)
    states = sorted(i + (where == "output") for i in taps)
    return "eagle3", write_pair(tmp, write_folder(tmp / "eagle3", config, weights)), f"hidden states {states}"


def generate_json(config, *args: str):
    run = runner.invoke(app, ["generate", "-c", str(config), "-p", PROMPT, "--raw", "--json", *args])
    assert run.exit_code == 0, run.output
    return json.loads(run.stdout), run.stderr


def test_greedy_output_is_the_targets(pair_config, tmp_path):
    kind, config, layers = pair_config
    alone = write_pair(tmp_path, None, "alone.yaml", draft={"ngram": {}})
    expected, _ = generate_json(alone)
    for num_draft_tokens in ("1", "3"):
        record, stderr = generate_json(config, "--num-draft-tokens", num_draft_tokens)
        assert record["token_ids"] == expected["token_ids"]
        assert record["draft"] == f"{kind} draft, reads the target's {layers}"
        assert f"Draft: {record['draft']}" in stderr


def test_sampled_output_is_the_targets(pair_config):
    _, config, _ = pair_config
    pair = load_pair(load_config(str(config)))
    prompt_ids = pair.encode(PROMPT, raw=True)
    rows = checks.check_model(pair, prompt_ids, "p", SamplingParams(temperature=1.0), 200, seed=0, significance=0.01)
    statistics.holm(rows, 0.01)
    assert [r.what for r in rows if r.status == statistics.FAIL] == []
    assert checks.check_greedy(pair, prompt_ids, "p", 24, seed=0).passed


# ---------------------------------------------------------------- bad checkpoints


def drop(name):
    return lambda config, weights: weights.pop(name)


def set_config(**changes):
    return lambda config, weights: config.update(changes)


def set_tensor(name, value):
    return lambda config, weights: weights.__setitem__(name, value)


BROKEN = {
    "hidden size": ("eagle", set_config(hidden_size=32), "hidden size mismatch"),
    "target hidden size": ("eagle3", set_config(target_hidden_size=96), "hidden size mismatch"),
    "vocabulary": ("eagle3", set_config(vocab_size=300), "vocabulary mismatch"),
    "d2t": ("eagle3", set_tensor("d2t", torch.full((DRAFT_VOCAB,), 200)), "vocabulary mismatch"),
    "layer ids": (
        "eagle3",
        set_config(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, LAYERS - 1]}),
        "(hidden states [2, 4, 8]) do not fit a target of 8 layers",
    ),
    "missing tensor": ("eagle3", drop("midlayer.hidden_norm.weight"), "missing tensors midlayer.hidden_norm.weight"),
    "missing head": ("eagle3", drop("lm_head.weight"), "missing tensors lm_head.weight"),
    "tensor shape": ("eagle3", set_tensor("fc.weight", torch.zeros(H, 2 * H)), "fc.weight [64, 128]"),
    "unexpected tensor": ("eagle", set_tensor("norm.weight", torch.ones(H)), "do not fit, norm.weight"),
    "bias": ("eagle", set_config(bias=False), "config says bias False"),
    "architecture": ("eagle", set_config(architectures=["MysteryDraftForCausalLM"]), "unknown architecture"),
    "speculators algorithm": (
        "speculators",
        set_config(speculators_model_type="mlp_speculator"),
        "a speculators mlp_speculator draft (vllm-project/speculators' layout); specdec reads its eagle3 and dflash",
    ),
    "speculators layer config": (
        "speculators",
        lambda config, weights: config.pop("transformer_layer_config"),
        "(speculators layout): config.json has no transformer_layer_config",
    ),
    "fc_norm tensors": ("eagle3", set_config(fc_norm=True), "missing tensors fc_norm.0.weight"),
    "fc_norm and norm_before_fc": (
        "speculators",
        set_config(fc_norm=True, norm_before_fc=True),
        "fc_norm and norm_before_fc exclude each other",
    ),
}


@pytest.mark.parametrize("case", BROKEN)
def test_a_bad_checkpoint_is_one_error_line(tmp_path, case):
    kind, breaking, message = BROKEN[case]
    layout = "speculators" if kind == "speculators" else "specforge"
    config, weights = eagle_checkpoint() if kind == "eagle" else eagle3_checkpoint(layout=layout)
    breaking(config, weights)
    if case == "architecture":  # weights that no format recognises
        weights = {"w": torch.zeros(2)}
    pair = write_pair(tmp_path, write_folder(tmp_path / "draft", config, weights))
    run = runner.invoke(app, ["generate", "-c", str(pair), "-p", "Hi"])
    assert run.exit_code == EXIT_BAD_INPUT, run.output
    errors = [line for line in run.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and message in errors[0], run.stderr
    assert "Traceback" not in run.output


def test_pickles_load_only_as_plain_tensors(tmp_path, target):
    config, weights = eagle_checkpoint()
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps(config))
    torch.save(weights, plain / "pytorch_model.bin")  # as SafeAILab publishes EAGLE-1 drafts
    from_pickle = load_format(plain, target, torch.float32)
    from_safetensors = load_format(write_folder(tmp_path / "st", config, weights), target, torch.float32)
    for (name, a), (_, b) in zip(from_pickle.named_parameters(), from_safetensors.named_parameters()):
        assert torch.equal(a, b), name

    (plain / "pytorch_model.bin").unlink()
    torch.save({**weights, "extra": argparse.Namespace(x=1)}, plain / "pytorch_model.bin")  # builds an object
    run = runner.invoke(app, ["generate", "-c", str(write_pair(tmp_path, plain)), "-p", "Hi"])
    assert run.exit_code == EXIT_BAD_INPUT
    [error] = [line for line in run.stderr.splitlines() if line.startswith("Error:")]
    assert "weights_only=True" in error


def test_an_eagle_draft_is_not_a_target(tmp_path):
    folder = write_folder(tmp_path / "eagle3", *eagle3_checkpoint())
    config = tmp_path / "target.yaml"
    config.write_text(yaml.safe_dump({"name": "x", "target": {"checkpoint": str(folder)}, "draft": {"ngram": {}}}))
    run = runner.invoke(app, ["generate", "-c", str(config), "-p", "Hi"])
    assert run.exit_code == EXIT_BAD_INPUT and "only be loaded as the draft of a target" in run.stderr


def test_a_truncated_weights_file_is_one_error_line(tmp_path):
    folder = write_folder(tmp_path / "eagle3", *eagle3_checkpoint())
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    run = runner.invoke(app, ["generate", "-c", str(write_pair(tmp_path, folder)), "-p", "Hi"])
    assert run.exit_code == EXIT_BAD_INPUT
    [error] = [line for line in run.stderr.splitlines() if line.startswith("Error:")]
    assert "not a readable safetensors file" in error


# ---------------------------------------------------------------- hub ids


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """The hub without a network: repo ids mapped to local folders. A download copies the files its
    patterns select (huggingface_hub's own matching) into a snapshot folder per revision and returns it."""
    repos = {}

    def snapshot_download(repo_id, *, revision=None, allow_patterns=None, ignore_patterns=None):
        source, snapshot = repos[repo_id], tmp_path / "hub" / repo_id / (revision or "main")
        names = [str(path.relative_to(source)) for path in source.rglob("*") if path.is_file()]
        for name in filter_repo_objects(names, allow_patterns=allow_patterns, ignore_patterns=ignore_patterns):
            (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(source / name, snapshot / name)
        snapshot.mkdir(parents=True, exist_ok=True)
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return repos


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "eagle3 sharded"])
def test_a_hub_id_loads_the_drafts_format_and_decodes_exactly(kind, tmp_path, hub):
    config, weights = eagle_checkpoint() if kind == "eagle" else eagle3_checkpoint()
    repo = write_folder(tmp_path / "repo", config, weights)
    (repo / "README.md").write_text("a model card")
    if kind == "eagle":  # as SafeAILab publishes EAGLE-1/2: a pickle only, beside a trainer's pickles
        (repo / "model.safetensors").unlink()
        torch.save(weights, repo / "pytorch_model.bin")
        torch.save(argparse.Namespace(learning_rate=1e-4), repo / "training_args.bin")
        torch.save({"state": {}}, repo / "optimizer.pt")
        fetched = ["config.json", "pytorch_model.bin"]
    elif kind == "eagle3":  # the weights also as a pickle and in a subfolder: only the safetensors are fetched
        torch.save(weights, repo / "pytorch_model.bin")
        (repo / "original").mkdir()
        torch.save(weights, repo / "original" / "consolidated.00.pth")
        fetched = ["config.json", "model.safetensors"]
    else:  # shards listed by an index, and the same tensors once more in one file: only the shards
        (repo / "model.safetensors").rename(repo / "consolidated.safetensors")
        shards = {"model-00001-of-00002.safetensors": sorted(weights)[:5]}
        shards["model-00002-of-00002.safetensors"] = sorted(weights)[5:]
        for file, names in shards.items():
            save_file({k: weights[k].contiguous() for k in names}, repo / file)
        index = {"weight_map": {k: file for file, names in shards.items() for k in names}}
        (repo / "model.safetensors.index.json").write_text(json.dumps(index))
        fetched = ["config.json", *shards, "model.safetensors.index.json"]
    hub["someone/draft"] = repo
    pair = load_pair(
        load_config(str(write_pair(tmp_path, None, draft={"checkpoint": "someone/draft", "revision": "v1"})))
    )
    assert sorted(p.name for p in (tmp_path / "hub" / "someone" / "draft" / "v1").rglob("*")) == fetched
    assert pair.draft_description.startswith(f"{kind.split()[0]} draft, reads the target's")
    ids, greedy = pair.encode(PROMPT, raw=True), SamplingParams(0.0)
    speculative = pair.decoder(greedy).generate(ids, 24, 0, ignore_eos=True).token_ids
    assert speculative == pair.decoder(greedy, speculative=False).generate(ids, 24, 0, ignore_eos=True).token_ids


@pytest.mark.parametrize(
    "hub_env",
    [{"HF_HUB_OFFLINE": "1"}, {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"}],  # port 9: refused
    ids=["offline", "unreachable"],
)
def test_a_hub_draft_that_cannot_be_fetched_is_one_error_line(tmp_path, hub_env):
    """The real entry point, an empty hub cache and no hub: one `Error:` line, exit 2, no traceback."""
    config = write_pair(tmp_path, None, draft={"checkpoint": "someone/no-such-draft"})
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE")}
    env.update(hub_env, HF_HOME=str(tmp_path / "hf"))
    done = subprocess.run(
        [sys.executable, "-m", "specdec_cli", "generate", "-c", str(config), "-p", "Hi"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert done.returncode == EXIT_BAD_INPUT, done.stderr
    [error] = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert error.startswith("Error: cannot fetch someone/no-such-draft from the Hugging Face hub: "), error
    assert "Traceback" not in done.stderr


# ---------------------------------------------------------------- what recognising a folder reads


def test_a_plain_model_beside_training_args_loads_as_a_plain_model(tmp_path, target):
    """A transformers folder with its weights in a pickle and a trainer's `training_args.bin` (a
    pickle of an object, refused by weights_only) beside it: no format claims it, transformers loads
    it, the trainer's pickle is never read."""
    folder = tmp_path / "plain"
    model = build_tiny(TinyModel(seed=0, num_layers=LAYERS, noise=0.005))
    model.config.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    torch.save(argparse.Namespace(learning_rate=1e-4), folder / "training_args.bin")
    assert load_format(folder, target, torch.float32) is None
    run = runner.invoke(app, ["generate", "-c", str(write_pair(tmp_path, folder)), "-p", "Hi", "--json"])
    assert run.exit_code == 0, run.output
    assert json.loads(run.stdout)["stats"]["new_tokens"] == 24


def test_recognising_a_folder_reads_only_the_weights_its_format_names(tmp_path, target):
    """An EAGLE-1 draft (a plain Llama config: only its tensor names tell) published as a pickle, with
    an optimizer state and a trainer's pickle beside it that would raise if they were ever opened."""
    config, weights = eagle_checkpoint()
    folder = tmp_path / "eagle"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    torch.save(weights, folder / "pytorch_model.bin")
    for decoy in ("optimizer.pt", "training_args.bin", "rng_state.pth"):
        (folder / decoy).write_bytes(b"\x80\x02 not a pickle" * 100_000)
    draft = load_format(folder, target, torch.float32)
    assert getattr(draft.config, DRAFT_FORMAT) == "eagle"
    assert torch.equal(getattr(draft, FEATURES).weight, weights["fc.weight"])


@pytest.mark.parametrize("kind", ["safetensors", "pickle"])
def test_shards_that_share_a_tensor_name_are_refused(tmp_path, kind):
    config, weights = eagle3_checkpoint()
    names = sorted(weights)
    first = {k: weights[k] for k in names[: len(names) // 2]}
    second = {k: weights[k] for k in names[len(names) // 2 :] + ["fc.weight"]}
    assert "fc.weight" in first  # and in the second shard
    folder = tmp_path / "draft"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    for i, shard in enumerate((first, second), 1):
        if kind == "safetensors":
            save_file({k: v.contiguous() for k, v in shard.items()}, folder / f"model-0000{i}-of-00002.safetensors")
        else:
            torch.save(shard, folder / f"pytorch_model-0000{i}-of-00002.bin")
    run = runner.invoke(app, ["generate", "-c", str(write_pair(tmp_path, folder)), "-p", "Hi"])
    assert run.exit_code == EXIT_BAD_INPUT, run.output
    [error] = [line for line in run.stderr.splitlines() if line.startswith("Error:")]
    suffix = "safetensors" if kind == "safetensors" else "bin"
    assert "fc.weight" in error and f"-00001-of-00002.{suffix}" in error and f"-00002-of-00002.{suffix}" in error
