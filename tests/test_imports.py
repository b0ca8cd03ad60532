"""specdec's modules import one another without a circle: every import, at the top, inside a
function or only for type checking, read from the source. A format module (methods/feature/eagle.py,
dflash.py, ...) needs nothing from the registry that lists it (methods/formats.py)."""

from __future__ import annotations

import ast
import graphlib
import re
from pathlib import Path

import specdec_cli

PACKAGE = Path(specdec_cli.__file__).parent


def imports() -> dict[str, set[str]]:
    """Each specdec_cli module -> the specdec_cli modules it imports."""
    modules = {
        ".".join(f.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): f
        for f in PACKAGE.rglob("*.py")
    }
    graph = {}
    for name, file in modules.items():
        named = set()
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Import):
                named |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                named |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
        graph[name] = {m for m in named if m in modules and m != name}
    return graph


def test_no_import_circle():
    graph = imports()
    # the registry imports every format module, so a format module that needed it would close a circle
    assert {"specdec_cli.methods.dflash.checkpoint", "specdec_cli.methods.medusa.checkpoint"} <= graph[
        "specdec_cli.methods.formats"
    ]
    graphlib.TopologicalSorter(graph).prepare()  # CycleError names the circle


# the floors of the house, top to bottom: a module imports its own floor's modules and lower ones only
FLOORS = [
    ("command line", ["cli", "__main__", "options"]),
    ("commands", ["commands", "bench", "distill", "vllm_engine", "llamacpp_engine", "workers", "worker_protocol"]),
    ("assembly", ["pair"]),
    ("drafting methods", ["methods"]),
    ("loading", ["loading"]),
    ("config", ["config"]),
    ("core", ["decoding"]),
    ("shared", ["records", "display", "errors", "interrupts"]),
]


def floor(module: str) -> int:
    part = module.removeprefix("specdec_cli.").split(".")[0]
    return next(i for i, (_, parts) in enumerate(FLOORS) if part in parts)


def test_no_import_runs_back_up():
    graph = {m: deps for m, deps in imports().items() if m != "specdec_cli"}
    upward = [f"{m} -> {d}" for m, deps in graph.items() for d in deps if d != "specdec_cli" and floor(d) < floor(m)]
    assert upward == []


def test_the_core_and_the_methods_read_no_config():
    """Only the assembly (pair.py) and the commands turn a config into the core's types and a method's settings."""
    readers = [
        f"{m} -> {d}"
        for m, deps in imports().items()
        if m.startswith(("specdec_cli.decoding", "specdec_cli.methods"))
        for d in deps
        if d.startswith("specdec_cli.config")
    ]
    assert readers == []


def test_pyproject_lists_every_package():
    """pyproject.toml names the packages (configs/ installs as specdec_cli.configs): a package left out
    would be missing from the wheel."""
    text = (PACKAGE.parent / "pyproject.toml").read_text()
    listed = set(re.findall(r'^\s+"(specdec_cli[\w.]*)",$', text.split("packages = [")[1].split("]")[0], re.M))
    found = {".".join(init.parent.relative_to(PACKAGE.parent).parts) for init in PACKAGE.rglob("__init__.py")} | {
        "specdec_cli.configs"
    }
    assert listed == found
