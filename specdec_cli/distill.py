"""Train a small draft model for a target: `specdec distill`.

1. Corpus: the target answers the training prompts itself (sampled at temperature 1, several answers
   per prompt), so the draft learns the text it will actually be asked to predict.
2. Draft (Llama-style models: `model.layers`, `model.norm`): a few decoder layers of the target's width, initialised from evenly spaced target layers,
   sharing the target's embeddings, final norm's shape and LM head. The shared tensors are frozen and
   stored by reference (`specdec-draft.json` names them), so the checkpoint holds only the new layers.
3. Training: KL(p_target || q_draft) at every position of the corpus, teacher-forced.
   Held-out greedy agreement and expected acceptance sum(min(p, q)) are printed as it goes.

The corpus and training state live in the output folder until training ends, so an interrupted run
resumes where it stopped.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from specdec_cli import display
from specdec_cli.checkpoints import DRAFT_INFO, SHARED
from specdec_cli.pair import eos_token_ids

WORK = "distill-work"  # subfolder of the output: corpus and training state until training ends
CORPUS = "corpus.pt"
STATE = "train-state.pt"


@dataclass
class DistillSettings:
    num_layers: int = 2
    answers_per_prompt: int = 8
    answer_tokens: int = 192
    steps: int = 2000
    batch_size: int = 4
    learning_rate: float = 5e-4
    eval_every: int = 200
    heldout_fraction: float = 0.05
    seed: int = 0


@torch.inference_mode()
def build_corpus(target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[list[int]],
                 settings: DistillSettings, out: Path) -> list[list[int]]:
    """Prompt + target-sampled answer token ids, saved after every batch so a restart keeps them."""
    path = out / CORPUS
    corpus: list[list[int]] = torch.load(path) if path.is_file() else []
    jobs = [ids for ids in prompts for _ in range(settings.answers_per_prompt)]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = eos_token_ids(target, tokenizer)
    batch = 32  # sampling many answers at once is far faster than one by one
    with display.progress() as bar:
        task = bar.add_task("Target writes the corpus", total=len(jobs), completed=len(corpus))
        for start in range(len(corpus), len(jobs), batch):
            group = jobs[start:start + batch]
            width = max(map(len, group))
            # left padding, so every answer starts right after its prompt
            input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in group])
            mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in group])
            torch.manual_seed(settings.seed * 1_000_003 + start)  # deterministic, and per batch on resume
            out_ids = target.generate(input_ids=input_ids.to(target.device), attention_mask=mask.to(target.device),
                                      do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                      max_new_tokens=settings.answer_tokens, pad_token_id=pad)
            for ids, row in zip(group, out_ids[:, width:].tolist()):
                ends = [i for i, t in enumerate(row) if t in eos]  # keep the EOS, drop the padding after it
                corpus.append(ids + row[:ends[0] + 1] if ends else ids + row)
            torch.save(corpus, path)
            bar.update(task, completed=len(corpus))
    return corpus


def init_draft(target: PreTrainedModel, num_layers: int) -> PreTrainedModel:
    """A shallow copy of the target: evenly spaced layers (first and last included), the target's
    final norm, and the target's embedding and head tensors themselves (frozen, shared)."""
    config = target.config.__class__.from_dict(target.config.to_dict())
    chosen = spaced_layers(config.num_hidden_layers, num_layers)
    config.num_hidden_layers = num_layers
    config.layer_types = None  # re-derived for the new depth where the architecture uses it
    draft = AutoModelForCausalLM.from_config(config).to(device=target.device, dtype=torch.float32)
    with torch.no_grad():
        for mine, theirs in zip(draft.model.layers, chosen):
            mine.load_state_dict(target.model.layers[theirs].state_dict())
        draft.model.norm.load_state_dict(target.model.norm.state_dict())
    draft.model.embed_tokens = target.model.embed_tokens
    draft.lm_head = target.lm_head
    for name, param in draft.named_parameters():
        param.requires_grad = name not in SHARED
    return draft


def spaced_layers(total: int, count: int) -> list[int]:
    """`count` evenly spaced indices of `total` layers, the first and the last among them."""
    return [round(i * (total - 1) / max(count - 1, 1)) for i in range(count)]


def batches(corpus: list[list[int]], batch_size: int, seed: int, step: int):
    """Endless shuffled batches; deterministic given the seed, and resumable at any step."""
    order: list[int] = []
    epoch = 0
    skipped = 0
    while True:
        if not order:
            order = list(range(len(corpus)))
            random.Random(seed + epoch).shuffle(order)
            epoch += 1
        group, order = order[:batch_size], order[batch_size:]
        if skipped < step:
            skipped += 1
            continue
        yield [corpus[i] for i in group]


def pad_batch(group: list[list[int]], pad: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, group))
    ids = torch.tensor([seq + [pad] * (width - len(seq)) for seq in group], device=device)
    mask = torch.tensor([[1] * len(seq) + [0] * (width - len(seq)) for seq in group], device=device)
    return ids, mask


def distributions(target: PreTrainedModel, draft: PreTrainedModel, ids: torch.Tensor, mask: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Target log-probs (no grad) and draft log-probs at the positions that predict a token."""
    with torch.no_grad():
        p_log = target(input_ids=ids, attention_mask=mask).logits.float().log_softmax(-1)
    # the shared embedding and head are in the target's dtype (bfloat16 for speed): compute in it
    with torch.autocast(device_type=ids.device.type, dtype=target.dtype, enabled=target.dtype != torch.float32):
        q_log = draft(input_ids=ids, attention_mask=mask).logits.float().log_softmax(-1)
    positions = mask[:, 1:].bool()  # position t predicts token t + 1, which must exist
    return p_log[:, :-1][positions], q_log[:, :-1][positions]


def kl_loss(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    return F.kl_div(q_log, p_log, log_target=True, reduction="batchmean")


@torch.no_grad()
def evaluate(target: PreTrainedModel, draft: PreTrainedModel, heldout: list[list[int]], pad: int
             ) -> dict[str, float]:
    """Greedy agreement (draft argmax == target argmax) and expected acceptance at temperature 1,
    sum_x min(p, q), over held-out positions."""
    agree = accept = count = 0.0
    for start in range(0, len(heldout), 4):
        ids, mask = pad_batch(heldout[start:start + 4], pad, target.device)
        p_log, q_log = distributions(target, draft, ids, mask)
        agree += (p_log.argmax(-1) == q_log.argmax(-1)).sum().item()
        accept += torch.minimum(p_log.exp(), q_log.exp()).sum().item()
        count += p_log.shape[0]
    return {"greedy_agreement": agree / count, "expected_acceptance": accept / count}


def train(target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, corpus: list[list[int]],
          settings: DistillSettings, out: Path) -> tuple[PreTrainedModel, list[dict]]:
    torch.manual_seed(settings.seed)
    split = max(1, int(len(corpus) * settings.heldout_fraction))
    heldout, training = corpus[:split], corpus[split:]  # corpus order is prompt-major: held-out prompts
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    draft = init_draft(target, settings.num_layers)
    trainable = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=settings.learning_rate, weight_decay=0.0)
    warmup = max(1, settings.steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1, (s + 1) / warmup) * 0.5 * (
        1 + math.cos(math.pi * min(s, settings.steps) / settings.steps)))
    log: list[dict] = []
    step = 0
    state_path = out / STATE
    if state_path.is_file():
        state = torch.load(state_path, weights_only=False)
        draft.load_state_dict(state["draft"], strict=False)
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        step, log = state["step"], state["log"]
    if not log:
        log.append({"step": 0, **evaluate(target, draft, heldout, pad)})
        display.stderr.print(format_eval(log[-1]))

    def save_state() -> None:
        own = {k: v for k, v in draft.state_dict().items() if k not in SHARED}
        torch.save({"draft": own, "optimizer": optimizer.state_dict(), "schedule": schedule.state_dict(),
                    "step": step, "log": log}, state_path)

    stream = batches(training, settings.batch_size, settings.seed, step)
    draft.train()
    with display.progress() as bar:
        task = bar.add_task("Training the draft", total=settings.steps, completed=step)
        try:
            while step < settings.steps:
                ids, mask = pad_batch(next(stream), pad, target.device)
                p_log, q_log = distributions(target, draft, ids, mask)
                loss = kl_loss(p_log, q_log)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(trainable, 1.0)
                optimizer.step()
                schedule.step()
                step += 1
                bar.update(task, completed=step, description=f"Training the draft (KL {loss.item():.3f})")
                if step % settings.eval_every == 0 or step == settings.steps:
                    draft.eval()
                    log.append({"step": step, "kl": loss.item(), **evaluate(target, draft, heldout, pad)})
                    draft.train()
                    bar.console.print(format_eval(log[-1]))
                    save_state()
        except KeyboardInterrupt:
            save_state()
            display.stderr.print(f"Interrupted at step {step}; run the same command again to resume.")
            raise
    draft.eval()
    return draft, log


def format_eval(entry: dict) -> str:
    kl = f", KL {entry['kl']:.3f}" if "kl" in entry else ""
    return (f"step {entry['step']}{kl}: held-out greedy agreement {entry['greedy_agreement']:.3f}, "
            f"expected acceptance (T=1) {entry['expected_acceptance']:.3f}")


def save_draft(draft: PreTrainedModel, target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out: Path,
               target_name: str, log: list[dict], settings: DistillSettings) -> Path:
    """config.json + the draft's own weights (bfloat16) + the target's tokenizer + specdec-draft.json."""
    own = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in draft.state_dict().items()
           if k not in SHARED}
    draft.config.save_pretrained(out)
    save_file(own, out / "model.safetensors", metadata={"format": "pt"})
    tokenizer.save_pretrained(out)
    info = {"target": target_name, "shared_from_target": sorted(SHARED),
            "initialised_from_target_layers": spaced_layers(
                target.config.num_hidden_layers, draft.config.num_hidden_layers), "settings": vars(settings),
            "log": log}
    (out / DRAFT_INFO).write_text(json.dumps(info, indent=2) + "\n")
    return out
