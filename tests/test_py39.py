"""The sidecar runs on Python 3.9: no `X | Y` type union may be evaluated at run time there.

`make py39-check` runs vermin (newer stdlib names, keyword arguments and syntax) and mypy for 3.10
(newer methods of typed values); neither sees a union of types built at run time, e.g.
`isinstance(x, A | B)`, which 3.10 allows and 3.9 raises TypeError on. Annotations are exempt where
the module has `from __future__ import annotations` (they are never evaluated then).
"""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("sidecar", "proto/boxwarden_pb")


def _type_like(node: ast.expr) -> bool:
    """None, a subscripted generic, a builtin type or a CapWords name (a class; O_RDONLY-style flags
    are not)."""
    if isinstance(node, ast.Constant):
        return node.value is None
    if isinstance(node, ast.Subscript):
        return True
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _type_like(node.left) or _type_like(node.right)
    name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""
    capwords = name[:1].isupper() and (len(name) == 1 or not name.isupper())
    return capwords or isinstance(getattr(builtins, name, None), type)


def _annotations(tree: ast.Module) -> set[int]:
    """ids of every node inside an annotation."""
    roots: list[ast.expr | None] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign | ast.arg):
            roots.append(node.annotation)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            roots.append(node.returns)
    return {id(n) for root in roots if root is not None for n in ast.walk(root)}


def runtime_unions(source: str) -> list[int]:
    """Lines of `X | Y` type unions that are evaluated when the code runs."""
    tree = ast.parse(source)
    lazy = any(
        isinstance(n, ast.ImportFrom)
        and n.module == "__future__"
        and any(a.name == "annotations" for a in n.names)
        for n in tree.body
    )
    skip = _annotations(tree) if lazy else set()
    return sorted(
        {
            node.lineno
            for node in ast.walk(tree)
            if isinstance(node, ast.BinOp)
            and isinstance(node.op, ast.BitOr)
            and id(node) not in skip
            and _type_like(node.left)
            and _type_like(node.right)
        }
    )


def test_the_check_finds_runtime_unions_and_only_those() -> None:
    source = (
        "from __future__ import annotations\n"
        "import os\n"
        "def f(x: int | None, y: list[str] | None = None) -> A | None:\n"  # 3: annotations
        "    z: B | None = None\n"  # 4: annotation
        "    flags = os.O_RDONLY | os.O_CLOEXEC | mask\n"  # 5: bit flags
        "    if isinstance(x, int | str):\n"  # 6: runtime
        "        return cast(Foo | None, x)\n"  # 7: runtime
        "Alias = dict[str, int] | None\n"  # 8: runtime
        "Deep = mod.Thing | None | Other\n"  # 9: runtime (one nested union)
    )
    assert runtime_unions(source) == [6, 7, 8, 9]
    assert runtime_unions(source.replace("from __future__ import annotations\n", "")) == [2, 3, 5, 6, 7, 8]


def test_no_union_of_types_is_evaluated_at_run_time() -> None:
    files = [p for root in ROOTS for p in sorted((REPO / root).rglob("*.py"))]
    assert len(files) > 20, "found almost nothing to look at: is the test looking in the right place?"
    found = [f"{p.relative_to(REPO)}:{line}" for p in files for line in runtime_unions(p.read_text())]
    assert not found, (
        f"`X | Y` evaluated at run time needs Python 3.10, and the sidecar runs on 3.9 (use a tuple "
        f"in isinstance, Optional/Union, or a string): {', '.join(found)}"
    )
