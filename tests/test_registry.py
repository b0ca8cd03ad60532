"""The registry of drafting methods (methods/registry.py): every draft key of the config has its row,
every row's module builds, the registry loads without torch, and it describes and maps to vLLM what
the config says. That each method decodes exactly is the exactness table's (test_exactness.py)."""

from __future__ import annotations

import dataclasses
import importlib
import subprocess
import sys

import pytest

from specdec_cli.config import DraftSpec, LookupSettings, ModelSpec, NgramSettings, RecyclingSettings, SuffixSettings
from specdec_cli.errors import SpecdecError
from specdec_cli.methods import registry


def test_every_draft_key_of_the_config_has_a_row_whose_module_builds():
    method_keys = {f.name for f in dataclasses.fields(DraftSpec)} - {f.name for f in dataclasses.fields(ModelSpec)}
    rows = {m.key: m for m in registry.DRAFTING + registry.AHEAD}
    assert method_keys <= set(rows), f"draft keys with no row: {method_keys - set(rows)}"
    for method in rows.values():
        assert callable(importlib.import_module(method.module).build), method.module


def test_the_registry_imports_without_torch():
    code = "import sys, specdec_cli.methods.registry; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


@pytest.mark.parametrize(
    "draft, method, ahead, words",
    [
        (DraftSpec(ngram=NgramSettings(max_n=4, min_n=2)), "ngram", None, "ngram(n=2..4)"),
        (DraftSpec(recycling=RecyclingSettings(candidates=5)), "recycling", None, "recycling(candidates=5)"),
        (DraftSpec(suffix=SuffixSettings(max_tree_depth=16)), "suffix", None, "suffix(depth=16)"),
        (DraftSpec(checkpoint="some/draft"), "checkpoint", None, "some/draft"),
        (
            DraftSpec(checkpoint="d", lookup=LookupSettings(num_draft_tokens=8)),
            "checkpoint",
            "lookup",
            "d after lookup(n=1..3, up to 8 tokens)",
        ),
        (DraftSpec(checkpoint="d", suffix=SuffixSettings()), "checkpoint", "suffix", "d after suffix(depth=24)"),
    ],
)
def test_a_draft_selects_its_method_and_the_one_ahead(draft, method, ahead, words):
    assert registry.drafting(draft)[0].key == method
    lead = registry.ahead(draft)
    assert (lead and lead[0].key) == ahead
    assert registry.describe(draft) == words


@pytest.mark.parametrize(
    "draft, message",
    [
        (DraftSpec(recycling=RecyclingSettings()), "vLLM has no token recycling (draft.recycling)"),
        (
            DraftSpec(checkpoint="d", lookup=LookupSettings()),
            "vLLM has no equivalent of prompt lookup ahead of a draft model (draft.lookup)",
        ),
        (
            DraftSpec(checkpoint="d", suffix=SuffixSettings()),
            "vLLM has no equivalent of suffix decoding ahead of a draft model (draft.suffix)",
        ),
    ],
)
def test_what_vllm_lacks_is_refused_by_name(draft, message):
    with pytest.raises(SpecdecError, match=message.replace("(", r"\(").replace(")", r"\)")):
        registry.vllm_config(draft, 3)


def test_ngram_maps_to_vllms_ngram():
    speculative = registry.vllm_config(DraftSpec(ngram=NgramSettings(max_n=4, min_n=2)), 5)
    assert speculative == {
        "method": "ngram",
        "num_speculative_tokens": 5,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 4,
    }
