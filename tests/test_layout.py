"""The package's layout is its architecture: the import direction and module size are checked here.

Rules (docs/ARCHITECTURE.md):
- Product code never imports testing/ (the test harness), not even the commands.
- Product code never imports bench/ or recipes/. The command modules (cli.py, commands/) are
  the composition root: they may import those lazily, inside a function, for the `bench` and
  `demo` commands, never at module level.
- The leaves know nothing of trainers, stores or receivers: core/ imports only core/; codec/
  and placement/ import only core/ and themselves.
- Sender and receiver meet only in protocol/: sender/ imports nothing from receiver/, and
  receiver/ nothing from sender/.
- The import graph has no cycle, counting imports inside functions (not those under
  `if TYPE_CHECKING:`, which never run).
- An import inside a function says why on its line or the line above: an optional
  dependency (vllm, boto3, megatron, transformers, lightning, CUDA) or start-up cost.
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
ROOTS = ("cli", "commands")  # may import bench/ and recipes/ lazily
HARNESS = "testing"  # no product module imports it, the roots included
APART = {"sender": "receiver", "receiver": "sender"}  # they meet only in protocol/
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
        if tarea == HARNESS:
            out.append(f"{module} imports the test harness {target}")
        elif tarea in NOT_PRODUCT and (own not in ROOTS or top):
            out.append(f"{module} imports {target}" + (" at module level" if top else ""))
        if APART.get(own) == tarea:
            out.append(f"{own}/ module {module} imports {target}: they meet only in protocol/")
        if own in LEAVES and tarea and tarea not in LEAVES[own]:
            out.append(f"leaf {module} imports {target}")
    return out


def test_import_direction():
    bad = []
    for mod, path in modules().items():
        bad += violations(mod, path.read_text())
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("module,source,expect", [
    ("nemo_dcr_callback.sender.publisher", "from nemo_dcr_callback.recipes import synthetic", 1),
    ("nemo_dcr_callback.sender.publisher", "def f():\n    from nemo_dcr_callback.bench import relay", 1),
    ("nemo_dcr_callback.tools.planner", "from nemo_dcr_callback.bench.results import RESULTS", 1),
    ("nemo_dcr_callback.codec.encode", "from nemo_dcr_callback.sender.shard import Encoder", 1),
    ("nemo_dcr_callback.core.bitops", "from nemo_dcr_callback import codec", 1),
    ("nemo_dcr_callback.commands.bench", "def run(a):\n    from nemo_dcr_callback.bench import relay", 0),
    ("nemo_dcr_callback.commands.bench", "from nemo_dcr_callback.bench import relay", 1),
    ("nemo_dcr_callback.codec.encode", "from . import streams\nfrom ..core import kernels", 0),
    ("nemo_dcr_callback.codec.encode", "from ..sender import delta", 1),
    ("nemo_dcr_callback.bench.relay", "from nemo_dcr_callback.recipes import synthetic", 0),
    ("nemo_dcr_callback.commands.bench", "def run(a):\n    from nemo_dcr_callback.testing import tensor_sender", 1),
    ("nemo_dcr_callback.sender.callback", "def f():\n    from nemo_dcr_callback.receiver import Follower", 1),
    ("nemo_dcr_callback.receiver.follow", "from nemo_dcr_callback.sender.shard import Encoder", 1),
    ("nemo_dcr_callback.sender.callback", "from nemo_dcr_callback.protocol.rebuild import Replica", 0),
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


# ------------------------------------------------------------------ the import graph
def resolve(target: str, mods: dict[str, Path]) -> str | None:
    """The module an import runs: `from pkg import sub` names the submodule where there is
    one; an imported name is resolved to the module that defines it (its longest existing prefix)."""
    while target and target not in mods:
        target = target.rpartition(".")[0]
    return target or None


def graph_imports(source: str, module: str, mods: dict[str, Path]) -> set[str]:
    """Every module of this package that `module` imports, at any depth, except under
    `if TYPE_CHECKING:`. `from a.b import c` counts a.b.c if that is a module, else a.b."""
    tree = ast.parse(source)
    pkg = module.split(".") if mods.get(module, Path()).name == "__init__.py" else module.split(".")[:-1]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for x in child.orelse:
                    visit(x)
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names if a.name.startswith(NAME))
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = ".".join(pkg[: len(pkg) - child.level + 1])
                    mod = f"{base}.{child.module}" if child.module else base
                else:
                    mod = child.module or ""
                if mod == NAME or mod.startswith(NAME + "."):
                    for a in child.names:
                        found.add(f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod)
            visit(child)

    visit(tree)
    return {r for r in (resolve(t, mods) for t in found) if r and r != module}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a path (first node repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def dfs(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in sorted(edges.get(v, ())):
            if state.get(w) == 1:
                return path[path.index(w):] + [w]
            if w not in state and (c := dfs(w)):
                return c
        path.pop()
        state[v] = 2
        return None

    for v in sorted(edges):
        if v not in state and (c := dfs(v)):
            return c
    return None


def package_graph() -> dict[str, set[str]]:
    mods = modules()
    return {m: graph_imports(p.read_text(), m, mods) for m, p in mods.items()}


def test_the_import_graph_has_no_cycle():
    cycle = find_cycle(package_graph())
    assert cycle is None, "import cycle: " + " -> ".join(c.removeprefix(NAME + ".") for c in cycle)


def test_the_cycle_finder_names_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    mods = {f"{NAME}.codec": Path("__init__.py"), f"{NAME}.codec.digest": Path("digest.py"),
            f"{NAME}.codec.format": Path("format.py")}
    # a submodule named in a from-import is an edge to it; a name is an edge to its module
    assert graph_imports("from nemo_dcr_callback.codec import digest", f"{NAME}.codec.format", mods) \
        == {f"{NAME}.codec.digest"}
    assert graph_imports("from . import digest\nfrom .format import X", f"{NAME}.codec", mods) \
        == {f"{NAME}.codec.digest", f"{NAME}.codec.format"}
    src = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from nemo_dcr_callback.codec import digest"
    assert graph_imports(src, f"{NAME}.codec.format", mods) == set()


def test_sender_and_receiver_meet_only_in_protocol():
    graph = package_graph()
    bad = [f"{m} -> {t}" for m, ts in graph.items() for t in ts if APART.get(area(m)) == area(t)]
    assert not bad, "\n".join(bad)


def _reasonless_inner_imports(source: str) -> list[int]:
    """Line numbers of imports inside functions with no comment on their line, on the line
    above, or on a line of the run of imports they belong to."""
    tree = ast.parse(source)
    lines = source.splitlines()
    out: list[int] = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            for body in (getattr(node, f, None) for f in ("body", "orelse", "finalbody")):
                if not isinstance(body, list):
                    continue
                i = 0
                while i < len(body):
                    if not isinstance(body[i], (ast.Import, ast.ImportFrom)):
                        i += 1
                        continue
                    j = i
                    while j + 1 < len(body) and isinstance(body[j + 1], (ast.Import, ast.ImportFrom)):
                        j += 1
                    first, last = body[i].lineno, body[j].end_lineno
                    if not any("#" in t for t in lines[max(first - 2, 0):last]):
                        out.append(first)
                    i = j + 1
    return out


def test_an_import_inside_a_function_says_why():
    bad = []
    for mod, path in modules().items():
        if area(mod) in NOT_PRODUCT:
            continue
        bad += [f"{path.relative_to(PKG.parent)}:{n}" for n in _reasonless_inner_imports(path.read_text())]
    assert not bad, f"{len(bad)} imports inside functions without a reason:\n" + "\n".join(bad)


def test_the_reason_check_sees_a_missing_reason():
    assert _reasonless_inner_imports("def f():\n    import json\n") == [2]
    assert _reasonless_inner_imports("def f():\n    import vllm  # optional\n") == []
    assert _reasonless_inner_imports("def f():\n    # boto3 is optional\n    import boto3\n    import x\n") == []


# The layers of docs/ARCHITECTURE.md, lowest first: a module imports only its own layer and the
# layers below (same-layer imports are checked by the other rules: leaves, sender and receiver
# apart, no cycle). The package root (its version, the lazy DCRCallback) and bench/ and
# testing/ (outside the product) are not layered.
LAYERS = {"launcher": 0, "core": 0, "safe_io": 0, "bounded": 0, "codec": 1, "placement": 1, "config": 2,
          "protocol": 3, "faults": 3, "transport": 4, "sender": 5, "receiver": 5, "tools": 6, "integrations": 6,
          "recipes": 7, "cli": 7, "commands": 7}


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for m, targets in graph.items():
        src = area(m)
        if src not in LAYERS:
            continue
        for t in targets:
            dst = area(t)
            if dst in LAYERS and LAYERS[dst] > LAYERS[src] and not (src in ROOTS and dst in NOT_PRODUCT):
                out.append(f"{m} (layer {LAYERS[src]}) imports {t} (layer {LAYERS[dst]})")
    return out


def test_imports_go_down_the_layers_of_the_architecture_page():
    mods = modules()
    assert {area(m) for m in mods} - {""} - set(NOT_PRODUCT) <= set(LAYERS), "a folder missing from LAYERS"
    bad = layer_violations(package_graph())
    assert not bad, "\n".join(bad)


def test_the_layer_check_sees_an_upward_import():
    assert layer_violations({f"{NAME}.protocol.commit": {f"{NAME}.transport.store"}}) != []
    assert layer_violations({f"{NAME}.transport.store": {f"{NAME}.protocol.keys"}}) == []


def test_no_cpu_kernel_source_is_long():
    """The CPU kernels are one translation unit laid out by stage (cuda_ext/cpu/parts/, included
    in order by dcr_cpu.cpp), under the same size rule as the Python modules."""
    cpu = PKG.parent / "cuda_ext" / "cpu"
    files = [cpu / "dcr_cpu.cpp", *sorted((cpu / "parts").glob("*.h"))]
    included = (cpu / "dcr_cpu.cpp").read_text()
    assert all(f'#include "parts/{p.name}"' in included for p in files[1:]), "a part dcr_cpu.cpp does not include"
    long = [f"{p.relative_to(cpu)}: {n} lines" for p in files if (n := p.read_text().count("\n")) > MAX_LINES]
    assert len(files) > 2 and not long, "\n".join(long)
