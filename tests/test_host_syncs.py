"""The decode loop's promise to a GPU: one host sync per block, and nothing copied from host memory
inside a block except through `to_device`'s pinned staging. Shown on the CPU by counting, under a
dispatch mode, what would stall a CUDA stream: reads of device values on the host (`.item()`,
`.tolist()`, `bool(t)`, `nonzero`, boolean-mask indexing) and tensors built from host data (Python
lists and numbers: `aten::lift_fresh`). The confidence threshold's read per draft token is counted
apart (it is documented)."""

from __future__ import annotations

import sys
import traceback
from collections import Counter

import pytest
import torch
from block_checkpoints import write_dflash, write_medusa_vllm
from feature_checkpoints import eagle3_checkpoint, write_folder
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from specdec_cli.config import TinyModel, load_config
from specdec_cli.decoding import host
from specdec_cli.decoding.params import SamplingParams
from specdec_cli.loading.checkpoints import build_tiny, byte_tokenizer
from specdec_cli.methods.feature.draft import init_draft, save_draft
from specdec_cli.methods.model import confident
from specdec_cli.pair import load_pair

PROMPTS = ["Hello there, how are you?", "abc abc abc abc abc", "Once upon a time", "The quick brown fox"]
READS = {
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.nonzero.default,
    torch.ops.aten.masked_select.default,
}
UPLOADS = {torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default}
HOST_READ_METHODS = {torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy}


def caller_is(code) -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


class HostTraffic(TorchDispatchMode):
    """Counts what would make the host wait for a GPU, by kind."""

    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.where: list[str] = []

    def note(self, kind: str, what) -> None:
        if caller_is(confident.__code__):
            kind = "confidence read"
        elif kind == "upload" and caller_is(host.to_device.__code__):
            kind = "staged upload"
        self.counts[kind] += 1
        if kind in ("read", "upload"):
            stack = traceback.extract_stack()[::-1]
            frames = [
                f"{f.filename.split('specdec_cli/')[-1]}:{f.lineno}" for f in stack if "specdec_cli/" in f.filename
            ]
            self.where.append(f"{kind} {what} at {' < '.join(frames[:3])}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in READS:
            self.note("read", func)
        elif func in UPLOADS:
            self.note("upload", func)
        elif func is torch.ops.aten.index.Tensor and any(
            i is not None and i.dtype == torch.bool for i in args[1]
        ):  # a boolean mask's indices are counted on the host
            self.note("read", "boolean index")
        return func(*args, **(kwargs or {}))


class HostReads(TorchFunctionMode):
    """`.tolist()` and friends read a CPU tensor without dispatching: count them here."""

    def __init__(self, traffic: HostTraffic):
        super().__init__()
        self.traffic = traffic

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_READ_METHODS:
            self.traffic.note("read", func.__name__)
        return func(*args, **(kwargs or {}))


def pair_of(tmp_path, write_config, kind: str, threshold: float = 0.0, device: str = "cpu"):
    """A pair whose drafter is `kind`, on the tiny target (8 layers: EAGLE-3's taps differ); a kind
    with "+lookup" ("+suffix") drafts after prompt lookup (suffix decoding), and one ending in "+tree"
    drafts trees."""
    base = kind.split("+")[0]
    target = {"tiny": {"seed": 0, "num_layers": 2 if base == "dflash" else 8}}  # the DFlash draft reads 2
    lookup = {"lookup": {"max_n": 3, "min_n": 1, "num_draft_tokens": 4}} if "+lookup" in kind else {}
    lookup = {"suffix": {"num_draft_tokens": 4}} if "+suffix" in kind else lookup
    tree = {"depth": 3, "top_k": 2, "max_nodes": 6} if kind.endswith("+tree") else None
    if base == "model":
        draft = {"tiny": {"seed": 0, "num_layers": 8, "noise": 0.01}}
    elif base == "ngram":
        draft = {"ngram": {"max_n": 3, "min_n": 1}}
    elif base == "suffix":
        draft = {"suffix": {}}
    elif base == "recycling":
        draft = {"recycling": {}}
    elif base == "feature":
        draft = {"checkpoint": str(feature_draft_folder(tmp_path))}
    elif base == "eagle3":
        draft = {"checkpoint": str(write_folder(tmp_path / "eagle3", *eagle3_checkpoint()))}
    elif base == "medusa":
        write_medusa_vllm(tmp_path / "medusa")
        draft = {"checkpoint": str(tmp_path / "medusa")}
    else:
        write_dflash(tmp_path / "dflash")
        draft = {"checkpoint": str(tmp_path / "dflash")}
    config = write_config(
        {
            "target": target,
            "draft": {**draft, **lookup},
            "speculation": {"num_draft_tokens": 3, "confidence_threshold": threshold, "tree": tree},
            "runtime": {"device": device},
        }
    )
    return load_pair(load_config(str(config)))


def feature_draft_folder(tmp_path):
    """specdec's own feature draft for the tiny target, reading three of its layers."""
    target = build_tiny(TinyModel(seed=0, num_layers=8)).eval()
    draft = init_draft(target, 1, torch.arange(target.config.vocab_size), (1, 4, 7))
    save_draft(draft, byte_tokenizer(), tmp_path / "feature", {"target": "tiny"})
    return tmp_path / "feature"


def count_traffic(pair, prompts, params):
    decoder = pair.decoder(params)
    ids = [pair.encode(p, raw=True) for p in prompts]
    traffic = HostTraffic()
    with traffic, HostReads(traffic):
        rows = decoder.generate_batch(ids, 20, seed=0)
    blocks = max(len(r.steps) for r in rows)
    return traffic, blocks


KINDS = [
    "model",
    "feature",
    "eagle3",
    "medusa",
    "dflash",
    "ngram",
    "model+lookup",
    "feature+lookup",
    "model+tree",
    "feature+tree",
    "medusa+tree",
    "dflash+tree",
    "ngram+tree",
    "feature+lookup+tree",
    "suffix",
    "suffix+tree",
    "model+suffix",
    "recycling",
    "recycling+tree",
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("batch", [1, 4])
def test_one_host_read_per_block_and_no_blocking_upload(tmp_path, write_config, kind, temperature, batch):
    pair = pair_of(tmp_path, write_config, kind)
    traffic, blocks = count_traffic(pair, PROMPTS[:batch], SamplingParams(temperature=temperature, top_k=50))
    assert traffic.counts["upload"] == 0, "\n".join(traffic.where)
    assert traffic.counts["read"] == blocks, "\n".join(traffic.where)


def test_the_confidence_threshold_reads_once_per_draft_token(tmp_path, write_config):
    pair = pair_of(tmp_path, write_config, "model", threshold=0.05)
    traffic, blocks = count_traffic(pair, PROMPTS[:2], SamplingParams())
    assert traffic.counts["read"] == blocks, "\n".join(traffic.where)
    assert blocks <= traffic.counts["confidence read"] <= 3 * blocks


def test_the_counter_sees_what_would_stall_a_gpu():
    traffic = HostTraffic()
    t = torch.arange(6)
    with traffic, HostReads(traffic):
        t.tolist()
        bool(t[1])
        t[t > 2]
        t[[0, 2]]
        torch.tensor([1, 2])
        host.to_device([1, 2], t.device)
    assert traffic.counts == {"read": 3, "upload": 2, "staged upload": 1}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_no_other_sync_on_cuda(tmp_path, write_config, kind, temperature):
    """On a GPU, torch itself raises at any synchronizing call but `to_host`'s wait on an event."""
    pair = pair_of(tmp_path, write_config, kind, device="cuda")
    decoder = pair.decoder(SamplingParams(temperature=temperature, top_k=50))
    prompts = [pair.encode(p, raw=True) for p in PROMPTS]
    torch.cuda.set_sync_debug_mode("error")
    try:
        rows = decoder.generate_batch(prompts, 20, seed=0)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert all(r.token_ids and r.steps for r in rows)
