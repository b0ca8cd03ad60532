"""Ctrl-C and SIGTERM (`timeout`, `kill`, CI runners): the first stops the run as Ctrl-C does
(KeyboardInterrupt), so that each command keeps what it finished; a signal while a record is being
saved waits for the save to end; after the first, a second only says so, and a third stops at once."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from specdec_cli.errors import EXIT_INTERRUPTED


class _State:
    signals = 0  # received since install()
    saving = 0  # depth of saving() blocks
    pending = False  # a first signal arrived while saving: interrupt when the save ends


_state = _State()


def install() -> None:
    """Handle both signals in this process (the CLI's main thread)."""
    _state.signals, _state.saving, _state.pending = 0, 0, False
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, _on_signal)


def _on_signal(number: int, frame) -> None:
    _state.signals += 1
    if _state.signals == 1:
        if _state.saving:
            _state.pending = True
            return
        raise KeyboardInterrupt
    if _state.signals == 2:
        print("\nStopping: saving what the run keeps first (signal again to stop at once).", file=sys.stderr)
        return
    print("\nStopped before the record was saved.", file=sys.stderr)
    os._exit(EXIT_INTERRUPTED)


@contextmanager
def saving() -> Iterator[None]:
    """A block that a first signal does not cut short: it interrupts when the block has ended."""
    _state.saving += 1
    try:
        yield
    finally:
        _state.saving -= 1
    if not _state.saving and _state.pending:
        _state.pending = False
        raise KeyboardInterrupt
