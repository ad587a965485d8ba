"""Size limits of the library's code (issue 41): no function over 60 lines and no class over 250 in
``concept/``. ``ALLOWED`` lists what is still over, each at most its size today; it may only shrink: an
entry that grows fails, and an entry no longer over its limit (or gone) fails until it is deleted here."""
from __future__ import annotations

import ast
from pathlib import Path

MAX_FUNCTION, MAX_CLASS = 60, 250
ROOT = Path(__file__).resolve().parents[1] / "concept"
# "path inside concept/::qualified name" -> its lines today (none left: it may only shrink, so it stays empty)
ALLOWED: dict[str, int] = {
}


def oversized(source: str, path: str = "") -> dict[str, int]:
    """``{"path::Qualified.name": lines}`` of every function over MAX_FUNCTION lines and class over MAX_CLASS
    in ``source`` (lines: from the ``def`` / ``class`` line to the last line of its body)."""
    found = {}

    def visit(node, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                lines = child.end_lineno - child.lineno + 1
                limit = MAX_CLASS if isinstance(child, ast.ClassDef) else MAX_FUNCTION
                if lines > limit:
                    found[f"{path}::{name}"] = lines
                visit(child, name + ".")
            elif isinstance(child, (ast.stmt, ast.excepthandler)):  # (a def is a statement: no expression holds one)
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def library_oversized() -> dict[str, int]:
    found = {}
    for file in sorted(ROOT.rglob("*.py")):
        found.update(oversized(file.read_text(encoding="utf-8"), file.relative_to(ROOT).as_posix()))
    return found


def test_no_function_over_60_lines_and_no_class_over_250_in_concept():
    found = library_oversized()
    new = {k: v for k, v in found.items() if k not in ALLOWED}
    grown = {k: (v, ALLOWED[k]) for k, v in found.items() if k in ALLOWED and v > ALLOWED[k]}
    stale = sorted(k for k in ALLOWED if k not in found)
    assert not new, (f"over the limits ({MAX_FUNCTION} lines a function, {MAX_CLASS} a class): {new}; split them "
                     f"into named parts")
    assert not grown, f"allowed but grown (lines now, allowed): {grown}; split them instead"
    assert not stale, f"no longer over the limits: {stale}; delete them from ALLOWED in tests/test_code_limits.py"


def test_the_measure_catches_a_long_function_a_long_method_and_a_long_class():
    body = "".join(f"    x{i} = {i}\n" for i in range(60))  # 60 lines of body: 61 with the def
    method = "".join(f"        y{i} = {i}\n" for i in range(59))  # 60 with the def: at the limit, allowed
    source = (f"def long():\n{body}\n\ndef short():\n    return 1\n\n"
              f"class Big:\n    def ok(self):\n{method}" + "".join(f"    z{i} = {i}\n" for i in range(129)) +
              "    def big(self):\n" + method + "        return 0\n")
    assert oversized(source, "m.py") == {"m.py::long": 61, "m.py::Big": 251, "m.py::Big.big": 61}
