"""specdec's modules import one another without a circle: every import, at the top, inside a
function or only for type checking, read from the source. A format module (models/eagle.py,
dflash.py, ...) needs nothing from the registry that lists it (models/formats.py)."""

from __future__ import annotations

import ast
import graphlib
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
    assert {"specdec_cli.models.dflash", "specdec_cli.models.medusa"} <= graph["specdec_cli.models.formats"]
    graphlib.TopologicalSorter(graph).prepare()  # CycleError names the circle
