"""The sidecar's wheelhouse: everything a box needs to install the sidecar without a package index.

Owns three things: the platform a box reports (`BoxPlatform`, validated at the edge) and what pip
must be told about it; the sidecar wheel, built deterministically from this controller's own
`sidecar` and `boxwarden_pb` sources; and the wheelhouse cache, where each wheelhouse holds that
wheel, its dependency closure for the box's Python and platform, and a `pip` wheel, so that a box
whose Python has no pip installs with `python pip-X.whl/pip install --no-index --find-links DIR`.

A wheelhouse enters the cache only by renaming a finished directory into place, so concurrent
builders never see half of one, and a complete one is reused without the network. Its key holds
the sidecar wheel's digest, so changed sidecar sources never reuse a stale wheel; the dependency
wheels of an earlier wheelhouse for the same platform and requirements are linked, not downloaded.

The controller never imports `sidecar`: `importlib.util.find_spec` locates a top-level package
without executing it, in an editable install and in an installed wheel alike.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import hashlib
import importlib.util
import io
import json
import logging
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import blake3

from controller import __version__
from controller.errors import ControllerError
from controller.state import default_home

logger = logging.getLogger(__name__)

# nvidia-ml-py (pure Python, imported lazily): a rented box is a GPU box, and without it the sidecar
# has no GPU readings at all; on a box without a driver it is simply not used.
SIDECAR_REQUIREMENTS: tuple[str, ...] = (
    "grpcio>=1.80",
    "protobuf>=6.31",
    "blake3>=1.0",
    "watchdog>=6.0",
    "nvidia-ml-py>=12.0",
)
SIDECAR_DIST = "boxwarden-sidecar"
SIDECAR_PACKAGES = ("boxwarden_pb", "sidecar")
SIDECAR_SCRIPT = "boxwarden-sidecar = sidecar.__main__:main"
# Downloaded with the closure: the box may have no pip of its own (Debian without python3-venv).
EXTRA_DOWNLOADS = ("pip",)

# The sidecar's optional extras, by name: what a box needs only for some configurations (boto3 for
# an s3:// durable store, prometheus_client for `up --metrics-port`). A wheelhouse (and so a venv)
# with an extra is another one than without.
EXTRAS: dict[str, tuple[str, ...]] = {"s3": ("boto3>=1.34",), "metrics": ("prometheus-client>=0.20",)}


def _wanted(extras: tuple[str, ...]) -> tuple[str, ...]:
    """What pip downloads for a wheelhouse with `extras` (sorted names, each in EXTRAS)."""
    return (*SIDECAR_REQUIREMENTS, *(r for e in extras for r in EXTRAS[e]), *EXTRA_DOWNLOADS)


SUPPORTED_PYTHONS = ("3.9", "3.10", "3.11", "3.12", "3.13")
MIN_GLIBC_MINOR = 17
MACHINES = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}
BOX_NEEDS = "the sidecar needs CPython 3.9 to 3.13 on Linux x86_64 or aarch64 with glibc 2.17 or newer"
DOWNLOAD_FIX = (
    "check this machine's connection to PyPI, or pass --box-index URL to let the box use its own index"
)

PIP_TIMEOUT_S = 600.0
STALE_TMP_S = 24 * 3600.0
_TAIL_LINES = 15
_ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)

# Run on the box by its python3; prints what `BoxPlatform.from_probe` reads. Plain old syntax on
# purpose: a python3 too old for the sidecar still answers, and gets a clear refusal.
PROBE_SCRIPT = (
    "import json, os, platform, sys, sysconfig\n"
    "try:\n"
    "    libc = os.confstr('CS_GNU_LIBC_VERSION') or ''\n"
    "except (AttributeError, ValueError, OSError):\n"
    "    libc = ''\n"
    "print(json.dumps({'implementation': sys.implementation.name,\n"
    "    'python': '%d.%d' % sys.version_info[:2], 'machine': platform.machine(), 'libc': libc,\n"
    "    'gil_disabled': bool(sysconfig.get_config_var('Py_GIL_DISABLED'))}))\n"
)


@dataclass(frozen=True)
class BoxPlatform:
    """A box's Python and platform, e.g. ("3.10", "x86_64", "2.35"); only supported ones exist."""

    python: str
    machine: str
    glibc: str

    def __post_init__(self) -> None:
        if self.python not in SUPPORTED_PYTHONS:
            raise ControllerError(f"the box's Python is {self.python}; {BOX_NEEDS} (install one there)")
        if self.machine not in ("x86_64", "aarch64"):
            raise ControllerError(f"the box is a {self.machine} machine; {BOX_NEEDS}")
        libc = re.fullmatch(r"2\.(0|[1-9]\d*)", self.glibc)
        if libc is None or int(libc.group(1)) < MIN_GLIBC_MINOR:
            raise ControllerError(f"the box has glibc {self.glibc}; {BOX_NEEDS} (use a newer image)")

    @classmethod
    def from_probe(cls, probe: Mapping[str, Any]) -> BoxPlatform:
        """The platform from PROBE_SCRIPT's JSON; a box the sidecar cannot run on is refused, saying why."""
        impl = str(probe.get("implementation", ""))
        if impl.lower() != "cpython":
            raise ControllerError(f"the box's python3 is {impl or 'unknown'}, not CPython; {BOX_NEEDS}")
        if probe.get("gil_disabled"):
            raise ControllerError(f"the box's python3 is a free-threaded build; {BOX_NEEDS} (with the GIL)")
        libc = str(probe.get("libc", "")).split()
        if len(libc) != 2 or libc[0] != "glibc":
            raise ControllerError(
                f"the box's C library is {' '.join(libc) or 'not glibc (musl, e.g. Alpine?)'}; {BOX_NEEDS}: "
                "use a glibc-based image (Debian, Ubuntu, RHEL)"
            )
        machine = str(probe.get("machine", ""))
        python = ".".join(str(probe.get("python", "")).split(".")[:2])  # "3.11.4" is "3.11"
        return cls(python=python, machine=MACHINES.get(machine.lower(), machine), glibc=libc[1])

    @property
    def python_tag(self) -> str:
        """The interpreter and ABI tag of the box's wheels: "cp310" for Python 3.10."""
        return "cp" + self.python.replace(".", "")

    def __str__(self) -> str:
        return f"CPython {self.python} on Linux {self.machine} with glibc {self.glibc}"


def pip_platforms(p: BoxPlatform) -> list[str]:
    """pip's --platform values for `p`: manylinux_2_{glibc minor..17}, newest first, then manylinux2014."""
    newest = int(p.glibc.split(".")[1])
    return [f"manylinux_2_{minor}_{p.machine}" for minor in range(newest, MIN_GLIBC_MINOR - 1, -1)] + [
        f"manylinux2014_{p.machine}"
    ]


def _closure_prefix(p: BoxPlatform, extras: tuple[str, ...] = ()) -> str:
    """The part of a cache key shared by every wheelhouse with the same dependency closure."""
    wanted = "\n".join(_wanted(extras)).encode()
    return f"{p.python_tag}-{p.machine}-glibc{p.glibc}-deps{blake3.blake3(wanted).hexdigest()[:8]}"


def cache_key(p: BoxPlatform, version: str, extras: tuple[str, ...] = ()) -> str:
    """The cache directory name of the wheelhouse of sidecar `version` (any identity string) for `p`."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+-]*", version):
        raise ValueError(f"not a usable version for a cache key: {version!r}")
    return f"{_closure_prefix(p, extras)}-{version}"


def default_cache_root(env: Mapping[str, str]) -> Path:
    """$BOXWARDEN_WHEELHOUSE, else the wheelhouse directory under $BOXWARDEN_HOME (or its default)."""
    if env.get("BOXWARDEN_WHEELHOUSE"):
        return Path(env["BOXWARDEN_WHEELHOUSE"]).expanduser()
    return default_home(env) / "wheelhouse"


# --- the sidecar wheel ---------------------------------------------------------------------------


def _source_dir(package: str) -> Path:
    """Where `package` lives, found without importing it."""
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec else []
    if not locations:
        raise ControllerError(
            f"cannot find the {package} package beside this controller: reinstall boxwarden"
        )
    return Path(locations[0])


def _check_sidecar_version(root: Path) -> None:
    """Refuse sidecar sources of another version (a stray `sidecar` package earlier on sys.path)."""
    m = re.search(r"""^__version__ = ["']([^"']+)["']""", (root / "__init__.py").read_text(), re.MULTILINE)
    if m is None or m.group(1) != __version__:
        found = m.group(1) if m else "unknown"
        raise ControllerError(
            f"the sidecar sources at {root} are version {found}, this controller is {__version__}: "
            "reinstall boxwarden"
        )


def _package_files(package: str) -> list[tuple[str, Path]]:
    """(archive name, file) for the .py files and py.typed of `package` and its subpackages."""
    root = _source_dir(package)
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = [d for d in dirnames if d != "__pycache__" and (here / d / "__init__.py").is_file()]
        parts = here.relative_to(root).parts
        for name in filenames:
            if not name.startswith(".") and (name.endswith(".py") or name == "py.typed"):
                found.append((str(PurePosixPath(package, *parts, name)), here / name))
    return found


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


def _dist_info(files: list[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
    """METADATA, WHEEL, entry_points.txt and RECORD (last) for a wheel holding `files`."""
    info = f"boxwarden_sidecar-{__version__}.dist-info"
    metadata = [
        "Metadata-Version: 2.1",
        f"Name: {SIDECAR_DIST}",
        f"Version: {__version__}",
        "Summary: The boxwarden on-box daemon, installed on a box by the boxwarden controller.",
        "Requires-Python: >=3.9",
        *(f"Requires-Dist: {req}" for req in SIDECAR_REQUIREMENTS),
        *(
            line
            for e in sorted(EXTRAS)
            for line in (f"Provides-Extra: {e}", *(f'Requires-Dist: {r}; extra == "{e}"' for r in EXTRAS[e]))
        ),
    ]
    wheel = ["Wheel-Version: 1.0", "Generator: boxwarden", "Root-Is-Purelib: true", "Tag: py3-none-any"]
    meta = [
        (f"{info}/METADATA", "\n".join(metadata) + "\n"),
        (f"{info}/WHEEL", "\n".join(wheel) + "\n"),
        (f"{info}/entry_points.txt", f"[console_scripts]\n{SIDECAR_SCRIPT}\n"),
    ]
    entries = files + [(name, text.encode()) for name, text in meta]
    record = "".join(f"{name},{_record_hash(data)},{len(data)}\n" for name, data in entries)
    return [*entries[len(files) :], (f"{info}/RECORD", (record + f"{info}/RECORD,,\n").encode())]


def _zip(entries: list[tuple[str, bytes]]) -> bytes:
    """A zip of `entries` in the order given, with fixed timestamps and modes."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in entries:
            entry = zipfile.ZipInfo(name, date_time=_ZIP_EPOCH)
            entry.external_attr = 0o100644 << 16
            entry.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(entry, data, compresslevel=9)
    return buf.getvalue()


def _sidecar_wheel_bytes() -> tuple[str, bytes]:
    """(file name, bytes) of the sidecar wheel: the same sources always give the same bytes."""
    _check_sidecar_version(_source_dir("sidecar"))
    files = sorted(
        (name, path.read_bytes()) for package in SIDECAR_PACKAGES for name, path in _package_files(package)
    )
    return f"boxwarden_sidecar-{__version__}-py3-none-any.whl", _zip(files + _dist_info(files))


def sidecar_wheel(dest_dir: Path) -> Path:
    """Write the sidecar wheel into `dest_dir` (atomically, replacing one of the same name); its path."""
    name, data = _sidecar_wheel_bytes()
    dest_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=dest_dir)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, dest_dir / name)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return dest_dir / name


# --- pip -----------------------------------------------------------------------------------------


def _target_args(p: BoxPlatform) -> list[str]:
    """pip options that select binary wheels for the box instead of for this machine."""
    abi = p.python_tag
    args = ["--only-binary=:all:", "--python-version", p.python, "--implementation", "cp", "--abi", abi]
    for tag in pip_platforms(p):
        args += ["--platform", tag]
    return args


def _redact(url: str) -> str:
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc="***@" + parts.netloc.rsplit("@", 1)[1]))


def _run_pip(
    args: list[str],
    p: BoxPlatform,
    index_url: str | None,
    *,
    what: str = "could not fetch the sidecar's wheels for the box",
    fix: str = DOWNLOAD_FIX,
) -> None:
    """Run this Python's pip; any failure becomes one ControllerError naming the platform and the fix."""
    if importlib.util.find_spec("pip") is None:
        raise ControllerError(
            f"{sys.executable} has no pip, which the controller uses to fetch the box's wheels: "
            f"install it ({sys.executable} -m ensurepip, or uv tool install --with pip boxwarden)"
        )
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
    if index_url:
        env["PIP_INDEX_URL"] = index_url  # never in argv: it may hold credentials
    what = f"{what} ({p})"
    logger.debug("pip %s", " ".join(args))
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "pip", *args],
            check=False,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=PIP_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as e:
        raise ControllerError(f"{what}: pip took over {PIP_TIMEOUT_S:.0f} s; {fix}") from e
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-_TAIL_LINES:])
        if index_url:
            tail = tail.replace(index_url, _redact(index_url))
        raise ControllerError(f"{what}: pip exited with status {proc.returncode}; {fix}.\n{tail}")


def resolve(p: BoxPlatform, *, index_url: str | None = None, extras: tuple[str, ...] = ()) -> dict[str, str]:
    """The wheel file pip would choose for each distribution of the box's wheelhouse (by normalized
    name), from the index's metadata alone: no wheel is downloaded, nothing is cached."""
    return {name: file for name, (_, file) in _chosen(p, [*_wanted(extras)], index_url=index_url).items()}


def _chosen(
    p: BoxPlatform, wanted: list[str], *, index_url: str | None = None, find_links: Path | None = None
) -> dict[str, tuple[str, str]]:
    """(version, wheel file) that pip would install on a box of platform `p` for each distribution
    (by normalized name) of `wanted` and what it needs: from the index's metadata, or with
    `find_links` from that directory alone (no index). Nothing is downloaded or installed."""
    with tempfile.TemporaryDirectory(prefix="boxwarden-resolve-") as tmp:
        report = Path(tmp) / "report.json"
        args = ["install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report)]
        if find_links is None:
            _run_pip([*args, *_target_args(p), *wanted], p, index_url)
        else:
            args += ["--no-index", "--find-links", str(find_links)]
            what = f"the wheelhouse {find_links} does not hold all that the sidecar needs"
            fix = f"remove {find_links} and run up again"
            _run_pip([*args, *_target_args(p), *wanted], p, None, what=what, fix=fix)
        chosen = json.loads(report.read_text())["install"]
    found: dict[str, tuple[str, str]] = {}
    for item in chosen:
        name = re.sub(r"[-_.]+", "-", item["metadata"]["name"]).lower()
        file = PurePosixPath(urlsplit(item["download_info"]["url"]).path).name
        found[name] = (str(item["metadata"]["version"]), file)
    return found


# --- the wheelhouse cache ------------------------------------------------------------------------


@dataclass(frozen=True)
class Wheelhouse:
    """A finished wheelhouse. `digest` (blake3 of the sorted names and their blake3 hashes) lets a
    box tell whether the venv it installed from a wheelhouse is current."""

    dir: Path
    wheels: tuple[str, ...]
    pip_wheel: str
    sidecar_wheel: str
    digest: str


def _load(path: Path, sidecar: str) -> Wheelhouse | None:
    """The wheelhouse at `path` if it is complete (holds `sidecar` and a pip wheel), else None."""
    try:
        wheels = tuple(sorted(e.name for e in os.scandir(path) if e.name.endswith(".whl")))
        pips = [w for w in wheels if w.startswith("pip-")]
        if sidecar not in wheels or len(pips) != 1:
            return None
        h = blake3.blake3()
        for name in wheels:
            h.update(f"{name} {blake3.blake3((path / name).read_bytes()).hexdigest()}\n".encode())
    except FileNotFoundError:  # absent, or being moved aside by another builder
        return None
    return Wheelhouse(dir=path, wheels=wheels, pip_wheel=pips[0], sidecar_wheel=sidecar, digest=h.hexdigest())


def _earlier(cache_root: Path, p: BoxPlatform, extras: tuple[str, ...]) -> Path | None:
    """The newest complete wheelhouse with the same dependency closure, whatever its sidecar."""
    candidates = []
    for d in cache_root.glob(_closure_prefix(p, extras) + "-*"):
        sidecars = [w.name for w in d.glob("boxwarden_sidecar-*.whl")]
        if len(sidecars) == 1 and _load(d, sidecars[0]) is not None:
            candidates.append((d.stat().st_mtime, d))
    return max(candidates)[1] if candidates else None


def _link_dependencies(source: Path, dest: Path) -> None:
    """Hard-link (else copy) every wheel of `source` but its sidecar wheel into `dest`."""
    for wheel in source.glob("*.whl"):
        if wheel.name.startswith("boxwarden_sidecar-"):
            continue
        try:
            os.link(wheel, dest / wheel.name)
        except OSError:
            shutil.copyfile(wheel, dest / wheel.name)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(tmp: Path, final: Path, sidecar: str) -> Wheelhouse:
    """Rename the finished `tmp` to `final`. If another builder got there first, theirs is used; an
    incomplete directory in the way (left by hand) is moved aside and removed."""
    for _ in range(3):
        try:
            os.rename(tmp, final)
        except OSError as e:
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            won = _load(final, sidecar)
            if won is not None:
                return won
            aside = Path(tempfile.mkdtemp(prefix=".tmp-broken-", dir=final.parent))
            with contextlib.suppress(FileNotFoundError):  # another builder moved it first
                os.rename(final, aside / final.name)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            _fsync(final.parent)
            done = _load(final, sidecar)
            if done is not None:
                return done
    raise ControllerError(f"could not put the wheelhouse in place at {final}")


def _sweep(cache_root: Path) -> None:
    """Remove what builders killed long ago left behind."""
    for d in cache_root.glob(".tmp-*"):
        try:
            if time.time() - d.stat().st_mtime > STALE_TMP_S:
                shutil.rmtree(d, ignore_errors=True)
        except FileNotFoundError:
            continue


def build(
    platform: BoxPlatform,
    cache_root: Path,
    *,
    index_url: str | None = None,
    progress: Callable[[str], None] | None = None,
    extras: tuple[str, ...] = (),
) -> Wheelhouse:
    """The wheelhouse for `platform` under `cache_root`: the cached one when complete (no network),
    else one built from the dependency wheels of an earlier one or downloaded with pip. `extras`:
    names in EXTRAS whose requirements it holds too."""
    say = progress or (lambda _message: None)
    unknown = sorted(set(extras) - set(EXTRAS))
    if unknown:
        raise ValueError(f"unknown sidecar extras: {unknown}")
    extras = tuple(sorted(set(extras)))
    name, data = _sidecar_wheel_bytes()
    version = f"{__version__}-{blake3.blake3(data).hexdigest()[:16]}"
    final = cache_root / cache_key(platform, version, extras)
    cached = _load(final, name)
    if cached is not None:
        say(f"using the cached wheelhouse for {platform}")
        return cached
    cache_root.mkdir(parents=True, exist_ok=True)
    _sweep(cache_root)
    tmp = cache_root / f".tmp-{os.getpid()}-{secrets.token_hex(6)}"
    tmp.mkdir()  # not mkdtemp: its mode 0700 would travel to the box with the directory
    try:
        earlier = _earlier(cache_root, platform, extras)
        if earlier is not None:
            say(f"reusing the dependency wheels for {platform} from {earlier.name}")
            _link_dependencies(earlier, tmp)
        else:
            say(f"downloading the sidecar's dependencies for {platform}")
            args = ["download", "--progress-bar", "off", "--dest", str(tmp), *_target_args(platform)]
            _run_pip([*args, *_wanted(extras)], platform, index_url)
        (tmp / name).write_bytes(data)
        for path in [*tmp.iterdir(), tmp]:
            _fsync(path)
        house = _publish(tmp, final, name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    size = sum((house.dir / w).stat().st_size for w in house.wheels)
    say(f"wheelhouse ready: {len(house.wheels)} wheels, {size / 1e6:.1f} MB, in {house.dir}")
    logger.info("wheelhouse %s: %s", house.dir, ", ".join(house.wheels))
    return house


# --- what a box installs, pinned by hash -----------------------------------------------------------


def sha256_file(path: Path) -> str:
    """The sha256 of a file, hex: the digest pip's --require-hashes takes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def sidecar_spec(extras: tuple[str, ...]) -> str:
    """The sidecar as pip names it, with `extras`, at this controller's version."""
    return f"{SIDECAR_DIST}{'[' + ','.join(extras) + ']' if extras else ''}=={__version__}"


@dataclass(frozen=True)
class Pinned:
    """What a box may install from a wheelhouse, by digests this controller computed: each file
    sent (name -> sha256), and the requirements pip installs them by with --require-hashes."""

    files: dict[str, str]
    requirements: str


def pin_alone(wheel: Path) -> Pinned:
    """One wheel, hashed now, for a box whose pip resolves the rest from its own index (no pins)."""
    return Pinned(files={wheel.name: sha256_file(wheel)}, requirements="")


def pin(house: Wheelhouse, platform: BoxPlatform, extras: tuple[str, ...] = ()) -> Pinned:
    """Hash every wheel of `house` now and pin exactly the sidecar's closure (pip's own wheel, run
    from the wheelhouse, is sent and checked too, but not installed). ControllerError for a sidecar
    wheel other than the one this controller builds from its sources, or a wheel the closure does
    not take (a shared $BOXWARDEN_WHEELHOUSE that someone added to): nothing is sent then."""
    name, data = _sidecar_wheel_bytes()
    files = {w: sha256_file(house.dir / w) for w in house.wheels}
    if files.get(name) != hashlib.sha256(data).hexdigest():
        raise ControllerError(
            f"the wheelhouse {house.dir} holds a sidecar wheel other than the one this controller builds "
            f"from its own sources ({name}): remove {house.dir} and run up again"
        )
    spec = sidecar_spec(extras)
    chosen = _chosen(platform, [spec, *EXTRA_DOWNLOADS], find_links=house.dir)
    extra = sorted(set(files) - {file for _, file in chosen.values()})
    if extra:
        raise ControllerError(
            f"the wheelhouse {house.dir} holds wheels that the sidecar and its dependencies do not need: "
            f"{', '.join(extra)}; a box installs only what this controller can account for: remove "
            f"{house.dir} (or those files) and run up again"
        )
    lines = []
    for dist, (version, file) in sorted(chosen.items()):
        if dist in EXTRA_DOWNLOADS:
            continue
        what = spec if dist == SIDECAR_DIST else f"{dist}=={version}"
        lines.append(f"{what} --hash=sha256:{files[file]}\n")
    return Pinned(files=files, requirements="".join(lines))
