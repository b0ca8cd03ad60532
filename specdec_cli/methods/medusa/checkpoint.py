"""Medusa heads (Cai et al. 2024): a few small heads on the target's last hidden state, head i
guessing the token i + 2 positions ahead (the target's own head says the next one), all heads from
the same state in one pass. Head i is `num_layers` residual blocks x + SiLU(W x + b) and a linear
map to the vocabulary.

Two layouts are read:
- FasterDecoding's `medusa_lm_head.pt` (a pickle of tensors, loaded with `weights_only=True`):
  `{i}.{j}.linear.{weight,bias}` and `{i}.{num_layers}.weight`; config `medusa_num_heads`,
  `medusa_num_layers`. Its config may under-count the heads (the original loader forces 5), so the
  heads are counted from the tensors.
- vLLM's safetensors: `blocks.{i}.layers.{j}.weight` (`.bias` with `medusa_fc_bias`),
  `lm_heads.{i}.weight` (one shared `lm_heads.0` with `original_lm_head`), and with
  `truncated_vocab_size` < `vocab_size` a `token_map` of the target ids the heads score.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import torch

from specdec_cli.errors import SpecdecError
from specdec_cli.loading.draft_folder import DraftFolder, Format, Wiring
from specdec_cli.loading.target_states import LAST
from specdec_cli.methods.medusa.drafter import MedusaDrafter

FASTER_DECODING_LAYER = re.compile(r"(\d+)\.(\d+)\.linear\.weight")


def recognise(folder: DraftFolder) -> bool:
    config = folder.config
    return (
        config.get("model_type") == "medusa"
        or "MedusaModel" in (config.get("architectures") or [])
        or "medusa_num_heads" in config
    )


class MedusaHeads(torch.nn.Module):
    """state [B, H] -> logits [B, num_heads, vocab_size] (float32)."""

    def __init__(
        self,
        blocks: list[list[torch.nn.Linear]],
        heads: list[torch.nn.Linear],
        vocab_size: int,
        token_map: torch.Tensor | None = None,
        logit_scale: float = 1.0,
    ):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.ModuleList(block) for block in blocks)
        self.heads = torch.nn.ModuleList(heads)  # may hold one shared head several times
        self.vocab_size = vocab_size
        self.logit_scale = logit_scale
        self.register_buffer("token_map", token_map, persistent=False)

    @property
    def num_heads(self) -> int:
        return len(self.blocks)

    def forward(self, state: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        logits = []
        for block, head in list(zip(self.blocks, self.heads))[:num_heads]:
            x = state
            for layer in block:
                x = x + torch.nn.functional.silu(layer(x))
            logits.append(head(x).float() * self.logit_scale)
        logits = torch.stack(logits, dim=1)
        if self.token_map is None:
            return logits
        # a head over a subset of the vocabulary: the other tokens can never be proposed
        full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
        full[..., self.token_map] = logits
        return full


def load(folder: DraftFolder, target_model, dtype: torch.dtype) -> MedusaHeads:
    """The heads, on the target's device in `dtype`, checked against the target's width and vocabulary."""
    config, where = folder.config, f"Medusa checkpoint {folder.path}"
    state = folder.weights  # safetensors, or a pickle read with weights_only=True
    if any(FASTER_DECODING_LAYER.fullmatch(k.removeprefix("medusa_head.")) for k in state):
        blocks, heads, token_map = faster_decoding_layout(state, where)
    else:
        blocks, heads, token_map = vllm_layout(state, config, where)
    target_head = target_model.get_output_embeddings().weight
    vocab_size, hidden_size = target_head.shape
    for name, weight in [(n, w) for block in blocks for n, w, _ in block] + heads:
        if weight.shape[-1] != hidden_size:
            raise SpecdecError(
                f"{where}: {name} reads states of width {weight.shape[-1]}, the target's hidden size is {hidden_size}"
            )
    for name, weight, bias in [layer for block in blocks for layer in block]:
        if weight.shape[0] != hidden_size or (bias is not None and bias.shape != (hidden_size,)):
            raise SpecdecError(f"{where}: {name} maps {list(weight.shape)}, not {hidden_size} to itself")
    scored = len(token_map) if token_map is not None else vocab_size
    for name, weight in heads:
        if weight.shape[0] != scored:
            raise SpecdecError(
                f"{where}: {name} scores {weight.shape[0]} tokens, "
                f"the target's vocabulary has {vocab_size}"
                + (f" and the token map {scored}" if token_map is not None else "")
            )
    if token_map is not None and (int(token_map.max()) >= vocab_size or int(token_map.min()) < 0):
        raise SpecdecError(f"{where}: token_map holds ids outside the target's {vocab_size}")

    def linear(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.nn.Linear:
        layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
        layer.weight = torch.nn.Parameter(weight.to(target_head.device, dtype), requires_grad=False)
        if bias is not None:
            layer.bias = torch.nn.Parameter(bias.to(target_head.device, dtype), requires_grad=False)
        return layer

    head_layers = {}  # a shared head stays one module
    model = MedusaHeads(
        [[linear(w, b) for _, w, b in block] for block in blocks],
        [head_layers.setdefault(name, linear(w, None)) for name, w in heads],
        vocab_size,
        None if token_map is None else token_map.long().to(target_head.device),
        float(config.get("logit_scale", 1.0)),
    )
    model.config = SimpleNamespace(**config)  # the registry marks the format on it
    return model.eval()


Block = list[tuple[str, torch.Tensor, torch.Tensor | None]]  # (name, weight, bias) per residual layer


def faster_decoding_layout(state: dict, where: str) -> tuple[list[Block], list[tuple[str, torch.Tensor]], None]:
    state = {k.removeprefix("medusa_head."): v for k, v in state.items()}
    layer_keys = [FASTER_DECODING_LAYER.fullmatch(k) for k in state]
    layers: dict[int, int] = {}
    for match in filter(None, layer_keys):
        head, layer = int(match[1]), int(match[2])
        layers[head] = max(layers.get(head, 0), layer + 1)
    head_ids = {int(m[1]) for m in filter(None, (re.fullmatch(r"(\d+)\.\d+\.weight", k) for k in state))}
    num_heads = max(head_ids | set(layers), default=-1) + 1
    if num_heads == 0:
        raise SpecdecError(f"{where}: no Medusa heads ({{i}}.{{j}}.linear.weight, {{i}}.{{n}}.weight) in it")
    depth = layers.get(0, 0)
    blocks, heads = [], []
    for i in range(num_heads):
        names = [f"{i}.{j}.linear.{p}" for j in range(depth) for p in ("weight", "bias")] + [f"{i}.{depth}.weight"]
        missing = [n for n in names if n not in state]
        if missing or layers.get(i, 0) != depth:
            raise SpecdecError(f"{where}: head {i} lacks tensors the others have (missing {missing[:3]})")
        layer = [f"{i}.{j}.linear" for j in range(depth)]
        blocks.append([(name, state[f"{name}.weight"], state[f"{name}.bias"]) for name in layer])
        heads.append((f"{i}.{depth}.weight", state[f"{i}.{depth}.weight"]))
    return blocks, heads, None


def count_key(config: dict, word: str) -> int | None:
    """vLLM's reading of a Medusa config: any key with "num" and "heads" (or "layers") in it."""
    for key, value in config.items():
        if "num" in key and word in key and isinstance(value, int):
            return value
    return None


def vllm_layout(
    state: dict, config: dict, where: str
) -> tuple[list[Block], list[tuple[str, torch.Tensor]], torch.Tensor | None]:
    state = {k.removeprefix("medusa_heads."): v for k, v in state.items()}
    num_heads = count_key(config, "heads")
    num_layers = count_key(config, "layers")
    if num_heads is None:
        num_heads = len({k.split(".")[1] for k in state if k.startswith("lm_heads.")})
    if num_layers is None:
        num_layers = len({k.split(".")[3] for k in state if k.startswith("blocks.0.layers.")})
    bias = bool(config.get("medusa_fc_bias", False))
    if not bias and any(k.startswith("blocks.") and k.endswith(".bias") for k in state):
        raise SpecdecError(f"{where}: fc biases stored, but its config lacks medusa_fc_bias: true")
    shared_head = bool(config.get("original_lm_head", False))
    head_names = [f"lm_heads.{0 if shared_head else i}.weight" for i in range(num_heads)]
    layer_names = [f"blocks.{i}.layers.{j}" for i in range(num_heads) for j in range(num_layers)]
    wanted = head_names + [f"{n}.weight" for n in layer_names] + ([f"{n}.bias" for n in layer_names] if bias else [])
    missing = [n for n in wanted if n not in state]
    if missing or num_heads == 0:
        raise SpecdecError(
            f"{where}: missing tensors for {num_heads} heads of {num_layers} layers: "
            f"{missing[:3] or ['lm_heads.0.weight']}"
        )
    token_map = None
    truncated = config.get("truncated_vocab_size")
    if truncated is not None and truncated < config.get("vocab_size", truncated + 1):
        token_map = state.get("token_map")
        if token_map is None or token_map.shape != (truncated,):
            raise SpecdecError(f"{where}: truncated_vocab_size {truncated} needs a token_map of {truncated} ids")
    heads = []
    for name in head_names:
        weight = state[name]
        if token_map is not None and weight.shape[0] > len(token_map):  # a full head: keep the mapped rows
            weight = weight[token_map.long()]
        heads.append((name, weight))
    blocks = [
        [
            (f"blocks.{i}.layers.{j}", state[f"blocks.{i}.layers.{j}.weight"], state.get(f"blocks.{i}.layers.{j}.bias"))
            for j in range(num_layers)
        ]
        for i in range(num_heads)
    ]
    return blocks, heads, token_map


def wire(heads: MedusaHeads, vocab_size: int, confidence_threshold: float, graphs: bool) -> Wiring:
    """One pass of its heads drafts a block from the target's last state (eagerly: heads alone)."""
    return Wiring(
        MedusaDrafter(heads, vocab_size), LAST, f"{heads.num_heads} heads, reads the target's last hidden state"
    )


FORMAT = Format(claims=recognise, load=load, wire=wire, architectures=("MedusaModel",))
