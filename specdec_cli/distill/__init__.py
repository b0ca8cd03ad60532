"""Train a small draft model for a target: `specdec distill`.

1. Corpus: the target answers the training prompts itself, once greedily and several times sampled
   at temperature 1, so the draft learns the text it will be asked to predict in both modes. Then it
   writes prompts of its own (sampling the user's turn from the bare chat template, as in Magpie, Xu
   et al. 2024) and answers each once: a few hundred hand-written prompts are too few, and a draft
   trained on them alone learns their answers by heart instead of the target's habits. While it
   writes, the target's own next-token distribution at every answer position is kept (its top-k);
   one more pass keeps the hidden states the draft reads, so training never runs the target again.
   The corpus is saved as text beside the draft; given answers (that file, or any conversations),
   the target labels them instead of writing its own, in one forward pass each that also keeps the
   hidden states.
2. Draft (methods/feature/draft.py): a feature draft of a few decoder layers initialised from chosen
   (default: evenly spaced) target layers, reading chosen target hidden states (default: EAGLE-3's
   three, fused); the target's embedding, and the target's head
   restricted to the tokens that carry most of the target's probability mass in the corpus. With
   `format="eagle3"` it is EAGLE-3's architecture instead (one layer reading 3 target layers, its own
   head rows over that vocabulary), saved in the layout serving engines load (methods/feature/eagle3_export.py).
3. Training: cross-entropy of the draft against the target's top-k distribution (KL up to a
   constant) at every answer position, as the 1st draft token (reading the target's states) and as
   the 2nd, 3rd ... (reading its own for the tokens before it in the draft: `draft_log_probs`
   attends exactly as drafting does), position k weighted decay ** k. Held-out greedy agreement (on
   greedy answers) and expected acceptance sum(min(p, q)) at temperature 1 (on sampled answers) are
   printed per draft token.

Corpus shards, hidden states and training state live in a work folder until training ends, so an
interrupted run resumes where it stopped (only with the settings that shaped its state: `trained_with`).

corpus.py writes and labels the corpus, state.py keeps files and training state, batches.py turns the
corpus into batches, train.py trains and evaluates; this module runs the command.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specdec_cli import display, records
from specdec_cli.config import Config
from specdec_cli.distill.corpus import ANSWERS, build_corpus, label_answers, read_answers, write_answers
from specdec_cli.distill.settings import ANSWER_KINDS, EAGLE3_LAYOUTS, FORMATS, DistillSettings, read_layers
from specdec_cli.distill.state import WORK, claimed, save
from specdec_cli.distill.train import sample_tokens, split_given_heldout, split_heldout, train
from specdec_cli.distill.writing import read_corpus
from specdec_cli.errors import SpecdecError
from specdec_cli.loading.tokens import padding_id
from specdec_cli.methods.feature import eagle3_export
from specdec_cli.methods.feature.draft import check_target_layers, starting_layers
from specdec_cli.pair import load_checkpoint, resolve_device, resolve_dtype

__all__ = ["DistillSettings", "distill"]


def distill(
    cfg: Config,
    prompts: list[str],
    settings: DistillSettings,
    out: Path,
    keep_work: bool,
    answers: list[Path],
    run: records.Run,
) -> None:
    """The whole command: corpus (written by the target, or the `answers` files and corpus folders it
    labels, together), training, the saved draft and its record. What cannot work is refused before
    `out` is made; from then on `out` is held by this run alone."""
    if settings.format not in FORMATS:
        raise SpecdecError(f"unknown draft format {settings.format!r} (specdec distills {', '.join(FORMATS)})")
    if settings.layout not in EAGLE3_LAYOUTS or (settings.layout != "specforge" and settings.format != "eagle3"):
        layouts = ", ".join(EAGLE3_LAYOUTS)
        raise SpecdecError(f"--layout {settings.layout}: EAGLE-3 drafts (--format eagle3) are saved as {layouts}")
    if settings.trained_answers not in ANSWER_KINDS:
        raise SpecdecError(f"--trained-answers {settings.trained_answers}: one of {', '.join(ANSWER_KINDS)}")
    if settings.heldout_answers and not answers:
        raise SpecdecError("--heldout-answers needs --answers: the target labels both in one pass")
    if cfg.runtime.threads:
        torch.set_num_threads(cfg.runtime.threads)
    device = resolve_device(cfg.runtime.device)
    # the dtype the target decodes in (`auto`: float32 on CPU, bfloat16 on CUDA), so the draft learns
    # the very labels it will be checked against
    dtype = resolve_dtype(cfg.runtime.dtype, device)
    with display.stderr.status(f"Loading {cfg.target.describe()}..."):
        target, tokenizer = load_checkpoint(cfg.target, device, dtype)
    check_target_layers(read_layers(settings, target), target.config)  # before an hour of corpus
    if settings.format == "eagle3":
        eagle3_export.check_taps(read_layers(settings, target), target.config.num_hidden_layers)
    starting_layers(target.config, settings.num_layers, settings.init_layers)
    with claimed(out):
        distill_into(cfg, target, tokenizer, prompts, settings, out, keep_work, answers, run)


def distill_into(
    cfg: Config,
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    settings: DistillSettings,
    out: Path,
    keep_work: bool,
    answers: list[Path],
    run: records.Run,
) -> None:
    """The corpus, the training and the saved draft in `out`, with the loaded target."""
    work = out / WORK  # corpus and training state: what a resumed run continues from
    work.mkdir(parents=True, exist_ok=True)
    if answers:
        given = [
            answer
            for path in answers
            for answer in (
                read_corpus(path, settings.answer_tokens)
                if path.is_dir()
                else read_answers(path, tokenizer, settings.answer_tokens)
            )
        ]
        others = (
            read_answers(Path(settings.heldout_answers), tokenizer, settings.answer_tokens)
            if settings.heldout_answers
            else None
        )
        training, heldout = choose_answers(given, settings, others)  # before the target's pass: it may refuse
        label_answers(
            target, heldout + training, padding_id(tokenizer), settings.top_k, work, read_layers(settings, target)
        )
    else:
        built = build_corpus(target, tokenizer, prompts, settings, work)
        write_answers(built, tokenizer, out / ANSWERS)
        training, heldout = choose_answers(built, settings)
    corpus = heldout + training
    draft, log = train(target, tokenizer, training, heldout, settings, work, cfg.target.describe())
    save(draft, target, tokenizer, out, cfg.target.describe(), log, settings)
    if not keep_work:
        shutil.rmtree(work)
    record = {
        **records.header("distill", cfg),
        "out": str(out),
        "answers": [str(path) for path in answers],  # the files and folders labelled, if any
        "corpus_answers": len(corpus),  # held out and trained on
        "corpus_answer_tokens": sum(len(a["answer"]) for a in corpus),
        "settings": vars(settings),
        "log": log,
    }
    saved = f"Draft saved to {out}: name it as `draft: {{checkpoint: {out}}}`."
    run.finish("distill", cfg.name, record, lambda: display.stderr.print(saved))


def choose_answers(
    corpus: list[dict], settings: DistillSettings, others: list[dict] | None = None
) -> tuple[list[dict], list[dict]]:
    """The answers trained on and the held-out ones (from `others`, answers given apart, where given;
    else a share of the corpus's given prompts'); with `trained_answers`, only the greedy or only the
    sampled training answers, and with `training_tokens`, a seeded sample of that many training answer
    tokens (the held-out answers chosen first, from them all, so that runs differing in these are
    measured on the same answers)."""
    if others is None:
        training, heldout = split_heldout(corpus, settings.heldout_prompts)
    else:
        training, heldout = split_given_heldout(corpus, others)
    if settings.trained_answers != "all":
        kind = [a for a in training if a["greedy"] == (settings.trained_answers == "greedy")]
        if not kind:
            raise SpecdecError(
                f"no answers to train on: none of the {len(training)} training answers is {settings.trained_answers} "
                '(answer files mark the target\'s greedy answers with "greedy": true)'
            )
        training = kind
    if settings.training_tokens:
        training = sample_tokens(training, settings.training_tokens, settings.seed)
    return training, heldout
