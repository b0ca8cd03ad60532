"""`specdec corpus`: the target's answers to a large mix of prompts (prompt_mix.py), written in
shards of token ids, for `specdec distill --answers FOLDER`.

A shard is one compressed .npz file (prompt and answer ids, their lengths, each prompt's kind) and
one temperature (0: greedy); corpus.json lists the finished shards and the settings that shape the
content, so an interrupted run loses at most the shard it was writing and the same command continues,
on this machine or another. Shard k's prompts come from the seed and k alone, plus passages from the
answers of shard k-1."""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from specdec_cli import display
from specdec_cli.config import Config
from specdec_cli.distill.prompt_mix import MadePrompt, PromptMaker
from specdec_cli.errors import SpecdecError
from specdec_cli.loading.tokens import encode_prompt

MANIFEST = "corpus.json"
SHARD = "shard-{:05d}.npz"


@dataclass(frozen=True)
class CorpusShape:
    """What decides the corpus's content: a run with other values is refused rather than mixed in."""

    target: str
    seed: int
    prompts_per_shard: int
    answer_tokens: int
    temperatures: tuple[float, ...]  # shard k is written at temperatures[k % len]


def ids_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= 1 << 16 else np.uint32


def open_manifest(out: Path, shape: CorpusShape) -> dict:
    path = out / MANIFEST
    if not path.is_file():
        out.mkdir(parents=True, exist_ok=True)
        return {"shape": asdict(shape), "shards": []}
    manifest = json.loads(path.read_text())
    kept = manifest["shape"] | {"temperatures": tuple(manifest["shape"]["temperatures"])}
    for name, value in asdict(shape).items():
        if kept.get(name) != value:
            raise SpecdecError(
                f"{out} holds a corpus written with {name}={kept.get(name)!r}, not {value!r}: use another --out"
            )
    return manifest


def write_whole(out: Path, name: str, write) -> None:
    """`write(path)` into a temporary file, then the rename: never a truncated file after an interrupt."""
    partial = out / (name + ".partial")
    write(partial)
    partial.replace(out / name)


def save_shard(
    out: Path, index: int, texts: list[str], prompts: list[list[int]], answers: list[list[int]], kinds: list[int], dtype
) -> None:
    def write(path: Path) -> None:
        with path.open("wb") as file:
            np.savez_compressed(
                file,
                prompt_texts=np.frombuffer(json.dumps(texts).encode(), dtype=np.uint8),
                prompt_ids=np.array([t for p in prompts for t in p], dtype=dtype),
                prompt_lengths=np.array(list(map(len, prompts)), dtype=np.uint32),
                answer_ids=np.array([t for a in answers for t in a], dtype=dtype),
                answer_lengths=np.array(list(map(len, answers)), dtype=np.uint32),
                kinds=np.array(kinds, dtype=np.uint8),
            )

    write_whole(out, SHARD.format(index), write)


@dataclass
class Shard:
    texts: list[str]  # each prompt's last user turn
    prompts: list[list[int]]  # chat-templated ids, earlier turns included
    answers: list[list[int]]
    kinds: list[int]


def read_shard(path: Path) -> Shard:
    with np.load(path, allow_pickle=False) as data:
        prompts = np.split(data["prompt_ids"].astype(np.int64), np.cumsum(data["prompt_lengths"])[:-1])
        answers = np.split(data["answer_ids"].astype(np.int64), np.cumsum(data["answer_lengths"])[:-1])
        texts = json.loads(data["prompt_texts"].tobytes().decode())
        return Shard(texts, [p.tolist() for p in prompts], [a.tolist() for a in answers], data["kinds"].tolist())


def read_corpus(out: Path, answer_tokens: int) -> list[dict]:
    """The corpus as distill's answers: prompt and answer ids (cut at `answer_tokens`), greedy where
    the shard's temperature is 0."""
    if not (out / MANIFEST).is_file():
        raise SpecdecError(f"{out}: not a corpus folder (no {MANIFEST}; `specdec corpus --out {out}` writes one)")
    manifest = json.loads((out / MANIFEST).read_text())
    answers = []
    for shard in manifest["shards"]:
        written = read_shard(out / shard["file"])
        for prompt, answer in zip(written.prompts, written.answers):
            if answer:
                answers.append(
                    {
                        "prompt": prompt,
                        "answer": answer[:answer_tokens],
                        "greedy": shard["temperature"] == 0,
                        "synthetic": False,
                    }
                )
    return answers


class TransformersWriter:
    """Answers with transformers' generate, in batches of prompts of similar length."""

    def __init__(self, cfg: Config, dtype: torch.dtype, batch_size: int):
        from specdec_cli.loading.tokens import eos_token_ids, padding_id
        from specdec_cli.pair import load_checkpoint, resolve_device

        self.model, self.tokenizer = load_checkpoint(cfg.target, resolve_device(cfg.runtime.device), dtype)
        self.pad = padding_id(self.tokenizer)
        self.eos = eos_token_ids(self.model.generation_config, self.tokenizer)
        self.batch_size = batch_size
        self.name = "transformers"

    @torch.inference_mode()
    def answer(self, prompts: list[list[int]], temperature: float, max_tokens: int, seed: int) -> list[list[int]]:
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        answers: list[list[int]] = [[] for _ in prompts]
        for start in range(0, len(order), self.batch_size):
            rows = order[start : start + self.batch_size]
            width = max(len(prompts[i]) for i in rows)
            ids = torch.tensor([[self.pad] * (width - len(prompts[i])) + prompts[i] for i in rows])
            mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in rows])
            torch.manual_seed(seed * 1_000_003 + start)
            sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature else {}
            out = self.model.generate(
                input_ids=ids.to(self.model.device),
                attention_mask=mask.to(self.model.device),
                **({"do_sample": False} | sampling),
                max_new_tokens=max_tokens,
                pad_token_id=self.pad,
            )
            for i, row in zip(rows, out[:, width:].tolist()):
                ends = [n for n, t in enumerate(row) if t in self.eos]
                answers[i] = row[: ends[0] + 1] if ends else row  # keep the EOS, drop the padding after it
        return answers

    def close(self, interrupted: bool) -> None:
        pass


class VllmWriter:
    """Answers with vLLM (its environment from `specdec setup-vllm`): continuous batching of up to
    `batch_size` sequences. vLLM's CPU build refuses a seed per request, so its sampled answers are
    not reproducible: the shards, once written, are the corpus."""

    def __init__(self, cfg: Config, dtype: str, batch_size: int):
        from specdec_cli.loading.checkpoints import load_tokenizer
        from specdec_cli.vllm_engine.client import VllmWorker
        from specdec_cli.vllm_engine.settings import engine_settings

        self.tokenizer, self.eos = load_tokenizer(cfg.target)
        self.worker = VllmWorker(engine_settings(cfg, dtype, None) | {"max_num_seqs": batch_size})
        self.name = f"vllm {self.worker.version}"

    def answer(self, prompts: list[list[int]], temperature: float, max_tokens: int, seed: int) -> list[list[int]]:
        sampling = {"temperature": temperature, "top_k": 0, "top_p": 1.0, "max_tokens": max_tokens}
        reply = self.worker.generate(prompts, sampling | {"stop_token_ids": sorted(self.eos)})
        return [output["token_ids"] for output in reply["outputs"]]

    def close(self, interrupted: bool) -> None:
        self.worker.close(interrupted)


def encode(tokenizer, prompt: MadePrompt) -> list[int]:
    return encode_prompt(tokenizer, prompt.text, history=prompt.history)


def write_corpus(
    cfg: Config,
    shape: CorpusShape,
    tokens: int,
    out: Path,
    engine: str,
    dtype: str,
    batch_size: int,
    excluded: list[str],
) -> dict:
    """Shards until the corpus holds `tokens` answer tokens; returns the manifest."""
    manifest = open_manifest(out, shape)
    done = sum(s["answer_tokens"] for s in manifest["shards"])
    if done >= tokens:
        return manifest
    maker = PromptMaker(excluded)
    seen: set[str] = set(manifest.get("prompt_keys", []))
    writer = open_writer(cfg, engine, dtype, batch_size)
    interrupted = True
    try:
        earlier = last_shard_texts(out, manifest, writer.tokenizer)
        start, resumed = time.perf_counter(), done
        while done < tokens:
            entry, earlier = write_shard(out, len(manifest["shards"]), shape, maker, writer, earlier, seen)
            manifest["shards"].append(entry | {"dtype": dtype, "batch_size": batch_size})
            manifest["prompt_keys"] = sorted(seen)
            manifest["excluded_prompts_dropped"] = manifest.get("excluded_prompts_dropped", 0) + maker.dropped
            maker.dropped = 0
            write_whole(out, MANIFEST, lambda path: path.write_text(json.dumps(manifest, indent=1)))
            done += entry["answer_tokens"]
            rate = (done - resumed) / (time.perf_counter() - start)
            left = display.duration((tokens - done) / rate) if done < tokens else "0s"
            display.stderr.print(
                f"shard {len(manifest['shards']) - 1}: {min(done, tokens):,}/{tokens:,} answer tokens "
                f"({min(done / tokens, 1):.0%}), {entry['answer_tokens'] / entry['seconds']:.0f} tok/s, {left} left",
                highlight=False,
            )
        interrupted = False
    finally:
        writer.close(interrupted)
    return manifest


def write_shard(
    out: Path, index: int, shape: CorpusShape, maker: PromptMaker, writer, earlier: list, seen: set[str]
) -> tuple[dict, list[tuple[str, str]]]:
    """Shard `index`: its prompts (passages from `earlier`), the target's answers, the file. Returns
    the manifest's entry and the (prompt, answer) texts the next shard draws passages from."""
    temperature = shape.temperatures[index % len(shape.temperatures)]
    prompts = maker.shard(random.Random(f"{shape.seed}-{index}"), shape.prompts_per_shard, earlier, seen)
    ids = [encode(writer.tokenizer, p) for p in prompts]
    began = time.perf_counter()
    answers = writer.answer(ids, temperature, shape.answer_tokens, shape.seed * 100_003 + index)
    seconds = time.perf_counter() - began
    number = {k.name: i for i, k in enumerate(maker.kinds)}
    kinds = [number[p.kind] for p in prompts]
    texts = [p.text for p in prompts]
    save_shard(out, index, texts, ids, answers, kinds, ids_dtype(len(writer.tokenizer)))
    entry = {
        "file": SHARD.format(index),
        "temperature": temperature,
        "answers": len(answers),
        "answer_tokens": sum(map(len, answers)),
        "prompt_tokens": sum(map(len, ids)),
        "seconds": round(max(seconds, 1e-3), 3),
        "engine": writer.name,
    }
    return entry, [(t, writer.tokenizer.decode(a, skip_special_tokens=True)) for t, a in zip(texts, answers)]


def open_writer(cfg: Config, engine: str, dtype: str, batch_size: int):
    if engine == "vllm":
        return VllmWriter(cfg, dtype, batch_size)
    from specdec_cli.pair import resolve_device, resolve_dtype

    return TransformersWriter(cfg, resolve_dtype(dtype, resolve_device(cfg.runtime.device)), batch_size)


def last_shard_texts(out: Path, manifest: dict, tokenizer) -> list[tuple[str, str]]:
    """The last finished shard's (prompt, answer) texts: the passages of the next shard."""
    if not manifest["shards"]:
        return []
    shard = read_shard(out / manifest["shards"][-1]["file"])
    return [(text, tokenizer.decode(a, skip_special_tokens=True)) for text, a in zip(shard.texts, shard.answers)]


def summary(manifest: dict) -> dict:
    """The record's view of a corpus: its size, how fast it was written, by temperature and engine."""
    shards = manifest["shards"]
    seconds = sum(s["seconds"] for s in shards)
    tokens = sum(s["answer_tokens"] for s in shards)
    return {
        "shards": len(shards),
        "answers": sum(s["answers"] for s in shards),
        "answer_tokens": tokens,
        "prompt_tokens": sum(s["prompt_tokens"] for s in shards),
        "tokens_per_second": tokens / seconds if seconds else 0.0,
        "answer_tokens_by_temperature": {
            str(t): sum(s["answer_tokens"] for s in shards if s["temperature"] == t)
            for t in dict.fromkeys(s["temperature"] for s in shards)
        },
        "engines": sorted({f"{s['engine']} {s['dtype']} batch {s['batch_size']}" for s in shards}),
        "excluded_prompts_dropped": manifest.get("excluded_prompts_dropped", 0),
        "shape": manifest["shape"],
    }
