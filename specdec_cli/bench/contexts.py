"""Long contexts for `benchmark --context-lengths`: each prompt's first turn asked after a document of
real text, cut so that the chat-templated prompt holds about that many tokens. The document is the
prompt set's other turns, then the built-in suites' (the benchmark's and distill's prompts): real
text, as random tokens would overstate what a draft or a lookup accepts."""

from __future__ import annotations

from specdec_cli.bench.prompts import Prompt, builtin_suite, training_prompts
from specdec_cli.errors import SpecdecError

FRAME = "Read this document, then answer the request after it.\n\n{document}\n\nRequest: {request}"


def parse_lengths(text: str) -> list[int]:
    """ "1k,4k,8000" -> [1024, 4096, 8000], each a context length in tokens."""
    lengths = []
    for part in text.split(","):
        part = part.strip().lower()
        try:
            lengths.append(int(part[:-1]) * 1024 if part.endswith("k") else int(part))
        except ValueError:
            raise SpecdecError(f"--context-lengths takes token counts such as 1k,4k,8000, got {text!r}") from None
    if min(lengths) < 1:
        raise SpecdecError(f"--context-lengths must be positive, got {text!r}")
    return sorted(set(lengths))


def with_context(pair, prompts: list[Prompt], length: int, max_new_tokens: int) -> tuple[list[Prompt], dict[str, int]]:
    """Each prompt's first turn after a document that brings its chat-templated ids to about `length`
    tokens (id `<id>@<length>`), and each new prompt's token count."""
    window = pair.target.context_length
    if length + max_new_tokens > window:
        raise SpecdecError(
            f"--context-lengths {length}: with {max_new_tokens} new tokens it passes the target's window of "
            f"{window} tokens: choose lengths up to {window - max_new_tokens}"
        )
    pool = [t for p in prompts for t in p.turns] + [t for p in builtin_suite() + training_prompts() for t in p.turns]
    tokenizer = pair.tokenizer
    out, tokens = [], {}
    for prompt in prompts:
        request = prompt.turns[0]
        document = "\n\n".join(dict.fromkeys(t for t in pool if t != request))
        document_ids = tokenizer.encode(document, add_special_tokens=False)
        room = length - len(pair.encode(FRAME.format(document="", request=request)))
        if room < 0:
            raise SpecdecError(f"--context-lengths {length}: prompt {prompt.id} alone is longer than that")
        if room > len(document_ids):
            raise SpecdecError(
                f"--context-lengths {length}: only {len(document_ids)} tokens of text to build it from: "
                f"choose lengths up to about {len(document_ids)}"
            )
        text = FRAME.format(document=tokenizer.decode(document_ids[:room]), request=request)
        new = Prompt(f"{prompt.id}@{length}", prompt.category, (text,))
        out.append(new)
        tokens[new.id] = len(pair.encode(text))
    return out, tokens
