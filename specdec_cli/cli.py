"""The `specdec` command line."""

from __future__ import annotations

import os
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from specdec_cli import interrupts
from specdec_cli.bench.contexts import parse_lengths
from specdec_cli.bench.plan import choose_prompts, make_plan, parse_list
from specdec_cli.bench.prompts import Prompt, load_prompts
from specdec_cli.config import parse_tree
from specdec_cli.errors import EXIT_BAD_INPUT, SpecdecError, one_line
from specdec_cli.options import (
    EXIT_INTERRUPTED,
    CategoryOpt,
    ConfidenceOpt,
    ConfigOpt,
    CudaGraphsOpt,
    DeviceOpt,
    DtypeOpt,
    IgnoreEosOpt,
    JsonOpt,
    LimitOpt,
    MaxNewOpt,
    NumDraftTokensOpt,
    PromptsOpt,
    RecordOpt,
    RunsDirOpt,
    SeedOpt,
    TemperatureOpt,
    ThreadsOpt,
    TopKOpt,
    TopPOpt,
    TreeOpt,
    VerificationOpt,
    WeightsOpt,
    configure,
    read_prompt,
    reports_errors,
)
from specdec_cli.records import Run

app = typer.Typer(
    name="specdec",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    help="Run and measure exact speculative decoding: a draft proposes, the target verifies, the "
    "output is distributed exactly as the target's own.",
)


def show_version(value: bool) -> None:
    if value:
        from specdec_cli import __version__

        print(f"specdec {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[
        bool, typer.Option("--version", callback=show_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Run and measure exact speculative decoding."""


def command(*name, **settings):
    """`app.command` with the docstring as one paragraph: Typer's rich help keeps its line breaks."""

    def register(function):
        return app.command(*name, help=" ".join(function.__doc__.split()), **settings)(function)

    return register


class CorpusEngine(str, Enum):
    transformers = "transformers"
    vllm = "vllm"


class Engine(str, Enum):
    specdec = "specdec"
    vllm = "vllm"


class DraftFormat(str, Enum):
    specdec = "specdec"
    eagle3 = "eagle3"


class DistillLoss(str, Enum):
    kl = "kl"
    tv = "tv"


class TrainedAnswers(str, Enum):
    all = "all"
    greedy = "greedy"
    sampled = "sampled"


class Eagle3Layout(str, Enum):
    specforge = "specforge"
    speculators = "speculators"


@command(
    epilog="""Examples:\n
  specdec generate --prompt "Summarize: ..."\n
  specdec generate -c tiny-random --prompt "abc" --temperature 0.7 --json\n
  cat question.txt | specdec generate --prompt - --max-new-tokens 64\n
  specdec generate --prompts prompts.txt --batch-size 4 --json > answers.json"""
)
@reports_errors
def generate(
    prompt: Annotated[Optional[str], typer.Option("--prompt", "-p", help="Prompt text; - reads stdin.")] = None,
    prompt_file: Annotated[Optional[Path], typer.Option(help="Read the prompt from a file.")] = None,
    prompts: Annotated[
        Optional[Path],
        typer.Option(
            help="Many prompts, as benchmark reads them (a prompt per line, JSONL, Spec-Bench), decoded in "
            "batches; their answers are printed after each other."
        ),
    ] = None,
    batch_size: Annotated[int, typer.Option(min=1, help="Rows decoded together: prompts of --prompts per batch.")] = 1,
    engine: Annotated[
        Engine,
        typer.Option(
            help="specdec's loop, or vllm: the config in vLLM (after `specdec setup-vllm`), with runtime's tensor "
            "and pipeline parallel sizes; the prompts go to vLLM at once, its scheduler batches them."
        ),
    ] = Engine.specdec,
    config: ConfigOpt = None,
    raw: Annotated[bool, typer.Option("--raw", help="Do not apply the chat template.")] = False,
    temperature: TemperatureOpt = None,
    top_k: TopKOpt = None,
    top_p: TopPOpt = None,
    seed: SeedOpt = None,
    num_draft_tokens: NumDraftTokensOpt = None,
    confidence_threshold: ConfidenceOpt = None,
    verification: VerificationOpt = None,
    tree: TreeOpt = None,
    max_new_tokens: MaxNewOpt = None,
    ignore_eos: IgnoreEosOpt = None,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    weights: WeightsOpt = None,
    threads: ThreadsOpt = None,
    cuda_graphs: CudaGraphsOpt = None,
    as_json: JsonOpt = False,
    runs_dir: RunsDirOpt = None,
    record: RecordOpt = True,
) -> None:
    """Generate text with speculative decoding, streaming it (accepted draft tokens in green), then
    show the decoding statistics; with --prompts, decode a prompt file in batches. Flags override the
    config's YAML values."""
    cfg = configure(
        config,
        tree,
        sampling__temperature=temperature,
        sampling__top_k=top_k,
        sampling__top_p=top_p,
        sampling__seed=seed,
        speculation__num_draft_tokens=num_draft_tokens,
        speculation__confidence_threshold=confidence_threshold,
        speculation__verification=verification,
        generation__max_new_tokens=max_new_tokens,
        generation__ignore_eos=ignore_eos,
        runtime__device=device,
        runtime__dtype=dtype,
        runtime__weights=weights,
        runtime__threads=threads,
        runtime__cuda_graphs=cuda_graphs,
    )
    if prompts is not None and (prompt is not None or prompt_file is not None):
        raise SpecdecError("give one of --prompt, --prompt-file and --prompts")
    if batch_size != 1 and prompts is None:
        raise SpecdecError("--batch-size needs --prompts (a single prompt is one row)")
    if batch_size != 1 and engine == Engine.vllm:
        raise SpecdecError("--batch-size is specdec's: vLLM schedules its own batches")
    if engine == Engine.vllm:
        from specdec_cli.commands.generate import generate_vllm

        many = load_prompts(prompts) if prompts else [Prompt("1", "prompt", [read_prompt(prompt, prompt_file)])]
        return generate_vllm(cfg, many, raw, Run(runs_dir, record, as_json))
    if prompts is not None:
        many = load_prompts(prompts)
        from specdec_cli.commands.generate import generate_many  # torch/transformers load only once arguments are fine

        return generate_many(cfg, many, raw, batch_size, Run(runs_dir, record, as_json))
    text = read_prompt(prompt, prompt_file)
    from specdec_cli.commands.generate import generate_one

    generate_one(cfg, text, raw, Run(runs_dir, record, as_json))


@command(
    epilog="""Examples:\n
  specdec benchmark\n
  specdec benchmark -c tiny-random --num-draft-tokens-list 1,2,4 --temperatures 0,0.7 --repeats 3\n
  specdec benchmark --prompts question.jsonl --category qa --limit 5 --peer hf\n
  specdec benchmark --min-speedup 1.2 --min-accept-length 2 --json > result.json\n
  specdec benchmark --batch-sizes 1,2,4,8 --max-new-tokens 64\n
  specdec benchmark --temperatures 1 --verification token,block   # both rules side by side\n
  specdec benchmark -c smollm2-draft-only --tree 4,3,16 --tree 3,2,8   # a chain and two trees side by side\n
  specdec benchmark -c smollm2-ngram --engine vllm --batch-sizes 1,4   # the config in vLLM"""
)
@reports_errors
def benchmark(
    config: ConfigOpt = None,
    prompts: PromptsOpt = None,
    category: CategoryOpt = None,
    limit: LimitOpt = None,
    num_draft_tokens_list: Annotated[
        Optional[str],
        typer.Option(help="Draft tokens per target forward to sweep, e.g. 1,2,4 (default: the config's)."),
    ] = None,
    temperatures: Annotated[
        Optional[str],
        typer.Option(help="Temperatures, e.g. 0,0.7,1.0 (default: 0 and the config's, 1.0 if it is greedy)."),
    ] = None,
    tree: Annotated[
        Optional[list[str]],
        typer.Option(
            help="Also measure a draft tree DEPTH,TOP_K,MAX_NODES, e.g. 4,3,16, beside the chains; repeat for "
            "several (default: the config's tree, if it has one)."
        ),
    ] = None,
    confidence_threshold: ConfidenceOpt = None,
    verification: Annotated[
        Optional[str],
        typer.Option(
            help="How sampled chains are verified: token, block, or token,block for both side by side (greedy "
            "and trees run once: they are the same under both rules) (default: the config's)."
        ),
    ] = None,
    max_new_tokens: MaxNewOpt = None,
    ignore_eos: IgnoreEosOpt = None,
    seed: SeedOpt = None,
    repeats: Annotated[int, typer.Option(help="Runs per prompt and mode; median and range reported.")] = 1,
    warmup: Annotated[int, typer.Option(help="Unmeasured warm-up generations per mode.")] = 1,
    peer: Annotated[
        Optional[str],
        typer.Option(
            help="Also measure a peer on the same prompts: hf (transformers' generate(), alone and with its "
            "assisted generation or prompt lookup), vllm (vLLM, alone and with the config's draft; needs "
            "`specdec setup-vllm`) or llamacpp (llama.cpp on the target's GGUF file, alone and with its prompt "
            "lookup; needs `specdec setup-llamacpp`)."
        ),
    ] = None,
    batch_sizes: Annotated[
        Optional[str],
        typer.Option(
            help="Also decode the prompts in batches of these sizes, e.g. 2,4,8: throughput, speedup and the "
            "batch size where speculation stops paying."
        ),
    ] = None,
    engine: Annotated[
        Engine,
        typer.Option(
            help="specdec's loop, or vllm: the config's benchmark in vLLM (after `specdec setup-vllm`), with "
            "runtime's tensor and pipeline parallel sizes; --batch-sizes sends that many prompts per call."
        ),
    ] = Engine.specdec,
    context_lengths: Annotated[
        Optional[str],
        typer.Option(
            help="Also run each prompt's first turn after a document of real text bringing it to about these "
            "many tokens, e.g. 1k,4k,8000 (up to the target's window less --max-new-tokens): speedup, acceptance "
            "and forward costs per length."
        ),
    ] = None,
    synthetic_acceptance: Annotated[
        Optional[float],
        typer.Option(
            help="A loop benchmark, never exact: keep each draft with this probability given the ones before "
            "it were, whatever the target says (vLLM's synthetic rejection sampling); greedy identity is not "
            "checked. Chains only, no peer."
        ),
    ] = None,
    min_speedup: Annotated[
        Optional[float], typer.Option(help="Exit 4 unless every overall speedup reaches this.")
    ] = None,
    min_accept_length: Annotated[
        Optional[float], typer.Option(help="Exit 4 unless every overall mean accepted length reaches this.")
    ] = None,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    weights: WeightsOpt = None,
    threads: ThreadsOpt = None,
    cuda_graphs: CudaGraphsOpt = None,
    as_json: JsonOpt = False,
    runs_dir: RunsDirOpt = None,
    record: RecordOpt = True,
) -> None:
    """Measure target-only vs speculative decoding on a prompt set, greedy and sampled: tokens/s,
    speedup, acceptance, cost ratio and Leviathan's predicted speedup. Writes runs/<time>-benchmark-<name>/
    with record.json, report.md and its charts (chart.png, chart.svg)."""
    cfg = configure(
        config,
        loop_benchmark=True,
        sampling__seed=seed,
        speculation__confidence_threshold=confidence_threshold,
        speculation__synthetic_acceptance=synthetic_acceptance,
        generation__max_new_tokens=max_new_tokens,
        generation__ignore_eos=ignore_eos,
        runtime__device=device,
        runtime__dtype=dtype,
        runtime__weights=weights,
        runtime__threads=threads,
        runtime__cuda_graphs=cuda_graphs,
    )
    plan = make_plan(
        cfg,
        parse_list(num_draft_tokens_list, int, "--num-draft-tokens-list"),
        parse_list(temperatures, float, "--temperatures"),
        repeats,
        warmup,
        peer,
        parse_list(batch_sizes, int, "--batch-sizes"),
        [parse_tree(shape) for shape in tree or []],
        parse_list(verification, str, "--verification"),
        engine.value,
        parse_lengths(context_lengths) if context_lengths else None,
    )
    selected = choose_prompts(prompts, category, limit)
    if max(plan.batch_sizes) > len(selected):
        raise SpecdecError(
            f"--batch-sizes {max(plan.batch_sizes)}: more rows than the {len(selected)} prompts selected "
            f"(a batch holds distinct prompts: choose sizes up to {len(selected)}, or more prompts)"
        )
    from specdec_cli.commands.benchmark import execute  # torch/transformers load only once arguments are fine

    execute(cfg, selected, plan, Run(runs_dir, record, as_json), min_speedup, min_accept_length)


@command(
    epilog="""Examples:\n
  specdec tune\n
  specdec tune -c smollm2-ngram --prompts question.jsonl --batch-sizes 1,2,4,8,16 --temperatures 0,1\n
  specdec tune --budget-minutes 20 --max-new-tokens 64 --json > tune.json\n
  specdec benchmark -c runs/<time>-tune-<name>/tuned.yaml --batch-sizes 4   # the tuned config, as written"""
)
@reports_errors
def tune(
    config: ConfigOpt = None,
    prompts: PromptsOpt = None,
    category: CategoryOpt = None,
    limit: LimitOpt = None,
    batch_sizes: Annotated[str, typer.Option(help="Batch sizes to tune for, e.g. 1,2,4,8,16.")] = "1,2,4,8",
    temperatures: Annotated[str, typer.Option(help="Temperatures to tune for (0 is greedy).")] = "0,1",
    sample: Annotated[int, typer.Option(min=1, help="Prompts (at least) in each batch size's short probe.")] = 4,
    finalists: Annotated[
        int,
        typer.Option(
            min=0, help="Predicted best candidates run for real, besides the target alone and the config's own."
        ),
    ] = 2,
    budget_minutes: Annotated[
        Optional[float],
        typer.Option(
            help="Stop starting a batch size's finalists after this long (the runs that predict always run); "
            "keep what was measured."
        ),
    ] = None,
    max_new_tokens: MaxNewOpt = None,
    ignore_eos: IgnoreEosOpt = None,
    seed: SeedOpt = None,
    repeats: Annotated[
        int,
        typer.Option(
            min=1,
            help="Runs of each batch per finalist, taken in turns with the others; the median counts. Batch sizes "
            "the prompts fill fewer than 3 times repeat more, to 3 batch runs.",
        ),
    ] = 1,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    weights: WeightsOpt = None,
    threads: ThreadsOpt = None,
    as_json: JsonOpt = False,
    runs_dir: RunsDirOpt = None,
    record: RecordOpt = True,
) -> None:
    """Find how blocks decode fastest at each batch size and temperature: the draft tokens per block, and
    whether a tree, the other verification rule or another confidence threshold beats the config's own
    chain. The config's full drafting on every prompt and a short probe of every candidate predict each
    one's speedup, the best few run for real beside the target alone and the config as it is, and the
    measured best is kept. Writes runs/<time>-tune-<name>/ with tuned.yaml (the config with
    speculation.schedule), vLLM's speculative_config where vLLM has the draft, report.md and a chart."""
    cfg = configure(
        config,
        sampling__seed=seed,
        generation__max_new_tokens=max_new_tokens,
        generation__ignore_eos=ignore_eos,
        runtime__device=device,
        runtime__dtype=dtype,
        runtime__weights=weights,
        runtime__threads=threads,
    )
    sizes = sorted(set(parse_list(batch_sizes, int, "--batch-sizes")))
    plan = make_plan(cfg, None, parse_list(temperatures, float, "--temperatures"), repeats, 1, None, sizes)
    if sizes[0] < 1:
        raise SpecdecError(f"--batch-sizes must be >= 1, got {sizes}")
    from specdec_cli.commands.tune import TuneSettings
    from specdec_cli.commands.tune import tune as run_tune

    settings = TuneSettings(sizes, plan.temperatures, sample, finalists, budget_minutes, plan)
    run_tune(cfg, choose_prompts(prompts, category, limit), settings, Run(runs_dir, record, as_json))


@command(
    epilog="""Examples:\n
  specdec compare runs/A runs/B\n
  specdec compare runs/A/record.json runs/B --json > comparison.json\n
  specdec compare runs/A runs/B --runs-dir charts   # the charts go to charts/<time>-compare-<A>-vs-<B>/"""
)
@reports_errors
def compare(
    a: Annotated[Path, typer.Argument(metavar="A", help="Benchmark record A: a run folder or its record.json.")],
    b: Annotated[Path, typer.Argument(metavar="B", help="Benchmark record B, set beside A (B / A ratios).")],
    as_json: JsonOpt = False,
    runs_dir: RunsDirOpt = None,
    record: RecordOpt = True,
) -> None:
    """Show two benchmark records side by side, matched by temperature and num_draft_tokens or tree, with B / A
    ratios; runs nothing. Writes runs/<time>-compare-<A>-vs-<B>/ with the table (report.md) and both
    runs' charts side by side on shared scales (chart.png, chart.svg)."""
    from specdec_cli.commands.compare import compare as compare_records

    compare_records(a, b, Run(runs_dir, record, as_json))


@command(
    "verify-distribution",
    epilog="""Examples:\n
  specdec verify-distribution -c tiny-random\n
  specdec verify-distribution --prompt "Tell me a joke." --samples 300 --temperature 0.7 --top-k 50\n
  specdec verify-distribution --batch-size 8  # the runs as rows of batches\n
  specdec verify-distribution --verification block --top-p 0.9\n
  specdec verify-distribution --json > verify.json  # exit 0: exact; 3: a check failed; 2: bad input""",
)
@reports_errors
def verify_distribution(
    prompt: Annotated[
        Optional[list[str]],
        typer.Option("--prompt", "-p", help="Prompt text; repeat for several (default: two built-in prompts)."),
    ] = None,
    samples: Annotated[
        Optional[int],
        typer.Option(help="Speculative runs per prompt (default: 1000 for models under 50M parameters, else 150)."),
    ] = None,
    significance: Annotated[
        float, typer.Option(help="Family-wise significance of the statistical tests (Holm-corrected).")
    ] = 0.01,
    batch_size: Annotated[
        int,
        typer.Option(min=1, help="Rows decoded together: speculative runs (copies of a prompt) per batch."),
    ] = 1,
    config: ConfigOpt = None,
    temperature: TemperatureOpt = None,
    top_k: TopKOpt = None,
    top_p: TopPOpt = None,
    seed: SeedOpt = None,
    num_draft_tokens: NumDraftTokensOpt = None,
    confidence_threshold: ConfidenceOpt = None,
    verification: VerificationOpt = None,
    tree: TreeOpt = None,
    max_new_tokens: MaxNewOpt = None,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    weights: WeightsOpt = None,
    threads: ThreadsOpt = None,
    as_json: JsonOpt = False,
    runs_dir: RunsDirOpt = None,
    record: RecordOpt = True,
) -> None:
    """Check, with statistics, that speculative output is distributed exactly as the target's: the
    sampler on synthetic (p, q) pairs, the first and deeper tokens of many seeded runs, and greedy
    identity (over max-new-tokens). Distribution checks use the config's sampling settings, at
    temperature 1 when the config is greedy. Exit code 0: all passed; 3: a check failed; 2: bad input."""
    from specdec_cli.commands.verify import verify_distribution as run_verification

    if temperature == 0:
        raise SpecdecError("the distribution checks need --temperature > 0 (greedy identity always runs)")
    cfg = configure(
        config,
        tree,
        sampling__temperature=temperature,
        sampling__top_k=top_k,
        sampling__top_p=top_p,
        sampling__seed=seed,
        speculation__num_draft_tokens=num_draft_tokens,
        speculation__confidence_threshold=confidence_threshold,
        speculation__verification=verification,
        generation__max_new_tokens=max_new_tokens,
        runtime__device=device,
        runtime__dtype=dtype,
        runtime__weights=weights,
        runtime__threads=threads,
    )
    run_verification(cfg, prompt or [], samples, significance, Run(runs_dir, record, as_json), batch_size)


@command(
    epilog="""Examples:\n
  specdec distill --out drafts/my-draft\n
  specdec distill -c configs/my-target.yaml --out drafts/x --prompts prompts.txt --training-steps 500 --layers 2\n
  specdec distill --out drafts/y --target-layers=-1 --keep-work   # read only the target's last state\n
  specdec distill --out drafts/eagle3 --format eagle3\n
  specdec distill --out drafts/eagle3-speculators --format eagle3 --layout speculators\n
  specdec distill --out drafts/eagle3-deep --format eagle3 --layers 2   # two layers: vLLM loads it, SGLang not\n
  specdec distill --out drafts/z --answers drafts/my-draft/corpus.jsonl.gz --layers 2   # reuse a corpus\n
  specdec distill --out drafts/big --answers corpus/smollm2-135m-instruct   # a corpus specdec corpus wrote\n
  specdec distill --out drafts/2m --answers corpus/smollm2-135m-instruct --training-tokens 2M   # learning curve\n
  specdec distill --out drafts/mix --answers corpus/smollm2-135m-instruct --answers chats.jsonl.gz   # both sources"""
)
@reports_errors
def distill(
    out: Annotated[Path, typer.Option(help="Folder for the draft; an unfinished run there resumes.")],
    config: ConfigOpt = None,
    prompts: Annotated[
        Optional[Path],
        typer.Option(help="Training prompts (text, JSONL or Spec-Bench JSONL) (default: the built-in training set)."),
    ] = None,
    answers: Annotated[
        Optional[list[Path]],
        typer.Option(
            help='JSONL (.gz) of {"prompt": ..., "answer": ...}, or a folder `specdec corpus` wrote: the target '
            "labels these answers instead of writing its own (a saved draft's corpus.jsonl.gz, your own "
            "conversations, or a corpus folder). Repeat it to train on several sources together.",
        ),
    ] = None,
    heldout_answers: Annotated[
        Optional[Path],
        typer.Option(
            help="With --answers: measure the draft on these answers (same format; at most 256, spread over "
            "the file) instead of on a share of the given prompts' answers. Answers to prompts unlike the "
            "training ones say how the draft does on prompts it never saw the like of.",
        ),
    ] = None,
    layers: Annotated[int, typer.Option(min=1, help="Decoder layers of the draft.")] = 1,
    draft_format: Annotated[
        DraftFormat,
        typer.Option(
            "--format",
            help="specdec: specdec's own draft (normalised tap fusion, the target's head rows). eagle3: "
            "EAGLE-3's architecture, saved in the layout SpecForge, SGLang and vLLM load (3 target layers, "
            "its own head rows; one layer, or with --layers N more, which vLLM loads and SGLang refuses).",
        ),
    ] = DraftFormat.specdec,
    layout: Annotated[
        Eagle3Layout,
        typer.Option(
            help="With --format eagle3, the files it is saved as: specforge (midlayer.*, a flat config: "
            "SpecForge, SGLang, vLLM) or speculators (vllm-project/speculators' Eagle3Speculator, as "
            "RedHatAI publishes drafts: vLLM).",
        ),
    ] = Eagle3Layout.specforge,
    target_layers: Annotated[
        Optional[str],
        typer.Option(
            help="Target hidden states the draft reads, comma-separated indices of transformers' hidden_states "
            "(i: the input of layer i; -1: the last, after the final norm) (default: 2, L/2 and L-3 of L "
            "layers, as EAGLE-3).",
        ),
    ] = None,
    init_layers: Annotated[
        Optional[str],
        typer.Option(help="Target layers the draft's layers start as, comma-separated (default: evenly spaced)."),
    ] = None,
    zero_features: Annotated[
        bool,
        typer.Option(
            "--zero-features", help="Start as a token-only draft: the target's states enter through weights at 0."
        ),
    ] = False,
    position_decay: Annotated[
        float, typer.Option(min=0.0, help="Loss weight of draft position k is DECAY**k (later tokens count less).")
    ] = 0.8,
    draft_positions: Annotated[
        int,
        typer.Option(
            min=1, help="Draft positions trained: the 1st reads the target's states, later ones the draft's own."
        ),
    ] = 3,
    loss: Annotated[
        DistillLoss,
        typer.Option(
            help="Loss over the target's top-32 probabilities p and the draft's q: kl, cross-entropy (forward "
            "KL, as EAGLE trains); tv, 1 - sum min(p, q), one minus the acceptance at temperature 1.",
        ),
    ] = DistillLoss.kl,
    vocab: Annotated[
        int,
        typer.Option(
            min=1,
            help="Tokens the draft's head scores (the ones with the most "
            "target probability in the corpus); the rest it never proposes.",
        ),
    ] = 8192,
    training_steps: Annotated[int, typer.Option(min=1, help="Training steps.")] = 3000,
    answers_per_step: Annotated[int, typer.Option(min=1, help="Answers per training step.")] = 8,
    learning_rate: Annotated[float, typer.Option(min=0.0, help="AdamW peak learning rate.")] = 1e-3,
    answers_per_prompt: Annotated[
        int, typer.Option(min=0, help="Target answers sampled at temperature 1 per prompt, besides one greedy answer.")
    ] = 4,
    synthetic_prompts: Annotated[
        int,
        typer.Option(min=0, help="More prompts the target writes itself (from its chat template), answered once each."),
    ] = 2048,
    answer_tokens: Annotated[int, typer.Option(min=1, help="Most tokens per target answer.")] = 192,
    eval_every: Annotated[int, typer.Option(min=1, help="Steps between held-out evaluations.")] = 250,
    training_tokens: Annotated[
        Optional[str],
        typer.Option(
            help="Train on a seeded sample of this many answer tokens (2M, 500k; default all): the points of a "
            "learning curve (the same seed gives nested samples, and the same held-out answers).",
        ),
    ] = None,
    trained_answers: Annotated[
        TrainedAnswers,
        typer.Option(
            help="Train on every answer, or only on the target's greedy or only its sampled ones (the "
            "held-out answers stay the same: greedy agreement is measured on greedy ones, acceptance at "
            "T=1 on sampled ones).",
        ),
    ] = TrainedAnswers.all,
    seed: SeedOpt = None,
    device: DeviceOpt = None,
    dtype: Annotated[
        Optional[str],
        typer.Option(
            help="Dtype of the target while it writes the corpus and its labels (default: the config's; `auto` "
            "is the dtype it decodes in, float32 on CPU)."
        ),
    ] = None,
    threads: ThreadsOpt = None,
    as_json: JsonOpt = False,
    keep_work: Annotated[
        bool,
        typer.Option(
            "--keep-work",
            help="Keep OUT/distill-work (corpus, target states) after training, so a retrain with "
            "other draft settings skips writing the corpus.",
        ),
    ] = False,
    runs_dir: RunsDirOpt = None,
    record: RecordOpt = True,
) -> None:
    """Train a small feature draft (EAGLE-style: it reads the target's hidden states) for the config's
    target on text the target writes itself, matching the target's next-token distributions. The
    draft borrows the target's embedding and the head rows of its vocabulary by reference, so the
    saved folder holds only its own layers; name it as `draft: {checkpoint: PATH}`."""
    from specdec_cli.bench.prompts import training_prompts

    cfg = configure(
        config,
        sampling__seed=seed,
        runtime__device=device,
        runtime__dtype=dtype,
        runtime__threads=threads,
    )
    if prompts and answers:
        raise SpecdecError("--prompts and --answers exclude each other: the target answers prompts, or labels answers")
    texts = [] if answers else [p.turns[0] for p in (load_prompts(prompts) if prompts else training_prompts())]
    from specdec_cli import distill as distillation  # torch/transformers load only once arguments are fine

    settings = distillation.DistillSettings(
        num_layers=layers,
        target_layers=tuple(parse_list(target_layers, int, "--target-layers") or ()) or None,
        init_layers=tuple(parse_list(init_layers, int, "--init-layers") or ()) or None,
        zero_features=zero_features,
        position_decay=position_decay,
        draft_positions=draft_positions,
        loss=loss.value,
        draft_vocab=vocab,
        answers_per_prompt=answers_per_prompt,
        synthetic_prompts=synthetic_prompts,
        answer_tokens=answer_tokens,
        training_steps=training_steps,
        answers_per_step=answers_per_step,
        learning_rate=learning_rate,
        eval_every=eval_every,
        training_tokens=parse_count(training_tokens, "--training-tokens") if training_tokens else None,
        trained_answers=trained_answers.value,
        heldout_answers=str(heldout_answers) if heldout_answers else None,
        seed=cfg.sampling.seed,
        format=draft_format.value,
        layout=layout.value,
    )
    distillation.distill(cfg, texts, settings, out, keep_work, answers or [], Run(runs_dir, record, as_json))


def parse_count(text: str, flag: str) -> int:
    """`5500000`, `5.5M` or `500k`."""
    scale = {"k": 1_000, "m": 1_000_000}.get(text[-1:].lower(), 1)
    try:
        count = int(float(text[:-1] if scale > 1 else text) * scale)
    except ValueError:
        count = 0
    if count <= 0:
        raise SpecdecError(f"{flag} {text}: expected a positive count such as 5500000, 5.5M or 500k")
    return count


@command(
    epilog="""Examples:\n
  specdec corpus --out corpus/smollm2 --tokens 5.5M\n
  specdec corpus --out corpus/smollm2 --tokens 5.5M --engine vllm   # after specdec setup-vllm; faster on CPU\n
  specdec corpus -c configs/my-target.yaml --out corpus/mine --tokens 500k --exclude my-eval.jsonl\n
  specdec distill --out drafts/mine --answers corpus/smollm2   # train on it"""
)
@reports_errors
def corpus(
    out: Annotated[
        Path, typer.Option(help="Folder of the corpus; the same command again continues an unfinished one.")
    ],
    tokens: Annotated[str, typer.Option(help="Answer tokens to write in all (5500000, 5.5M, 500k).")] = "5.5M",
    config: ConfigOpt = None,
    engine: Annotated[
        CorpusEngine,
        typer.Option(help="What runs the target: transformers, or vLLM's own environment (specdec setup-vllm)."),
    ] = CorpusEngine.transformers,
    dtype: Annotated[str, typer.Option(help="The target's dtype while it writes.")] = "bfloat16",
    batch_size: Annotated[int, typer.Option(min=1, help="Answers written at once.")] = 256,
    answer_tokens: Annotated[int, typer.Option(min=1, help="Most tokens per answer.")] = 256,
    prompts_per_shard: Annotated[
        int, typer.Option(min=1, help="Prompts per shard: an interrupted run loses at most one shard.")
    ] = 1024,
    temperatures: Annotated[
        str, typer.Option(help="Temperatures the shards take in turn, comma-separated; 0 is greedy.")
    ] = "0,0.7,0.85,1",
    exclude: Annotated[
        Optional[list[Path]],
        typer.Option(
            help="Evaluation prompts (text, JSONL or Spec-Bench JSONL) no corpus prompt may share 8 words with; "
            "the built-in benchmark prompts always are."
        ),
    ] = None,
    seed: SeedOpt = None,
    threads: ThreadsOpt = None,
    json_output: JsonOpt = False,
    runs_dir: RunsDirOpt = None,
    record: RecordOpt = True,
) -> None:
    """Have the config's target answer a large mix of prompts of the kinds people send (conversation,
    writing, roleplay, reasoning, math, coding, science, humanities, questions, and summaries,
    extraction, retrieval, translation and follow-up turns over its own earlier answers), greedy and
    sampled, into compressed shards of token ids: the corpus `specdec distill --answers FOLDER` trains
    a draft on. Ctrl-C or a stopped machine loses at most the shard being written."""
    cfg = configure(config, sampling__seed=seed, runtime__threads=threads)
    target_tokens = parse_count(tokens, "--tokens")
    temperature_list = parse_list(temperatures, float, "--temperatures")
    if not temperature_list or any(t < 0 for t in temperature_list):
        raise SpecdecError(f"--temperatures {temperatures}: expected temperatures >= 0, such as 0,0.7,1")
    from specdec_cli.commands.corpus import write_corpus  # torch/transformers load only once arguments are fine
    from specdec_cli.distill.writing import CorpusShape

    shape = CorpusShape(
        cfg.target.describe(), cfg.sampling.seed, prompts_per_shard, answer_tokens, tuple(temperature_list)
    )
    run = Run(runs_dir, record, json_output)
    write_corpus(cfg, out, target_tokens, shape, engine.value, dtype, batch_size, exclude or [], run)


@command(
    "setup-vllm",
    epilog="""Examples:\n
  specdec setup-vllm\n
  specdec setup-vllm && specdec benchmark -c smollm2-ngram --peer vllm""",
)
@reports_errors
def setup_vllm() -> None:
    """Create vLLM's own environment under the specdec cache (~/.cache/specdec/vllm-venv) with vLLM's
    CPU build, or its CUDA build where nvidia-smi is found, for `benchmark --peer vllm`. Several GB.
    To use another install instead, set SPECDEC_VLLM_PYTHON to a python that has vllm."""
    from specdec_cli.vllm_engine.install import setup_vllm as install

    python = install()
    print(f"vLLM is set up: {python}")


@command(
    "setup-llamacpp",
    epilog="""Examples:\n
  specdec setup-llamacpp\n
  specdec setup-llamacpp && specdec benchmark --prompts docs/experiments/data/unseen-13.jsonl --peer llamacpp""",
)
@reports_errors
def setup_llamacpp() -> None:
    """Create llama.cpp's own environment under the specdec cache (~/.cache/specdec/llamacpp-venv) with
    llama-cpp-python, for `benchmark --peer llamacpp`. PyPI has it as source only: the first setup on a
    kind of CPU compiles llama.cpp for it (5-15 minutes on 2 cores) and keeps the wheel for the next.
    To use another install instead, set SPECDEC_LLAMACPP_PYTHON to a python that has llama_cpp."""
    from specdec_cli.llamacpp_engine.client import setup_llamacpp as install

    python = install()
    print(f"llama.cpp is set up: {python}")


def main() -> None:
    """Entry point: usage errors (unknown flags, unparsable values) also become one `Error:` line, and
    so does a stdout that cannot be written (a full disk, a closed pipe)."""
    if len(sys.argv) == 1:
        sys.argv.append("--help")
    interrupts.install()  # SIGTERM keeps what Ctrl-C keeps; a second signal does not cut the save short
    try:
        code = app(standalone_mode=False)
    except typer.Abort:
        code = EXIT_INTERRUPTED
    except typer.TyperException as exc:  # typer's parsing errors (its vendored click exceptions)
        print(f"Error: {one_line(exc.format_message())} (see --help)", file=sys.stderr)
        code = exc.exit_code
    try:
        sys.stdout.flush()  # here, not at exit, where a failure would be a traceback and exit 120
    except OSError as exc:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush at exit
        if not code:  # else the command has said what failed
            print(f"Error: cannot write to stdout: {exc.strerror or exc}", file=sys.stderr)
            code = EXIT_BAD_INPUT
    sys.exit(code or 0)
