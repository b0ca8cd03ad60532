"""Matrix products of loaded models on CPU, taken whichever way is fastest on this machine.

A decoding forward multiplies every weight matrix W [out, in] by one to a few token rows x [n, in].
Which kernel is fastest at that shape depends on the CPU and the dtype. Four ways:
- `x @ W.T`: torch's F.linear;
- `W @ x.T`: the same product transposed, a lone row doubled; faster on some CPUs in float32 at
  a few rows, slower on others (docs/experiments/2026-12-02-decode-matmul.md);
- `oneDNN, prepacked`: oneDNN's linear on a copy of W laid out once, at load, for the CPU's matrix
  instructions (what inductor's weight freezing and vLLM's CPU build use): the layout is paid once,
  not at every call.
- `MKL, prepacked` (float32): MKL's product on a copy of W packed once, at load, for a number of
  rows (what inductor's weight freezing does in float32), which spares the plain product laying W out
  at every call: two copies, one for up to `MAX_ROWS` rows and one for up to `MKL_WIDE_ROWS`, a
  product's rows padded up to its copy's; with fewer than `MKL_FEWEST_ROWS` rows, or more than
  `MKL_WIDE_ROWS` (a prompt), the plain product serves.
The first CPU model of each dtype (float32, bfloat16) that a process loads times them over its own
weight matrices as its forward takes them (`timed_weights`), at a few rows (up to `MAX_ROWS`: a
decoding step, a verification) and at many (a batch's verification; the transposed way is not a
candidate there), and the fastest of each serves every later product of that dtype in the process
(`PROCESS_CHOICE`: the target and its draft alike). F.linear takes everything on GPUs, with
gradients or under autocast. Results differ from F.linear's in the last bits at most (another
summation order), and the target-only baseline goes through the same path as speculative decoding,
so benchmark ratios compare like with like. A model served through copies keeps its weights beside
them (F.linear takes the shapes the copies do not).

Sibling projections of one input (q, k and v; gate and up) are taken as one product over their
weights side by side, as vLLM fuses them: fewer, larger products are faster on a CPU, and the
model's own forward is left as it is (`Siblings`); loading/llama_forward.py calls the joint product
directly.
"""

from __future__ import annotations

import math
import os
import time
from typing import NamedTuple

import torch
import torch.nn.functional as F

from specdec_cli.loading import quantized

MAX_ROWS = 8  # a decoding step or verification block: the transposed product and the narrow copies serve up to it
TIMED_BYTES = 256 * 2**20  # weights timed: enough to stream from memory, as in a forward
NARROW_ROWS = (1, 4)  # a target-only decoding step and a verification block of 3 draft tokens
WIDE_ROWS = (16, 20)  # a batch of 4 rows verifying 3 or 4 draft tokens each
CHOSEN_DTYPES = (torch.float32, torch.bfloat16)
# projections of one input that a layer calls one after another, as transformers names them
SIBLING_NAMES = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))

MKL_WIDE_ROWS = 32  # MKL's wide copy: a batch of rows verifying a few draft tokens each
MKL_FEWEST_ROWS = 4  # below, the plain product is as fast and padding to MAX_ROWS rows would cost

F_LINEAR, TRANSPOSED, PACKED, MKL_PACKED = "x @ W.T", "W @ x.T", "oneDNN, prepacked", "MKL, prepacked"


def transposed_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) taken as (W @ x.T).T, a lone row doubled (one column would take the
    matrix-vector kernel)."""
    rows = x.reshape(-1, x.shape[-1])
    count = rows.shape[0]
    if count == 1:
        rows = torch.cat([rows, rows])
    out = torch.mm(weight, rows.T).T[:count].contiguous().view(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` laid out for oneDNN's linear, or None where this torch or CPU has no such kernel."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    if weight.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class MklCopy(NamedTuple):
    """A weight packed by MKL for products of `rows` rows (fewer are padded up to them)."""

    packed: torch.Tensor
    rows: int


def mkl_pack(weight: torch.Tensor, rows: int) -> MklCopy | None:
    """`weight` packed by MKL for `rows` rows, or None where this torch, CPU or dtype has no such
    product."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not torch.backends.mkl.is_available():
        return None
    return MklCopy(torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), rows), rows)


def mkl_linear(x: torch.Tensor, copy: MklCopy, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) through MKL's packed copy, x's rows padded up to the copy's; outside
    `MKL_FEWEST_ROWS` to the copy's rows, F.linear itself."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    count = rows.shape[0]
    if not MKL_FEWEST_ROWS <= count <= copy.rows:
        return F.linear(x, weight, bias)
    if count < copy.rows:
        rows = torch.cat([rows, rows.new_zeros(copy.rows - count, rows.shape[1])])
    out = torch.ops.mkl._mkl_linear(rows, copy.packed, weight, bias, copy.rows)[:count]
    return out.view(*x.shape[:-1], weight.shape[0])


def copy_for(product: str, weight: torch.Tensor, wide: bool) -> torch.Tensor | MklCopy | None:
    """The copy of `weight` that `product` reads for narrow (up to `MAX_ROWS` rows) or wide inputs:
    None where the product reads none, or where this torch or CPU cannot make it."""
    if product == PACKED:
        return pack(weight)
    if product == MKL_PACKED:
        return mkl_pack(weight, MKL_WIDE_ROWS if wide else MAX_ROWS)
    return None


def time_products(
    weights: list[torch.Tensor],
    timed_rows: tuple[int, ...] = NARROW_ROWS,
    copies: dict[str, list] | None = None,
    repeats: int = 3,
) -> dict[str, float]:
    """Seconds to multiply `weights` by each of `timed_rows` token rows, each way this CPU has (best of
    `repeats`, after one warm-up pass; the transposed way only up to `MAX_ROWS` rows, a way that
    reads a copy where `copies` holds each weight's copy for it). Each repeat is a round that times
    every way in turn, so that a passing disturbance (another process starting or ending) slows them
    alike instead of deciding the choice."""
    inputs = {w.shape[1]: torch.randn(max(timed_rows), w.shape[1], dtype=w.dtype) for w in weights}
    products = (
        {F_LINEAR: F.linear, TRANSPOSED: transposed_product} if max(timed_rows) <= MAX_ROWS else {F_LINEAR: F.linear}
    )
    for name, made in (copies or {}).items():
        if all(c is not None for c in made):
            products[name] = with_copies(name, dict(zip(map(id, weights), made)))

    def seconds(product, rows: int) -> float:
        start = time.perf_counter()
        for w in weights:
            product(inputs[w.shape[1]][:rows], w)
        return time.perf_counter() - start

    best = {(name, rows): math.inf for name in products for rows in timed_rows}
    with torch.no_grad():
        for product in products.values():
            seconds(product, 1)
        for _ in range(repeats):
            for (name, rows), fastest in best.items():
                best[name, rows] = min(fastest, seconds(products[name], rows))
    return {name: sum(best[name, rows] for rows in timed_rows) for name in products}


def with_copies(product: str, by_weight: dict[int, torch.Tensor | MklCopy]):
    """`product` as a function of (x, weight) that reads the weight's copy in `by_weight`."""
    if product == MKL_PACKED:
        return lambda x, w: mkl_linear(x, by_weight[id(w)], w)
    return lambda x, w: packed_linear(x, by_weight[id(w)])


class Chosen(NamedTuple):
    """The products that serve a dtype: up to `MAX_ROWS` rows, and beyond."""

    narrow: str
    wide: str

    def __str__(self) -> str:
        return self.narrow if self.narrow == self.wide else f"{self.narrow} up to {MAX_ROWS} rows, {self.wide} above"


def copies_of(chosen: Chosen | None, weight: torch.Tensor) -> tuple:
    """The copies of a frozen `weight` that the chosen products read, for narrow and wide inputs (one
    oneDNN copy serves both)."""
    if chosen is None or weight.requires_grad:
        return None, None
    narrow = copy_for(chosen.narrow, weight, wide=False)
    return narrow, narrow if chosen.wide == chosen.narrow == PACKED else copy_for(chosen.wide, weight, wide=True)


def copies_for(choice: MatmulChoice, weight: torch.Tensor, weights: str) -> tuple:
    """The copies the products read: the chosen ways' for float weights, else the quantized weight."""
    if weights in quantized.KINDS:
        copy = quantized.quantize(weight, weights)
        return copy, copy
    return copies_of(choice.chosen.get(weight.dtype), weight)


class Linear:
    """A linear layer's forward through the process's choice: `module.forward = Linear(choice, module)`.
    Holds the copies of a frozen weight that the chosen ways read (`weights`: float, int8 or int4)."""

    def __init__(self, choice: MatmulChoice, module: torch.nn.Module, weights: str = "float"):
        self.choice, self.module = choice, module
        self.copies = copies_for(choice, module.weight, weights)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.choice.linear(x, self.module.weight, self.module.bias, self.copies)


class Siblings:
    """Linear layers of one input taken as one product: the first of them called with an input
    computes every sibling's output, and each other one, called next with that same tensor, takes
    its part; called with another input (or twice), a layer computes afresh. Their weights become
    views of the joint weight (no second copy); the joint one has the copies the chosen ways read.
    Under torch.compile (inductor fuses on its own) or with gradients each layer takes its own
    product."""

    def __init__(self, choice: MatmulChoice, modules: list[torch.nn.Module], weights: str = "float"):
        self.choice, self.modules = choice, modules
        self.sizes = [m.weight.shape[0] for m in modules]
        self.weight = torch.cat([m.weight for m in modules])
        self.bias = None if modules[0].bias is None else torch.cat([m.bias for m in modules])
        biases = self.bias.split(self.sizes) if self.bias is not None else [None] * len(modules)
        for index, (module, weight, bias) in enumerate(zip(modules, self.weight.split(self.sizes), biases)):
            module.weight = torch.nn.Parameter(weight, requires_grad=False)
            if bias is not None:
                module.bias = torch.nn.Parameter(bias, requires_grad=False)
            module.forward = SiblingForward(self, index)
        self.copies = copies_for(choice, self.weight, weights)
        self.input: torch.Tensor | None = None
        self.parts: list[torch.Tensor | None] = []

    def joint(self, x: torch.Tensor) -> torch.Tensor:
        """Every sibling's output side by side, [..., sum of their widths]."""
        return self.choice.linear(x, self.weight, self.bias, self.copies)

    def output(self, x: torch.Tensor, index: int) -> torch.Tensor:
        module = self.modules[index]
        if torch.compiler.is_compiling() or torch.is_grad_enabled():  # gradients reach the layer's own weight
            return self.choice.linear(x, module.weight, module.bias)
        if self.input is not x or self.parts[index] is None:
            out = self.joint(x)
            self.input, self.parts = x, [part.contiguous() for part in out.split(self.sizes, dim=-1)]
        part, self.parts[index] = self.parts[index], None
        if all(p is None for p in self.parts):
            self.input = None  # nothing left to hand out: let the input go
        return part


class SiblingForward:
    def __init__(self, siblings: Siblings, index: int):
        self.siblings, self.index = siblings, index

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.siblings.output(x, self.index)


def sibling_groups(model: torch.nn.Module) -> list[list[torch.nn.Linear]]:
    """Each module's children named as sibling projections (`SIBLING_NAMES`), where all are plain
    linear layers of one input width, dtype and kind of bias."""
    groups = []
    for parent in model.modules():
        for names in SIBLING_NAMES:
            members = [getattr(parent, name, None) for name in names]
            if not all(type(m) is torch.nn.Linear for m in members):
                continue
            kinds = {(m.in_features, m.weight.dtype, m.bias is None) for m in members}
            if len(kinds) == 1:
                groups.append(members)
    return groups


class MatmulChoice:
    """Which product serves a process's CPU matmuls, per dtype: unknown until the first such model is
    loaded, then measured once over its weights and kept for every later one."""

    def __init__(self) -> None:
        self.chosen: dict[torch.dtype, Chosen] = {}

    def name(self, dtype: torch.dtype) -> str | None:
        """The products chosen for `dtype`, as a record names them (None: nothing measured)."""
        return str(self.chosen[dtype]) if dtype in self.chosen else None

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        copies: tuple = (None, None),
    ) -> torch.Tensor:
        if isinstance(copies[0], quantized.Quantized) and not (torch.is_grad_enabled() and x.requires_grad):
            return quantized.product(x, copies[0], bias)
        chosen = self.chosen.get(weight.dtype) if x.device.type == "cpu" and x.dtype == weight.dtype else None
        if chosen is None or torch.is_autocast_enabled("cpu") or (torch.is_grad_enabled() and x.requires_grad):
            return F.linear(x, weight, bias)
        if torch.compiler.is_compiling():  # inductor picks (and with freezing, packs) its own products
            return F.linear(x, weight, bias)
        wide = x.numel() // x.shape[-1] > MAX_ROWS
        product, copy = (chosen.wide if wide else chosen.narrow), copies[wide]
        if product == PACKED and copy is not None and copy.dtype == x.dtype:
            return packed_linear(x, copy, bias)
        if product == MKL_PACKED and copy is not None:
            return mkl_linear(x, copy, weight, bias)
        if product == TRANSPOSED:
            return transposed_product(x, weight, bias)
        return F.linear(x, weight, bias)

    def route(self, model: torch.nn.Module, weights: str = "float") -> None:
        """Freeze a CPU float32 or bfloat16 model and route its linear layers through the chosen product
        (measured over this model's weights if it is the first of its dtype), sibling projections as
        one product; with `weights` int8 or int4, through quantized products (loading/quantized.py)."""
        parameter = next(model.parameters(), None)
        if parameter is None or parameter.device.type != "cpu" or parameter.dtype not in CHOSEN_DTYPES:
            return
        model.requires_grad_(False)  # loaded models are only run: their weights may be packed
        linears = [
            m for m in model.modules() if isinstance(m, torch.nn.Linear) or getattr(m, "routed_as_linear", False)
        ]
        groups = sibling_groups(model)
        if weights == "float" and parameter.dtype not in self.chosen and linears:
            timed, room = timed_weights(linears, groups), room_for_copies(linears)
            onednn = [pack(w) for w in timed] if room else None  # one copy serves every row count
            fastest = []
            for wide, timed_rows in ((False, NARROW_ROWS), (True, WIDE_ROWS)):
                made = {PACKED: onednn, MKL_PACKED: [copy_for(MKL_PACKED, w, wide) for w in timed]} if room else {}
                seconds = time_products(timed, timed_rows, made)
                fastest.append(min(seconds, key=seconds.get))
            self.chosen[parameter.dtype] = Chosen(*fastest)
        fused = set()
        for group in groups:
            Siblings(self, group, weights)
            fused.update(map(id, group))
        if weights != "float" or self.chosen.get(parameter.dtype, (F_LINEAR, F_LINEAR)) != (F_LINEAR, F_LINEAR):
            for module in linears:
                if id(module) not in fused:
                    module.forward = Linear(self, module, weights)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one forward's products read: each linear layer's weight as its product reads it
    (a quantized copy's values and scales, else the weight), sibling projections' joint weight once. An
    embedding reads a row per token and is left out (a head tied to it is counted as the head)."""
    total, seen = 0, set()
    for module in model.modules():
        if not isinstance(module, torch.nn.Linear) and not getattr(module, "routed_as_linear", False):
            continue
        forward = module.__dict__.get("forward")
        holder = forward.siblings if isinstance(forward, SiblingForward) else forward
        if not isinstance(holder, (Linear, Siblings)):
            total += module.weight.nbytes
            continue
        if id(holder) in seen:
            continue
        seen.add(id(holder))
        copy = holder.copies[0]
        weight = holder.weight if isinstance(holder, Siblings) else module.weight
        total += copy.data.nbytes + copy.scales.nbytes if isinstance(copy, quantized.Quantized) else weight.nbytes
    return total


def timed_weights(linears: list[torch.nn.Module], groups: list[list[torch.nn.Linear]]) -> list[torch.Tensor]:
    """The weights a forward multiplies by, as it takes them (sibling projections side by side), in
    the model's order up to `TIMED_BYTES`, and the last one (a causal LM's output head: a shape like no
    other, and the largest single product of a forward)."""
    first = {id(group[0]): group for group in groups}
    later = {id(m) for group in groups for m in group[1:]}
    products = [first.get(id(m), [m]) for m in linears if id(m) not in later]
    timed, size = [], 0
    for product in products[:-1]:
        if size >= TIMED_BYTES:
            break
        timed.append(product)
        size += sum(m.weight.nbytes for m in product)
    return [torch.cat([m.weight for m in p]) if len(p) > 1 else p[0].weight for p in [*timed, products[-1]]]


def room_for_copies(linears: list[torch.nn.Module]) -> bool:
    """Whether the copies these layers' weights may get (up to two MKL copies, each somewhat larger
    than the weight: counted as three weights) fit in half the memory now free."""
    needed = 3 * sum(m.weight.nbytes for m in linears)
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not a POSIX system: do not risk it
        return False
    return needed < free / 2


PROCESS_CHOICE = MatmulChoice()  # the target and its draft share it
