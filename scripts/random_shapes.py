#!/usr/bin/env python3
"""specdec's loop at the shapes people deploy, on random weights built in this process (nothing to
download): a Llama-3.1-8B-shaped target, a Llama-3.2-1B-shaped draft and an EAGLE-3-shaped one-layer
draft (written as an EAGLE-3 folder and read by specdec's loader).

    python scripts/random_shapes.py --json OUT.json            # on a CUDA GPU, bfloat16
    python scripts/random_shapes.py --dry-run --json OUT.json  # on the CPU at tiny shapes, float32

It measures:
- the target's verification forward by width at two context lengths, eager and replayed from CUDA
  graphs (`runtime.cuda_graphs`), with the largest difference between their logits;
- target alone against speculative decoding with each draft, tokens/s and speedup beside the
  speedup predicted from the run's measured parts (metrics.predicted_speedup_from_parts), eager and
  (on CUDA) with graphs.

Random weights give real costs (they depend on shapes only) but no acceptance, so acceptance is
set by a knob: the draft runs in full, then each of its tokens is replaced by the target's own next
token with probability `--agreement`, else by a wrong one. The target's embedding (tied to its
head) is scaled up so that its greedy next token is robustly its input token: bfloat16 rounding
cannot flip it, and the speculative output must equal target alone's token for token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specdec_cli.config import ModelSpec  # noqa: E402
from specdec_cli.decoding.cache import CachedModel  # noqa: E402
from specdec_cli.decoding.drafter import Drafter  # noqa: E402
from specdec_cli.decoding.engine import SpeculativeDecoder  # noqa: E402
from specdec_cli.decoding.metrics import block_costs, mean_accepted_length, predicted_speedup_from_parts  # noqa: E402
from specdec_cli.decoding.params import SamplingParams  # noqa: E402
from specdec_cli.loading.checkpoints import load_model  # noqa: E402
from specdec_cli.methods.formats import FORMATS, load_format  # noqa: E402
from specdec_cli.methods.model import ModelDrafter  # noqa: E402

LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256)  # fmt: skip
LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256)  # fmt: skip
EAGLE3_VOCAB = 32000  # the draft vocabulary of the published EAGLE-3 heads for Llama-3.1-8B
TINY_TARGET = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=512)  # fmt: skip
TINY_DRAFT = dict(TINY_TARGET, num_hidden_layers=1)
TINY_EAGLE3_VOCAB = 128
EMBEDDING_STD = 50.0  # large against what the random layers add: the next token is the input token


def llama(shape: dict, device: torch.device, dtype: torch.dtype, seed: int, tied: bool = False):
    config = LlamaConfig(**shape, max_position_embeddings=8192, tie_word_embeddings=tied)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    return model


def target_model(shape: dict, device: torch.device, dtype: torch.dtype):
    model = llama(shape, device, dtype, seed=0, tied=True)
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_(0, EMBEDDING_STD)
    return model


def eagle3_folder(folder: Path, shape: dict, draft_vocab: int, dtype: torch.dtype) -> Path:
    """An EAGLE-3 draft as SpecForge saves it, random: one midlayer whose q/k/v read [embedding,
    state] (2H), fc fusing three target taps (3H -> H), its norm and a head over `draft_vocab` ids."""
    hidden, ffn, vocab = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim = hidden // heads
    gen = torch.Generator().manual_seed(3)

    def rand(*size):
        return (torch.randn(*size, generator=gen) * 0.02).to(dtype)

    p = "midlayer."
    weights = {
        f"{p}self_attn.q_proj.weight": rand(heads * head_dim, 2 * hidden),
        f"{p}self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        f"{p}self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        f"{p}self_attn.o_proj.weight": rand(hidden, heads * head_dim),
        f"{p}mlp.gate_proj.weight": rand(ffn, hidden),
        f"{p}mlp.up_proj.weight": rand(ffn, hidden),
        f"{p}mlp.down_proj.weight": rand(hidden, ffn),
        "fc.weight": rand(hidden, 3 * hidden),
        "lm_head.weight": rand(draft_vocab, hidden),
    }
    for name in (f"{p}input_layernorm", f"{p}hidden_norm", f"{p}post_attention_layernorm", "norm"):
        weights[f"{name}.weight"] = torch.ones(hidden, dtype=dtype)
    used = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values
    weights["d2t"] = used - torch.arange(draft_vocab)
    weights["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill(0, used, True)
    config = {
        **shape,
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "draft_vocab_size": draft_vocab,
        "max_position_embeddings": 8192,
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(weights, folder / "model.safetensors")
    return folder


class Agreeing(Drafter):
    """A drafter that drafts in full (its cost is real), then keeps each of its tokens only as a
    vehicle: with probability `agreement` it becomes the token target alone emitted at that place
    (`answer`, per row), else a token the target will reject. The draws run on the device."""

    def __init__(self, inner: Drafter, answers: list[list[int]], agreement: float, target: CachedModel):
        self.inner, self.agreement = inner, agreement
        self.vocab_size, self.device = target.vocab_size, target.device
        self.reads_target_states = inner.reads_target_states
        self.answers_given = answers
        self.done: list[int] = []

    def start(self, prompts, max_tokens, target_states):
        self.inner.start(prompts, max_tokens, target_states)
        width = max(map(len, self.answers_given)) + max_tokens  # drafts may look past the answer's end
        self.answers = torch.tensor([a + [0] * (width - len(a)) for a in self.answers_given], device=self.device)
        self.draws = torch.Generator(device=self.device).manual_seed(0)
        self.done = [0] * len(prompts)

    def propose(self, num_draft_tokens, params, generator):
        drafts, q = self.inner.propose(num_draft_tokens, params, generator)
        g = drafts.shape[1]
        right = torch.stack([self.answers[row, done : done + g] for row, done in enumerate(self.done)])
        agree = torch.rand(drafts.shape, device=self.device, generator=self.draws) < self.agreement
        return torch.where(agree, right, (right + 1) % self.vocab_size), q

    def commit(self, draft_ids, num_accepted, next_tokens, target_states):
        self.inner.commit(draft_ids, num_accepted, next_tokens, target_states)
        self.done = [done + accepted + 1 for done, accepted in zip(self.done, num_accepted)]

    def follow(self, tokens, target_states):
        self.inner.follow(tokens, target_states)
        self.done = [done + len(new) for done, new in zip(self.done, tokens)]

    def keep(self, rows):
        self.inner.keep(rows)
        self.answers = self.answers[torch.tensor(rows, device=self.device)]
        self.done = [self.done[r] for r in rows]


class Timer:
    """Seconds of a callable's run, by CUDA events on a GPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def median(self, run, repeats: int) -> float:
        times = []
        for _ in range(repeats + 2):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                run()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1000)
            else:
                begin = time.perf_counter()
                run()
                times.append(time.perf_counter() - begin)
        return statistics.median(times[2:])  # the first two warm up


@torch.inference_mode()
def verification_costs(eager: CachedModel, graphed: CachedModel, widths, contexts, repeats: int) -> list[dict]:
    """Per context and width: a verification forward of the same model eagerly and replayed from its
    graph (on a CPU: the graphs' fixed tensors run eagerly), and the largest difference of their logits."""
    timer, rows = Timer(eager.device), []
    vocab = eager.vocab_size
    for context in contexts:
        gen = torch.Generator(device=eager.device).manual_seed(1)
        prompt = torch.randint(vocab, (1, context), device=eager.device, generator=gen)
        for model in (eager, graphed):
            model.reset(context + max(widths) + 1)
            model.forward(prompt, logits="none")
        for width in widths:
            ids = torch.randint(vocab, (1, width), device=eager.device, generator=gen)

            def run(model, ids=ids):
                out = model.forward(ids).logits
                model.rollback(ids.shape[1])
                return out

            row = {"context": context, "width": width}
            row["eager_ms"] = 1000 * timer.median(lambda: run(eager), repeats)
            row["graphs_ms"] = 1000 * timer.median(lambda: run(graphed), repeats)
            row["graphs_vs_eager_max_abs_diff"] = float((run(graphed) - run(eager)).abs().max())
            rows.append(row)
            print(f"  verification, context {context}, width {width}: {row}", file=sys.stderr, flush=True)
    return rows


def speculative_runs(
    target,
    drafts: dict,
    prompt: list[int],
    batch: int,
    agreement: float,
    num_draft_tokens: int,
    tokens: int,
    label: str = "",
):
    """Target alone, then each draft under the agreement knob, greedy, `batch` copies of `prompt`.
    With graphs the warm-up is a whole run, which captures every graph the measured run replays."""
    params, prompts = SamplingParams(), [prompt] * batch
    warm_up = tokens if target.graphed is not None else 8
    alone = SpeculativeDecoder(target, None, params, 0, set())
    alone.generate_batch(prompts, warm_up, seed=0, ignore_eos=True)
    base = alone.generate_batch(prompts, tokens, seed=0, ignore_eos=True)
    base_tps = sum(len(r.token_ids) for r in base) / max(r.decode_seconds for r in base)
    answers = [r.token_ids for r in base]
    # beside the verification table's eager width-1 forward: what the loop adds around it
    block_ms = 1000 * max(r.decode_seconds for r in base) / len(base[0].steps)
    rows = [
        {
            "draft": f"none (target alone){label}",
            "batch": batch,
            "tokens_per_second": base_tps,
            "ms_per_block": block_ms,
        }
    ]
    for name, inner in drafts.items():
        drafter = Agreeing(inner, answers, agreement, target)
        decoder = SpeculativeDecoder(target, drafter, params, num_draft_tokens, set())
        decoder.generate_batch(prompts, warm_up, seed=0, ignore_eos=True)
        spec = decoder.generate_batch(prompts, tokens, seed=0, ignore_eos=True)
        tps = sum(len(r.token_ids) for r in spec) / max(r.decode_seconds for r in spec)
        spec_steps = [s for r in spec for s in r.steps]
        costs = block_costs(spec_steps, [s for r in base for s in r.steps])
        rows.append(
            {
                "draft": name + label,
                "batch": batch,
                "num_draft_tokens": num_draft_tokens,
                "agreement": agreement,
                "tokens_per_second": tps,
                "speedup": tps / base_tps,
                "predicted_speedup": predicted_speedup_from_parts(spec_steps, costs) if costs else None,
                "mean_accepted_length": mean_accepted_length(spec_steps),
                "verify_cost": costs[0] if costs else None,  # a block's verification / one target forward
                "draft_cost": costs[1] if costs else None,
                "same_tokens_as_target_alone": [r.token_ids for r in spec] == answers,
            }
        )
        print(f"  {rows[-1]}", file=sys.stderr, flush=True)
    return rows


def loop_profile(target: CachedModel, draft: Drafter, prompt: list[int], num_draft_tokens: int) -> str:
    """torch.profiler's view of 32 tokens of target alone, then of speculative decoding with `drafter`
    (`draft`, its drafts kept as they are): where the loop's host time goes besides the model."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if target.device.type == "cuda" else [])
    tables = []
    for name, drafter in (("target alone", None), ("speculative", draft)):
        decoder = SpeculativeDecoder(target, drafter, SamplingParams(), num_draft_tokens if drafter else 0, set())
        decoder.generate(prompt, 8, seed=0, ignore_eos=True)
        with profile(activities=activities) as prof:
            result = decoder.generate(prompt, 32, seed=0, ignore_eos=True)
        tables.append(
            f"== {name}: {len(result.steps)} blocks, {result.tokens_per_second:.1f} tok/s\n"
            + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
        )
    return "\n\n".join(tables)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, float32: a check of this script")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--agreement", type=float, default=0.7)
    parser.add_argument("--num_draft_tokens", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--profile", type=Path, help="write torch.profiler's tables of the loop here")
    args = parser.parse_args()
    if args.dry_run:
        device, dtype = torch.device("cpu"), torch.float32
        target_shape, draft_shape, eagle_vocab = TINY_TARGET, TINY_DRAFT, TINY_EAGLE3_VOCAB
        widths, contexts, repeats, tokens, batches = (1, 4, 16), (32, 96), 3, 24, (1, 2)
    elif torch.cuda.is_available():
        device, dtype = torch.device("cuda"), torch.bfloat16
        target_shape, draft_shape, eagle_vocab = LLAMA_8B, LLAMA_1B, EAGLE3_VOCAB
        widths, contexts, repeats, batches = (1, 2, 4, 8, 16, 32, 64), (512, 2048), 20, (1, 4)
        tokens = args.max_new_tokens
    else:
        print("Error: no CUDA GPU (use --dry-run for a CPU check of this script)", file=sys.stderr)
        return 2
    started = time.perf_counter()
    model = target_model(target_shape, device, dtype)
    with tempfile.TemporaryDirectory() as tmp:
        eagle, _ = load_model(
            ModelSpec(checkpoint=str(eagle3_folder(Path(tmp) / "eagle3", target_shape, eagle_vocab, dtype))),
            device,
            dtype,
            target=model,
            read_format=load_format,
        )
    wiring = FORMATS["eagle3"].wire(eagle, target_shape["vocab_size"], 0.0, graphs=False)
    target = CachedModel(model, target_shape["vocab_size"], wiring.state_layers)
    small = CachedModel(llama(draft_shape, device, dtype, seed=1), target_shape["vocab_size"])
    print(f"built the models in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)

    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "shapes": {"target": target_shape, "model_draft": draft_shape, "eagle3_draft_vocab": eagle_vocab},
        "verification": [],
        "speculative": [],
    }

    def save():  # after each part: a run stopped at its time limit keeps what it measured
        result["seconds"] = time.perf_counter() - started
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))

    graphed = CachedModel(model, target_shape["vocab_size"], wiring.state_layers, graphs=True)
    result["verification"] = verification_costs(target, graphed, widths, contexts, repeats)
    save()
    prompt = torch.randint(target_shape["vocab_size"], (contexts[0],), generator=torch.Generator().manual_seed(2))
    for batch in batches:
        drafts = {"eagle3-shaped": wiring.drafter, "1b-shaped": ModelDrafter(small)}
        result["speculative"] += speculative_runs(
            target, drafts, prompt.tolist(), batch, args.agreement, args.num_draft_tokens, tokens
        )
        save()
        if device.type == "cuda":  # the same with decoding forwards replayed from CUDA graphs
            vocab = target_shape["vocab_size"]
            drafts = {
                "eagle3-shaped": FORMATS["eagle3"].wire(eagle, vocab, 0.0, graphs=True).drafter,
                "1b-shaped": ModelDrafter(CachedModel(small.model, vocab, graphs=True)),
            }
            rows = speculative_runs(
                graphed, drafts, prompt.tolist(), batch, args.agreement, args.num_draft_tokens, tokens, ", graphs"
            )
            eager_alone = next(
                r for r in result["speculative"] if r["draft"] == "none (target alone)" and r["batch"] == batch
            )
            rows[0]["speedup_over_eager"] = rows[0]["tokens_per_second"] / eager_alone["tokens_per_second"]
            result["speculative"] += rows
            save()
    if args.profile:
        args.profile.write_text(loop_profile(target, ModelDrafter(small), prompt.tolist(), args.num_draft_tokens))
    ok = all(row.get("same_tokens_as_target_alone", True) for row in result["speculative"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
