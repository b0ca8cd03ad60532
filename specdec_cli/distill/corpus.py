"""The corpus: the target's answers to the training prompts and to prompts it writes itself, or
answers given as text that it labels; its top-k at every answer position, and the hidden states the
draft reads. Kept in shards in the work folder, so a restart keeps what is done."""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specdec_cli import display
from specdec_cli.distill.batches import pad_right
from specdec_cli.distill.memory import release_freed_memory
from specdec_cli.distill.settings import DistillSettings
from specdec_cli.distill.state import load_kept, save_whole
from specdec_cli.errors import SpecdecError
from specdec_cli.loading.tokens import encode_prompt, eos_token_ids, padding_id

FEATURES = "target-features-{}-{:05d}.pt"  # the target states a draft reads: layers, shard
ANSWERS = "corpus.jsonl.gz"  # the corpus as text, saved beside the draft: `--answers` labels it again
SHARD = 256  # answers per shard of labels and of target states (a restart keeps the finished shards)
GENERATION_BATCH = 32  # sampling many answers at once is far faster than one by one
PROMPT_TOKENS = 64  # most tokens of a prompt the target writes


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
    shards = [answers[start : start + SHARD] for start in range(0, len(answers), SHARD)]
    done = set()
    for number, shard in enumerate(shards):
        path = work / f"labels-{number:05d}.pt"
        kept = load_kept(path) if path.is_file() else []
        # a kept shard counts only while it labels these very answers (the file may have grown or
        # changed since)
        if [(a["prompt"], a["answer"]) for a in kept] == [(a["prompt"], a["answer"]) for a in shard]:
            for a, labels in zip(shard, kept):
                a["top_ids"], a["top_logp"] = labels["top_ids"], labels["top_logp"]
            done.add(number)
    with display.progress() as bar:
        # what a stopped run labelled counts as done from the start, so the time left is this run's
        kept_answers = sum(len(shards[number]) for number in done)
        task = bar.add_task("Target labels the answers", total=len(answers), completed=kept_answers)
        for number, shard in enumerate(shards):
            path = work / f"labels-{number:05d}.pt"
            if number in done:
                labelled += shard
                continue
            states: list[torch.Tensor | None] = [None] * len(shard)
            # rows of similar length together: less padding to run through the target
            by_length = sorted(range(len(shard)), key=lambda i: sequence_length(shard[i]))
            for first in range(0, len(shard), 8):
                rows = by_length[first : first + 8]
                group = [shard[i] for i in rows]
                ids, mask = pad_right([a["prompt"] + a["answer"] for a in group], pad)
                out = target(
                    input_ids=ids.to(target.device),
                    attention_mask=mask.to(target.device),
                    output_hidden_states=True,
                )
                taps = torch.cat([out.hidden_states[i] for i in layers], dim=-1)
                for row, (i, a) in enumerate(zip(rows, group)):
                    # the last prompt token's logits predict the first answer token
                    at = slice(len(a["prompt"]) - 1, len(a["prompt"]) - 1 + len(a["answer"]))
                    top = out.logits[row, at].float().log_softmax(-1).topk(top_k, dim=-1)
                    a["top_ids"], a["top_logp"] = top.indices.int().cpu(), top.values.half().cpu()
                    states[i] = taps[row, : sequence_length(a)].cpu().clone()  # its own storage: saved alone
                bar.update(task, advance=len(group))
            save_whole(states, states_path(work, layers, number))
            save_whole(shard, path)
            labelled += shard
            release_freed_memory()
    return labelled


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
            states = load_kept(path, mapped=True) if path.is_file() else []
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
        states += [batch[row, : len(seq)].cpu().clone() for row, seq in enumerate(seqs)]  # each its own storage
    return states
