"""Which of the target's hidden states a draft reads, in one convention: indices into transformers'
`hidden_states` of a target of L layers. 0 is the embedding output, i the input of layer i (the
output of layer i - 1), L the last, after the final norm; -1, as in Python, also names the last.

Why this one: it is what the engine hands a drafter (decoding/cache.py reads `hidden_states[i]`),
what transformers and vLLM count, and what a feature draft's config stores (`TARGET_LAYERS`).
Checkpoints that count layer outputs instead (SpecForge / SGLang's EAGLE-3, z-lab's DFlash) are
converted here by `from_outputs`, and every reader's indices are checked here by `check_states`,
each against the states it can read.
"""

from __future__ import annotations

from specdec_cli.errors import SpecdecError

# config key: the target states a feature draft reads (specdec's own and the EAGLE drafts)
TARGET_LAYERS = "specdec_target_layers"
LAST = (-1,)  # the target's last state, after its final norm


def target_layers(draft) -> tuple[int, ...]:
    return tuple(getattr(draft.config, TARGET_LAYERS, None) or LAST)


def from_outputs(ids: list) -> list:
    """Layer-output ids as `hidden_states` indices: the output of layer i is the input of layer i + 1."""
    return [i + 1 if type(i) is int else i for i in ids]


def check_states(
    states: list | tuple,
    num_layers: int,
    what: str,
    lowest: int = 0,
    highest: int | None = None,
    count: int | None = None,
    last: bool = False,
) -> tuple[int, ...]:
    """`states` (this module's convention) if each is a state the reader can read, lowest .. highest
    (default: 0 .. L; -1 too with `last`) and, with `count`, that many distinct ones; else one line
    that names them as `what` says they were given."""
    highest = num_layers if highest is None else highest

    def readable(i) -> bool:
        return type(i) is int and (lowest <= i <= highest or (last and i == -1))

    if states and all(map(readable, states)) and (count is None or len(set(states)) == len(states) == count):
        return tuple(states)
    need = f"{count} distinct hidden states" if count else "hidden states"
    raise SpecdecError(
        f"{what} do not fit a target of {num_layers} layers: this draft reads {need} among {lowest} .. "
        f"{highest}{' or -1' if last else ''} (state i is the input of layer i, {num_layers} the last state)"
    )
