"""A causal LM with its KV cache: feed tokens, get logits, roll back rejected tokens."""

from __future__ import annotations

from typing import NamedTuple

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import Cache, StaticLayer

from specdec_cli.errors import SpecdecError

# layers whose keys and values can be cut back to any earlier length
ATTENTION_LAYERS = {"full_attention", "sliding_attention"}


class Output(NamedTuple):
    logits: torch.Tensor  # [1, n or 1, vocab_size] float32
    hidden: torch.Tensor | None  # [1, n, hidden] the last layer's states (what the head reads), if asked


class CachedModel:
    """Owns one model's KV cache for one sequence.

    `vocab_size` is the width of the logits handed out: a draft whose head is narrower than the
    target's is padded with -inf (it can never propose those tokens), a wider one is cut. Either way
    the draft distribution q that is sampled is the same q the acceptance test sees, so exactness
    holds. With a static cache a rollback only rewinds a counter (no copy, no host sync); stale slots
    are overwritten by the next write.

    Every layer keeps all its keys, sliding-window layers too: the attention mask still applies the
    window, but a rollback never needs keys that a windowed cache would already have evicted
    (transformers' windowed caches cannot be cropped once full, or rewind past evicted keys).
    """

    def __init__(self, model: PreTrainedModel, vocab_size: int, static_cache: bool):
        layer_types = set(getattr(model.config, "layer_types", None) or ()) - ATTENTION_LAYERS
        if layer_types:
            raise SpecdecError(f"{model.config.model_type} has {', '.join(sorted(layer_types))} layers, whose "
                               f"state cannot be rolled back to an accepted prefix: speculative decoding needs "
                               f"attention layers only")
        self.model = model
        self.vocab_size = vocab_size
        self.static_cache = static_cache
        self.device = model.device
        self.cache: Cache | None = None

    @property
    def context_length(self) -> int:
        return self.model.config.max_position_embeddings

    def reset(self, max_tokens: int) -> None:
        """Start a new sequence that will hold at most `max_tokens` tokens."""
        layers = self.model.config.get_text_config().num_hidden_layers
        self.cache = (Cache(layers=[StaticLayer(max_cache_len=max_tokens) for _ in range(layers)])
                      if self.static_cache else DynamicCache())

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor | None = None, *, inputs_embeds: torch.Tensor | None = None,
                last_only: bool = False, hidden: bool = False) -> Output:
        """Append input_ids [1, n] (or their input vectors [1, n, width]) to the sequence."""
        out = self.model(input_ids=input_ids, inputs_embeds=inputs_embeds, cache=self.cache, use_cache=True, output_hidden_states=hidden,
                         logits_to_keep=1 if last_only else 0)
        logits = out.logits.float()
        width = logits.shape[-1]
        if width > self.vocab_size:
            logits = logits[..., : self.vocab_size]
        elif width < self.vocab_size:
            logits = torch.nn.functional.pad(logits, (0, self.vocab_size - width), value=float("-inf"))
        return Output(logits, out.hidden_states[-1] if hidden else None)

    @torch.inference_mode()  # a static cache's counter is an inference tensor on CUDA: update it in that mode
    def rollback(self, num_tokens: int) -> None:
        """Forget the last num_tokens tokens."""
        if num_tokens > 0:  # crop(-0) would mean "keep nothing"
            self.cache.crop(-num_tokens)
