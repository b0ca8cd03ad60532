"""Token helpers shared by the decoding commands and distill: prompts to ids, EOS ids, padding."""

from __future__ import annotations

from transformers import GenerationConfig, PreTrainedTokenizerBase

from specdec_cli.errors import SpecdecError


def eos_token_ids(generation_config: GenerationConfig, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """End-of-sequence ids from a model's generation config (one or a list) and the tokenizer."""
    ids = generation_config.eos_token_id
    ids = set(ids if isinstance(ids, list) else [] if ids is None else [ids])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def encode_prompt(
    tokenizer: PreTrainedTokenizerBase, prompt: str, raw: bool = False, history: list[dict] | None = None
) -> list[int]:
    """Token ids of a prompt: through the chat template when the tokenizer has one (unless raw).
    `history` holds earlier turns of a conversation as chat messages."""
    if not prompt.strip():
        raise SpecdecError("the prompt is empty")
    if tokenizer.chat_template and not raw:
        messages = (history or []) + [{"role": "user", "content": prompt}]
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))
    return list(tokenizer.encode(prompt))


def padding_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """What fills batches; never attended to, so EOS will do where the tokenizer has no pad token."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
