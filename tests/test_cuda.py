"""The CUDA path: the preallocated ragged cache on the device, device-side sampling, CUDA-event
timing, batches. Skipped without a GPU; `scripts/check_cuda.py` runs these and a short
generate/verify/benchmark on a GPU machine."""

from __future__ import annotations

import time

import pytest
import torch
import yaml
from conftest import cached
from typer.testing import CliRunner

from specdec_cli.cli import app
from specdec_cli.config import TinyModel
from specdec_cli.decoding.cache import CachedModel
from specdec_cli.decoding.engine import SpeculativeDecoder
from specdec_cli.decoding.metrics import acceptance_rate
from specdec_cli.decoding.params import SamplingParams
from specdec_cli.decoding.sampling import sample
from specdec_cli.loading.checkpoints import build_tiny
from specdec_cli.methods.model import ModelDrafter

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown"


def on_cuda(noise: float = 0.0, dtype: torch.dtype = torch.float32):
    return build_tiny(TinyModel(seed=0, noise=noise)).to("cuda", dtype).eval()


def decode(target, draft, prompt_ids, params, num_draft_tokens=3, seed=0, max_new=48):
    drafter = ModelDrafter(cached(draft)) if draft is not None else None
    decoder = SpeculativeDecoder(cached(target), drafter, params, num_draft_tokens, set())
    return decoder.generate(prompt_ids, max_new, seed)


@pytest.mark.parametrize("num_draft_tokens", [1, 4])
def test_greedy_output_is_the_targets_on_cuda(tokenizer, num_draft_tokens):
    target, draft = on_cuda(), on_cuda(noise=0.005)
    prompt = tokenizer.encode(PROMPT)
    baseline = decode(target, None, prompt, SamplingParams())
    result = decode(target, draft, prompt, SamplingParams(), num_draft_tokens)
    assert result.token_ids == baseline.token_ids
    assert 0 < acceptance_rate(result.steps) < 1  # rollbacks of the static cache happened
    assert result.decode_seconds > 0 and all(s.verify_seconds > 0 for s in result.steps)  # CUDA events


def test_bfloat16_identical_draft_accepts_everything(tokenizer):
    target = on_cuda(dtype=torch.bfloat16)
    result = decode(target, target, tokenizer.encode(PROMPT), SamplingParams(), num_draft_tokens=4, max_new=20)
    assert acceptance_rate(result.steps) == 1.0


def test_sampling_is_reproducible_on_cuda(tokenizer):
    target, draft = on_cuda(), on_cuda(noise=0.005)
    params = SamplingParams(temperature=1.0, top_k=20, top_p=0.9)
    prompt = tokenizer.encode(PROMPT)
    runs = [decode(target, draft, prompt, params, seed=seed).token_ids for seed in (7, 7, 8)]
    assert runs[0] == runs[1] != runs[2]


def test_cuda_sampling_is_the_float64_exponential_race():
    probs = torch.tensor([[0.2, 0.3, 0.5]], device="cuda").expand(4096, 3)
    drawn = sample(probs, torch.Generator(device="cuda").manual_seed(3))
    noise = torch.empty(probs.shape, dtype=torch.float64, device="cuda").exponential_(
        generator=torch.Generator(device="cuda").manual_seed(3)
    )
    assert torch.equal(drawn, (probs.double() / noise).argmax(dim=-1))
    frequencies = torch.bincount(drawn, minlength=3).double() / len(drawn)
    assert torch.allclose(frequencies.cpu(), torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64), atol=0.03)


def test_batch_rows_are_their_prompts_alone_on_cuda(tokenizer):
    target, draft = on_cuda(), on_cuda(noise=0.005)
    prompts = [tokenizer.encode(p) for p in ("Hi", PROMPT, "abc abc abc abc")]
    alone = [decode(target, None, p, SamplingParams(), max_new=24).token_ids for p in prompts]
    decoder = SpeculativeDecoder(cached(target), ModelDrafter(cached(draft)), SamplingParams(), 3, set())
    assert [r.token_ids for r in decoder.generate_batch(prompts, 24, 0)] == alone


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_decode_is_timed_on_the_pairs_gpu(tokenizer):
    """On cuda:1 while cuda:0 is the current device, the decode time is the decode's, not ~0."""
    target = build_tiny(TinyModel(seed=0)).to("cuda:1").eval()
    draft = build_tiny(TinyModel(seed=0, noise=0.005)).to("cuda:1").eval()
    decoder = SpeculativeDecoder(cached(target), ModelDrafter(cached(draft)), SamplingParams(), 3, set())
    start = time.perf_counter()
    result = decoder.generate(tokenizer.encode(PROMPT), 48, 0)
    wall = time.perf_counter() - start
    assert 0.3 * wall < result.decode_seconds <= wall


def test_running_out_of_gpu_memory_is_one_line(tmp_path):
    """A context the tiny target allows but no GPU holds: the KV cache allocation on the device fails."""
    huge = 10**12
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "target": {"tiny": {"seed": 0, "max_position_embeddings": 2 * huge}},
                "draft": {"tiny": {"seed": 0, "noise": 0.005}},
                "runtime": {"device": "cuda", "dtype": "float32"},
            }
        )
    )
    result = CliRunner().invoke(app, ["generate", "-c", str(config), "-p", "Hi", "--max-new-tokens", str(huge)])
    assert result.exit_code == 2, result.output
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("Error: out of memory on GPU 0 (") and "--max-new-tokens" in line, line


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_cuda_graphs_decode_the_eager_loops_tokens(tokenizer, temperature):
    """Replayed graphs compute what the eager forwards do: the same tokens, greedy and sampled, for a
    ragged batch, and again on the cache and graphs kept from the first request."""
    target, draft = on_cuda(), on_cuda(noise=0.005)
    prompts = [tokenizer.encode(p) for p in ("Hi", PROMPT, "abc abc abc abc")]
    params = SamplingParams(temperature=temperature)

    def tokens(graphs: bool) -> list[list[int]]:
        vocab = target.config.vocab_size
        drafter = ModelDrafter(CachedModel(draft, vocab, graphs=graphs))
        decoder = SpeculativeDecoder(CachedModel(target, vocab, graphs=graphs), drafter, params, 3, set())
        return [[r.token_ids for r in decoder.generate_batch(prompts, 40, seed)] for seed in (0, 1)]

    assert tokens(graphs=True) == tokens(graphs=False)
