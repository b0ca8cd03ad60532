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
2. Draft (models/feature_draft.py): a feature draft of a few decoder layers initialised from chosen
   (default: evenly spaced) target layers, reading chosen target hidden states (default: EAGLE-3's
   three, fused); the target's embedding, and the target's head
   restricted to the tokens that carry most of the target's probability mass in the corpus. With
   `format="eagle3"` it is EAGLE-3's architecture instead (one layer reading 3 target layers, its own
   head rows over that vocabulary), saved in the layout serving engines load (models/eagle3_draft.py).
3. Training: cross-entropy of the draft against the target's top-k distribution (KL up to a
   constant) at every answer position, as the 1st draft token (reading the target's states) and as
   the 2nd, 3rd ... (reading its own for the tokens before it in the draft: `draft_log_probs`
   attends exactly as drafting does), position k weighted decay ** k. Held-out greedy agreement (on
   greedy answers) and expected acceptance sum(min(p, q)) at temperature 1 (on sampled answers) are
   printed per draft token.

Corpus shards, hidden states and training state live in a work folder until training ends, so an
interrupted run resumes where it stopped (only with the settings that shaped its state: `trained_with`).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import math
import pickle
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from specdec_cli import display, records
from specdec_cli.config import Config
from specdec_cli.errors import SpecdecError
from specdec_cli.models import eagle3_draft
from specdec_cli.models.checkpoints import first_lines, load_model
from specdec_cli.models.feature_draft import (
    EMBEDDING,
    check_target_layers,
    eagle3_layers,
    feature_inputs,
    init_draft,
    own_weights,
    read_target,
    save_draft,
    starting_layers,
    target_layers,
)
from specdec_cli.models.pair import resolve_device, resolve_dtype
from specdec_cli.models.tokens import encode_prompt, eos_token_ids, padding_id

WORK = "distill-work"  # subfolder of the output: corpus and training state until training ends
STATE = "train-state.pt"  # (train-state-eagle3.pt for an EAGLE-3 draft)
FEATURES = "target-features-{}-{:05d}.pt"  # the target states a draft reads: layers, shard
ANSWERS = "corpus.jsonl.gz"  # the corpus as text, saved beside the draft: `--answers` labels it again
SHARD = 256  # answers per shard of labels and of target states (a restart keeps the finished shards)
GENERATION_BATCH = 32  # sampling many answers at once is far faster than one by one
PROMPT_TOKENS = 64  # most tokens of a prompt the target writes
FORMATS = ("specdec", "eagle3")  # the draft specdec trains, or EAGLE-3's (models/eagle3_draft.py)


@dataclass
class DistillSettings:
    num_layers: int = 1
    # the target hidden states the draft reads (indices of transformers' `hidden_states`, -1 the
    # last); None: the inputs of layers 2, L // 2 and L - 3, as EAGLE-3 reads them
    target_layers: tuple[int, ...] | None = None
    init_layers: tuple[int, ...] | None = None  # target layers the draft's layers start from (None: spaced)
    zero_features: bool = False  # start as a token-only draft (the state's part of the projection 0)
    position_decay: float = 0.8  # loss weight of draft position k is decay ** k (EAGLE-3)
    draft_steps: int = 3  # draft positions trained: the 1st reads target states, later ones its own
    answers_per_prompt: int = 4  # sampled at temperature 1, plus one greedy answer
    synthetic_prompts: int = 2048  # prompts the target writes itself, answered once each
    answer_tokens: int = 192
    top_k: int = 32  # target probabilities kept per position
    draft_vocab: int = 8192
    steps: int = 3000
    batch_size: int = 8
    learning_rate: float = 1e-3
    eval_every: int = 250
    heldout_prompts: float = 0.1  # of the given prompts: their answers are never trained on
    seed: int = 0
    format: str = "specdec"  # or "eagle3": EAGLE-3's architecture, saved in its layout


def save_whole(obj, path: Path) -> None:
    """torch.save through a temporary file: a run stopped mid-write leaves the previous file (or none),
    never a truncated one that the resumed run would fail to read."""
    partial = path.with_suffix(".partial")
    torch.save(obj, partial)
    partial.replace(path)


def load_kept(path: Path):
    """A file of the work folder, read as data only: the folder may come from someone else, and a
    pickle can run code as it loads. What specdec saves there is tensors and plain containers (on the
    CPU, so a run stopped on a GPU resumes anywhere)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        problem = "it holds objects other than tensors and plain data, which could run code as they load"
    except (RuntimeError, EOFError) as exc:
        problem = f"it is damaged ({first_lines(exc).split('. ')[0]})"
    raise SpecdecError(f"{path}: refused, {problem}: delete it, or use another --out")


@dataclass
class Job:
    prompt_index: int
    greedy: bool


def corpus_batches(num_prompts: int, answers_per_prompt: int) -> list[list[Job]]:
    """Generation batches, each all greedy or all sampled: greedy answers first, then the rest."""
    greedy = [Job(i, True) for i in range(num_prompts)]
    sampled = [Job(i, False) for i in range(num_prompts) for _ in range(answers_per_prompt)]
    return [
        jobs[start : start + GENERATION_BATCH]
        for jobs in (greedy, sampled)
        for start in range(0, len(jobs), GENERATION_BATCH)
    ]


@torch.inference_mode()
def build_corpus(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    settings: DistillSettings,
    work: Path,
) -> list[dict]:
    """One dict per answer: prompt text and ids, answer ids, the target's top-k ids and log-probs at
    each answer position. Written in shards of one generation batch, so a restart keeps what is done:
    first the answers to `prompts`, then the synthetic prompts' (greedy and sampled batches in turn)."""
    pad = padding_id(tokenizer)
    eos = eos_token_ids(target.generation_config, tokenizer)
    groups = corpus_batches(len(prompts), settings.answers_per_prompt)
    synthetic = [
        min(GENERATION_BATCH, settings.synthetic_prompts - start)
        for start in range(0, settings.synthetic_prompts, GENERATION_BATCH)
    ]
    sizes = [len(g) for g in groups] + synthetic
    paths = [work / f"corpus-{shard:05d}.pt" for shard in range(len(sizes))]
    corpus: list[dict] = []
    with display.progress() as bar:
        resumed = sum(size for size, path in zip(sizes, paths) if path.is_file())
        task = bar.add_task("Target writes the corpus", total=sum(sizes), completed=resumed)
        for shard, (size, path) in enumerate(zip(sizes, paths)):
            if not path.is_file():
                torch.manual_seed(settings.seed * 1_000_003 + shard)  # deterministic, also on resume
                if shard < len(groups):
                    group = groups[shard]
                    texts = [prompts[j.prompt_index] for j in group]
                    greedy = group[0].greedy
                else:
                    texts = synthetic_prompts(target, tokenizer, size, pad, eos)
                    greedy = shard % 2 == 0
                ids = [encode_prompt(tokenizer, text) for text in texts]
                answers = answer_batch(target, ids, greedy, pad, eos, settings)
                for text, answer in zip(texts, answers):
                    answer["prompt_text"] = text
                    # never held out: evaluation stays on the given prompts
                    answer["synthetic"] = shard >= len(groups)
                save_whole(answers, path)
                bar.update(task, advance=size)
            corpus += load_kept(path)
    return corpus


def synthetic_prompts(
    target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, count: int, pad: int, eos: set[int]
) -> list[str]:
    """`count` user prompts the target writes itself at temperature 1, started from the chat
    template's text before the user's message (from the first token, where there is no template)."""
    if tokenizer.chat_template:
        marker = "\x00prompt\x00"
        text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
        start = tokenizer.encode(text[: text.index(marker)], add_special_tokens=False)
    else:
        start = [tokenizer.bos_token_id if tokenizer.bos_token_id is not None else pad]
    input_ids = torch.tensor([start] * count, device=target.device)
    out = target.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=PROMPT_TOKENS,
        pad_token_id=pad,
    )
    texts = []
    for row in out[:, len(start) :].tolist():
        ends = [i for i, t in enumerate(row) if t in eos]
        text = tokenizer.decode(row[: ends[0]] if ends else row, skip_special_tokens=True).strip()
        if text:
            texts.append(text)
    return texts or ["Hello."]  # never an empty batch


def answer_batch(
    target: PreTrainedModel, prompts: list[list[int]], greedy: bool, pad: int, eos: set[int], settings: DistillSettings
) -> list[dict]:
    width = max(map(len, prompts))
    # left padding, so every answer starts right after its prompt
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in prompts], device=target.device)
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompts], device=target.device)
    sampling = {} if greedy else {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
    out = target.generate(
        input_ids=input_ids,
        attention_mask=mask,
        do_sample=not greedy,
        **sampling,
        max_new_tokens=settings.answer_tokens,
        pad_token_id=pad,
        return_dict_in_generate=True,
        output_logits=True,
    )
    # the raw (unwarped) distribution that produced each answer token
    top = [step.float().log_softmax(-1).topk(settings.top_k, dim=-1) for step in out.logits]
    top_logp = torch.stack([t.values for t in top], dim=1)  # [batch, steps, k]
    top_ids = torch.stack([t.indices for t in top], dim=1)
    answers = []
    for row, ids in enumerate(prompts):
        answer = out.sequences[row, width:].tolist()
        ends = [i for i, t in enumerate(answer) if t in eos]  # keep the EOS, drop the padding after it
        n = ends[0] + 1 if ends else len(answer)
        answers.append(
            {
                "prompt": ids,
                "answer": answer[:n],
                "greedy": greedy,
                "top_ids": top_ids[row, :n].int().cpu(),
                "top_logp": top_logp[row, :n].half().cpu(),
            }
        )
    return answers


def write_answers(corpus: list[dict], tokenizer: PreTrainedTokenizerBase, path: Path) -> None:
    """The corpus as JSON lines of {"prompt", "answer", "greedy", "synthetic"}: what `--answers` reads
    (a few MB where the corpus with its labels and states takes GBs)."""
    partial = path.with_suffix(".partial")
    with gzip.open(partial, "wt", encoding="utf-8") as file:
        for a in corpus:
            record = {"prompt": a["prompt_text"], "answer": tokenizer.decode(a["answer"])}
            file.write(json.dumps(record | {"greedy": a["greedy"], "synthetic": a["synthetic"]}) + "\n")
    partial.replace(path)


def read_answers(path: Path, tokenizer: PreTrainedTokenizerBase, answer_tokens: int) -> list[dict]:
    """Answers from JSON lines (gzipped where the name ends in .gz) of {"prompt": user text, "answer":
    text, "greedy": whether it is the target's greedy answer (default false), "synthetic": never hold
    it out (default false)}; answers are cut at `answer_tokens`."""
    answers = []
    try:
        with (gzip.open if path.suffix == ".gz" else open)(path, "rt", encoding="utf-8") as file:
            for number, line in enumerate(file, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    text, answer = record["prompt"], record["answer"]
                    ids = tokenizer.encode(answer, add_special_tokens=False)[:answer_tokens]
                    if not (isinstance(text, str) and text.strip() and ids):
                        raise ValueError("an empty prompt or answer")
                except (ValueError, KeyError, TypeError) as exc:
                    expected = '{"prompt": "...", "answer": "..."}'
                    raise SpecdecError(f"{path}, line {number}: expected {expected} ({exc})") from None
                answers.append(
                    {
                        "prompt_text": text,
                        "prompt": encode_prompt(tokenizer, text),
                        "answer": ids,
                        "greedy": bool(record.get("greedy", False)),
                        "synthetic": bool(record.get("synthetic", False)),
                    }
                )
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise SpecdecError(f"cannot read {path}: {exc}") from None
    if not answers:
        raise SpecdecError(f"{path} holds no answers")
    return answers


@torch.inference_mode()
def label_answers(
    target: PreTrainedModel, answers: list[dict], pad: int, top_k: int, work: Path, layers: tuple[int, ...]
) -> list[dict]:
    """Adds the target's top-k at every answer position, from one forward pass over prompt and answer
    (teacher forcing: the distribution generation would have kept), in shards a restart keeps. The
    same pass gives the target states `layers` the draft reads, kept as `add_target_features` keeps
    them, so training does not run the target over the answers again."""
    labelled: list[dict] = []
    with display.progress() as bar:
        task = bar.add_task("Target labels the answers", total=len(answers))
        for number, start in enumerate(range(0, len(answers), SHARD)):
            shard = answers[start : start + SHARD]
            path = work / f"labels-{number:05d}.pt"
            kept = load_kept(path) if path.is_file() else []
            # a kept shard counts only while it labels these very answers (the file may have grown
            # or changed since)
            if [(a["prompt"], a["answer"]) for a in kept] == [(a["prompt"], a["answer"]) for a in shard]:
                for a, labels in zip(shard, kept):
                    a["top_ids"], a["top_logp"] = labels["top_ids"], labels["top_logp"]
                labelled += shard
                bar.update(task, advance=len(shard))
                continue
            states = []
            for first in range(0, len(shard), 8):
                group = shard[first : first + 8]
                ids, mask = pad_right([a["prompt"] + a["answer"] for a in group], pad)
                out = target(
                    input_ids=ids.to(target.device),
                    attention_mask=mask.to(target.device),
                    output_hidden_states=True,
                )
                taps = torch.cat([out.hidden_states[i] for i in layers], dim=-1)
                for row, a in enumerate(group):
                    # the last prompt token's logits predict the first answer token
                    at = slice(len(a["prompt"]) - 1, len(a["prompt"]) - 1 + len(a["answer"]))
                    top = out.logits[row, at].float().log_softmax(-1).topk(top_k, dim=-1)
                    a["top_ids"], a["top_logp"] = top.indices.int().cpu(), top.values.half().cpu()
                    states.append(taps[row, : sequence_length(a)].cpu())
                bar.update(task, advance=len(group))
            save_whole(states, states_path(work, layers, number))
            save_whole(shard, path)
            labelled += shard
    return labelled


def choose_vocabulary(corpus: list[dict], vocab_size: int, size: int, eos: set[int]) -> torch.Tensor:
    """The `size` tokens with the most target probability mass over the corpus' answer positions
    (EOS always among them), in id order."""
    mass = torch.zeros(vocab_size)
    for answer in corpus:
        mass.index_add_(0, answer["top_ids"].flatten().long(), answer["top_logp"].flatten().float().exp())
    mass[sorted(eos)] = math.inf
    return mass.topk(min(size, vocab_size)).indices.sort().values


def batches(corpus: list[dict], batch_size: int, seed: int, step: int):
    """Endless shuffled batches; deterministic given the seed, and resumable at any step."""
    order: list[int] = []
    epoch = 0
    skipped = 0
    while True:
        if not order:
            order = list(range(len(corpus)))
            random.Random(seed + epoch).shuffle(order)
            epoch += 1
        group, order = order[:batch_size], order[batch_size:]
        if skipped < step:
            skipped += 1
            continue
        yield [corpus[i] for i in group]


def read_layers(settings: DistillSettings, target: PreTrainedModel) -> tuple[int, ...]:
    """The target states the draft reads: the settings', or the inputs of layers 2, L // 2 and L - 3
    (EAGLE-3's choice: low, middle and high; all of them on a target of 3 layers or fewer)."""
    count = target.config.num_hidden_layers
    default = eagle3_layers(count) if count > 3 else tuple(range(count + 1))
    return settings.target_layers or default


def add_target_features(
    target: PreTrainedModel, corpus: list[dict], pad: int, work: Path, layers: tuple[int, ...]
) -> None:
    """The target's hidden states `layers` at every token but the last of each answer's sequence,
    which the draft reads beside the next token. Kept in the work folder in shards of `SHARD` answers,
    one set per choice of layers, so a restart or a retrain reading the same layers skips this pass; a
    kept shard is reused while its states fit its answers' lengths (the corpus grows at its end when
    there are more synthetic prompts: only the shards that changed are run)."""
    with display.progress() as bar:
        task = bar.add_task("Target hidden states", total=len(corpus))
        for number, start in enumerate(range(0, len(corpus), SHARD)):
            answers = corpus[start : start + SHARD]
            path = states_path(work, layers, number)
            states = load_kept(path) if path.is_file() else []
            if [len(s) for s in states] != [sequence_length(a) for a in answers]:
                states = target_states(target, answers, pad, layers)
                save_whole(states, path)
            for answer, state in zip(answers, states):
                answer["features"] = state
            bar.update(task, advance=len(answers))


def states_path(work: Path, layers: tuple[int, ...], shard: int) -> Path:
    return work / FEATURES.format("_".join(map(str, layers)), shard)


def sequence_length(answer: dict) -> int:
    return len(answer["prompt"]) + len(answer["answer"]) - 1


@torch.inference_mode()
def target_states(
    target: PreTrainedModel, answers: list[dict], pad: int, layers: tuple[int, ...]
) -> list[torch.Tensor]:
    """Per answer [sequence_length, taps * hidden]: the target's states `layers` at its tokens."""
    states = []
    for start in range(0, len(answers), 8):
        seqs = [a["prompt"] + a["answer"][:-1] for a in answers[start : start + 8]]
        ids, mask = pad_right(seqs, pad)
        out = target(
            input_ids=ids.to(target.device),
            attention_mask=mask.to(target.device),
            output_hidden_states=True,
            logits_to_keep=1,
        )
        batch = torch.cat([out.hidden_states[i] for i in layers], dim=-1)
        states += [batch[row, : len(seq)].cpu() for row, seq in enumerate(seqs)]
    return states


def pad_right(seqs: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, seqs))
    ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    return ids, mask


@dataclass
class Batch:
    ids: torch.Tensor  # [B, L] input j is token j + 1 of prompt + answer, right-padded ...
    features: torch.Tensor  # [B, L, taps * hidden] ... beside the target's states at token j
    mask: torch.Tensor
    rows: torch.Tensor  # [N] (row, column) of every input whose output predicts an answer token
    cols: torch.Tensor
    targets: torch.Tensor  # [N, k] the target's top-k as indices into the draft's vocabulary
    weights: torch.Tensor  # [N, k] their target probabilities, 0 where the draft cannot score them
    top1: torch.Tensor  # [N] the target's most likely token id
    greedy: torch.Tensor  # [N] whether the position belongs to a greedy answer


def make_batch(answers: list[dict], pad: int, to_subset: torch.Tensor, device: torch.device) -> Batch:
    ids, mask = pad_right([a["prompt"][1:] + a["answer"] for a in answers], pad)
    features = torch.nn.utils.rnn.pad_sequence([a["features"] for a in answers], batch_first=True)
    # input j reads token j + 1 and predicts token j + 2: input P - 2 predicts the first answer token
    # (after a one-token prompt no input does: the first token is never drafted)
    rows = torch.cat([torch.full((len(a["answer"]),), i) for i, a in enumerate(answers)])
    cols = torch.cat([torch.arange(len(a["answer"])) + len(a["prompt"]) - 2 for a in answers])
    top_ids = torch.cat([a["top_ids"] for a in answers]).long()
    subset = to_subset[top_ids]
    weights = torch.cat([a["top_logp"] for a in answers]).float().exp() * (subset >= 0)
    greedy = torch.cat([torch.full((len(a["answer"]),), a["greedy"]) for a in answers])
    drafted = cols >= 0
    return Batch(
        ids.to(device),
        features.to(device),
        mask.to(device),
        *(t[drafted].to(device) for t in (rows, cols, subset.clamp(min=0), weights, top_ids[:, 0], greedy)),
    )


def draft_log_probs(
    draft: PreTrainedModel, batch: Batch, autocast: torch.dtype | None, draft_steps: int
) -> list[torch.Tensor]:
    """Draft log-probs over its vocabulary subset [N, subset] at the batch's answer positions, as
    the 1st, 2nd, ... token of a draft, attending to exactly what drafting attends to ("training-time
    test", EAGLE-3): the k-th draft token at input j is drafted as if the verified text ended at
    input j - k + 1, so it sees the 1st step's inputs (target states) up to there, then its own
    inputs of steps 2 .. k on the diagonal that leads to j. Each step's output stands in for the
    target's state at the next step."""
    length = batch.ids.shape[1]
    positions = torch.arange(length, device=batch.ids.device)
    # [query j, key i] of one step: how far back the key is
    behind = positions[:, None] - positions[None, :]
    cache = DynamicCache(config=draft.config)
    log_probs = []
    target_states = read_target(draft, batch.features)
    features = target_states
    # the borrowed embedding and head are in the target's dtype (bfloat16 for speed): compute in it
    with torch.autocast(
        device_type=batch.ids.device.type, dtype=autocast or torch.float32, enabled=autocast is not None
    ):
        for step in range(draft_steps):
            verified = (behind >= step) & batch.mask[:, None, :].bool()  # [B, query, key] of step 1's inputs
            drafted = [(behind == step - earlier).expand_as(verified) for earlier in range(1, step + 1)]
            mask = torch.cat([verified, *drafted], dim=-1)[:, None]
            inputs = feature_inputs(draft, batch.ids, features)
            hidden = draft.model(
                inputs_embeds=inputs, attention_mask=mask, position_ids=positions[None], cache=cache, use_cache=True
            ).last_hidden_state
            log_probs.append(draft.lm_head.scores(hidden[batch.rows, batch.cols]).float().log_softmax(-1))
            # input j's output stands in for the target's state at token j + 1
            features = torch.cat([target_states[:, :1], hidden[:, :-1].to(target_states.dtype)], dim=1)
    return log_probs


def distillation_loss(log_probs: list[torch.Tensor], batch: Batch, decay: float) -> torch.Tensor:
    """Cross-entropy against the target's top-k probabilities, per position, weighted over draft
    steps by decay ** k: a later draft token only counts if the ones before it were accepted."""
    weights = [decay**k for k in range(len(log_probs))]
    losses = [-(batch.weights * q_log.gather(1, batch.targets)).sum(1).mean() for q_log in log_probs]
    return sum(w * loss for w, loss in zip(weights, losses)) / sum(weights)


@torch.no_grad()
def evaluate(
    draft: PreTrainedModel,
    heldout: list[dict],
    pad: int,
    to_subset: torch.Tensor,
    autocast: torch.dtype | None,
    draft_steps: int,
) -> dict[str, list[float] | float | None]:
    """Per draft step: greedy agreement (draft argmax == target argmax) on greedy answers, and
    expected acceptance at temperature 1, sum_x min(p, q) over the target's top-k, on sampled
    answers; and the share of the target's probability the draft's vocabulary covers."""
    agree = [0.0] * draft_steps
    accept = [0.0] * draft_steps
    greedy_count = sampled_count = covered = 0.0
    for start in range(0, len(heldout), 8):
        batch = make_batch(heldout[start : start + 8], pad, to_subset, draft.device)
        for k, q_log in enumerate(draft_log_probs(draft, batch, autocast, draft_steps)):
            predicted = draft.lm_head.token_ids[q_log.argmax(-1)]
            agree[k] += ((predicted == batch.top1) & batch.greedy).sum().item()
            overlap = torch.minimum(batch.weights, q_log.gather(1, batch.targets).exp()).sum(1)
            accept[k] += (overlap * ~batch.greedy).sum().item()
        greedy_count += batch.greedy.sum().item()
        sampled_count += (~batch.greedy).sum().item()
        covered += batch.weights.sum().item()
    # a figure with nothing held out to measure it on is None, not 0: a 0 reads as a draft that fails
    return {
        "greedy_agreement": [a / greedy_count for a in agree] if greedy_count else None,
        "expected_acceptance": [a / sampled_count for a in accept] if sampled_count else None,
        "vocabulary_coverage": covered / (greedy_count + sampled_count) if greedy_count + sampled_count else None,
    }


def split_heldout(corpus: list[dict], share: float) -> tuple[list[dict], list[dict]]:
    """Training answers, and held-out answers: those to a `share` of the given prompts (the first ones
    in the corpus), so that evaluation measures the draft on the given prompts' kind of text and on
    prompts it never trained on. The target's own prompts are never held out; an answer to one that
    happens to repeat a held-out prompt is not trained on either."""
    given = list(dict.fromkeys(tuple(a["prompt"]) for a in corpus if not a["synthetic"]))
    heldout_prompts = set(given[: max(1, round(len(given) * share))])
    heldout = [a for a in corpus if tuple(a["prompt"]) in heldout_prompts and not a["synthetic"]]
    training = [a for a in corpus if tuple(a["prompt"]) not in heldout_prompts]
    if not training:
        raise SpecdecError(
            f"no answers to train on: all {len(corpus)} answers are to the held-out prompts "
            f"({len(heldout_prompts)} of the {len(given)} given); give more prompts or answers"
        )
    return training, heldout


def train(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    corpus: list[dict],
    settings: DistillSettings,
    work: Path,
    target_name: str,
) -> tuple[PreTrainedModel, list[dict]]:
    pad = padding_id(tokenizer)
    training, heldout = split_heldout(corpus, settings.heldout_prompts)  # before the target's pass: it may refuse
    taps = read_layers(settings, target)
    add_target_features(target, corpus, pad, work, taps)
    torch.manual_seed(settings.seed)
    vocab_size = target.get_output_embeddings().weight.shape[0]
    token_ids = choose_vocabulary(
        training, vocab_size, settings.draft_vocab, eos_token_ids(target.generation_config, tokenizer)
    )
    to_subset = torch.full((vocab_size,), -1, dtype=torch.long)
    to_subset[token_ids] = torch.arange(len(token_ids))
    if settings.format == "eagle3":
        draft = eagle3_draft.init_eagle3(target, token_ids, taps, settings.init_layers, settings.zero_features)
    else:
        draft = init_draft(target, settings.num_layers, token_ids, taps, settings.init_layers, settings.zero_features)
    autocast = target.dtype if target.dtype != torch.float32 else None
    trainable = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=settings.learning_rate, weight_decay=0.0)
    warmup = max(1, settings.steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: min(1, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, settings.steps) / settings.steps)),
    )
    log: list[dict] = []
    step = 0
    state_path = work / (STATE if settings.format == "specdec" else f"train-state-{settings.format}.pt")
    shaped_by = trained_with(settings, target, target_name, corpus)
    if state_path.is_file():
        step, log = resume(state_path, shaped_by, draft, optimizer, schedule)

    def evaluation(**extra) -> None:
        draft.eval()
        log.append({"step": step, **extra, **evaluate(draft, heldout, pad, to_subset, autocast, settings.draft_steps)})
        draft.train()
        display.stderr.print(format_eval(log[-1]))

    if not log:
        display.stderr.print(
            f"Corpus: {len(training)} training answers "
            f"({sum(len(a['answer']) for a in training)} answer tokens), {len(heldout)} held out "
            f"({sum(a['greedy'] for a in heldout)} greedy, {sum(not a['greedy'] for a in heldout)} sampled "
            f"at T=1); draft vocabulary {len(token_ids)} of {vocab_size} tokens"
        )
        evaluation()

    def save_state() -> None:
        save_whole(
            {
                "draft": own_weights(draft),
                "optimizer": optimizer.state_dict(),
                "schedule": schedule.state_dict(),
                "step": step,
                "log": log,
                "trained_with": shaped_by,
            },
            state_path,
        )

    stream = batches(training, settings.batch_size, settings.seed, step)
    draft.train()
    with display.progress() as bar:
        task = bar.add_task("Training the draft", total=settings.steps, completed=step)
        try:
            while step < settings.steps:
                batch = make_batch(next(stream), pad, to_subset, draft.device)
                log_probs = draft_log_probs(draft, batch, autocast, settings.draft_steps)
                loss = distillation_loss(log_probs, batch, settings.position_decay)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(trainable, 1.0)
                optimizer.step()
                schedule.step()
                step += 1
                bar.update(task, completed=step, description=f"Training the draft (loss {loss.item():.3f})")
                if step % settings.eval_every == 0 or step == settings.steps:
                    evaluation(loss=loss.item())
                    save_state()
        except KeyboardInterrupt:
            save_state()
            display.stderr.print(f"Interrupted at step {step}; run the same command again to resume.")
            raise
    draft.eval()
    return draft, log


def trained_with(settings: DistillSettings, target: PreTrainedModel, target_name: str, corpus: list[dict]) -> dict:
    """What shapes a training state (the draft's weights, the optimizer, the answers and their order):
    a run resumes it only with the same. `steps` may change (the schedule goes on from the step
    reached towards the new end), and so may `eval_every`."""
    answers = json.dumps([(a["prompt"], a["answer"]) for a in corpus]).encode()
    return {
        **{key: value for key, value in vars(settings).items() if key not in ("steps", "eval_every")},
        # as resolved: by default they depend on the target
        "target_layers": list(read_layers(settings, target)),
        "init_layers": starting_layers(target.config, settings.num_layers, settings.init_layers),
        "target": target_name,
        "dtype": str(target.dtype).removeprefix("torch."),
        "corpus": hashlib.sha256(answers).hexdigest()[:12],
    }


def resume(
    path: Path,
    shaped_by: dict,
    draft: PreTrainedModel,
    optimizer: torch.optim.Optimizer,
    schedule: torch.optim.lr_scheduler.LRScheduler,
) -> tuple[int, list[dict]]:
    """Loads a saved training state into the draft, optimizer and schedule: the step and log it reached."""
    state = load_kept(path)
    saved = state.get("trained_with", {}) if isinstance(state, dict) else {}
    for key, value in shaped_by.items():
        if saved.get(key) != value:
            raise SpecdecError(
                f"{path} holds training with {key} {saved.get(key, '(not recorded)')}, this run {key} {value}: "
                "run with the same settings, use another --out, or delete that file to train anew on the kept corpus"
            )
    try:
        # strictly: every tensor of the draft but the target's embedding, which is never saved
        missing, unexpected = draft.load_state_dict(state["draft"], strict=False)
        if missing != [EMBEDDING] or unexpected:
            raise ValueError(f"missing {[m for m in missing if m != EMBEDDING]}, unexpected {unexpected}")
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        return state["step"], state["log"]
    except (KeyError, TypeError, RuntimeError, ValueError) as exc:
        raise SpecdecError(
            f"{path} does not fit this draft ({first_lines(exc)}): delete it, or use another --out"
        ) from None


def format_eval(entry: dict) -> str:
    loss = f", loss {entry['loss']:.3f}" if "loss" in entry else ""

    def figure(value: list[float] | float | None, answers: str) -> str:
        if value is None:
            return f"not measured (no {answers} held out)"
        return " / ".join(f"{v:.3f}" for v in value) if isinstance(value, list) else f"{value:.3f}"

    return (
        f"step {entry['step']}{loss}: held out, per draft token 1 / 2 ...: greedy agreement "
        f"{figure(entry['greedy_agreement'], 'greedy answers')}, expected acceptance (T=1) "
        f"{figure(entry['expected_acceptance'], 'sampled answers')}; vocabulary coverage "
        f"{figure(entry['vocabulary_coverage'], 'answers')}"
    )


def save(
    draft: PreTrainedModel,
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    out: Path,
    target_name: str,
    log: list[dict],
    settings: DistillSettings,
) -> None:
    eagle3 = settings.format == "eagle3"
    info = {
        "target": target_name,
        "format": settings.format,
        "borrowed_from_target": ["input embedding"] + ([] if eagle3 else ["LM head rows of its vocabulary"]),
        "initialised_from_target_layers": starting_layers(
            target.config, draft.config.num_hidden_layers, settings.init_layers
        ),
        "reads_target_layers": list(target_layers(draft)),
        "vocabulary_size": len(draft.lm_head.token_ids),
        "settings": vars(settings),
        "log": log,
    }
    if eagle3:
        eagle3_draft.save_eagle3(draft, target, out, info)
    else:
        save_draft(draft, tokenizer, out, info)


def distill(
    cfg: Config, prompts: list[str], settings: DistillSettings, out: Path, keep_work: bool, answers: Path | None = None
) -> None:
    """The whole command: corpus (written by the target, or `answers` it labels), training, the saved
    draft and its record."""
    if cfg.runtime.threads:
        torch.set_num_threads(cfg.runtime.threads)
    device = resolve_device(cfg.runtime.device)
    # the dtype the target decodes in (`auto`: float32 on CPU, bfloat16 on CUDA), so the draft learns
    # the very labels it will be checked against
    dtype = resolve_dtype(cfg.runtime.dtype, device)
    with display.stderr.status(f"Loading {cfg.target.describe()}..."):
        target, tokenizer = load_model(cfg.target, device, dtype)
    check_target_layers(read_layers(settings, target), target.config)  # before an hour of corpus
    if settings.format not in FORMATS:
        raise SpecdecError(f"unknown draft format {settings.format!r} (specdec distills {', '.join(FORMATS)})")
    if settings.format == "eagle3":
        eagle3_draft.check_taps(read_layers(settings, target), target.config.num_hidden_layers, settings.num_layers)
    starting_layers(target.config, settings.num_layers, settings.init_layers)
    work = out / WORK  # corpus and training state: what a resumed run continues from
    work.mkdir(parents=True, exist_ok=True)
    if answers:
        corpus = label_answers(
            target,
            read_answers(answers, tokenizer, settings.answer_tokens),
            padding_id(tokenizer),
            settings.top_k,
            work,
            read_layers(settings, target),
        )
    else:
        corpus = build_corpus(target, tokenizer, prompts, settings, work)
        write_answers(corpus, tokenizer, out / ANSWERS)
    draft, log = train(target, tokenizer, corpus, settings, work, cfg.target.describe())
    save(draft, target, tokenizer, out, cfg.target.describe(), log, settings)
    if not keep_work:
        shutil.rmtree(work)
    written = records.write_record(
        "distill",
        cfg.name,
        {
            **records.header("distill", cfg),
            "out": str(out),
            "corpus_answers": len(corpus),
            "corpus_answer_tokens": sum(len(a["answer"]) for a in corpus),
            "settings": vars(settings),
            "log": log,
        },
    )
    display.stderr.print(f"Draft saved to {out}: name it as `draft: {{checkpoint: {out}}}`. {written}")
