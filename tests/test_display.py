"""Terminal output: the token stream prints exactly the text, in linear time; logs get progress lines."""

from __future__ import annotations

import io

from rich.console import Console

from specdec_cli import display


def test_the_stream_prints_the_text_and_decodes_short_windows(tokenizer, monkeypatch):
    text = "Plain words, then ünïcödé and 🦊 emoji split across byte tokens. " * 8
    ids = tokenizer.encode(text)
    windows = []
    decode = tokenizer.decode

    def recording_decode(token_ids, **kwargs):
        windows.append(len(token_ids))
        return decode(token_ids, **kwargs)

    monkeypatch.setattr(tokenizer, "decode", recording_decode)
    out = io.StringIO()
    stream = display.TokenStream(tokenizer, Console(file=out, width=10_000))
    for start in range(0, len(ids), 3):  # blocks of 3 tokens, the first of each from the draft
        stream(ids[start : start + 3], 1)
    stream.close()
    assert out.getvalue() == text + "\n"
    assert max(windows) <= 8  # the longest character is 4 bytes: never the whole answer again


def test_collecting_without_a_console_decodes_nothing(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "decode", lambda *args, **kwargs: 1 / 0)
    stream = display.TokenStream(tokenizer, None)
    stream([1, 2, 3], 2)
    stream.close()
    assert stream.token_ids == [1, 2, 3]


def test_logs_get_plain_progress_lines():
    out = io.StringIO()
    console = Console(file=out, width=200)
    assert not console.is_terminal
    with display.ProgressLines(console, every=3600) as bar:
        task = bar.add_task("prompt 1/2", total=4)
        bar.update(task, advance=1)  # within `every` of the start: quiet
        bar.update(task, completed=4, description="prompt 2/2")  # done: always a line
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("progress: prompt 2/2: 4/4 (100%), 0s elapsed")
    assert display.progress_line("x", 1, 4, 90) == "progress: x: 1/4 (25%), 1m30s elapsed, ETA 4m30s"
    # resumed at 2 of 10: the ETA comes from the 1 done in this run's 60 s, not from all 3
    assert display.progress_line("x", 3, 10, 60, resumed_at=2) == "progress: x: 3/10 (30%), 1m00s elapsed, ETA 7m00s"
