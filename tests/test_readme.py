"""The README against the code: every `specdec <command>` it names exists, every flag it shows is
accepted by the command it is shown with, and its config schema holds exactly the keys of the config
dataclasses. Each checker returns the problems it finds, so the tests below also show that a README
naming something that does not exist fails."""

from __future__ import annotations

import dataclasses
import re
import shlex
import types
import typing
from pathlib import Path

import click
import typer.main
import yaml

from specdec_cli.cli import app
from specdec_cli.config import Config

ROOT_DIR = Path(__file__).resolve().parent.parent
README = (ROOT_DIR / "README.md").read_text()
LINK = re.compile(r"\]\(([^)#\s]+)[^)]*\)")  # a Markdown link's target file
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
INLINE = re.compile(r"`([^`\n]+)`")
HEADING = re.compile(r"^#+ .*$", re.M)
FLAG = re.compile(r"-{1,2}[A-Za-z][\w-]*")
SHELL_BREAKS = {"|", "||", "&&", ";", ">", ">>", "<", "&"}

ROOT = typer.main.get_command(app)
COMMANDS = ROOT.commands


def accepted(command: click.Command) -> set[str]:
    """Every spelling of every option `command` takes, its help option included."""
    names = set(click.Context(command).help_option_names)
    for param in command.params:
        names.update(param.opts + param.secondary_opts)
    return names


def sections(text: str) -> list[tuple[str, str]]:
    """(heading, body) for each heading of the text, and ("", ...) for what precedes the first."""
    fences = [m.span() for m in FENCE.finditer(text)]  # a `# comment` in a code block is no heading
    marks = [(m.start(), m.group()) for m in HEADING.finditer(text) if not any(a <= m.start() < b for a, b in fences)]
    starts = [(0, "")] + marks
    ends = [start for start, _ in marks] + [len(text)]
    return [(heading, text[start:end]) for (start, heading), end in zip(starts, ends)]


def code_lines(text: str) -> list[str]:
    """The lines of fenced code blocks and the inline code spans outside them."""
    lines = [line for _, body in FENCE.findall(text) for line in body.splitlines()]
    return lines + INLINE.findall(FENCE.sub("", text))


def specdec_invocations(line: str) -> list[list[str]]:
    """The words after each `specdec` (or `.../specdec`) in a shell line, up to a pipe, redirection,
    `&&` or comment."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        words = list(lexer)
    except ValueError:  # an unbalanced quote: not a shell line
        return []
    found, current = [], None
    for word in words:
        if word == "specdec" or word.endswith("/specdec"):
            current = []
            found.append(current)
        elif word in SHELL_BREAKS:
            current = None
        elif current is not None:
            current.append(word)
    return found


def flags_of(words: list[str]) -> list[str]:
    """The options among a command line's words (`--x=1` is `--x`; `-` and `-1` are values)."""
    return [word.split("=", 1)[0] for word in words if FLAG.fullmatch(word.split("=", 1)[0])]


def command_line_problems(text: str) -> tuple[list[str], set[str]]:
    """Problems of the README's `specdec ...` lines, and the commands they name."""
    problems, named = [], set()
    for line in code_lines(text):
        for words in specdec_invocations(line):
            if words and not words[0].startswith("-"):
                name, command, options = words[0], COMMANDS.get(words[0]), words[1:]
                named.add(name)
                if command is None:
                    problems.append(f"`specdec {name}` is not a command ({', '.join(COMMANDS)}): {line}")
                    continue
            else:
                name, command, options = "", ROOT, words
            for flag in flags_of(options):
                if flag not in accepted(command):
                    problems.append(f"`specdec {name}` does not take {flag}: {line}")
    return problems, named


def standalone_flag_problems(text: str) -> list[str]:
    """Flags named on their own in prose (`--num-draft-tokens`, `--ignore-eos/--stop-at-eos`): in a section
    headed by a command, that command must take them; elsewhere, some command must."""
    anywhere = accepted(ROOT).union(*(accepted(c) for c in COMMANDS.values()))
    problems = []
    for heading, body in sections(text):
        command = next((COMMANDS[n] for n in COMMANDS if f"`specdec {n}`" in heading), None)
        allowed = accepted(command) if command else anywhere
        for span in INLINE.findall(FENCE.sub("", body)):
            names = span.split("/")
            if all(FLAG.fullmatch(n.split("=", 1)[0]) for n in names):
                problems += [f"{n} is not an option ({heading or 'top'})" for n in names if n not in allowed]
    return problems


def nested(tp) -> type | None:
    """The dataclass a field holds (through Optional), or None for a plain value."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        tp = next(t for t in typing.get_args(tp) if t is not type(None))
    return tp if dataclasses.is_dataclass(tp) else None


def schema_fields(cls: type, prefix: str = "") -> dict[str, type | None]:
    """Dotted key -> the dataclass it holds (None: a value), over the whole config schema."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        if f.name == "source":  # where the config was read from, not a YAML key
            continue
        key, inner = prefix + f.name, nested(hints[f.name])
        out[key] = inner
        if inner is not None:
            out.update(schema_fields(inner, key + "."))
    return out


SCHEMA = schema_fields(Config)


def yaml_keys(data: dict, prefix: str = "") -> dict[str, object]:
    """Dotted key -> value, for every key of a nested mapping."""
    keys = {}
    for key, value in data.items():
        keys[prefix + key] = value
        if isinstance(value, dict):
            keys.update(yaml_keys(value, f"{prefix}{key}."))
    return keys


def missing_keys(shown: dict[str, object]) -> list[str]:
    """Schema keys the block leaves out. A section shown as `null` (`draft.tiny: null`) may leave its
    keys out when another section of the same kind (`target.tiny`) shows them all."""
    complete = {
        kind
        for path, kind in SCHEMA.items()
        if kind is not None
        and isinstance(shown.get(path), dict)
        and all(key in shown for key in SCHEMA if key.startswith(path + "."))
    }
    missing = []
    for key in SCHEMA:
        parent = key.rpartition(".")[0]
        if parent in shown and shown[parent] is None and SCHEMA[parent] in complete:
            continue
        if key not in shown:
            missing.append(key)
    return missing


def config_problems(text: str) -> list[str]:
    """The schema block of the Configs section against the config dataclasses, both ways, and every
    dotted config key named in the README (`draft.lookup.num_draft_tokens`) against the schema."""
    config_section = next((body for heading, body in sections(text) if heading == "## Configs"), None)
    if config_section is None:
        return ["no `## Configs` section"]
    blocks = [body for kind, body in FENCE.findall(config_section) if kind == "yaml"]
    if not blocks:
        return ["no yaml block in the Configs section"]
    shown = yaml_keys(yaml.safe_load(blocks[0]))
    problems = [f"`{key}` is not a config key" for key in shown if key not in SCHEMA]
    problems += [f"config key `{key}` is missing from the schema" for key in missing_keys(shown)]
    top = {key for key in SCHEMA if "." not in key and SCHEMA[key] is not None}
    for span in INLINE.findall(FENCE.sub("", text)):
        dotted = span.split(":")[0].strip()
        if re.fullmatch(r"[a-z_]+(\.[a-z_]+)+", dotted) and dotted.split(".")[0] in top and dotted not in SCHEMA:
            problems.append(f"`{dotted}` is not a config key")
    return problems


def test_readme_names_existing_commands_and_their_flags():
    problems, named = command_line_problems(README)
    assert problems == []
    assert named == set(COMMANDS), "the README shows every command"


def test_readme_prose_flags_exist():
    assert standalone_flag_problems(README) == []


def test_readme_config_schema_matches_the_dataclasses():
    assert config_problems(README) == []


def test_links_in_readme_and_docs_resolve():
    pages = [ROOT_DIR / "README.md", *sorted((ROOT_DIR / "docs").rglob("*.md"))]
    broken = [
        f"{page.relative_to(ROOT_DIR)}: {target}"
        for page in pages
        for target in LINK.findall(page.read_text())
        if "://" not in target and not (page.parent / target).exists()
    ]
    assert len(pages) > 1 and broken == []


def test_a_readme_naming_what_does_not_exist_fails():
    """The checkers are not vacuous: each kind of mistake is reported."""
    line = "specdec generate --prompt hi --no-such-flag"
    assert command_line_problems(f"```bash\n{line}\n```\n")[0] == [
        f"`specdec generate` does not take --no-such-flag: {line}"
    ]
    assert len(command_line_problems("Run `specdec distill --temperatures 0,1`.")[0]) == 1  # benchmark's flag
    problems, named = command_line_problems("```bash\n.venv/bin/specdec compile --fast && specdec --version\n```\n")
    assert named == {"compile"} and len(problems) == 1 and problems[0].startswith("`specdec compile` is not a command")
    prose = (
        "## Configs\n\n(flag `--num-draft-tokens`)\n\n### `specdec distill`\n\n```bash\n# not a heading\n```\n\n"
        "See `--answers-per-step` and `--batch-sizes`.\n"
    )
    assert standalone_flag_problems(prose) == ["--batch-sizes is not an option (### `specdec distill`)"]
    assert standalone_flag_problems("Use `--ignore-eos/--warp-speed`.") == ["--warp-speed is not an option (top)"]
    wrong_key = README.replace("  revision:", "  branch:", 1)  # the first is the target's, in the schema
    assert config_problems(wrong_key) == [
        "`target.branch` is not a config key",
        "config key `target.revision` is missing from the schema",
    ]
    assert config_problems(README + "\nSet `speculation.gama`.\n") == ["`speculation.gama` is not a config key"]
