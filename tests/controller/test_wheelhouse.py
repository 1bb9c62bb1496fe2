"""The wheelhouse: a box installs the sidecar from it with no package index.

Pure tests pin the platform rules. The sidecar wheel is checked entry by entry. A real wheelhouse for
this machine (downloaded once with pip from this machine's index, shared by the module and, under
xdist, by the workers) installs into fresh venvs, with their own pip and with the wheelhouse's pip;
a cached one is reused, and one for changed sidecar sources is made, with the network cut off. The
closure resolves to binary wheels for the oldest and newest supported Python on both machines.
"""

from __future__ import annotations

import configparser
import csv
import dataclasses
import hashlib
import io
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import zipfile
from base64 import urlsafe_b64encode
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from email.parser import HeaderParser
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename

from controller import __version__
from controller.errors import ControllerError
from controller.wheelhouse import (
    BOX_NEEDS,
    EXTRAS,
    PROBE_SCRIPT,
    SIDECAR_REQUIREMENTS,
    BoxPlatform,
    Wheelhouse,
    build,
    cache_key,
    default_cache_root,
    pin,
    pip_platforms,
    resolve,
    sidecar_wheel,
)
from tests.conftest import exclusive, session_dir

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(sys.platform != "linux", reason="boxes are Linux; the install test needs one"),
]

REPO = Path(__file__).resolve().parents[2]
DEAD_INDEX = "http://127.0.0.1:9/simple"  # nothing listens on the discard port: any use of it fails
GOOD_PROBE = {
    "implementation": "cpython",
    "python": "3.10.12",
    "machine": "x86_64",
    "libc": "glibc 2.35",
    "gil_disabled": False,
}
WANTED = {canonicalize_name(Requirement(r).name) for r in SIDECAR_REQUIREMENTS} | {"pip"}
S3_WANTED = WANTED | {canonicalize_name(Requirement(r).name) for r in EXTRAS["s3"]}


def clean_env() -> dict[str, str]:
    """This environment without pip's configuration, PYTHONPATH or an active venv."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    for name in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"):
        env.pop(name, None)
    env["PIP_CONFIG_FILE"] = os.devnull
    return env


def run(argv: Sequence[str | Path], cwd: Path) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [str(a) for a in argv], cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, f"{argv} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


# --- the platform rules --------------------------------------------------------------------------


def test_pip_platforms_are_every_manylinux_the_box_runs_newest_first() -> None:
    tags = pip_platforms(BoxPlatform("3.10", "x86_64", "2.35"))
    assert tags[0] == "manylinux_2_35_x86_64"
    assert tags[-2:] == ["manylinux_2_17_x86_64", "manylinux2014_x86_64"]
    assert tags[:-1] == [f"manylinux_2_{m}_x86_64" for m in range(35, 16, -1)]
    assert pip_platforms(BoxPlatform("3.9", "aarch64", "2.17")) == [
        "manylinux_2_17_aarch64",
        "manylinux2014_aarch64",
    ]


def test_cache_keys_are_single_names_that_tell_platforms_and_versions_apart() -> None:
    grid = [
        (BoxPlatform(py, machine, glibc), version)
        for py in ("3.9", "3.13")
        for machine in ("x86_64", "aarch64")
        for glibc in ("2.17", "2.35")
        for version in ("0.1.0-aaaa", "0.1.0-bbbb")
    ]
    keys = [cache_key(p, v) for p, v in grid]
    assert len(set(keys)) == len(grid)
    assert keys == [cache_key(p, v) for p, v in grid]
    assert all("/" not in k and not k.startswith(".") for k in keys)
    with pytest.raises(ValueError):
        cache_key(grid[0][0], "../escape")


def test_a_probe_of_a_supported_box_is_accepted_and_normalized() -> None:
    assert BoxPlatform.from_probe(GOOD_PROBE) == BoxPlatform("3.10", "x86_64", "2.35")
    assert BoxPlatform.from_probe({**GOOD_PROBE, "machine": "arm64"}).machine == "aarch64"
    assert BoxPlatform.from_probe({**GOOD_PROBE, "machine": "AMD64"}).machine == "x86_64"
    assert str(BoxPlatform("3.13", "aarch64", "2.17")) == "CPython 3.13 on Linux aarch64 with glibc 2.17"


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"python": "3.8.10"}, "Python is 3.8"),
        ({"python": "3.14.0"}, "Python is 3.14"),
        ({"python": "2.7"}, "Python is 2.7"),
        ({"implementation": "pypy"}, "pypy, not CPython"),
        ({"gil_disabled": True}, "free-threaded"),
        ({"libc": ""}, "musl"),
        ({"libc": "uclibc 1.0"}, "uclibc 1.0"),
        ({"libc": "glibc 2.12"}, "glibc 2.12"),
        ({"machine": "armv7l"}, "armv7l machine"),
        ({"machine": "ppc64le"}, "ppc64le machine"),
    ],
)
def test_an_unsupported_box_is_refused_saying_what_it_needs(change: dict[str, object], said: str) -> None:
    with pytest.raises(ControllerError) as e:
        BoxPlatform.from_probe({**GOOD_PROBE, **change})
    assert said in str(e.value)
    assert BOX_NEEDS in str(e.value)


@pytest.mark.parametrize(
    "fields", [("3.11.2", "x86_64", "2.35"), ("3.11", "i686", "2.35"), ("3.9", "x86_64", "2.5")]
)
def test_an_unsupported_platform_cannot_be_made(fields: tuple[str, str, str]) -> None:
    with pytest.raises(ControllerError, match="the sidecar needs"):
        BoxPlatform(*fields)


def test_the_probe_describes_this_machine() -> None:
    out = run([sys.executable, "-c", PROBE_SCRIPT], cwd=REPO).stdout
    got = BoxPlatform.from_probe(json.loads(out))
    assert got.python == f"{sys.version_info.major}.{sys.version_info.minor}"
    assert got.machine == platform.machine()
    assert got.glibc == platform.libc_ver()[1]


def test_the_cache_root_follows_the_environment(tmp_path: Path) -> None:
    assert default_cache_root({"BOXWARDEN_WHEELHOUSE": str(tmp_path / "w")}) == tmp_path / "w"
    assert default_cache_root({"BOXWARDEN_HOME": str(tmp_path)}) == tmp_path / "wheelhouse"
    assert default_cache_root({"HOME": str(tmp_path)}) == tmp_path / ".local/state/boxwarden/wheelhouse"


# --- the sidecar wheel ---------------------------------------------------------------------------


def source_files() -> dict[str, bytes]:
    """What the sidecar wheel must carry: the .py files and py.typed of its packages, by archive name."""
    roots = {"sidecar": REPO / "sidecar", "boxwarden_pb": REPO / "proto" / "boxwarden_pb"}
    return {
        f"{package}/{path.relative_to(root).as_posix()}": path.read_bytes()
        for package, root in roots.items()
        for path in root.rglob("*")
        if (path.suffix == ".py" or path.name == "py.typed") and "__pycache__" not in path.parts
    }


def test_the_sidecar_wheel_is_deterministic(tmp_path: Path) -> None:
    first = sidecar_wheel(tmp_path / "a")
    second = sidecar_wheel(tmp_path / "b")
    assert first.name == second.name == f"boxwarden_sidecar-{__version__}-py3-none-any.whl"
    assert first.read_bytes() == second.read_bytes()
    assert sidecar_wheel(tmp_path / "a").read_bytes() == second.read_bytes()
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [first.name]


def test_the_sidecar_wheel_carries_the_sources_and_correct_metadata(tmp_path: Path) -> None:
    with zipfile.ZipFile(sidecar_wheel(tmp_path)) as zf:
        entries = {info.filename: zf.read(info) for info in zf.infolist()}
        assert {info.date_time for info in zf.infolist()} == {(1980, 1, 1, 0, 0, 0)}
    names = list(entries)
    info = f"boxwarden_sidecar-{__version__}.dist-info"
    sources = source_files()
    must = {"sidecar/storage/__init__.py", "boxwarden_pb/v1/sidecar_pb2.py", "sidecar/py.typed"}
    assert set(sources) >= must
    assert names[: len(sources)] == sorted(sources)
    assert {n: entries[n] for n in sources} == sources
    dist_info = [f"{info}/{n}" for n in ("METADATA", "WHEEL", "entry_points.txt", "RECORD")]
    assert names[len(sources) :] == dist_info

    metadata = HeaderParser().parsestr(entries[f"{info}/METADATA"].decode())
    assert metadata["Metadata-Version"] == "2.1"
    assert metadata["Name"] == "boxwarden-sidecar"
    assert metadata["Version"] == __version__
    assert metadata["Requires-Python"] == ">=3.9"
    extra = [f'{r}; extra == "{e}"' for e in sorted(EXTRAS) for r in EXTRAS[e]]
    assert metadata.get_all("Requires-Dist") == [*SIDECAR_REQUIREMENTS, *extra]
    assert metadata.get_all("Provides-Extra") == sorted(EXTRAS) == ["metrics", "s3"]
    wheel = HeaderParser().parsestr(entries[f"{info}/WHEEL"].decode())
    assert (wheel["Root-Is-Purelib"], wheel["Tag"]) == ("true", "py3-none-any")
    scripts = configparser.ConfigParser()
    scripts.read_string(entries[f"{info}/entry_points.txt"].decode())
    assert dict(scripts["console_scripts"]) == {"boxwarden-sidecar": "sidecar.__main__:main"}

    record = list(csv.reader(io.StringIO(entries[f"{info}/RECORD"].decode())))
    assert [row[0] for row in record] == names
    assert record[-1] == [f"{info}/RECORD", "", ""]
    for path, digest, size in record[:-1]:
        expected = urlsafe_b64encode(hashlib.sha256(entries[path]).digest()).rstrip(b"=").decode()
        assert (digest, int(size)) == (f"sha256={expected}", len(entries[path])), path


# --- a real wheelhouse for this machine ----------------------------------------------------------


@pytest.fixture(scope="module")
def local() -> BoxPlatform:
    return BoxPlatform.from_probe(json.loads(run([sys.executable, "-c", PROBE_SCRIPT], cwd=REPO).stdout))


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's one wheelhouse cache, shared by every xdist worker and by the remote tests
    (tests/test_remote_e2e.py), whose boxes run this machine's python3."""
    return session_dir(tmp_path_factory, "wheelhouse")


@pytest.fixture(scope="module")
def house(local: BoxPlatform, cache_root: Path) -> Wheelhouse:
    # Built by one worker while the others wait (build() would be right without the lock too: each
    # concurrent builder gets a complete one; the lock only saves downloading it twice).
    with exclusive(cache_root.parent / "wheelhouse.lock"):
        return build(local, cache_root)


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """pip without this machine's configuration (its find-links and extra indexes), failing fast."""
    for name in [n for n in os.environ if n.startswith("PIP_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "3")
    yield


def test_the_wheelhouse_holds_the_sidecar_its_closure_and_pip(
    house: Wheelhouse, local: BoxPlatform, cache_root: Path, tmp_path: Path
) -> None:
    assert house.dir.parent == cache_root
    assert house.dir.name.startswith(cache_key(local, __version__))
    assert house.wheels == tuple(sorted(p.name for p in house.dir.iterdir()))
    assert house.pip_wheel.startswith("pip-") and house.pip_wheel in house.wheels
    assert (house.dir / house.sidecar_wheel).read_bytes() == sidecar_wheel(tmp_path).read_bytes()
    assert {canonicalize_name(parse_wheel_filename(w)[0]) for w in house.wheels} >= WANTED
    assert house.dir.stat().st_mode & 0o055 == 0o055, "the box's other users could not read it"
    assert not list(cache_root.glob(f".tmp-{os.getpid()}-*")), "this build left its scratch directory"


def test_a_cached_wheelhouse_is_reused_without_the_network(
    house: Wheelhouse, local: BoxPlatform, cache_root: Path, offline: None
) -> None:
    started = time.monotonic()
    again = build(local, cache_root, index_url=DEAD_INDEX)
    assert again == house
    assert time.monotonic() - started < 5


def test_changed_sidecar_sources_get_a_fresh_wheelhouse_without_the_network(
    house: Wheelhouse, local: BoxPlatform, tmp_path: Path, offline: None
) -> None:
    stale = tmp_path / cache_key(local, "0.0.9-0123456789abcdef")
    shutil.copytree(house.dir, stale)
    (stale / house.sidecar_wheel).unlink()
    (stale / "boxwarden_sidecar-0.0.9-py3-none-any.whl").write_bytes(b"stale sidecar")
    fresh = build(local, tmp_path, index_url=DEAD_INDEX)
    assert fresh.dir != stale
    assert "boxwarden_sidecar-0.0.9-py3-none-any.whl" not in fresh.wheels
    assert (fresh.wheels, fresh.digest) == (house.wheels, house.digest)


def test_a_failed_download_is_one_error_naming_the_platform_and_the_fix(
    local: BoxPlatform, tmp_path: Path, offline: None
) -> None:
    with pytest.raises(ControllerError) as e:
        build(local, tmp_path, index_url="http://builder:s3cret@127.0.0.1:9/simple")
    message = str(e.value)
    assert str(local) in message
    assert "check this machine's connection to PyPI, or pass --box-index URL" in message
    assert "No matching distribution" in message or "ERROR" in message, "pip's own words are missing"
    assert "s3cret" not in message
    assert list(tmp_path.iterdir()) == [], "a failed build left something in the cache"


# Installing a wheelhouse on a box (a venv without pip, pip run from its wheel) is tested end to end
# over a real sshd in tests/test_remote_e2e.py, and by hash in tests/test_box_trust_e2e.py.


def test_a_box_installs_the_closure_pinned_to_the_digests_computed_here(
    house: Wheelhouse, local: BoxPlatform, offline: None
) -> None:
    pinned = pin(house, local, ())
    assert pinned.files == {w: hashlib.sha256((house.dir / w).read_bytes()).hexdigest() for w in house.wheels}
    lines = pinned.requirements.splitlines()
    assert len(lines) == len(house.wheels) - 1, "every wheel but pip's own (run, not installed)"
    by_name = {canonicalize_name(line.split("==")[0]): line for line in lines}
    assert by_name["boxwarden-sidecar"].startswith(f"boxwarden-sidecar=={__version__} --hash=sha256:")
    for wheel in house.wheels:
        name, version, *_ = parse_wheel_filename(wheel)
        if name != "pip":
            assert by_name[name] == f"{name}=={version} --hash=sha256:{pinned.files[wheel]}"


def _copy(house: Wheelhouse, where: Path) -> Wheelhouse:
    shutil.copytree(house.dir, where)
    return dataclasses.replace(house, dir=where)


def test_a_wheelhouse_someone_added_to_is_refused_naming_the_wheel(
    house: Wheelhouse, local: BoxPlatform, tmp_path: Path, offline: None
) -> None:
    shared = _copy(house, tmp_path / "shared")
    (shared.dir / "evil-1.0-py3-none-any.whl").write_bytes(b"not what anyone asked for")
    shared = dataclasses.replace(shared, wheels=(*shared.wheels, "evil-1.0-py3-none-any.whl"))
    with pytest.raises(ControllerError, match=r"do not need: evil-1\.0-py3-none-any\.whl.*remove"):
        pin(shared, local, ())


def test_a_sidecar_wheel_other_than_this_controller_builds_is_refused(
    house: Wheelhouse, local: BoxPlatform, tmp_path: Path, offline: None
) -> None:
    shared = _copy(house, tmp_path / "shared")
    (shared.dir / house.sidecar_wheel).write_bytes(b"a sidecar of someone else's")
    with pytest.raises(ControllerError, match="other than the one this controller builds"):
        pin(shared, local, ())


# --- the closure resolves for every supported box ------------------------------------------------

EDGES = [BoxPlatform(py, machine, "2.17") for py in ("3.9", "3.13") for machine in ("x86_64", "aarch64")]


@pytest.fixture(scope="module")
def resolutions() -> Iterator[dict[BoxPlatform, Future[dict[str, str]]]]:
    """All four resolved at once (metadata only): each is a few seconds of waiting on the index.
    With the s3 extra (boto3): the largest closure a box may need, so the others are in it."""
    with ThreadPoolExecutor(len(EDGES)) as pool:
        yield {p: pool.submit(resolve, p, extras=("s3",)) for p in EDGES}


def supported_tags(p: BoxPlatform) -> set[Tag]:
    version = tuple(int(n) for n in p.python.split("."))
    platforms = pip_platforms(p)
    return set(cpython_tags(version, [p.python_tag], platforms)) | set(
        compatible_tags(version, p.python_tag, platforms)
    )


@pytest.mark.parametrize("box", EDGES, ids=str)
def test_the_closure_resolves_to_binary_wheels(
    box: BoxPlatform, resolutions: dict[BoxPlatform, Future[dict[str, str]]]
) -> None:
    chosen = resolutions[box].result()  # a requirement that stopped resolving raises here, with pip's words
    assert set(chosen) >= S3_WANTED
    tags = supported_tags(box)
    for name, wheel in chosen.items():
        dist, version, _, wheel_tags = parse_wheel_filename(wheel)
        assert canonicalize_name(dist) == name
        assert wheel_tags & tags, f"{wheel} does not run on {box}"
        for req in map(Requirement, (*SIDECAR_REQUIREMENTS, *EXTRAS["s3"])):
            if canonicalize_name(req.name) == name:
                assert version in req.specifier, f"{wheel} does not satisfy {req}"
