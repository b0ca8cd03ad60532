"""A draft model (`draft.checkpoint` or `draft.tiny`) loaded against its target and wired to draft: in
a draft format of methods/formats.py (recognised from the folder), else a transformers causal LM that
drafts from tokens alone."""

from __future__ import annotations

from specdec_cli.decoding.cache import CachedModel
from specdec_cli.errors import SpecdecError
from specdec_cli.loading.checkpoints import check_embedding, load_model
from specdec_cli.loading.draft_folder import Wiring
from specdec_cli.loading.target_states import LAST
from specdec_cli.methods.formats import DRAFT_FORMAT, FORMATS, load_format
from specdec_cli.methods.model import ModelDrafter
from specdec_cli.methods.registry import Built, Target


def build(spec, target: Target) -> Built:
    draft, tokenizer = load_model(
        spec, target.device, target.dtype, target.model, read_format=load_format, weights=target.weights
    )
    if tokenizer is not None:  # a draft without one (EAGLE's) uses the target's
        check_tokenizers(target.tokenizer, tokenizer)
    kind = getattr(draft.config, DRAFT_FORMAT, None)
    if kind is None:  # a causal LM drafts from tokens alone: every token the target writes
        check_embedding(draft, target.tokenizer, f"draft {spec.describe()}")
        cached = CachedModel(draft, target.vocab_size, graphs=target.graphs)
        wiring = Wiring(ModelDrafter(cached, target.threshold), LAST, "reads tokens only")
    else:
        wiring = FORMATS[kind].wire(draft, target.vocab_size, target.threshold, target.graphs)
    causal_draft = draft if kind is None else None
    return Built(wiring.drafter, wiring.state_layers, f"{kind or 'causal LM'} draft, {wiring.reads}", causal_draft)


def check_tokenizers(target, draft) -> None:
    """The acceptance test compares token ids: both models must give every token the same id."""
    target_vocab, draft_vocab = target.get_vocab(), draft.get_vocab()
    if target_vocab != draft_vocab:
        differing = sorted(set(target_vocab.items()) ^ set(draft_vocab.items()), key=lambda kv: kv[1])
        token, _ = differing[0]
        raise SpecdecError(
            f"draft and target tokenizers disagree on token ids ({len(differing)} entries "
            f"differ, e.g. {token!r}): speculative decoding needs a shared vocabulary"
        )
