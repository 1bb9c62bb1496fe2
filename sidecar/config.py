"""Settings: the typed, frozen configuration of one sidecar, built once from the SidecarConfig JSON.

The controller writes the config as a `boxwarden_pb.v1.SidecarConfig` in the proto3 JSON mapping;
this module is the only place that reads it. Nothing here reads the environment.
"""

from __future__ import annotations

import dataclasses
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from boxwarden_pb.v1 import sidecar_pb2 as pb
from google.protobuf import json_format

from sidecar.compat import SLOTS
from sidecar.errors import ConfigError
from sidecar.keep import NO_RULES, KeepRules, parse_keep
from sidecar.paths import DEFAULT_TEMP_PATTERNS
from sidecar.progress import validate_patterns
from sidecar.stamp import NONCE_RE, new_nonce
from sidecar.storage import local_dir
from sidecar.storage.pace import DEFAULT_RATE, MIN_RATE

BOX_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
DEFAULT_RUN_ID = "default"
# sun_path is 108 bytes including the NUL; stay clear of it.
MAX_SOCKET_PATH = 104


@dataclass(frozen=True, **SLOTS)
class Settings:
    box_name: str
    profile: str
    state_dir: Path
    socket_path: Path
    watch_dirs: tuple[Path, ...]
    durable_url: str
    temp_patterns: tuple[str, ...] = DEFAULT_TEMP_PATTERNS
    exclude_patterns: tuple[str, ...] = ()
    settle_s: float = 0.2
    health_interval_s: float = 1.0
    hash_workers: int = 2
    run_id: str = DEFAULT_RUN_ID
    workdir: Path | None = None
    rescan_s: float = 10.0
    durable_credentials: Path | None = None
    keep: KeepRules = NO_RULES
    drain_grace_s: float = 5.0
    ahead_min_bytes: int = 256 << 20
    push_rate: float = DEFAULT_RATE  # bytes/s; 0: no limit
    memory_high_percent: int = 90
    stall_s: float = 1800.0
    step_regex: str = ""  # "": progress.DEFAULT_STEP_RE
    loss_regex: str = ""
    gpu_probe: str = "auto"  # "auto" | "none" | "replay:/abs/path.json"
    metrics_port: int = 0  # 0: no Prometheus endpoint
    nonce: str = ""  # this start's token (sidecar.stamp); "": one is made at start
    source: pb.SidecarConfig | None = None  # the config as read (Hello shows it)

    @property
    def ledger_path(self) -> Path:
        return self.state_dir / "ledger.sqlite"

    @property
    def log_dir(self) -> Path:
        return self.state_dir / "logs"

    @property
    def pid_path(self) -> Path:
        return self.state_dir / "sidecar.pid"

    @property
    def boxes_root(self) -> Path:
        """Where this machine keeps its boxes' state: <root>/boxes/<name>/sidecar (its venvs beside),
        or, for a state dir laid out otherwise, the state dir's own parent."""
        box_dir = self.state_dir.parent
        return box_dir.parent.parent if box_dir.parent.name == "boxes" else box_dir

    @property
    def job_cwd(self) -> Path:
        return self.workdir or self.state_dir


def load(path: Path) -> Settings:
    """Read and validate a SidecarConfig JSON file."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read config {path}: {e.strerror}") from e
    msg = pb.SidecarConfig()
    try:
        json_format.Parse(text, msg)
    except json_format.ParseError as e:
        raise ConfigError(f"config {path} is not a valid SidecarConfig: {e}") from e
    return from_message(msg, source=str(path))


def from_message(msg: pb.SidecarConfig, *, source: str = "config") -> Settings:
    def fail(field: str, why: str) -> ConfigError:
        return ConfigError(f"{source}: field {field}: {why}")

    if not BOX_NAME_RE.match(msg.box_name):
        raise fail("box_name", f"{msg.box_name!r} must match {BOX_NAME_RE.pattern}")
    for name, value in (("state_dir", msg.state_dir), ("socket_path", msg.socket_path)):
        if not value or not Path(value).is_absolute():
            raise fail(name, f"must be an absolute path, got {value!r}")
    if len(msg.socket_path.encode()) > MAX_SOCKET_PATH:
        raise fail("socket_path", f"longer than {MAX_SOCKET_PATH} bytes (a Unix socket path limit)")
    if not msg.watch_dirs:
        raise fail("watch_dirs", "at least one directory to watch is required")
    watch = tuple(Path(d) for d in msg.watch_dirs)
    for d in watch:
        if not d.is_absolute():
            raise fail("watch_dirs", f"{str(d)!r} is not absolute")
        if not d.is_dir():
            raise fail("watch_dirs", f"{d} is not a directory (create it first)")
    run_id = msg.run_id or DEFAULT_RUN_ID
    if not RUN_ID_RE.match(run_id):
        raise fail("run_id", f"{msg.run_id!r} must match {RUN_ID_RE.pattern}")
    for field, patterns in (("temp_patterns", msg.temp_patterns), ("exclude_patterns", msg.exclude_patterns)):
        for pat in patterns:
            if not pat or "\x00" in pat or pat in ("*", "**"):
                raise fail(field, f"{pat!r} is not a usable pattern (empty, NUL, or everything)")
    if len(watch) > 1 and len({d.name for d in watch}) != len(watch):
        raise fail(
            "watch_dirs", "several watched directories must have distinct names (paths are prefixed by them)"
        )
    if not msg.durable_url:
        raise fail("durable_url", "a durable storage URL is required (e.g. file:///mnt/durable)")
    durable_root = local_dir(msg.durable_url)
    for d in watch:
        w = d.resolve()
        # (field, path, also refuse it being an ancestor of the watched dir?)
        others = [
            ("state_dir", Path(msg.state_dir), False),
            ("socket_path", Path(msg.socket_path).parent, False),
        ]
        if durable_root is not None:
            others.append(("durable_url", durable_root / msg.box_name, True))
        for field, other, both_ways in others:
            o = other.resolve()
            if o == w or w in o.parents or (both_ways and o in w.parents):
                raise fail(
                    field,
                    f"{other} overlaps the watched directory {d}: the sidecar would claim (and copy) its own "
                    "files forever; put it outside every watched directory",
                )
    if msg.workdir and not Path(msg.workdir).is_absolute():
        raise fail("workdir", f"{msg.workdir!r} is not absolute")
    credentials = Path(msg.durable_credentials_file) if msg.durable_credentials_file else None
    if credentials is not None:
        why = credentials_problem(credentials)
        if why:
            raise fail("durable_credentials_file", why)
    try:
        keep = parse_keep(msg.keep)
    except ValueError as e:
        raise fail("keep", str(e)) from None
    if 0 < msg.push_rate_bytes_s < MIN_RATE:
        raise fail(
            "push_rate_bytes_s",
            f"{msg.push_rate_bytes_s} bytes/s would take hours per checkpoint: give at least {MIN_RATE}, "
            "0 for the default or a negative number for no limit",
        )
    for field, step_re, loss_re in (("step_regex", msg.step_regex, ""), ("loss_regex", "", msg.loss_regex)):
        try:
            validate_patterns(step_re or None, loss_re or None)
        except ValueError as e:
            raise fail(field, str(e)) from None
    gpu = msg.gpu_probe or "auto"
    if gpu not in ("auto", "none") and not (gpu.startswith("replay:") and Path(gpu[7:]).is_absolute()):
        raise fail("gpu_probe", f"{gpu!r} must be auto, none or replay:/absolute/path.json")
    if msg.metrics_port > 65535:
        raise fail("metrics_port", f"{msg.metrics_port} is not a TCP port")
    if msg.memory_high_percent > 100:
        raise fail("memory_high_percent", f"{msg.memory_high_percent} is over 100")
    return Settings(
        box_name=msg.box_name,
        profile=msg.profile or "local",
        state_dir=Path(msg.state_dir),
        socket_path=Path(msg.socket_path),
        watch_dirs=tuple(d.resolve() for d in watch),
        durable_url=msg.durable_url,
        temp_patterns=tuple(msg.temp_patterns) or DEFAULT_TEMP_PATTERNS,
        exclude_patterns=tuple(msg.exclude_patterns),
        settle_s=(msg.settle_ms or 200) / 1000,
        health_interval_s=(msg.health_interval_ms or 1000) / 1000,
        hash_workers=msg.hash_workers or 2,
        run_id=run_id,
        workdir=Path(msg.workdir) if msg.workdir else None,
        rescan_s=(msg.rescan_ms or 10000) / 1000,
        durable_credentials=credentials,
        keep=keep,
        drain_grace_s=float(msg.drain_grace_s or 5),
        ahead_min_bytes=msg.ahead_min_bytes or (256 << 20),
        push_rate=DEFAULT_RATE if msg.push_rate_bytes_s == 0 else max(0, msg.push_rate_bytes_s),
        memory_high_percent=msg.memory_high_percent or 90,
        stall_s=float(msg.stall_s or 1800),
        step_regex=msg.step_regex,
        loss_regex=msg.loss_regex,
        gpu_probe=gpu,
        metrics_port=msg.metrics_port,
        source=msg,
    )


def with_nonce(s: Settings, nonce: str) -> Settings:
    """`s` with this start's token (sidecar.stamp): the one given, checked, else a new one."""
    if nonce and not NONCE_RE.match(nonce):
        raise ConfigError(f"--nonce {nonce!r} must match {NONCE_RE.pattern}")
    return dataclasses.replace(s, nonce=nonce or new_nonce())


def credentials_problem(path: Path) -> str:
    """Why `path` must not be read as the durable store's credentials ("" when it may): it must be
    an absolute path to a regular file (not a symlink) of this process's user that no one else can
    read or write. The file's content is never looked at here, nor ever shown."""
    if not path.is_absolute():
        return f"{str(path)!r} is not absolute"
    try:
        st = os.lstat(path)
    except OSError as e:
        return f"cannot look at {path}: {e.strerror}"
    if not stat.S_ISREG(st.st_mode):
        return f"{path} is not a regular file (a symlink or another kind of file is never followed)"
    if st.st_uid != os.geteuid():
        return f"{path} belongs to uid {st.st_uid}, not to the sidecar's user (uid {os.geteuid()})"
    if st.st_mode & 0o077:
        return (
            f"{path} can be read or written by other users (mode {stat.S_IMODE(st.st_mode):04o}); "
            f"run `chmod 600 {path}`"
        )
    return ""
