"""The box-side half of `up`: every fact about the box's disks, and the sidecar's start, established
on the box itself (the controller may run on another machine; it asks through its connector).

Run as `python -m sidecar.launch VERB` with one JSON request on stdin; the answer is one JSON object
on stdout between two marker lines (a login shell may print a banner first). Verbs:

- `resolve`: check the directories `up` was given as the box sees them (symlinks, reserved names,
  files in the way, pseudo-filesystems, the durable dir apart from every watched dir and the state
  dir) and answer their real paths, and those of the profile's tier mounts. Creates nothing.
- `start`: create the watched and durable dirs, check the durable dir can be written and has inodes
  to spare, write the sidecar's config (0600) and start the sidecar detached in its own session
  (with the nonce the controller chose), unless a sidecar already holds this state dir; answer its
  pid once that child, not another process, answers on the socket.
- `gone`: whether the sidecar of a state dir has ended (its lock is free and its pid is dead).
- `stop`: SIGTERM (then SIGKILL) the sidecar this state dir's lock names, for an `up` that failed.
- `config`: the config the box's last sidecar was started with (for `up --adopt` of a dead one).
- `siblings`: the other boxes of this host's boxes root whose sidecar runs (before a meter stop).

A refusal answers {"refused": "usage" | "error" | "mismatch", "message": ...}: "usage" is a wrong
argument the user can fix (the CLI exits 2), "error" a box that cannot take the sidecar (exit 1),
"mismatch" a state dir that holds another controller's run (exit 3). Runs on Python 3.9+.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import signal
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sidecar.mounts import unescape
from sidecar.sockets import answers

BEGIN = "@@boxwarden-launch-begin@@"
END = "@@boxwarden-launch-end@@"
START_DEADLINE_S = 30.0
STOP_DEADLINE_S = 15.0

# Filesystems that hold no files of their own (the controller's pull checks know the same list).
PSEUDO_FILESYSTEMS = frozenset(
    {
        "proc",
        "sysfs",
        "devtmpfs",
        "devpts",
        "cgroup",
        "cgroup2",
        "debugfs",
        "tracefs",
        "securityfs",
        "pstore",
        "bpf",
        "configfs",
        "fusectl",
        "mqueue",
        "efivarfs",
        "binfmt_misc",
        "autofs",
        "nsfs",
    }
)
_PSEUDO_PREFIXES = ("/proc", "/sys", "/dev")

Request = dict[str, Any]


class Refused(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def usage(message: str) -> Refused:
    return Refused("usage", message)


# ---------------------------------------------------------------------------------------------
# paths


def expand(path: str) -> Path:
    """A path the controller wrote as the user gave it: `~` is this box's home."""
    return Path(os.path.expanduser(path))


def resolve_loose(path: Path) -> Path:
    """The real path `path` names: symlinks resolved in its deepest existing ancestor, the rest
    (which does not exist yet) appended as written."""
    here = Path(os.path.join(os.getcwd(), os.fspath(path)))
    tail: list[str] = []
    while not os.path.lexists(here) and here != here.parent:
        tail.insert(0, here.name)
        here = here.parent
    return Path(os.path.normpath(os.path.join(os.path.realpath(here), *tail)))


def _fs_type(real: Path) -> str | None:
    """The type of the filesystem mounted last at the deepest mount point above `real`."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    best: tuple[int, str] | None = None
    for line in lines:
        fields = line.split()
        try:
            sep = fields.index("-")
            point = unescape(fields[4])
            fstype = fields[sep + 1]
        except (ValueError, IndexError):
            continue
        inside = str(real) == point or str(real).startswith(point.rstrip("/") + "/")
        depth = len(Path(point).parts)
        if inside and (best is None or depth >= best[0]):
            best = (depth, fstype)
    return best[1] if best else None


def pseudo_filesystem(path: Path) -> str | None:
    real = resolve_loose(path)
    fs = _fs_type(real)
    if fs in PSEUDO_FILESYSTEMS:
        return fs
    if fs is None and any(str(real) == p or str(real).startswith(p + "/") for p in _PSEUDO_PREFIXES):
        return "system"
    return None


def same_dir_above(path: Path, other: Path) -> bool:
    """Is the directory `other` `path` itself or one of its ancestors, by (device, inode)? A bind
    mount is another path to the same directory, which no comparison of paths sees."""
    try:
        st = other.stat()
    except OSError:
        return False
    for p in (path, *path.parents):
        try:
            mine = p.stat()
        except OSError:
            continue
        if (mine.st_dev, mine.st_ino) == (st.st_dev, st.st_ino):
            return True
    return False


def check_dir_target(path: Path, what: str) -> None:
    """`path` is a directory or can become one: it is not a file, and neither is its nearest
    existing ancestor (`FILE/sub` can never be made)."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        where = "" if probe == path else f" (it is under {probe}, which is not a directory)"
        raise usage(f"{what} {path} is not a directory{where}; give a directory")


def check_real_filesystem(path: Path, what: str) -> None:
    kind = pseudo_filesystem(path)
    if kind is not None:
        raise usage(
            f"{what} {path} is on a {kind} pseudo-filesystem, which stores no files: give a directory "
            "on a real filesystem"
        )


def check_watch_spelling(given: Path, workdir: Path, reserved: frozenset[str]) -> None:
    """A watched dir reached through a symlink is fixed to the link's target at `up`: re-pointing the
    link (a `latest -> runs/r2` switch) would send new checkpoints where nobody watches. Refused for
    a link below the workdir (a relative --watch) or at the watched dir itself (an absolute one)."""
    base = workdir.absolute()
    inside = given == base or base in given.parents
    parts = given.relative_to(base).parts if inside else (given.name,)
    cur = base if inside else given.parent
    for part in parts:
        cur = cur / part
        if cur.is_symlink():
            raise usage(
                f"--watch {given}: {cur} is a symlink (to {os.readlink(cur)}); a watched dir is fixed at "
                "`up`, so re-pointing the link would hide new checkpoints: watch the real directory "
                f"({cur.resolve()}) or a directory above the link"
            )
    # The name the box will use: `.bw-parts/x/..` is `.bw-parts`.
    name = given.resolve().name
    if name in reserved or given.name in reserved:
        raise usage(
            f"--watch {given}: {name!r} is reserved for boxwarden's own files in a pulled tree or "
            "the durable store; rename the directory"
        )


def durable_apart(ddir: Path, watch: list[Path], state_dir: Path) -> None:
    """The durable dir may not overlap a watched dir (either way) nor the box's state. Paths are
    compared resolved, and directories also by (device, inode): a bind mount is another spelling
    of the same directory that no path comparison sees."""
    d = Path(os.path.realpath(ddir))
    for w in [*watch, state_dir]:
        r = Path(os.path.realpath(w))
        if d == r or r in d.parents or d in r.parents or same_dir_above(d, r) or same_dir_above(r, d):
            raise usage(
                f"the durable dir {ddir} overlaps {w}: the sidecar would claim (and copy) its own copies, or "
                "the copies would live and die with what they protect; put it outside every watched dir"
            )


def resolve(req: Request) -> Request:
    """Check the directories as the box sees them; answer their real paths. Creates nothing."""
    reserved = frozenset(req.get("reserved", ()))
    workdir_given = expand(req["workdir"])
    for w in req["watch"]:
        given = expand(w)
        check_watch_spelling(
            given if given.is_absolute() else workdir_given.absolute() / given, workdir_given, reserved
        )
    workdir = workdir_given.resolve()
    check_dir_target(workdir, "--workdir")
    watch = [(expand(w) if expand(w).is_absolute() else workdir / w).resolve() for w in req["watch"]]
    for w in watch:
        check_dir_target(w, "--watch")
    # "" : the durable store is not a directory of the box (an object store): nothing to resolve.
    ddir = expand(req["durable"]) if req["durable"] else None
    if ddir is not None and not ddir.is_absolute():
        raise usage(f"the durable path {req['durable']} is not absolute; give file:///absolute/dir")
    state_dir = expand(req["state_dir"])
    dirs = [(workdir, "--workdir"), *((w, "--watch") for w in watch)]
    for path, what in [*dirs, *([(ddir, "--durable")] if ddir is not None else [])]:
        check_real_filesystem(path, what)
    if ddir is not None:
        durable_apart(ddir, watch, state_dir)
    home = os.path.expanduser("~")
    tiers = {t: os.path.realpath(os.path.expanduser(t)) for t in req.get("tiers", ())}
    return {
        "workdir": str(workdir),
        "watch": [str(w) for w in watch],
        "durable": str(resolve_loose(ddir)) if ddir is not None else "",
        "state_dir": str(resolve_loose(state_dir)),
        "home": home,
        "tiers": tiers,
        "real": {str(p): os.path.realpath(p) for p in [*watch, *([ddir] if ddir is not None else [])]},
    }


# ---------------------------------------------------------------------------------------------
# start


def prepare_durable(ddir: Path, *, own_default: bool) -> None:
    """Make the durable directory ready without ever creating a durable volume's parent: a missing
    parent is an unmounted volume, and creating it would put the copies on the box's own disk.
    Only the default durable dir (under the box's own state dir) may be created with its parents."""
    if ddir.exists() and not ddir.is_dir():
        raise usage(f"the durable path {ddir} is not a directory; give --durable file:///DIR of one")
    if not own_default and not ddir.is_dir():
        parent = ddir.parent
        if parent.exists() and not parent.is_dir():
            raise usage(f"the durable path's parent {parent} is not a directory; give a directory")
        if not parent.is_dir():
            raise usage(
                f"the durable directory's parent {parent} does not exist: mount the durable volume "
                f"(or create {parent}) first"
            )
    try:
        ddir.mkdir(parents=own_default, exist_ok=True)
    except OSError as e:
        raise usage(f"cannot create the durable directory {ddir}: {e.strerror}") from e


def finding(level: str, check: str, message: str) -> dict[str, str]:
    return {"level": level, "check": check, "message": message}


def durable_writable(durable: Path) -> dict[str, str]:
    """The durable directory exists and a file can be written, synced and removed there."""
    probe = durable / f".boxwarden-probe-{uuid.uuid4().hex}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"probe")
            os.fsync(fd)
        finally:
            os.close(fd)
        probe.unlink()
    except OSError as e:
        return finding(
            "error",
            "durable_writable",
            f"cannot write to the durable directory {durable}: {e.strerror}; is the durable volume mounted "
            "and writable?",
        )
    return finding("ok", "durable_writable", f"{durable} is writable")


def inode_headroom(durable: Path, min_free: int, cap: int | None) -> dict[str, str]:
    try:
        st = os.statvfs(durable)
    except OSError as e:
        return finding("error", "inode_headroom", f"cannot stat {durable}: {e.strerror}")
    capped = f" (platform cap {cap})" if cap else ""
    if st.f_files and st.f_favail < min_free:
        return finding(
            "warn",
            "inode_headroom",
            f"only {st.f_favail} inodes free on the durable filesystem{capped}: a push of many small files "
            "can fail with 'No space left' while bytes remain",
        )
    return finding("ok", "inode_headroom", f"{st.f_favail} inodes free on the durable filesystem{capped}")


def holder(state_dir: Path) -> int | None:
    """The pid of the sidecar that holds this state dir's lock, or None if none does. 0: one holds
    it but its pid file cannot be read."""
    lock = state_dir / "sidecar.lock"
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise Refused("error", f"cannot open {lock}: {e.strerror}") from e
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                return int((state_dir / "sidecar.pid").read_text().strip())
            except (OSError, ValueError):
                return 0
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _private_dir(d: Path) -> None:
    """Create `d` and each missing directory above it 0700 (mkdir's own mode covers only the last)."""
    missing = []
    while not os.path.lexists(d) and d != d.parent:
        missing.append(d)
        d = d.parent
    for m in reversed(missing):
        with contextlib.suppress(FileExistsError):
            m.mkdir(mode=0o700)


def _write_private(path: Path, data: bytes) -> None:
    """Write `path` 0600 atomically (the config names the box's paths; nothing secret, but ours)."""
    _private_dir(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"(cannot read {path}: {e.strerror})"


def _own_pid(state_dir: Path) -> int:
    """The pid the state dir's sidecar wrote once its socket was bound (0: none yet)."""
    try:
        return int((state_dir / "sidecar.pid").read_text().strip())
    except (OSError, ValueError):
        return 0


def start(req: Request) -> Request:
    """Create the dirs, check the durable dir, then start the sidecar unless one holds the state dir."""
    cfg = req["config"]
    ddir = Path(req["durable_dir"]) if req["durable_dir"] else None  # None: an object store
    if ddir is not None:
        prepare_durable(ddir, own_default=bool(req.get("own_default")))
    for w in cfg["watchDirs"]:
        try:
            Path(w).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise usage(f"cannot create the watched directory {w}: {e.strerror}") from e
    checks = set(req.get("checks", ())) if ddir is not None else set()
    findings = []
    if ddir is not None and "durable_writable" in checks:
        findings.append(durable_writable(ddir))
    if ddir is not None and "inode_headroom" in checks:
        findings.append(inode_headroom(ddir, int(req.get("inode_min_free", 0)), req.get("inode_cap")))
    errors = [f["message"] for f in findings if f["level"] == "error"]
    if errors:
        raise Refused("error", "; ".join(errors))
    state_dir = Path(cfg["stateDir"])
    running = holder(state_dir)
    if running is not None:
        return {"findings": findings, "running": running}
    if not req.get("start", True):
        return {"findings": findings}
    cfg_path = Path(req["config_path"])
    _own_state(cfg_path, cfg, req.get("known_runs", []), req.get("closed_runs", []))
    log_path = Path(req["log_path"])
    creds = cfg.get("durableCredentialsFile")
    if creds and "durable_credentials" in req:
        _write_private(Path(creds), str(req["durable_credentials"]).encode())
    elif creds and not os.path.lexists(creds):
        raise usage(
            f"the durable store's credentials are gone from {creds}; give --durable-credentials FILE again"
        )
    first = not os.path.lexists(cfg_path)
    try:
        try:
            answer = _spawn(req, cfg, findings, cfg_path, log_path)
            try:
                _open_run(state_dir, cfg, req)
            except BaseException:
                _stop(int(answer["started"]))  # no sidecar of a run that is not marked open
                _close_mark(state_dir, str(cfg.get("runId") or ""))  # nor a mark of it
                raise
        except BaseException:
            if first:  # a run that never started leaves no config to be taken for one that did
                with contextlib.suppress(OSError):
                    os.unlink(cfg_path)
            raise
        return answer
    except BaseException:
        # A start that did not take leaves no secret behind: no sidecar reads them, and a box
        # that never came up has no record whose `down` would take them away.
        if creds and "durable_credentials" in req:
            _forget(Path(creds))
        raise


def _spawn(
    req: Request, cfg: Request, findings: list[dict[str, str]], cfg_path: Path, log_path: Path
) -> Request:
    """Write the config and start the sidecar; its pid once that child answers on the socket."""
    state_dir = Path(cfg["stateDir"])
    _write_private(cfg_path, json.dumps(cfg, indent=2).encode())
    _private_dir(log_path.parent)
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    argv = [sys.executable, "-m", "sidecar", "--config", str(cfg_path)]
    if req.get("nonce"):
        argv += ["--nonce", str(req["nonce"])]
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log_fd,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # setsid: no hangup when the SSH session that started it ends
            close_fds=True,
            cwd="/",
        )
    finally:
        os.close(log_fd)
    sock = Path(cfg["socketPath"])
    deadline = time.monotonic() + float(req.get("deadline_s", START_DEADLINE_S))
    while time.monotonic() < deadline:
        code = proc.poll()
        if code is not None:
            raise Refused(
                "error",
                f"the sidecar exited with status {code} while starting; its log says:\n{tail(log_path)}",
            )
        # Its own child, not whatever answers there: the pid file names the sidecar that bound the
        # socket (a sidecar of another box given the same path would answer too).
        if _own_pid(state_dir) == proc.pid and answers(sock):
            return {"findings": findings, "started": proc.pid}
        time.sleep(0.05)
    _stop(proc.pid)
    raise Refused(
        "error",
        f"the sidecar did not answer within {START_DEADLINE_S:.0f}s (stopped it); its log says:\n"
        f"{tail(log_path)}",
    )


def _last_config(cfg_path: Path) -> Request | None:
    """The config the state dir's last sidecar was started with, if any."""
    try:
        found = json.loads(cfg_path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise Refused("error", f"cannot read {cfg_path}: {e}") from e
    return found if isinstance(found, dict) else None


def _own_state(cfg_path: Path, cfg: Request, known_runs: list[str], closed_runs: list[str]) -> None:
    """A new sidecar starts on a state dir only if its last run is this one, or one the controller
    knows (`known_runs`: its record's; `closed_runs`: its own, torn down): another controller's run,
    whose sidecar died, is taken over only with `up --adopt` (its ledger would be rebound to a run
    it knows nothing of). A run whose teardown closed it on the box is over for everyone: it is
    never started again, whoever asks."""
    last = _last_config(cfg_path) or {}
    run = str(last.get("runId") or "")
    state_dir = cfg_path.parent / "sidecar"
    closed = torn_down(state_dir) - {str((open_run(state_dir) or {}).get("run") or "")}
    wanted = str(cfg.get("runId") or "")
    if wanted in closed:  # whichever controller asks, and whatever its record says
        raise Refused(
            "mismatch",
            f"run {wanted} of box {last.get('boxName')!r} was torn down on the box (a teardown closed it; "
            "what it released may be gone from the box): a run never starts again once torn down, whoever "
            "asks. A record that still says it is up is out of date (another controller tore it down). Its "
            "durable copies stay where they are (`boxwarden pull NAME --from durable`); a new run needs a "
            "new run id (`--run-id`)",
        )
    if not run or run in known_runs:  # (asking for the same run id is no claim to it: a record is)
        return
    if run in closed or run in closed_runs:
        # Over: closed on the box, or torn down by this controller from afar (a box gone, its
        # state dir kept on a durable tier), whose teardown could not reach the box to close it.
        return
    raise Refused(
        "mismatch",
        f"the state dir {cfg['stateDir']} holds run {run} of box {last.get('boxName')!r} (durable "
        f"{last.get('durableUrl')}), which this controller did not start, or not as it is now; its sidecar "
        "is not running. `boxwarden up NAME --adopt` starts it again and takes it over; or `down` it "
        "from the controller that started it",
    )


def config(req: Request) -> Request:
    """The config the box's last sidecar was started with ({"config": null}: none), and whether a
    sidecar holds the state dir now."""
    cfg_path = Path(req["config_path"])
    state_dir = cfg_path.parent / "sidecar"
    last = _last_config(cfg_path)
    run = str((last or {}).get("runId") or "")
    closed = run if open_run(state_dir) is None and run in torn_down(state_dir) else ""
    return {"config": last, "running": holder(state_dir), "torn_down": closed}


TORN_DOWN = "torn-down"
"""In a state dir: the run ids whose teardown saw their sidecar gone, one per line (the `gone` verb)."""
RUN_OPEN = "run-open"
"""In a state dir: the run a sidecar was started for, until its teardown closes it (JSON: run, box,
instance). Whatever its sidecar does (runs, stopped, killed), the run is not over until then."""
ROOTS = Path("~/.boxwarden/roots")
"""On the box's own disk: one file per state root a box of this user keeps elsewhere (a durable tier),
naming it, so that every box's `siblings` looks there too."""


def open_run(state_dir: Path) -> Request | None:
    """The run open in this state dir (None: none, or closed by its teardown)."""
    try:
        found = json.loads((state_dir / RUN_OPEN).read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) and found.get("run") else None


def _open_run(state_dir: Path, cfg: Request, req: Request) -> None:
    doc = {"run": cfg.get("runId", ""), "box": cfg.get("boxName", ""), "instance": req.get("instance_id", "")}
    _write_private(state_dir / RUN_OPEN, json.dumps(doc).encode())
    if req.get("register_root"):
        boxes_dir = str(state_dir.parent.parent.resolve())
        roots = Path(os.path.expanduser(ROOTS))
        _write_private(roots / hashlib.sha256(boxes_dir.encode()).hexdigest()[:32], boxes_dir.encode())


def _close_mark(state_dir: Path, run: str) -> None:
    """Remove the open-run mark of `run` (one of another run stays)."""
    opened = open_run(state_dir)
    if opened is not None and opened.get("run") == run:
        os.unlink(state_dir / RUN_OPEN)


def _registered_roots() -> set[Path]:
    roots = Path(os.path.expanduser(ROOTS))
    try:
        return {Path(f.read_text().strip()) for f in roots.iterdir() if f.is_file()}
    except OSError:
        return set()


def torn_down(state_dir: Path) -> set[str]:
    """The runs whose teardown ended a sidecar of the state dir (one per line; an older version
    kept only the last)."""
    try:
        return set((state_dir / TORN_DOWN).read_text().split())
    except (OSError, UnicodeDecodeError):
        return set()


def _unfinished_box(
    sidecar_dir: Path, instance: str, local: bool, closed: frozenset[tuple[str, str]]
) -> tuple[str, str]:
    """Why the box of this state dir may still be at work on this instance ("": its run is over),
    and the run it names:
    its sidecar runs, or its run is open (no teardown closed it, whatever its sidecar did). A run
    open on a durable tier under another instance id is that instance's (a tier outlives them). A
    state dir of an older version, with no open-run mark: a sidecar that ended without a shutdown
    (its pid file left) and no teardown mark. `closed`: the runs of this box that the asking
    controller tore down (from afar, where its teardown could not reach the box to close them),
    each with the instance it ran on."""
    opened = open_run(sidecar_dir)
    cfg = _last_config(sidecar_dir.parent / "sidecar.json") or {}
    run = str((opened or {}).get("run") or cfg.get("runId") or "")
    pid = holder(sidecar_dir)
    if pid is not None and (pid == 0 or _pid_alive(pid)):
        theirs = str((opened or {}).get("instance") or "")
        named = f" (its controller names the instance {theirs})" if theirs and theirs != instance else ""
        return f"its sidecar runs{named}", run
    if opened is not None and (run, str(opened.get("instance") or "")) in closed:
        return "", run
    if opened is not None:
        theirs = str(opened.get("instance") or "")
        if not local and theirs and instance and theirs != instance:
            return "", run
        # (On this disk it is on this instance, whatever id its controller gave it.)
        named = f" (its controller names the instance {theirs})" if theirs and theirs != instance else ""
        return f"run {run} never torn down{named}; its sidecar does not run", run
    if run and run in torn_down(sidecar_dir):
        return "", run
    if (sidecar_dir / "sidecar.pid").exists():
        return "its sidecar ended without a shutdown and no teardown closed its run", run
    return "", run


def siblings(req: Request) -> Request:
    """The other boxes of this user that may still be at work on this instance, each with why: a
    meter stop would stop them too. Looked for in every state root (this box's; `roots`: the
    profile's; and every one a box of this user registered on this disk). A root that cannot be
    read is an answer of its own. (Another Unix user's boxes on the same instance are not seen:
    their roots are private.)"""
    state_dir = Path(req["state_dir"])
    own_run = str(req.get("run_id") or "")
    instance = str(req.get("instance_id") or "")
    closed = {
        expand(str(k)).resolve(): frozenset((str(r[0]), str(r[1])) for r in v if len(r) == 2)
        for k, v in (req.get("closed") or {}).items()
    }
    own = state_dir.parent.resolve()
    local = Path(os.path.expanduser(ROOTS)).parent.resolve() / "boxes"
    roots = {own.parent} if own.parent.name == "boxes" else set()
    roots |= {Path(os.path.expanduser(str(r))).resolve() / "boxes" for r in req.get("roots", [])}
    roots |= {r.resolve() for r in _registered_roots()} | {local}
    found: dict[Path, Request] = {}
    for boxes_dir in sorted(roots):
        try:
            others = sorted(boxes_dir.iterdir()) if boxes_dir.is_dir() else []
        except OSError as e:
            found[boxes_dir] = {"name": str(boxes_dir), "run": "", "why": f"cannot be read: {e.strerror}"}
            continue
        for other in others:
            sidecar_dir = other / "sidecar"
            if not sidecar_dir.is_dir():
                continue
            why, run = _unfinished_box(
                sidecar_dir, instance, boxes_dir == local, closed.get(sidecar_dir.resolve(), frozenset())
            )
            if other.resolve() == own and (not own_run or run == own_run):
                continue  # its own run (another's run in the same state dir since is counted)
            if why:
                found[other] = {"name": other.name, "run": run, "why": f"{why}: {other}"}
    entries = sorted(found.values(), key=lambda e: (str(e["name"]), str(e["why"])))
    return {
        "running": sorted({str(e["name"]) for e in entries}),
        "beside": [f"{e['name']} ({e['why']})" for e in entries],
        "entries": entries,
    }


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            proc_stat = f.read()
    except OSError:
        return False
    return proc_stat[proc_stat.rfind(b")") + 2 :].split()[0] != b"Z"


def _stop(pid: int) -> bool:
    """SIGTERM, then SIGKILL after the deadline; True once the process is gone."""
    for sig, wait in ((signal.SIGTERM, STOP_DEADLINE_S), (signal.SIGKILL, 5.0)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not _pid_alive(pid):
                return True
            time.sleep(0.05)
    return not _pid_alive(pid)


def gone(req: Request) -> Request:
    state_dir = Path(req["state_dir"])
    pid = int(req.get("pid", 0))
    held = holder(state_dir)
    is_gone = held is None and not _pid_alive(pid)
    forget = Path(req.get("forget") or "")
    if is_gone and forget.parent == state_dir and forget.name:
        _forget(forget)  # the teardown's last look: the store's credentials leave with the sidecar
    if is_gone and req.get("torn_down"):
        # The run is over, for every controller: none adopts it again, no meter waits for it.
        runs = sorted(torn_down(state_dir) | {str(req["torn_down"])})  # every one: none starts again
        _write_private(state_dir / TORN_DOWN, "".join(f"{r}\n" for r in runs).encode())
        _close_mark(state_dir, str(req["torn_down"]))
    return {"gone": is_gone, "holder": held}


def stop(req: Request) -> Request:
    """Stop the state dir's sidecar; with `forget`, then remove the store's credentials it read
    (an `up` that failed after writing them)."""
    state_dir = Path(req["state_dir"])
    pid = holder(state_dir)
    if pid is not None and pid <= 0:
        raise Refused("error", f"a sidecar holds {req['state_dir']} but its pid file cannot be read")
    stopped = pid is None or _stop(pid)
    forget = Path(req.get("forget") or "")
    if stopped and forget.parent == state_dir and forget.name:
        _forget(forget)
    return {"stopped": stopped, "pid": pid}


def _forget(path: Path) -> None:
    """Remove the credentials file `path` (a regular file only; gone already is fine)."""
    try:
        if stat.S_ISREG(os.lstat(path).st_mode):
            os.unlink(path)
    except FileNotFoundError:
        pass


VERBS: dict[str, Callable[[Request], Request]] = {
    "resolve": resolve,
    "start": start,
    "gone": gone,
    "stop": stop,
    "config": config,
    "siblings": siblings,
}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] not in VERBS:
        print(f"usage: python -m sidecar.launch {{{'|'.join(VERBS)}}} < request.json", file=sys.stderr)
        return 2
    try:
        out = VERBS[args[0]](json.loads(sys.stdin.read()))
    except Refused as e:
        out = {"refused": e.kind, "message": str(e)}
    except OSError as e:
        what = errno.errorcode.get(e.errno or 0, "error")
        out = {"refused": "error", "message": f"{e.filename or 'the box'}: {e.strerror or e} ({what})"}
    sys.stdout.write(f"\n{BEGIN}\n{json.dumps(out)}\n{END}\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
