"""The package's layout is its architecture: the import direction and module size are checked here.

Rules (docs and README "Layout"):
- Product code never imports bench/, testing/ or recipes/. The command modules (cli.py,
  commands/) are the composition root: they may import those lazily, inside a function, for the
  `bench` and `demo` commands, never at module level.
- The leaves know nothing of trainers, stores or receivers: core/ imports only core/; codec/
  and placement/ import only core/ and themselves.
- No product module is longer than about 500 lines unless its docstring says why
  ("Long because ...").
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "nemo_dcr_callback"
NAME = "nemo_dcr_callback"
NOT_PRODUCT = ("bench", "testing", "recipes")
ROOTS = ("cli", "commands")  # may import NOT_PRODUCT lazily
LEAVES = {"core": {"core"}, "codec": {"core", "codec"}, "placement": {"core", "placement"}}
MAX_LINES = 520


def modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        rel = p.relative_to(PKG).with_suffix("")
        parts = [x for x in rel.parts if x != "__init__"]
        out[".".join([NAME, *parts])] = p
    return out


def imports(source: str, module: str) -> list[tuple[str, bool]]:
    """(imported module, at module level?) for every import of this package in source."""
    tree = ast.parse(source)
    pkg_parts = module.split(".")
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((a.name, top) for a in child.names if a.name.startswith(NAME))
            elif isinstance(child, ast.ImportFrom):
                if child.level:  # relative: resolve against this module's package
                    base = ".".join(pkg_parts[: len(pkg_parts) - child.level])
                    mod = f"{base}.{child.module}" if child.module else base
                else:
                    mod = child.module or ""
                if mod == NAME:  # `from nemo_dcr_callback import codec`: the names are the modules
                    found.extend((f"{mod}.{a.name}", top) for a in child.names)
                elif mod.startswith(NAME + "."):
                    found.append((mod, top))
            visit(child, inner)

    visit(tree, True)
    return found


def area(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def violations(module: str, source: str) -> list[str]:
    out = []
    own = area(module)
    if own in NOT_PRODUCT:
        return out
    for target, top in imports(source, module):
        tarea = area(target)
        if tarea in NOT_PRODUCT and (own not in ROOTS or top):
            out.append(f"{module} imports {target}" + (" at module level" if top else ""))
        if own in LEAVES and tarea and tarea not in LEAVES[own]:
            out.append(f"leaf {module} imports {target}")
    return out


def test_import_direction():
    bad = []
    for mod, path in modules().items():
        bad += violations(mod, path.read_text())
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("module,source,expect", [
    ("nemo_dcr_callback.sender.publisher", "from nemo_dcr_callback.testing import synthetic", 1),
    ("nemo_dcr_callback.sender.publisher", "def f():\n    from nemo_dcr_callback.bench import relay", 1),
    ("nemo_dcr_callback.tools.planner", "from nemo_dcr_callback.bench.results import RESULTS", 1),
    ("nemo_dcr_callback.codec.encode", "from nemo_dcr_callback.sender.delta import take_delta", 1),
    ("nemo_dcr_callback.core.bitops", "from nemo_dcr_callback import codec", 1),
    ("nemo_dcr_callback.commands.bench", "def run(a):\n    from nemo_dcr_callback.bench import relay", 0),
    ("nemo_dcr_callback.commands.bench", "from nemo_dcr_callback.bench import relay", 1),
    ("nemo_dcr_callback.codec.encode", "from . import streams\nfrom ..core import kernels", 0),
    ("nemo_dcr_callback.codec.encode", "from ..sender import delta", 1),
    ("nemo_dcr_callback.bench.relay", "from nemo_dcr_callback.testing import synthetic", 0),
])
def test_the_checker_sees_violations(module, source, expect):
    assert len(violations(module, source)) == expect


def test_no_product_module_is_long_without_a_reason():
    long = []
    for mod, path in modules().items():
        if area(mod) in NOT_PRODUCT:
            continue
        text = path.read_text()
        n = text.count("\n")
        doc = ast.get_docstring(ast.parse(text)) or ""
        if n > MAX_LINES and "Long because" not in doc:
            long.append(f"{mod}: {n} lines")
    assert not long, "\n".join(long)
