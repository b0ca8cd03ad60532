"""Memory a long distill run hands back to the system."""

from __future__ import annotations

import ctypes
import sys


def release_freed_memory() -> None:
    """Returns the heap's free pages to the system (glibc's malloc_trim). Every batch has its own
    length, so tensors of new sizes land between live ones and glibc keeps the freed pages around
    them: without this a long training or labelling run's memory grows to several times what its
    tensors hold."""
    if sys.platform.startswith("linux"):
        trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # absent outside glibc (musl)
        if trim is not None:
            trim(0)
