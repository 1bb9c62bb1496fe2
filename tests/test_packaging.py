"""The wheel is the product: it carries the contract, the profiles and the type markers, and it
installs into a clean venv (no torch, no dev tools) where both console scripts start.

The wheel is built from a copy of the working tree (tracked files plus untracked, not-ignored ones),
because setuptools writes build/ and *.egg-info into the tree it builds and packs whatever stale files
build/lib holds; a copy builds like a fresh clone with the uncommitted work on top.
"""

from __future__ import annotations

import configparser
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Sequence
from pathlib import Path

import pytest

from tests.conftest import built_once

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[1]
IMPORT_PACKAGES = ("sidecar", "controller", "boxwarden_pb", "boxwarden_profiles")
SCRIPTS = {"boxwarden": "controller.__main__:main", "boxwarden-sidecar": "sidecar.__main__:main"}


def run(
    argv: Sequence[str | Path],
    *,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 600,
) -> subprocess.CompletedProcess[str]:
    argv_s = [str(a) for a in argv]
    proc = subprocess.run(
        argv_s, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )
    assert proc.returncode == 0, (
        f"{argv_s}: rc={proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    )
    return proc


def clean_env() -> dict[str, str]:
    """The caller's environment minus anything that would let the repo or the dev venv leak in."""
    drop = {"PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE", "VIRTUAL_ENV"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONNOUSERSITE"] = "1"
    return env


def copy_worktree(dst: Path) -> Path:
    listed = run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO).stdout
    for rel in filter(None, listed.split("\0")):
        src = REPO / rel
        if rel.split("/")[0].endswith(".egg-info") or not src.is_file():
            continue  # a build artifact, or deleted in the worktree
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst / rel)
    return dst


def project_version() -> str:
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert isinstance(version, str)
    return version


# The tree, the wheel and the venv are built once for the session (`built_once`): under xdist the
# tests of this module may run on several workers, which share them instead of building each their own.


@pytest.fixture(scope="module")
def src_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return built_once(tmp_path_factory, "pkg", lambda d: copy_worktree(d / "src")) / "src"


@pytest.fixture(scope="module")
def wheel(src_tree: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    def build(dist: Path) -> None:
        run([sys.executable, "-m", "build", "--wheel", "--outdir", dist, src_tree], cwd=src_tree.parent)

    (whl,) = built_once(tmp_path_factory, "pkg-dist", build).glob("*.whl")
    return whl


@pytest.fixture(scope="module")
def wheel_names(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as zf:
        return set(zf.namelist())


@pytest.fixture(scope="module")
def venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A clean venv (no system site-packages) with only the wheel and its declared dependencies."""

    def build(d: Path) -> None:
        venv = d / "v"
        env = clean_env()
        run([sys.executable, "-m", "venv", venv], env=env)
        run(
            [venv / "bin/python", "-m", "pip", "install", "-q", "--disable-pip-version-check", wheel], env=env
        )

    return built_once(tmp_path_factory, "pkg-venv", build) / "v"


def test_wheel_ships_contract_profiles_and_type_markers(wheel_names: set[str], src_tree: Path) -> None:
    required = {
        "boxwarden_pb/v1/sidecar.proto",
        "boxwarden_pb/v1/sidecar_pb2.py",
        "boxwarden_pb/v1/sidecar_pb2.pyi",
        "boxwarden_pb/v1/sidecar_pb2_grpc.py",
        "boxwarden_pb/py.typed",
        "sidecar/py.typed",
        "controller/py.typed",
        "boxwarden_profiles/README.md",
    }
    assert required <= wheel_names, sorted(required - wheel_names)

    profiles = {f"boxwarden_profiles/{p.name}" for p in (src_tree / "profiles").glob("*.toml")}
    assert profiles, "profiles/ has no *.toml to ship"
    assert {n for n in wheel_names if n.startswith("boxwarden_profiles/") and n.endswith(".toml")} == profiles

    top = {n.split("/")[0] for n in wheel_names if not n.split("/")[0].endswith(".dist-info")}
    assert top == set(IMPORT_PACKAGES), "nothing else (proto/, tests/, examples/) may land in site-packages"


def test_every_source_module_ships(wheel_names: set[str], src_tree: Path) -> None:
    """pyproject lists packages explicitly: a new subpackage missing from that list fails here."""
    roots = {"sidecar": src_tree / "sidecar", "controller": src_tree / "controller"}
    roots["boxwarden_pb"] = src_tree / "proto" / "boxwarden_pb"
    expected = set()
    for name, root in roots.items():
        for f in root.rglob("*"):
            if f.is_file() and f.suffix in {".py", ".pyi", ".proto"} and "__pycache__" not in f.parts:
                expected.add(f"{name}/{f.relative_to(root).as_posix()}")
    assert expected - wheel_names == set()


def test_wheel_metadata(wheel: Path, wheel_names: set[str]) -> None:
    version = project_version()
    assert wheel.name.startswith(f"boxwarden-{version}-py3-none-any")
    dist_info = f"boxwarden-{version}.dist-info"
    with zipfile.ZipFile(wheel) as zf:
        metadata = zf.read(f"{dist_info}/METADATA").decode()
        entry_points = configparser.ConfigParser()
        entry_points.read_string(zf.read(f"{dist_info}/entry_points.txt").decode())
    assert f"\nVersion: {version}\n" in metadata
    assert dict(entry_points["console_scripts"]) == SCRIPTS
    base = {
        re.split(r"[\s<>=!~;\[(]", line.removeprefix("Requires-Dist:").strip(), maxsplit=1)[0].lower()
        for line in metadata.splitlines()
        if line.startswith("Requires-Dist:") and "extra ==" not in line
    }
    assert base == {"grpcio", "protobuf", "blake3", "watchdog", "click", "rich"}, (
        "heavy deps belong in extras"
    )


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_console_script_help(venv: Path, script: str, tmp_path: Path) -> None:
    # cwd is an empty directory so nothing can be imported from the repo by accident.
    proc = run([venv / "bin" / script, "--help"], cwd=tmp_path, env=clean_env(), timeout=120)
    assert "usage:" in proc.stdout.lower(), proc.stdout


IMPORT_PROBE = """
import importlib, importlib.resources, importlib.util, json, sys
files = {m: importlib.import_module(m).__file__ for m in sys.argv[1:]}
profiles = [p.name for p in importlib.resources.files("boxwarden_profiles").iterdir()]
extras = [n for n in ("torch", "safetensors", "pynvml", "boto3") if importlib.util.find_spec(n)]
print(json.dumps({"files": files, "profiles": profiles, "extras": extras}))
"""


def test_installed_packages_import_from_the_venv(venv: Path, tmp_path: Path) -> None:
    modules = [*IMPORT_PACKAGES, "boxwarden_pb.v1.sidecar_pb2", "boxwarden_pb.v1.sidecar_pb2_grpc"]
    proc = run(
        [venv / "bin/python", "-c", IMPORT_PROBE, *modules], cwd=tmp_path, env=clean_env(), timeout=120
    )
    got = json.loads(proc.stdout)
    site = (venv / "lib").resolve()
    for mod, file in got["files"].items():
        assert Path(file).resolve().is_relative_to(site), f"{mod} imported from {file}, not the venv"
    assert any(name.endswith(".toml") for name in got["profiles"]), (
        "profiles unreadable via importlib.resources"
    )
    assert got["extras"] == [], "optional extras must not be pulled in by the base install"
    pip_check: list[str | Path] = [venv / "bin/python", "-m", "pip", "check", "--disable-pip-version-check"]
    run(pip_check, env=clean_env(), timeout=120)
