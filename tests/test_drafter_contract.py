"""Each drafter's rule for what its cache holds, checked literally after every call the decode loop
makes (start, commit, follow, keep), in batches where rows accept different numbers of drafts,
blocks are drafted by prompt lookup, by the model or by neither (the target alone), and rows finish
early."""

from __future__ import annotations

import pytest
import torch
from block_checkpoints import pair_of, write_dflash
from conftest import cached

from specdec_cli.config import TinyModel
from specdec_cli.decoding.cache import CachedModel
from specdec_cli.decoding.drafter import Drafter
from specdec_cli.decoding.engine import SpeculativeDecoder
from specdec_cli.decoding.params import SamplingParams
from specdec_cli.loading.checkpoints import build_tiny
from specdec_cli.loading.target_states import target_layers
from specdec_cli.methods.dflash.drafter import BlockDrafter
from specdec_cli.methods.feature.draft import init_draft
from specdec_cli.methods.feature.drafter import FeatureDrafter
from specdec_cli.methods.lookup import LookupFirstDrafter
from specdec_cli.methods.model import ModelDrafter
from specdec_cli.methods.ngram import NgramDrafter

# token ids: in three rows every id of the vocabulary occurs, so lookup of one token always finds a
# continuation; in the last row half of them do: some blocks are lookup's, the others the model's
PROMPTS = [
    list(range(258)),
    list(range(257, -1, -1)),
    list(range(0, 258, 2)) + list(range(1, 258, 2)),
    list(range(129)),
]


def held(drafter) -> list[int]:
    """Per row, the context tokens the drafter has read or holds to read next: the rule its
    docstring states, as a count."""
    if isinstance(drafter, ModelDrafter):  # cache + pending = the whole context
        return [length + len(p) for length, p in zip(drafter.model.lengths, drafter.pending)]
    if isinstance(drafter, FeatureDrafter):  # input j pairs state j with token j + 1: one fewer
        return [length + len(p) + 1 for length, p in zip(drafter.model.lengths, drafter.pending)]
    # BlockDrafter: stored + pending states, and the last token (its state comes with the next block)
    return [length + (0 if p is None else len(p)) + 1 for length, p in zip(drafter.lengths, drafter.pending)]


class Checked(Drafter):
    """Passes every call to the drafter, then checks `held` against the rows' context lengths."""

    def __init__(self, lookup_first: LookupFirstDrafter):
        self.inner, self.drafter = lookup_first, lookup_first.model
        self.reads_target_states = lookup_first.reads_target_states
        self.context: list[int] = []
        self.blocks = {"model": 0, "lookup": 0, "alone": 0, "keep": 0}

    def check(self):
        assert held(self.drafter) == self.context

    def start(self, prompts, max_tokens, target_states):
        self.inner.start(prompts, max_tokens, target_states)
        self.context = [len(p) for p in prompts]
        self.check()

    def propose(self, num_draft_tokens, params, generator):
        return self.inner.propose(num_draft_tokens, params, generator)

    def commit(self, draft_ids, num_accepted, next_tokens, target_states):
        self.inner.commit(draft_ids, num_accepted, next_tokens, target_states)
        self.blocks["model" if self.inner.model_drafted else "lookup"] += 1
        self.context = [c + a + 1 for c, a in zip(self.context, num_accepted)]
        self.check()

    def follow(self, tokens, target_states):  # a block of the target alone (the last, at the token limit)
        self.inner.follow(tokens, target_states)
        self.blocks["alone"] += 1
        self.context = [c + len(new) for c, new in zip(self.context, tokens)]
        self.check()

    def keep(self, rows):
        self.inner.keep(rows)
        self.blocks["keep"] += 1
        self.context = [self.context[r] for r in rows]
        self.check()


@pytest.mark.parametrize("kind", ["model", "feature", "dflash"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_what_each_drafter_holds_is_the_context(kind, temperature, tokenizer, tmp_path, write_config):
    if kind == "dflash":  # a DFlash checkpoint for a 2-layer tiny target
        write_dflash(tmp_path / "dflash")
        pair = pair_of(write_config, tmp_path / "dflash")
        target, drafter = pair.target, pair.drafter
        assert isinstance(drafter, BlockDrafter)
    else:
        model = build_tiny(TinyModel(seed=0, num_layers=4)).eval()
        if kind == "model":
            drafter, taps = ModelDrafter(cached(build_tiny(TinyModel(seed=0, num_layers=4, noise=0.01)).eval())), (-1,)
        else:
            draft = init_draft(model, 1, torch.arange(model.config.vocab_size), (0, 3)).eval()
            drafter, taps = FeatureDrafter(draft, draft.config.vocab_size), target_layers(draft)
        target = CachedModel(model, model.config.vocab_size, taps)
    checked = Checked(LookupFirstDrafter(NgramDrafter(3, 1, target.vocab_size, torch.device("cpu")), drafter))
    decoder = SpeculativeDecoder(target, checked, SamplingParams(temperature), 3, set())
    decoder.generate_batch(PROMPTS, 40, 0)
    assert min(checked.blocks.values()) > 0, checked.blocks  # model, lookup and target-alone blocks, rows that left
