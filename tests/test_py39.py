"""The sidecar runs on Python 3.9: what vermin and mypy cannot see is checked here.

`make py39-check` runs vermin (newer stdlib names, keyword arguments and syntax) and mypy for 3.10
(newer methods of typed values). Neither sees a union of types built at run time, e.g.
`isinstance(x, A | B)`, which 3.10 allows and 3.9 raises TypeError on (annotations are exempt where
the module has `from __future__ import annotations`: they are never evaluated then); nor a builtin
`TimeoutError` caught around `asyncio.wait_for`, which raises asyncio's own before 3.11; nor
that the daemon switches gRPC's fork handlers off before grpc loads (sidecar.compat).
"""

from __future__ import annotations

import ast
import builtins
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("sidecar", "proto/boxwarden_pb")


def sidecar_files() -> list[Path]:
    files = [p for root in ROOTS for p in sorted((REPO / root).rglob("*.py"))]
    assert len(files) > 20, "found almost nothing to look at: is the test looking in the right place?"
    return files


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


def _names(node: ast.expr | None) -> list[str]:
    """The bare names an `except` clause or a suppress() call catches."""
    if isinstance(node, ast.Tuple):
        return [n for e in node.elts for n in _names(e)]
    return [node.id] if isinstance(node, ast.Name) else []


def _calls_wait_for(body: list[ast.stmt]) -> bool:
    calls = [n for stmt in body for n in ast.walk(stmt) if isinstance(n, ast.Call)]
    return any(ast.unparse(c.func).endswith("wait_for") for c in calls)


def builtin_timeouts(source: str) -> list[int]:
    """Lines that catch the builtin TimeoutError from code that calls asyncio.wait_for."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Try) and _calls_wait_for(node.body):
            found |= {h.lineno for h in node.handlers if "TimeoutError" in _names(h.type)}
        elif isinstance(node, ast.With | ast.AsyncWith) and _calls_wait_for(node.body):
            found |= {
                node.lineno
                for item in node.items
                if isinstance(call := item.context_expr, ast.Call)
                and ast.unparse(call.func).endswith("suppress")
                and any("TimeoutError" in _names(a) for a in call.args)
            }
    return sorted(found)


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
    found = [f"{p.relative_to(REPO)}:{n}" for p in sidecar_files() for n in runtime_unions(p.read_text())]
    assert not found, (
        f"`X | Y` evaluated at run time needs Python 3.10, and the sidecar runs on 3.9 (use a tuple "
        f"in isinstance, Optional/Union, or a string): {', '.join(found)}"
    )


def test_the_check_finds_builtin_timeouts_and_only_those() -> None:
    source = (
        "async def f(fut, other):\n"
        "    try:\n"
        "        await asyncio.wait_for(fut, 1)\n"
        "    except (OSError, TimeoutError):\n"  # 4
        "        pass\n"
        "    with contextlib.suppress(TimeoutError):\n"  # 6
        "        await asyncio.wait_for(fut, 1)\n"
        "    with contextlib.suppress(asyncio.TimeoutError):\n"
        "        await asyncio.wait_for(fut, 1)\n"
        "    try:\n"
        "        other.join(1)\n"
        "    except TimeoutError:\n"  # no wait_for: the builtin one is right
        "        pass\n"
    )
    assert builtin_timeouts(source) == [4, 6]


def test_no_builtin_timeout_is_caught_around_wait_for() -> None:
    found = [f"{p.relative_to(REPO)}:{n}" for p in sidecar_files() for n in builtin_timeouts(p.read_text())]
    assert not found, (
        f"asyncio.wait_for raises asyncio.TimeoutError, which is not the builtin TimeoutError before "
        f"Python 3.11, and the sidecar runs on 3.9: catch asyncio.TimeoutError at {', '.join(found)}"
    )


def test_the_daemon_loads_grpc_only_after_switching_its_fork_handlers_off() -> None:
    """`sidecar.__main__` imports nothing that loads grpc: main() switches the handlers off first."""
    code = "import sys, sidecar.__main__; print(sorted(m for m in sys.modules if m.split('.')[0] == 'grpc'))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "proto")])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
