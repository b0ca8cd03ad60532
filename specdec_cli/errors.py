"""Errors a user can cause: the CLI prints them as one line and exits with the code given."""

from __future__ import annotations

import re
import sys
from pathlib import Path

EXIT_BAD_INPUT = 2  # bad input (config, flags, files) or environment (out of memory, unwritable, disk full)
EXIT_CHECK_FAILED = 3  # not exact: a verify-distribution check failed, or greedy output left the target alone's
EXIT_GATE_FAILED = 4  # a benchmark gate (--min-speedup, --min-accept-length) was not met
EXIT_INTERRUPTED = 130  # Ctrl-C or SIGTERM, as shells report a SIGINT


class SpecdecError(Exception):
    """A failure with a message meant for the user; `exit_code` says which kind."""

    def __init__(self, message: str, exit_code: int = EXIT_BAD_INPUT):
        super().__init__(message)
        self.exit_code = exit_code


class FetchError(SpecdecError):
    """A checkpoint that could not be downloaded (no registry or hub reachable from here)."""


MESSAGE_LIMIT = 400  # characters of an `Error:` line: a hostile input must not print megabytes


def one_line(text: str, limit: int = MESSAGE_LIMIT) -> str:
    """`text` on one line, cut to `limit` characters with a note of how much was left out."""
    text = " ".join(text.split())
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit:,} more characters)"


def known_failure(exc: Exception) -> SpecdecError | None:
    """A failure that is the user's input or the machine's state, not a bug: specdec's own errors, out
    of memory, and the operating system refusing a file or a stream (missing, unwritable, read-only,
    disk full, name too long). None for anything else."""
    if isinstance(exc, SpecdecError):
        return exc
    if isinstance(exc, OSError) and exc.strerror:
        where = f": {exc.filename}" if exc.filename else ""
        return SpecdecError(f"{exc.strerror}{where}")
    return out_of_memory(exc)


def out_of_memory(exc: Exception) -> SpecdecError | None:
    """torch running out of memory (CUDA's OutOfMemoryError, the CPU allocator's RuntimeError, raised
    wherever the models, caches or batches are allocated) as one line with what to try; else None."""
    torch = sys.modules.get("torch")  # whatever ran out of memory loaded it; the CLI starts without it
    if torch is None or not isinstance(exc, RuntimeError):
        return None
    text = str(exc)
    if isinstance(exc, torch.OutOfMemoryError):
        size = re.search(r"Tried to allocate ([\d.]+ \w+)", text)
        free = re.search(r"(GPU \d+) has a total capacity of ([\d.]+ \w+) of which ([\d.]+ \w+) is free", text)
        where = f"{free[1]} ({free[3]} free of {free[2]})" if free else "the GPU"
        size = size[1] if size else None
    elif "DefaultCPUAllocator: can't allocate memory" in text:
        size = re.search(r"allocate (\d+) bytes", text)
        where, size = "the CPU", size and f"{int(size[1]) / 2**30:.2f} GiB"
    elif "Storage size calculation overflowed" in text:  # refused before any device is asked
        where, size = "any device", "more than 2**63 bytes"
    else:
        return None
    tried = f" allocating {size}" if size else ""
    return SpecdecError(
        f"out of memory on {where}{tried}: try fewer prompts at once (--batch-size), shorter prompts or a "
        f"smaller --max-new-tokens, or a smaller --dtype (bfloat16 or float16 halve float32's memory)"
    )


def read_text(what: str, path: Path | None = None) -> str:
    """Text the user gives, the file `path` or stdin (None), as UTF-8; `what` names it. A file that
    is missing or unreadable, or bytes that are not UTF-8, are one line instead of a traceback."""
    source = f"{what} {path}" if path else what
    try:
        # stdin's bytes, decoded here: Python's own decoding of stdin lets undecodable bytes through
        return path.read_text(encoding="utf-8") if path else sys.stdin.buffer.read().decode("utf-8")
    except FileNotFoundError:
        raise SpecdecError(f"{source} not found") from None
    except OSError as exc:
        raise SpecdecError(f"cannot read {source}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        utf16 = ", it looks like UTF-16" if exc.object[:2] in (b"\xff\xfe", b"\xfe\xff") else ""
        raise SpecdecError(
            f"{source} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}{utf16}): "
            f"save it as UTF-8"
        ) from None
