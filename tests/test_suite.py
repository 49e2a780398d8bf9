"""The test suite's own layout (README.md, "Layout"): every folder under tests/ is a package, so
test files of the same name in different folders do not collide; no test file imports another
test file or a conftest.py (what tests share lives in tests/helpers/); no file is long."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
MAX_LINES = 500


def _sources() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_folder_with_python_files_is_a_package():
    folders = {p.parent for p in _sources()}
    assert sorted(str(d.relative_to(TESTS.parent)) for d in folders if not (d / "__init__.py").is_file()) == []


def test_no_test_file_imports_another_test_file_or_a_conftest():
    bad = []
    for p in _sources():
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module or ''}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            if any(part.startswith("test_") or part == "conftest" for n in names for part in n.split(".")):
                bad.append(f"{p.relative_to(TESTS.parent)}:{node.lineno}")
    assert bad == []


def test_no_file_is_long():
    lines = {str(p.relative_to(TESTS.parent)): len(p.read_text().splitlines()) for p in _sources()}
    long = {name: n for name, n in lines.items() if n > MAX_LINES}
    assert long == {}, f"split by behaviour: {long}"
