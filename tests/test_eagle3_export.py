"""`specdec distill --format eagle3` on a tiny random target: the draft is EAGLE-3's architecture,
saved in the layout serving engines load (config keys, tensor names, no embedding), recognised and
loaded back by the EAGLE-3 loader, drafting what the trained draft drafted; and taps EAGLE-3
cannot read are refused before any corpus is written."""

from __future__ import annotations

import copy
import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch
import yaml
from conftest import DISTILL_PROMPTS as PROMPTS
from conftest import generate_json
from safetensors import safe_open
from typer.testing import CliRunner

from specdec_cli import distill as distillation
from specdec_cli.cli import app
from specdec_cli.config import TinyModel, load_config
from specdec_cli.decoding.cache import CachedModel
from specdec_cli.decoding.params import SamplingParams
from specdec_cli.distill.corpus import add_target_features, build_corpus
from specdec_cli.distill.train import evaluate
from specdec_cli.errors import EXIT_BAD_INPUT
from specdec_cli.loading.checkpoints import build_tiny, byte_tokenizer
from specdec_cli.loading.draft_folder import DraftFolder
from specdec_cli.loading.tokens import padding_id
from specdec_cli.methods.feature import eagle3_export
from specdec_cli.methods.feature.draft import DRAFT_INFO
from specdec_cli.methods.feature.drafter import FeatureDrafter
from specdec_cli.methods.feature.eagle3_export import INFO
from specdec_cli.methods.formats import recognise
from specdec_cli.pair import load_pair

runner = CliRunner()

LAYERS = 4  # the tiny target's: EAGLE-3 reads 3 distinct inputs among layers 1 .. 3
TARGET = {"tiny": {"seed": 0, "num_layers": LAYERS}}
H, VOCAB, DRAFT_VOCAB = 64, 258, 96
OPTIONS = (
    "--vocab 96 --training-steps 80 --learning-rate 3e-3 --answers-per-prompt 4 --synthetic-prompts 8 "
    "--answer-tokens 32 --eval-every 80 --dtype float32"
).split()


def write_yaml(path, data: dict):
    path.write_text(yaml.safe_dump(data))
    return path


def distil(tmp, *more: str) -> SimpleNamespace:
    """A tiny EAGLE-3 distillation in `tmp`: its folder, the trained draft as it was in memory when
    saved, and a config pairing the folder with the target."""
    config = write_yaml(
        tmp / "target.yaml",
        {"name": "tiny", "target": TARGET, "draft": {"ngram": {}}, "runtime": {"device": "cpu", "threads": 1}},
    )
    (tmp / "prompts.txt").write_text("\n".join(PROMPTS))
    out, trained = tmp / "draft", []
    save = distillation.save

    def keep_and_save(draft, *args, **kwargs):
        trained.append(draft)
        save(draft, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECDEC_RUNS_DIR", str(tmp / "runs"))
        patch.setattr(distillation, "save", keep_and_save)
        args = ["distill", "-c", str(config), "--out", str(out), "--prompts", str(tmp / "prompts.txt")]
        result = runner.invoke(app, [*args, "--format", "eagle3", "--target-layers", "3,1,2", *OPTIONS, *more])
    assert result.exit_code == 0, result.output
    pair_config = write_yaml(
        tmp / "pair.yaml",
        {
            "name": "pair",
            "target": TARGET,
            "draft": {"checkpoint": str(out)},
            "generation": {"max_new_tokens": 24, "ignore_eos": True},
            "runtime": {"device": "cpu", "threads": 1},
        },
    )
    return SimpleNamespace(
        out=out,
        draft=trained[0],
        target_config=config,
        pair_config=pair_config,
        config=json.loads((out / "config.json").read_text()),
        info=json.loads((out / INFO).read_text()),
    )


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """One tiny EAGLE-3 distillation shared by the tests below."""
    return distil(tmp_path_factory.mktemp("eagle3"))


def test_the_folder_is_in_eagle3_layout(exported):
    config = exported.config
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 1 and config["hidden_size"] == config["target_hidden_size"] == H
    assert (config["vocab_size"], config["draft_vocab_size"]) == (VOCAB, DRAFT_VOCAB)
    assert config["tie_word_embeddings"] is False and config["norm_before_residual"] is False
    # the same taps in both counts: vLLM's layer inputs, SpecForge / SGLang's layer outputs
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]

    with safe_open(exported.out / "model.safetensors", framework="pt") as f:
        weights = {name: f.get_tensor(name) for name in f.keys()}
    assert not [n for n in weights if "embed" in n]  # the target's embedding is not duplicated
    assert {n.split(".")[0] for n in weights} == {"fc", "midlayer", "norm", "lm_head", "d2t", "t2d"}
    assert weights["fc.weight"].shape == (H, 3 * H) and weights["lm_head.weight"].shape == (DRAFT_VOCAB, H)
    assert weights["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * H
    assert "midlayer.hidden_norm.weight" in weights and "midlayer.input_layernorm.weight" in weights
    d2t, t2d = weights["d2t"], weights["t2d"]
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool and t2d.shape == (VOCAB,)
    token_ids = torch.arange(DRAFT_VOCAB) + d2t
    assert torch.equal(token_ids, exported.draft.lm_head.token_ids) and torch.equal(t2d.nonzero()[:, 0], token_ids)
    # the trained head rows, stored in bfloat16
    assert torch.equal(weights["lm_head.weight"], exported.draft.lm_head.subset.weight.detach().bfloat16())

    # recognised as an EAGLE-3 draft, not as specdec's own: its record has another name
    assert not (exported.out / DRAFT_INFO).exists() and exported.info["format"] == "eagle3"
    folder = DraftFolder(exported.out, config)
    assert recognise(folder) == "eagle3"


def test_the_speculators_layout_holds_the_same_draft(exported, tmp_path, capsys):
    """`--layout speculators`: vllm-project/speculators' Eagle3Speculator files (the layer's config
    nested, `layers.0.*`, norm_before_residual written out), loaded back as the same draft."""
    target = build_tiny(TinyModel(seed=0, num_layers=LAYERS))
    out = tmp_path / "speculators"
    eagle3_export.save_eagle3(exported.draft, target, out, exported.info, "speculators")
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and "model_type" not in config
    assert config["norm_before_residual"] is False and config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert config["speculators_config"]["verifier"]["name_or_path"] == exported.info["target"]
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1 and "draft_vocab_size" not in layer
    with safe_open(out / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
    with safe_open(exported.out / "model.safetensors", framework="pt") as f:
        assert names == {n.replace("midlayer.", "layers.0.") for n in f.keys()}
    assert recognise(DraftFolder(out, config)) == "eagle3"

    pairs = []
    for folder in (exported.out, out):
        pair_config = yaml.safe_load(exported.pair_config.read_text())
        pair_config["draft"]["checkpoint"] = str(folder)
        pairs.append(load_pair(load_config(str(write_yaml(tmp_path / "pair.yaml", pair_config)))))
    ids = pairs[0].encode("The quick brown fox jumps")
    with torch.no_grad():
        (first, q_first), (second, q_second) = (drafts(p, ids, SamplingParams(temperature=1.0)) for p in pairs)
    assert first == second and torch.equal(q_first, q_second)


def test_a_layout_is_for_eagle3_drafts(tmp_path):
    config = write_yaml(tmp_path / "target.yaml", {"name": "tiny", "target": TARGET, "draft": {"ngram": {}}})
    run = runner.invoke(app, ["distill", "-c", str(config), "--out", str(tmp_path / "d"), "--layout", "speculators"])
    assert run.exit_code == EXIT_BAD_INPUT
    [error] = [line for line in run.stderr.splitlines() if line.startswith("Error:")]
    assert error == "Error: --layout speculators: EAGLE-3 drafts (--format eagle3) are saved as specforge, speculators"
    assert not (tmp_path / "d").exists()


def test_every_trained_position_improves(exported):
    first, last = exported.info["log"][0], exported.info["log"][-1]
    assert last["step"] == 80 and exported.info["reads_target_layers"] == [1, 2, 3]
    for position in range(3):
        assert last["expected_acceptance"][position] > first["expected_acceptance"][position] + 0.01


@torch.no_grad()
def test_held_out_expected_acceptance_is_what_drafting_accepts(exported, tmp_path):
    """distill's held-out expected acceptance at T=1 is sum_x min(p, q) of the target's p and the q
    the engine drafts with: checked here at the first draft token, q taken apart from training's code
    through the engine's drafter, after every prefix of answers the target sampled."""
    target, tokenizer = build_tiny(TinyModel(seed=0, num_layers=LAYERS)).eval(), byte_tokenizer()
    pad, taps = padding_id(tokenizer), (1, 2, 3)
    # the target's whole distribution kept (top_k = the vocabulary): the figure is then exact
    settings = distillation.DistillSettings(answers_per_prompt=1, synthetic_prompts=0, answer_tokens=16, top_k=VOCAB)
    torch.manual_seed(0)
    corpus = build_corpus(target, tokenizer, PROMPTS[:3], settings, tmp_path)
    add_target_features(target, corpus, pad, tmp_path, taps)
    draft = copy.deepcopy(exported.draft)
    to_subset = torch.full((VOCAB,), -1)
    to_subset[draft.lm_head.token_ids] = torch.arange(DRAFT_VOCAB)
    [measured] = evaluate(draft, corpus, pad, to_subset, None, 1)["expected_acceptance"]

    engine, drafter = CachedModel(target, VOCAB, taps), FeatureDrafter(draft, VOCAB)
    overlaps = []
    for answer in (a for a in corpus if not a["greedy"]):
        for t in range(len(answer["answer"])):
            prefix = answer["prompt"] + answer["answer"][:t]
            engine.reset(len(prefix))
            out = engine.forward(torch.tensor([prefix]), hidden=True)
            drafter.start([prefix], len(prefix) + 1, out.hidden)
            q = drafter.propose(1, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))[1][0, 0]
            overlaps.append(torch.minimum(out.logits[0, -1].softmax(-1), q).sum().item())
    assert len(overlaps) > 20 and measured > 0.05
    assert measured == pytest.approx(sum(overlaps) / len(overlaps), abs=2e-3)


def drafts(pair, prompt_ids: list[int], params: SamplingParams, num_draft_tokens: int = 3):
    """The pair's draft tokens and q for one block after the prompt, driven as the engine drives it."""
    pair.target.reset(len(prompt_ids) + num_draft_tokens + 1)
    states = pair.target.forward(torch.tensor([prompt_ids]), hidden=True).hidden
    pair.drafter.start([prompt_ids], len(prompt_ids) + num_draft_tokens + 1, states)
    tokens, q = pair.drafter.propose(num_draft_tokens, params, torch.Generator().manual_seed(0))
    return tokens[0].tolist(), q


@torch.no_grad()
def test_it_loads_back_and_drafts_what_the_trained_draft_drafted(exported, capsys):
    pair = load_pair(load_config(str(exported.pair_config)))
    assert "eagle3 draft reads target hidden states [1, 2, 3]" in capsys.readouterr().err
    assert pair.draft_description == "eagle3 draft, reads the target's hidden states [1, 2, 3]"
    drafts_as_trained(exported, pair)


def drafts_as_trained(exported: SimpleNamespace, pair) -> None:
    """The loaded pair drafts what the draft drafted in memory when it was saved."""
    # the draft as it was trained, its weights rounded as the folder stores them (bfloat16)
    trained = copy.deepcopy(exported.draft)
    for name, weight in trained.named_parameters():
        if name != "model.embed_tokens.weight":
            weight.copy_(weight.bfloat16().float())
    in_memory = dataclasses.replace(pair, drafter=FeatureDrafter(trained, VOCAB))
    for prompt in ("Hello there", "The quick brown fox jumps"):
        ids = pair.encode(prompt)
        assert drafts(pair, ids, SamplingParams())[0] == drafts(in_memory, ids, SamplingParams())[0]
        (loaded, q_loaded), (kept, q_kept) = (
            drafts(p, ids, SamplingParams(temperature=1.0)) for p in (pair, in_memory)
        )
        assert loaded == kept
        assert torch.equal(q_loaded == 0, q_kept == 0)  # the draft vocabulary only
        torch.testing.assert_close(q_loaded, q_kept, atol=1e-5, rtol=1e-4)


def test_greedy_output_is_the_targets(exported):
    outputs = [
        generate_json("-c", str(exported.pair_config), "--num-draft-tokens", num_draft_tokens)
        for num_draft_tokens in ("3", "1")
    ]
    alone = generate_json("-c", str(exported.target_config), "--max-new-tokens", "24", "--ignore-eos")
    assert outputs[0]["token_ids"] == outputs[1]["token_ids"] == alone["token_ids"]
    assert outputs[0]["draft"] == "eagle3 draft, reads the target's hidden states [1, 2, 3]"


@pytest.mark.parametrize(
    "options, message",
    [
        (["--target-layers", "1,2"], "[1, 2] do not fit"),
        (["--target-layers", "0,1,2"], "[0, 1, 2] do not fit"),  # the embedding output: no engine captures it
        (["--target-layers", "1,2,4"], "[1, 2, 4] do not fit"),  # after the final norm
        ([], "[2, 2, 1] do not fit"),  # the default, inputs of layers 2, L//2, L-3, coincide on 4 layers
    ],
)
def test_what_eagle3_cannot_read_is_refused_before_the_corpus(tmp_path, options, message):
    config = write_yaml(tmp_path / "target.yaml", {"name": "tiny", "target": TARGET, "draft": {"ngram": {}}})
    out = tmp_path / "draft"
    run = runner.invoke(
        app, ["distill", "-c", str(config), "--out", str(out), "--format", "eagle3", "--device", "cpu", *options]
    )
    assert run.exit_code == EXIT_BAD_INPUT, run.output
    [error] = [line for line in run.stderr.splitlines() if line.startswith("Error:")]
    assert message in error and "Traceback" not in run.output
    assert not out.exists()  # no corpus, not even the work folder


def test_a_draft_of_two_layers_is_the_midlayer_then_a_llama_layer(tmp_path):
    """`--layers 2`: the midlayer and one plain Llama layer after it (`layers.1.*`, as vLLM reads
    them), started from two target layers, loaded back drafting what it drafted when trained, and
    greedy output still the target's."""
    two = distil(tmp_path, "--layers", "2", "--training-steps", "20", "--eval-every", "20")
    assert two.config["num_hidden_layers"] == 2 and two.info["initialised_from_target_layers"] == [0, 3]
    with safe_open(two.out / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
    assert {n.split(".")[0] for n in names} == {"fc", "midlayer", "layers", "norm", "lm_head", "d2t", "t2d"}
    assert {n.split(".")[1] for n in names if n.startswith("layers.")} == {"1"}
    assert "layers.1.self_attn.q_proj.weight" in names and "layers.1.hidden_norm.weight" not in names
    pair = load_pair(load_config(str(two.pair_config)))
    assert len(pair.drafter.model.model.model.layers) == 2
    with torch.no_grad():
        drafts_as_trained(two, pair)
    alone = generate_json("-c", str(two.target_config), "--max-new-tokens", "24", "--ignore-eos")
    assert generate_json("-c", str(two.pair_config))["token_ids"] == alone["token_ids"]
