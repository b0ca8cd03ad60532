"""The training loop: the draft learns the target's top-k distribution at every answer position,
as the 1st, 2nd ... token of a draft, and is measured on held-out answers as it goes."""

from __future__ import annotations

import math
import random
from pathlib import Path

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from specdec_cli import display
from specdec_cli.distill.batches import Batch, batches, make_batch
from specdec_cli.distill.corpus import add_target_features
from specdec_cli.distill.memory import release_freed_memory
from specdec_cli.distill.settings import DistillSettings, read_layers
from specdec_cli.distill.state import resume, save_state, state_path, trained_with
from specdec_cli.errors import SpecdecError
from specdec_cli.loading.tokens import eos_token_ids, padding_id
from specdec_cli.methods.feature import eagle3_export
from specdec_cli.methods.feature.draft import init_draft
from specdec_cli.methods.feature.parts import feature_inputs, read_target

RELEASE_EVERY = 10  # steps between handing freed heap pages back (release_freed_memory)
HELDOUT_MOST = 256  # held-out prompts: enough to measure agreement within about 0.005, evaluated in seconds


def split_heldout(corpus: list[dict], share: float) -> tuple[list[dict], list[dict]]:
    """Training answers, and held-out answers: those to a `share` of the given prompts (at most
    `HELDOUT_MOST`, evenly spaced through the corpus, so that a corpus written in shards of one
    temperature each is held out at all of them), so that evaluation measures the draft on the given
    prompts' kind of text and on prompts it never trained on. The target's own prompts are never held
    out; an answer to one that happens to repeat a held-out prompt is not trained on either."""
    given = list(dict.fromkeys(tuple(a["prompt"]) for a in corpus if not a["synthetic"]))
    count = min(HELDOUT_MOST, max(1, round(len(given) * share)))
    heldout_prompts = {given[i * len(given) // count] for i in range(count)} if given else set()
    heldout = [a for a in corpus if tuple(a["prompt"]) in heldout_prompts and not a["synthetic"]]
    training = [a for a in corpus if tuple(a["prompt"]) not in heldout_prompts]
    if not training:
        raise SpecdecError(
            f"no answers to train on: all {len(corpus)} answers are to the held-out prompts "
            f"({len(heldout_prompts)} of the {len(given)} given); give more prompts or answers"
        )
    return training, heldout


def split_given_heldout(corpus: list[dict], others: list[dict]) -> tuple[list[dict], list[dict]]:
    """Training answers, and held-out answers given apart (`others`: at most `HELDOUT_MOST`, evenly
    spaced through them), such as answers to prompts unlike the training ones: what the draft meets
    on prompts of other kinds than it trained on. No answer to one of their prompts is trained on."""
    count = min(HELDOUT_MOST, len(others))
    heldout = [others[i * len(others) // count] for i in range(count)]
    prompts = {tuple(a["prompt"]) for a in heldout}
    training = [a for a in corpus if tuple(a["prompt"]) not in prompts]
    if not training:
        raise SpecdecError(f"no answers to train on: all {len(corpus)} answers are to prompts of the held-out answers")
    return training, heldout


def sample_tokens(training: list[dict], tokens: int, seed: int) -> list[dict]:
    """Training answers in a seeded order, up to `tokens` answer tokens: the same seed gives nested
    samples (the 1M-token one starts with the 500k-token one), as a learning curve needs."""
    order = list(range(len(training)))
    random.Random(seed).shuffle(order)
    sample, total = [], 0
    for i in order:
        if total >= tokens:
            break
        sample.append(training[i])
        total += len(training[i]["answer"])
    return sample


def choose_vocabulary(corpus: list[dict], vocab_size: int, size: int, eos: set[int]) -> torch.Tensor:
    """The `size` tokens with the most target probability mass over the corpus' answer positions
    (EOS always among them), in id order."""
    mass = torch.zeros(vocab_size)
    for answer in corpus:
        mass.index_add_(0, answer["top_ids"].flatten().long(), answer["top_logp"].flatten().float().exp())
    mass[sorted(eos)] = math.inf
    return mass.topk(min(size, vocab_size)).indices.sort().values


def train(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    training: list[dict],
    heldout: list[dict],
    settings: DistillSettings,
    work: Path,
    target_name: str,
) -> tuple[PreTrainedModel, list[dict]]:
    """Trains the draft on `training` (labelled answers), measuring it on `heldout` as it goes."""
    pad = padding_id(tokenizer)
    taps = read_layers(settings, target)
    corpus = heldout + training  # in the order they were labelled, so kept target states fit
    add_target_features(target, corpus, pad, work, taps)
    torch.manual_seed(settings.seed)
    draft, to_subset = new_draft(target, tokenizer, training, taps, settings)
    autocast = target.dtype if target.dtype != torch.float32 else None
    trainable = [p for p in draft.parameters() if p.requires_grad]
    optimizer, schedule = optimizer_and_schedule(trainable, settings)
    log: list[dict] = []
    step = 0
    path = state_path(work, settings.format)
    shaped_by = trained_with(settings, target, target_name, corpus)
    if path.is_file():
        step, log = resume(path, shaped_by, draft, optimizer, schedule)

    def evaluation(**extra) -> None:
        draft.eval()
        log.append(
            {"step": step, **extra, **evaluate(draft, heldout, pad, to_subset, autocast, settings.draft_positions)}
        )
        draft.train()
        display.stderr.print(format_eval(log[-1]))

    if not log:
        display.stderr.print(
            f"Corpus: {len(training)} training answers "
            f"({sum(len(a['answer']) for a in training)} answer tokens), {len(heldout)} held out "
            f"({sum(a['greedy'] for a in heldout)} greedy, {sum(not a['greedy'] for a in heldout)} sampled); "
            f"draft vocabulary {len(draft.lm_head.token_ids)} of {len(to_subset)} tokens"
        )
        evaluation()

    def checkpoint() -> None:
        save_state(path, shaped_by, draft, optimizer, schedule, step, log)

    stream = batches(training, settings.answers_per_step, settings.seed, step)
    draft.train()
    with display.progress() as bar:
        task = bar.add_task("Training the draft", total=settings.training_steps, completed=step)
        try:
            while step < settings.training_steps:
                batch = make_batch(next(stream), pad, to_subset, draft.device)
                log_probs = draft_log_probs(draft, batch, autocast, settings.draft_positions)
                loss = distillation_loss(log_probs, batch, settings.position_decay, settings.loss)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(trainable, 1.0)
                optimizer.step()
                schedule.step()
                step += 1
                if step % RELEASE_EVERY == 0:
                    release_freed_memory()
                bar.update(task, completed=step, description=f"Training the draft (loss {loss.item():.3f})")
                if step % settings.eval_every == 0 or step == settings.training_steps:
                    evaluation(loss=loss.item())
                    checkpoint()
        except KeyboardInterrupt:
            checkpoint()
            display.stderr.print(f"Interrupted at step {step}; run the same command again to resume.")
            raise
    draft.eval()
    return draft, log


def new_draft(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    training: list[dict],
    taps: tuple[int, ...],
    settings: DistillSettings,
) -> tuple[PreTrainedModel, torch.Tensor]:
    """The untrained draft over the vocabulary subset the training answers choose, and the map from
    the target's token ids to the subset's indices (-1 outside it)."""
    vocab_size = target.get_output_embeddings().weight.shape[0]
    token_ids = choose_vocabulary(
        training, vocab_size, settings.draft_vocab, eos_token_ids(target.generation_config, tokenizer)
    )
    to_subset = torch.full((vocab_size,), -1, dtype=torch.long)
    to_subset[token_ids] = torch.arange(len(token_ids))
    if settings.format == "eagle3":
        draft = eagle3_export.init_eagle3(
            target, token_ids, taps, settings.num_layers, settings.init_layers, settings.zero_features
        )
    else:
        draft = init_draft(target, settings.num_layers, token_ids, taps, settings.init_layers, settings.zero_features)
    return draft, to_subset


def optimizer_and_schedule(
    trainable: list[torch.nn.Parameter], settings: DistillSettings
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW, with a linear warm-up over the first 5% of the steps and cosine decay to 0 at the last."""
    optimizer = torch.optim.AdamW(trainable, lr=settings.learning_rate, weight_decay=0.0)
    total = settings.training_steps
    warmup = max(1, total // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total))
    )
    return optimizer, schedule


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
            log_probs.append(draft.lm_head(hidden[batch.rows, batch.cols]).float().log_softmax(-1))
            # input j's output stands in for the target's state at token j + 1
            features = torch.cat([target_states[:, :1], hidden[:, :-1].to(target_states.dtype)], dim=1)
    return log_probs


def distillation_loss(log_probs: list[torch.Tensor], batch: Batch, decay: float, kind: str) -> torch.Tensor:
    """The `kind` of loss (DistillSettings.loss) against the target's top-k probabilities, per
    position, weighted over draft steps by decay ** k: a later draft token only counts if the ones
    before it were accepted."""
    weights = [decay**k for k in range(len(log_probs))]
    if kind == "tv":
        losses = [(1 - overlap(q_log, batch)).mean() for q_log in log_probs]
    elif kind == "kl":
        losses = [-(batch.weights * q_log.gather(1, batch.targets)).sum(1).mean() for q_log in log_probs]
    else:
        raise ValueError(f"unknown loss {kind!r}")
    return sum(w * loss for w, loss in zip(weights, losses)) / sum(weights)


def overlap(q_log: torch.Tensor, batch: Batch) -> torch.Tensor:
    """[N] sum of min(p, q) over the target's top-k at each position: the chance that a token drafted
    from q is accepted at temperature 1 (as far as the top-k tells)."""
    return torch.minimum(batch.weights, q_log.gather(1, batch.targets).exp()).sum(1)


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
            accept[k] += (overlap(q_log, batch) * ~batch.greedy).sum().item()
        greedy_count += batch.greedy.sum().item()
        sampled_count += (~batch.greedy).sum().item()
        covered += batch.weights.sum().item()
    # a figure with nothing held out to measure it on is None, not 0: a 0 reads as a draft that fails
    return {
        "greedy_agreement": [a / greedy_count for a in agree] if greedy_count else None,
        "expected_acceptance": [a / sampled_count for a in accept] if sampled_count else None,
        "vocabulary_coverage": covered / (greedy_count + sampled_count) if greedy_count + sampled_count else None,
    }


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
