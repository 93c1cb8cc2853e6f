"""Rules about the source itself, checked on its syntax tree: nothing an ``assert`` does may matter.

``python -O`` (or ``PYTHONOPTIMIZE=1``, common in production images) strips every ``assert``, so
a call inside one that allocates, frees or records anything would silently not happen there.
Calls in an ``assert`` are allowed only to functions known to be pure queries.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "pagellm"

# Builtins and methods that only read. Anything else called inside an assert fails the test.
PURE_CALLS = {
    "len", "isinstance", "issubclass", "set", "frozenset", "sorted", "any", "all", "min", "max", "sum",
    "tuple", "list", "dict", "abs", "callable", "hasattr", "getattr", "id", "type", "repr", "str",
    "get", "keys", "values", "items", "is_contiguous", "dim", "size", "stride",
}


def _called_name(call: ast.Call) -> str:
    f = call.func
    if isinstance(f, ast.Attribute):
        return f.attr
    if isinstance(f, ast.Name):
        return f.id
    return ast.unparse(f)


def side_effect_calls(source: str) -> list[tuple[int, str]]:
    """``(line, call)`` for every call inside an ``assert`` that is not a known pure query."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assert):
            bad = [sub for sub in ast.walk(node) if isinstance(sub, ast.NamedExpr)
                   or (isinstance(sub, ast.Call) and _called_name(sub) not in PURE_CALLS)]
            if bad:
                found.append((node.lineno, ast.unparse(bad[0])))
    return found


def test_the_rule_catches_what_it_is_for():
    # The defect this rule exists for (issue 18): blocks allocated inside an assert.
    bad = "def f(kv, seq):\n    assert kv.allocate_slots(seq, 4) is not None\n    assert (n := kv.take()) > 0\n"
    assert [line for line, _ in side_effect_calls(bad)] == [2, 3]
    assert side_effect_calls("def f(x, d):\n    assert len(x) == d.get(1), f'{x!r}'\n") == []


def test_no_assert_in_the_package_calls_anything_with_effects():
    bad = [f"{path.relative_to(PKG.parent)}:{line}: {call}"
           for path in sorted(PKG.rglob("*.py")) for line, call in side_effect_calls(path.read_text())]
    assert not bad, "calls inside asserts vanish under python -O; call first, then check:\n" + "\n".join(bad)


MAX_FUNCTION_LINES = 70


def test_no_function_is_longer_than_70_lines():
    """A function that does not fit on a screen does several things: split it (nested route
    handlers count towards the function that defines them)."""
    long = []
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(PKG.parent)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, long


MAX_MODULE_LINES = 600


def test_no_module_is_longer_than_600_lines():
    """A module past a few hundred lines holds several concepts: split it by concept (C kernels aside)."""
    long = [f"{path.relative_to(PKG.parent)} ({n} lines)" for path in PKG.rglob("*.py")
            if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES]
    assert not long, long
