"""The two halves stay apart and stay light.

`sidecar` and `controller` never import each other (the only shared import is `boxwarden_pb`), every
module of both imports with torch, pynvml, safetensors and boto3 absent, and both report the
distribution's version.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import controller
import sidecar

REPO = Path(__file__).resolve().parents[1]
OTHER = {"sidecar": "controller", "controller": "sidecar"}
OPTIONAL_NATIVE = ("torch", "pynvml", "safetensors", "boto3", "prometheus_client")


def pyproject() -> dict[str, Any]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def entry_point_modules() -> list[str]:
    """Modules named by [project.scripts], e.g. `sidecar.__main__` for `sidecar.__main__:main`."""
    return sorted({target.split(":")[0] for target in pyproject()["project"]["scripts"].values()})


def imported_modules(path: Path, package: tuple[str, ...]) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) for every import statement in `path`, relative ones resolved.

    `package` is the package the module lives in; an import that climbs above the top-level package is
    reported as "<beyond top-level>", which no module may do either.
    """
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                base = (node.module or "").split(".")
            elif node.level - 1 >= len(package):
                yield node.lineno, "<beyond top-level>"
                continue
            else:
                base = [
                    *package[: len(package) - (node.level - 1)],
                    *filter(None, (node.module or "").split(".")),
                ]
            yield node.lineno, ".".join(base)
            # `from pkg import mod` imports pkg.mod when mod is a submodule.
            for alias in node.names:
                yield node.lineno, ".".join([*base, alias.name])


def python_files(pkg: str) -> list[tuple[Path, tuple[str, ...]]]:
    root = REPO / pkg
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(REPO).with_suffix("").parts
        package = rel if path.name == "__init__.py" else rel[:-1]
        files.append((path, tuple(p for p in package if p != "__init__")))
    return files


@pytest.mark.parametrize("pkg", sorted(OTHER))
def test_no_import_crosses_the_boundary(pkg: str) -> None:
    files = python_files(pkg)
    assert len(files) >= 2, f"found almost nothing under {pkg}/: is the test looking in the right place?"
    forbidden = OTHER[pkg]
    offenders = [
        f"{path.relative_to(REPO)}:{line}: imports {name}"
        for path, package in files
        for line, name in imported_modules(path, package)
        if name == "<beyond top-level>" or name.split(".")[0] == forbidden
    ]
    assert offenders == []


def test_boundary_checker_sees_every_import_form(tmp_path: Path) -> None:
    sample = tmp_path / "sidecar" / "storage" / "x.py"
    sample.parent.mkdir(parents=True)
    sample.write_text(
        "import controller\n"
        "import os, controller.gate as g\n"
        "from controller import gate\n"
        "from controller.cli import main\n"
        "from .. import y\n"
        "from ... import controller\n"
        "def f():\n    import controller.render\n"
    )
    names = [name for _, name in imported_modules(sample, ("sidecar", "storage"))]
    assert [n for n in names if n.startswith("controller")] == [
        "controller",
        "controller.gate",
        "controller",
        "controller.gate",
        "controller.cli",
        "controller.cli.main",
        "controller.render",
    ]
    assert "sidecar.y" in names
    assert "<beyond top-level>" in names


IMPORT_ALL = """
import importlib, importlib.abc, json, pkgutil, sys

BLOCKED = set(sys.argv[2].split(","))


class Absent(importlib.abc.MetaPathFinder):
    # Acts as if these distributions were not installed at all.
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by test)", name=name)
        return None


sys.meta_path.insert(0, Absent())
preloaded = sorted(m for m in sys.modules if m.partition(".")[0] in BLOCKED)

pkg_name = sys.argv[1]
entry_modules = [m for m in sys.argv[4].split(",") if m]
failed = {}
pkg = importlib.import_module(pkg_name)
names = [pkg_name]


def onerror(name):
    failed[name] = repr(sys.exc_info()[1])


# A `__main__` module may run its program on import (that is its job), so only the ones named as
# console-script targets are imported; they must not run anything at import time.
walked = [i.name for i in pkgutil.walk_packages(pkg.__path__, pkg_name + ".", onerror=onerror)]
for name in [n for n in walked if not n.endswith(".__main__")] + entry_modules:
    names.append(name)
    try:
        importlib.import_module(name)
    except BaseException as exc:
        failed[name] = repr(exc)

print(json.dumps({
    "preloaded": preloaded,
    "imported": names,
    "failed": failed,
    "loaded": sorted(m for m in sys.modules if m.partition(".")[0] in BLOCKED | {sys.argv[3]}),
}))
"""


def import_all(pkg: str, other: str, entry: list[str], path: list[Path]) -> dict[str, Any]:
    """Run IMPORT_ALL in a fresh interpreter whose sys.path starts with `path`."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join(map(str, path))
    proc = subprocess.run(
        [sys.executable, "-c", IMPORT_ALL, pkg, ",".join(OPTIONAL_NATIVE), other, ",".join(entry)],
        cwd=path[0],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert isinstance(got, dict)
    assert got["preloaded"] == [], "a blocked module was imported before the blocker was installed"
    return got


@pytest.mark.parametrize("pkg", sorted(OTHER))
def test_every_module_imports_without_optional_natives(pkg: str) -> None:
    entry = [m for m in entry_point_modules() if m.split(".")[0] == pkg]
    got = import_all(pkg, OTHER[pkg], entry, [REPO, REPO / "proto"])
    assert len(got["imported"]) >= 2, got["imported"]
    assert set(entry) <= set(got["imported"])
    assert got["failed"] == {}
    assert got["loaded"] == [], f"importing all of {pkg} pulled these in"


def test_import_harness_catches_offenders(tmp_path: Path) -> None:
    files = {
        "fakepkg/__init__.py": "",
        "fakepkg/eager.py": "import torch\n",
        "fakepkg/sub/__init__.py": "import pynvml.smi\n",
        "fakepkg/lazy.py": "def f():\n    import torch\n",
        "fakepkg/crosses.py": "import fakeother\n",
        "fakepkg/__main__.py": "raise SystemExit(3)\n",
        "fakepkg/cli.py": "raise SystemExit(4)\n",
        "fakeother/__init__.py": "",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    got = import_all("fakepkg", "fakeother", ["fakepkg.__main__"], [tmp_path])
    assert "blocked by test" in got["failed"].pop("fakepkg.eager")
    assert "blocked by test" in got["failed"].pop("fakepkg.sub")
    assert got["failed"] == {"fakepkg.cli": "SystemExit(4)", "fakepkg.__main__": "SystemExit(3)"}
    assert "fakepkg.lazy" in got["imported"]
    assert got["loaded"] == ["fakeother"]


def test_versions_agree_with_pyproject() -> None:
    version = pyproject()["project"]["version"]
    assert sidecar.__version__ == controller.__version__ == version
