"""Prompts of the kinds people send, made from templates (data/prompt_kinds.yaml): the requests the
target answers for `specdec corpus`. Everything is drawn from a seeded generator, so the same seed
and shard give the same prompts; passages (for summaries, extraction, retrieval, translation and
follow-up turns) are answers the target wrote in an earlier shard."""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from importlib import resources

import yaml

from specdec_cli.errors import SpecdecError

EXCLUDED_NGRAM = 8  # a prompt sharing this many consecutive words with an evaluation prompt is dropped
FIELD = re.compile(r"\{(\w+)\}")
NUMBERS = {"a": (2, 99), "b": (2, 50), "c": (10, 999)}
PASSAGE_WORDS = (40, 220)  # a passage is an earlier answer of this many words


@dataclass(frozen=True)
class Kind:
    name: str
    weight: float
    templates: tuple[str, ...]
    passage: bool  # needs an earlier answer
    follow_up: bool  # the earlier answer is the conversation's first turn, the template the second


@dataclass
class MadePrompt:
    kind: str
    text: str
    history: list[dict]  # earlier turns as chat messages (a follow-up's first exchange)

    @property
    def key(self) -> str:
        """A short fingerprint of the whole conversation: what duplicates are found by."""
        return hashlib.sha1("\x00".join([m["content"] for m in self.history] + [self.text]).encode()).hexdigest()[:16]


def load_mix() -> tuple[list[Kind], dict[str, list[str]]]:
    data = yaml.safe_load(resources.files("specdec_cli.distill").joinpath("data/prompt_kinds.yaml").read_text())
    kinds = [
        Kind(name, float(k["weight"]), tuple(k["templates"]), bool(k.get("passage")), bool(k.get("follow_up")))
        for name, k in data["kinds"].items()
    ]
    return kinds, data["fields"]


def words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def ngrams(text: str, n: int = EXCLUDED_NGRAM) -> set[tuple[str, ...]]:
    w = words(text)
    return {tuple(w[i : i + n]) for i in range(len(w) - n + 1)} or ({tuple(w)} if w else set())


class PromptMaker:
    """Draws prompts; `excluded` texts (an evaluation suite) never reappear, not even in part."""

    def __init__(self, excluded: list[str]):
        self.kinds, self.fields = load_mix()
        self.excluded = set().union(*(ngrams(t) for t in excluded)) if excluded else set()
        self.dropped = 0  # prompts drawn but dropped for overlapping the excluded texts

    def shard(self, rng: random.Random, count: int, earlier: list[tuple[str, str]], seen: set[str]) -> list[MadePrompt]:
        """`count` prompts not in `seen` (which grows); `earlier`: (prompt, answer) pairs to draw
        passages and first turns from (none: only kinds without passages)."""
        passages = [(p, a) for p, a in earlier if PASSAGE_WORDS[0] <= len(a.split()) <= PASSAGE_WORDS[1]]
        kinds = [k for k in self.kinds if passages or not k.passage]
        weights = [k.weight for k in kinds]
        made: list[MadePrompt] = []
        for _ in range(count * 20):  # redraws for duplicates and excluded prompts stay bounded
            if len(made) == count:
                break
            prompt = self.draw(rng, rng.choices(kinds, weights)[0], passages)
            if prompt.key in seen:
                continue
            if self.excluded and not ngrams(prompt.text).isdisjoint(self.excluded):
                self.dropped += 1
                continue
            seen.add(prompt.key)
            made.append(prompt)
        if len(made) < count:
            raise SpecdecError(
                f"the prompt templates ran out of new prompts after {len(seen)}: add templates or topics"
            )
        return made

    def draw(self, rng: random.Random, kind: Kind, passages: list[tuple[str, str]]) -> MadePrompt:
        template = rng.choice(kind.templates)
        values: dict[str, str] = {}
        history: list[dict] = []
        if kind.passage:
            prompt, answer = rng.choice(passages)
            values["passage"] = answer.strip()
            sentences = [s for s in re.split(r"(?<=[.!?])\s+", answer.strip()) if 4 <= len(s.split()) <= 40]
            values["sentence"] = rng.choice(sentences) if sentences else answer.strip().split("\n")[0]
            if kind.follow_up:
                history = [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer.strip()}]
        for field in dict.fromkeys(FIELD.findall(template)):
            if field in values:
                continue
            if field in NUMBERS:
                values[field] = str(rng.randint(*NUMBERS[field]))
            elif field in ("name2", "name3"):
                values[field] = rng.choice([n for n in self.fields["name"] if n not in values.values()])
            else:
                values[field] = rng.choice(self.fields[field])
        return MadePrompt(kind.name, template.format(**values), history)
