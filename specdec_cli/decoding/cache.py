"""A causal LM with its KV cache for a batch of sequences: feed tokens, get logits, roll back the
rejected ones, row by row."""

from __future__ import annotations

from contextvars import ContextVar
from typing import TYPE_CHECKING, NamedTuple

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from specdec_cli.decoding.graphs import GraphedForward
from specdec_cli.decoding.host import to_device
from specdec_cli.errors import SpecdecError

if TYPE_CHECKING:
    from specdec_cli.decoding.tree import Region

# layers whose keys and values can be cut back to any earlier length
ATTENTION_LAYERS = {"full_attention", "sliding_attention"}
# the widest input a graph is captured for (wider ones, prefills, run eagerly)
GRAPHED_WIDTH = 64
# the attention reads the cache's slots in steps of this many (the mask hides those past each row's
# context). With graphs, shapes then recur from block to block instead of growing by a token each, as
# graphs need. Eagerly, in smaller steps: SDPA's result for a query depends on how many keys it is
# given, masked ones too, unless that is a whole number of its blocks, so a single-token step and a
# verification block read the same keys the same way (greedy output equal to the target alone's)
KEY_SLOTS_STEP = 128
EAGER_KEY_SLOTS_STEP = 32
# on a CPU, a lone row's chain forwards of at most DECODING_WIDTH tokens (decoding steps,
# verifications; wider ones are prompts, alike in both ways of decoding) attend in calls of
# QUERY_CHUNK tokens (in_chunks), as CachedModel.forward plans them through CHUNKS
DECODING_WIDTH = 16
QUERY_CHUNK = 3
CHUNKS: ContextVar[ChunkPlan | None] = ContextVar("attention_chunks", default=None)
# the attribute where loading names a forward of specdec's own for a model: a class with `serves(model)`
# whose `cls(model)` is called as `CachedModel.step` calls transformers' model, with its outputs, in
# fewer operator calls (loading/llama_forward.py). The cache builds it over the model as it is when
# the cache is made (a draft format may have replaced parts since loading), where it still serves.
DECODING_FORWARD = "specdec_forward"


def grouped_query_sdpa(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' SDPA attention, except that a multi-token query (a verification) of a
    grouped-query model attends without copying keys and values per query head: the heads sharing
    a key/value head are stacked along the query axis instead (transformers does the same for one
    query token). A lone row's chain forward on a CPU attends in chunks instead (`in_chunks`). Our
    masks are [B, 1, n, keys]; anything else takes transformers' path."""
    batch, heads, n, dim = query.shape
    groups = heads // key.shape[1]
    extra = any(kwargs.get(name) is not None for name in ("position_bias", "softcap", "s_aux", "sinks"))
    ours = attention_mask is not None and attention_mask.shape[1] == 1 and not extra
    plan = None if torch.compiler.is_compiling() else CHUNKS.get()  # graphs replay shapes of their own
    if ours and plan is not None:
        return in_chunks(query, key, value, attention_mask, scaling, dropout, plan)
    if groups == 1 or n == 1 or not ours:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    stacked = query.reshape(batch, key.shape[1], groups * n, dim)  # query head h = kv head h // groups
    mask = attention_mask[:, :, None].expand(-1, -1, groups, -1, -1).flatten(2, 3)  # [B, 1, groups * n, keys]
    out = torch.nn.functional.scaled_dot_product_attention(
        stacked, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling
    )
    return out.reshape(batch, heads, n, dim).transpose(1, 2).contiguous(), None


class ChunkPlan:
    """A lone row's attention calls in one forward (`in_chunks`): per call, its tokens (at most
    QUERY_CHUNK, the last repeated as fillers up to QUERY_CHUNK) and the keys a single-token step at
    their slots reads; the calls' masks, made at the first layer, serve every layer."""

    def __init__(self, spans: list[tuple[int, int, int]], device: torch.device):
        self.spans = spans  # (first, last + 1, keys) per call
        fillers = [[end - 1] * (QUERY_CHUNK - end + first) for first, end, _ in spans]
        self.tokens = [to_device([*range(first, end), *fill], device) for (first, end, _), fill in zip(spans, fillers)]
        self.masks: list[torch.Tensor] | None = None

    def call_masks(self, mask: torch.Tensor, groups: int) -> list[torch.Tensor]:
        """Each call's rows of `mask` [1, 1, n, keys], repeated for the query heads stacked per key/value head."""
        if self.masks is None:
            self.masks = [
                mask[:, :, tokens, :keys][:, :, None].expand(-1, -1, groups, -1, -1).reshape(1, 1, -1, keys)
                for tokens, (_, _, keys) in zip(self.tokens, self.spans)
            ]
        return self.masks


def in_chunks(query, key, value, mask, scaling, dropout, plan: ChunkPlan) -> tuple[torch.Tensor, None]:
    """A row's tokens attending in the calls `plan` lists: every call takes QUERY_CHUNK tokens, their
    query heads stacked per key/value head, over the keys a single-token step at their slots reads.
    SDPA's CPU kernel rounds a query by how many query rows come with it and by the keys it is given
    (masked ones too), and on some CPUs by how few rows spread over the threads; not by where the
    query stands among a fixed number of rows or what the others hold. So a token gets the same
    result in a single-token step and in a verification block, and greedy output stays the target
    alone's (tests/test_engine.py)."""
    _, heads, n, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    rows = query.view(1, kv_heads, groups, n, dim)  # query head h = kv head h // groups
    outputs = []
    for (first, end, keys), tokens, call_mask in zip(plan.spans, plan.tokens, plan.call_masks(mask, groups)):
        chunk = rows.index_select(3, tokens).view(1, kv_heads, groups * QUERY_CHUNK, dim)
        out = torch.nn.functional.scaled_dot_product_attention(
            chunk, key[:, :, :keys], value[:, :, :keys], attn_mask=call_mask, dropout_p=dropout, scale=scaling
        )
        outputs.append(out.view(1, kv_heads, groups, QUERY_CHUNK, dim)[:, :, :, : end - first])
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=3)
    return out.reshape(1, heads, n, dim).transpose(1, 2).contiguous(), None


AttentionInterface.register("grouped_query_sdpa", grouped_query_sdpa)
# the model, run by transformers itself (generate(), training), gets the masks SDPA would get
AttentionMaskInterface.register("grouped_query_sdpa", sdpa_mask)


class Output(NamedTuple):
    logits: torch.Tensor  # [B, n, vocab_size] float32 ([B, 1, V] for each row's last real input, [B, 0, V] for none)
    hidden: torch.Tensor | None  # [B, n, taps * hidden] the states of `state_layers`, if asked


def right_padded(rows: list[list[int]], device: torch.device, pad: int = 0) -> tuple[torch.Tensor, list[int]]:
    """Token rows of different lengths as one [B, longest] tensor (padded with `pad`), and the lengths."""
    width = max(map(len, rows))
    return to_device([row + [pad] * (width - len(row)) for row in rows], device), [len(r) for r in rows]


def right_padded_states(states: list[torch.Tensor | None]) -> torch.Tensor:
    """Runs of hidden states of different lengths [n_b, H] (None: no run) as one [B, longest, H]
    tensor, padded with zeros."""
    empty = next(s for s in states if s is not None)[:0]
    return torch.nn.utils.rnn.pad_sequence([empty if s is None else s for s in states], batch_first=True)


class RaggedCache(Cache):
    """Keys and values of B rows in one preallocated tensor per layer, [B, heads, max_tokens + 1, dim],
    each row with a length of its own. A forward writes every row's n new entries at that row's
    length; a rollback only lowers lengths (no copy, no device work): stale entries are never
    attended to (the mask hides them) and are overwritten by the next write. Before each forward the
    owner calls `write_at` with the [B, n] slots to write and sets `visible` (how many slots the
    attention reads, never the scratch slot). Padding inputs (a row with fewer real inputs than the
    widest) are written to the last slot, `scratch`, which is never visible: written at the row's
    length they could pass the end of a row that is far along."""

    def __init__(self, num_layers: int, max_tokens: int):
        self.max_tokens = max_tokens
        self.scratch = max_tokens
        self.write_positions: torch.Tensor | None = None
        self.write_rows: dict[tuple[int, int], torch.Tensor] = {}
        self.visible = 0
        super().__init__(layers=[RaggedLayer(self) for _ in range(num_layers)])

    def write_at(self, positions: torch.Tensor) -> None:
        """The next forward writes row b's inputs at the slots positions[b] ([B, n])."""
        self.write_positions = positions
        self.write_rows = {}

    def rows_to_write(self, heads: int, slots: int) -> torch.Tensor:
        """Where the next forward's keys [B, heads, n, dim] go in a layer's store viewed as rows
        [B * heads * slots, dim], in their order: worked out once per forward for all layers alike
        (a copy of whole rows by index is much cheaper than an element-wise scatter)."""
        if (heads, slots) not in self.write_rows:
            batch = self.write_positions.shape[0]
            starts = torch.arange(batch * heads, device=self.write_positions.device).view(batch, heads, 1) * slots
            self.write_rows[heads, slots] = (starts + self.write_positions[:, None, :]).flatten()
        return self.write_rows[heads, slots]


class RaggedLayer(CacheLayerMixin):
    is_compileable = False
    is_sliding = False  # windows are applied by the mask: every layer keeps every key

    def __init__(self, cache: RaggedCache):
        super().__init__()
        self.owner = cache

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, _ = key_states.shape
        self.keys = key_states.new_zeros(batch, heads, self.owner.scratch + 1, key_states.shape[-1])
        self.values = value_states.new_zeros(batch, heads, self.owner.scratch + 1, value_states.shape[-1])
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        _, heads, slots, dim = self.keys.shape
        rows = self.owner.rows_to_write(heads, slots)
        self.keys.view(-1, dim).index_copy_(0, rows, key_states.reshape(-1, dim))
        self.values.view(-1, dim).index_copy_(0, rows, value_states.reshape(-1, dim))
        return self.keys[:, :, : self.owner.visible], self.values[:, :, : self.owner.visible]

    def keep(self, rows: torch.Tensor) -> None:
        if self.is_initialized:
            self.keys, self.values = self.keys[rows], self.values[rows]

    def move(self, source: torch.Tensor, target: torch.Tensor) -> None:
        """Copy the slots `source` [B, m] to `target` [B, m], row by row."""
        for store in (self.keys, self.values):
            heads, dim = store.shape[1], store.shape[3]
            picked = store.gather(2, source[:, None, :, None].expand(-1, heads, -1, dim))
            store.scatter_(2, target[:, None, :, None].expand(-1, heads, -1, dim), picked)

    def get_seq_length(self) -> int:
        return self.owner.visible

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.visible, 0

    def get_max_length(self) -> int:
        return self.owner.max_tokens


class CachedModel:
    """Owns one model's KV cache for a batch of sequences (rows), each with its own length.

    `vocab_size` is the width of the logits handed out: a draft whose head is narrower than the
    target's is padded with -inf (it can never propose those tokens), a wider one is cut. Either way
    the draft distribution q that is sampled is the same q the acceptance test sees, so exactness
    holds.

    Every row sees exactly its own context: positions are its own, and the attention mask shows a
    query only the keys of its row below its position (and within the window of a sliding-window
    layer). Keys a window has passed are kept, so a rollback never needs evicted keys.
    """

    def __init__(
        self, model: PreTrainedModel, vocab_size: int, state_layers: tuple[int, ...] = (-1,), graphs: bool = False
    ):
        """`graphs`: decoding forwards (at most GRAPHED_WIDTH inputs, one mask for every layer) replay
        CUDA graphs on a GPU (decoding/graphs.py)."""
        config = model.config.get_text_config()
        unsupported = set(getattr(config, "layer_types", None) or ()) - ATTENTION_LAYERS
        if unsupported:
            raise SpecdecError(
                f"{config.model_type} has {', '.join(sorted(unsupported))} layers, whose "
                f"state cannot be rolled back to an accepted prefix: speculative decoding needs "
                f"attention layers only"
            )
        if config._attn_implementation == "sdpa" and model._supports_attention_backend:
            model.set_attn_implementation("grouped_query_sdpa")
        self.model = model
        self.vocab_size = vocab_size
        # hidden states handed out on request (indices into transformers' `hidden_states`; -1 is
        # the last, after the final norm), side by side
        self.state_layers = state_layers
        self.device = model.device
        self.num_layers = config.num_hidden_layers
        self.layer_types = getattr(config, "layer_types", None)
        self.window = getattr(config, "sliding_window", None)
        self.cache: RaggedCache | None = None
        self.lengths: list[int] = []  # tokens held per row
        self.graphed = GraphedForward(self.step, self.device) if graphs else None
        own = getattr(model, DECODING_FORWARD, None)
        self.own_forward = own(model) if own is not None and own.serves(model) else None

    @property
    def key_step(self) -> int:
        """The attention reads the cache's slots in steps of this many."""
        return KEY_SLOTS_STEP if self.graphed is not None else EAGER_KEY_SLOTS_STEP

    @property
    def context_length(self) -> int:
        return self.model.config.max_position_embeddings

    def reset(self, max_tokens: int, batch: int = 1) -> None:
        """Start `batch` new sequences that will hold at most `max_tokens` tokens each. With graphs, a
        cache as large for as many rows is kept, and with it the graphs captured on it."""
        same_rows, self.lengths = len(self.lengths) == batch, [0] * batch
        if self.graphed is not None:
            if self.cache is not None and self.cache.max_tokens >= max_tokens and same_rows:
                return
            self.graphed.clear()
        step = self.key_step
        self.cache = RaggedCache(self.num_layers, -(-max_tokens // step) * step)  # every step fits

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        *,
        inputs_embeds: torch.Tensor | None = None,
        counts: list[int] | None = None,
        logits: str = "all",
        hidden: bool = False,
        region: Region | None = None,
    ) -> Output:
        """Append input_ids [B, n] (or their input vectors [B, n, width]) to the rows. `counts`: how
        many of a row's n inputs are real (default all); the rest, at the end, are padding, whose
        keys and values go to the never-visible scratch slot. `logits`: at "all" inputs, at each row's
        "last" real input, or "none" (a prefill that reads only states: a full vocabulary at every
        prompt position is large). `region`: the inputs are the last nodes of a tree
        (decoding/tree.py), each attending to the context before the tree's root and to its own
        ancestors, at the root's position + its depth."""
        n = (input_ids if input_ids is not None else inputs_embeds).shape[1]
        counts = counts or [n] * len(self.lengths)
        steps = torch.arange(n, device=self.device)
        slots = to_device(self.lengths, self.device)[:, None] + steps  # [B, n]
        positions = slots if region is None else region.positions
        ragged = min(counts) < n
        writes = (
            slots.masked_fill(steps >= to_device(counts, self.device)[:, None], self.cache.scratch) if ragged else slots
        )
        self.cache.visible = self.key_slots(max(length + count for length, count in zip(self.lengths, counts)))
        if logits == "none":
            keep = torch.zeros(0, dtype=torch.long, device=self.device)
        elif logits == "last" and ragged:  # each row's own last real input
            keep = to_device([[count - 1] for count in counts], self.device)
        else:
            keep = 1 if logits == "last" else 0
        mask = self.mask(positions, region)
        tensors = dict(ids=input_ids, embeds=inputs_embeds, positions=positions, slots=writes)
        tensors.update(mask=mask, keep=keep, hidden=hidden)
        # a new cache's first forward (its tensors made at the first write) runs eagerly
        ready = self.cache.layers[0].is_initialized
        if self.graphed is not None and ready and isinstance(mask, torch.Tensor) and n <= GRAPHED_WIDTH:
            inputs = {name: value for name, value in tensors.items() if isinstance(value, torch.Tensor)}
            settings = {name: value for name, value in tensors.items() if name not in inputs}
            shapes = tuple((name, tuple(value.shape)) for name, value in inputs.items())
            out = self.graphed((shapes, self.cache.visible, *settings.items()), inputs, **settings)
        else:
            lone = len(self.lengths) == 1 and isinstance(mask, torch.Tensor)
            chain = region is None and self.device.type == "cpu" and lone and n <= DECODING_WIDTH
            plan = CHUNKS.set(self.chunks(n) if chain else None)
            try:
                out = self.step(**tensors)
            finally:
                CHUNKS.reset(plan)
        self.lengths = [length + count for length, count in zip(self.lengths, counts)]
        return Output(self.fit_vocabulary(out[0].float()), out[1] if hidden else None)

    def key_slots(self, needed: int) -> int:
        """The cache slots a forward reads for `needed` of them: a whole number of steps, short of the scratch slot."""
        return min(-(-needed // self.key_step) * self.key_step, self.cache.scratch)

    def chunks(self, n: int) -> ChunkPlan:
        """A lone row's next n tokens' attention calls (in_chunks): at most QUERY_CHUNK tokens a call,
        tokens that a single-token step at their slots would give the same keys."""
        spans: list[tuple[int, int, int]] = []
        for i in range(n):
            keys = self.key_slots(self.lengths[0] + i + 1)
            if spans and spans[-1][2] == keys and i - spans[-1][0] < QUERY_CHUNK:
                spans[-1] = (spans[-1][0], i + 1, keys)
            else:
                spans.append((i, i + 1, keys))
        return ChunkPlan(spans, self.device)

    def step(self, ids, embeds, positions, slots, mask, keep, hidden) -> tuple[torch.Tensor, ...]:
        """The model's forward after the cache was told where to write (`slots`): (logits, and the
        states of `state_layers` side by side when `hidden`)."""
        self.cache.write_at(slots)
        if self.own_forward is not None:
            return self.own_forward(
                ids, embeds, positions, mask, self.cache, keep, self.state_layers if hidden else None
            )
        out = self.model(
            input_ids=ids,
            inputs_embeds=embeds,
            position_ids=positions,
            attention_mask=mask,
            cache=self.cache,
            use_cache=True,
            output_hidden_states=hidden,
            logits_to_keep=keep,
        )
        if not hidden:
            return (out.logits,)
        return out.logits, torch.cat([out.hidden_states[i] for i in self.state_layers], dim=-1)

    def mask(self, positions: torch.Tensor, region: Region | None = None) -> torch.Tensor | dict[str, torch.Tensor]:
        """[B, 1, n, visible] True where a query may attend to a key: the row's own keys at or below
        the query's position (in a tree: the context and the query's ancestors); in a sliding-window
        layer, only those of the last `window` positions."""
        keys = torch.arange(self.cache.visible, device=self.device)
        if region is None:
            allowed, key_positions = keys <= positions[..., None], keys
        else:
            allowed, key_positions = region.attention(keys)
            key_positions = key_positions[:, None]  # [B, 1, K]: per row
        causal = allowed[:, None]
        if self.window is None:
            return causal
        windowed = causal & (key_positions > positions[..., None] - self.window)[:, None]
        if self.layer_types is None:  # a window in every layer (Mistral)
            return windowed
        return {"full_attention": causal, "sliding_attention": windowed}

    def fit_vocabulary(self, logits: torch.Tensor) -> torch.Tensor:
        width = logits.shape[-1]
        if width > self.vocab_size:
            return logits[..., : self.vocab_size]
        if width < self.vocab_size:
            return torch.nn.functional.pad(logits, (0, self.vocab_size - width), value=float("-inf"))
        return logits

    def rollback(self, num_tokens: int | list[int]) -> None:
        """Forget each row's last num_tokens tokens (one count for all rows, or one per row)."""
        counts = num_tokens if isinstance(num_tokens, list) else [num_tokens] * len(self.lengths)
        self.lengths = [length - count for length, count in zip(self.lengths, counts)]

    @torch.inference_mode()
    def compact(self, start: list[int], path: torch.Tensor, kept: list[int]) -> None:
        """Keep a tree's accepted path: per row, the slots start + path[:, j] move to start + j, and
        the row then holds start + kept tokens (kept <= path's width; what lies past is never visible)."""
        base = to_device(start, self.device)[:, None]
        for layer in self.cache.layers:
            layer.move(base + path, base + torch.arange(path.shape[1], device=self.device))
        self.lengths = [s + k for s, k in zip(start, kept)]

    def keep(self, rows: list[int]) -> None:
        """Keep only these rows (the others finished), in this order."""
        index = to_device(rows, self.device)
        for layer in self.cache.layers:
            layer.keep(index)
        if self.graphed is not None:  # captured on the tensors just replaced
            self.graphed.clear()
        self.lengths = [self.lengths[r] for r in rows]
