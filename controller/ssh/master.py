"""A box's ControlMaster: where its sockets live, whether it is up, and starting it (one start per
box at a time, whoever asks). Blocking calls, light imports: the SSH connector runs them in a
thread, and `controller.warm` runs them while the CLI is still loading.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import subprocess
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import blake3

from controller.errors import ControllerError, SidecarUnreachable
from controller.ssh import argv as sshargv

MODES = ("master", "tcp")
MAX_SUN_PATH = 100  # bytes; ssh adds ".XXXXXXXXXXXXXXXX" to a ControlPath while it binds it
START_TIMEOUT_S = 60.0
CHECK_TIMEOUT_S = 15.0


def default_mode(env: Mapping[str, str]) -> str:
    """`master` (one ControlMaster per box) on POSIX, `tcp` (no master: what Windows' OpenSSH can
    do) on Windows; `BOXWARDEN_SSH_MODE` overrides."""
    mode = env.get("BOXWARDEN_SSH_MODE") or ("tcp" if os.name == "nt" else "master")
    if mode not in MODES:
        raise ControllerError(f"BOXWARDEN_SSH_MODE={mode!r}: use one of {', '.join(MODES)}")
    return mode


def link_dir(home: Path) -> Path:
    """The 0700 directory of the controller-side sockets (control socket, forwarded socket): under
    $BOXWARDEN_HOME when the paths fit in sun_path, else under /tmp/boxwarden-<uid>."""
    natural = home / "l"
    if len(os.fsencode(natural)) + 40 <= MAX_SUN_PATH:
        return natural
    return Path(f"/tmp/boxwarden-{os.getuid()}")


def private_dir(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = d.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ControllerError(
            f"{d} must be a directory of yours with mode 0700 (the SSH link's sockets live there)"
        )
    return d


@dataclass(frozen=True)
class LinkPaths:
    """The controller-side files of one box's link, named by a digest of (home, box, destination)."""

    dir: Path
    control: str  # the master's control socket
    local_socket: str  # the forward's local end
    lock: Path
    log: Path

    @classmethod
    def for_box(cls, home: Path, name: str, dest: sshargv.Destination) -> LinkPaths:
        """Box `name`'s link to `dest`: named by the box and by where it leads (destination, options,
        ssh_config), so that a master left by an `up` of the box to another host is never taken for
        this one's (a refused `up --host h1`, then `up --host h2`, worked on h1)."""
        where = "\0".join((dest.dest, *dest.options, dest.config))
        return cls.of(home, f"{name}\0{where}")

    @classmethod
    def of(cls, home: Path, tag: str) -> LinkPaths:
        key = blake3.blake3(f"{home}\0{tag}".encode()).hexdigest()[:16]
        d = link_dir(home)
        return cls(d, str(d / f"{key}.cm"), str(d / f"{key}.gs"), d / f"{key}.lock", d / f"{key}.log")


def explain(dest: str, stderr: str) -> ControllerError:
    """What an ssh failure means for the user, and what to run."""
    text = stderr.strip()
    last = "\n".join(text.splitlines()[-6:])
    if "REMOTE HOST IDENTIFICATION HAS CHANGED" in text or ("Host key for" in text and "has changed" in text):
        return ControllerError(
            f"the SSH host key of {dest} has CHANGED since you last connected; boxwarden refuses to use it. "
            f"If you know why (the box was re-created), remove the old key with `ssh-keygen -R HOST` and "
            f"connect once with `ssh {dest}` to check the new one.\nssh said: {last}"
        )
    if "host key is known" in text or "Host key verification failed" in text:
        return ControllerError(
            f"the SSH host key of {dest} is not known here, and boxwarden never accepts one for you: "
            f"connect once with `ssh {dest}`, check the fingerprint, accept it, then run this again.\n"
            f"ssh said: {last}"
        )
    if "Permission denied" in text or "passphrase" in text.lower() or "password" in text.lower():
        return ControllerError(
            f"ssh cannot log in to {dest} without a prompt (boxwarden runs ssh with BatchMode=yes): load "
            f"your key into ssh-agent (`ssh-add`) or name it with IdentityFile in ~/.ssh/config.\n"
            f"ssh said: {last}"
        )
    return SidecarUnreachable(f"ssh to {dest} failed: {last or 'no message'}")


def master_pid(dest: sshargv.Destination, control: str) -> int | None:
    """The pid of the box's live ControlMaster, or None."""
    if not os.path.exists(control):
        return None
    try:
        done = subprocess.run(
            sshargv.control(dest, control, "check"),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=CHECK_TIMEOUT_S,
            check=False,
            start_new_session=True,
            cwd="/",
        )
    except subprocess.TimeoutExpired:
        return None
    m = re.search(rb"pid=(\d+)", done.stderr)
    return int(m.group(1)) if done.returncode == 0 and m else None


@contextlib.contextmanager
def _locked(lock: Path) -> Iterator[None]:
    """One master start per box at a time (two `status` at once must not start two masters)."""
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def ensure(dest: sshargv.Destination, paths: LinkPaths, forward_to: str = "") -> bool:
    """A live master for the box; started here if there is none, then forwarding `paths.local_socket`
    to the box's socket `forward_to` from the start (one login instead of a login and a forward).
    True when this call started it with that forward."""
    private_dir(paths.dir)
    if master_pid(dest, paths.control) is not None:
        return False
    with _locked(paths.lock):
        if master_pid(dest, paths.control) is not None:
            return False  # another process started it while we waited
        _start(dest, paths, forward_to)
        return bool(forward_to)


def _start(dest: sshargv.Destination, paths: LinkPaths, forward_to: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(paths.control)  # a dead master's socket: ssh would not bind over it
    fwd = (paths.local_socket, forward_to) if forward_to else None
    log = os.open(paths.log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        # The master runs on in the background with our stderr: a file, never a pipe (a pipe
        # would stay open, and a reader would wait for its end forever). Its own session: a
        # Ctrl-C of the CLI must not end the master the next command will use. In "/": it
        # outlives this command, and where it ran may be a local box's workdir, whose sidecar
        # counts any process standing there as a stray.
        proc = subprocess.Popen(
            sshargv.master(dest, paths.control, fwd),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=log,
            start_new_session=True,
            cwd="/",
        )
    finally:
        os.close(log)
    try:
        code = proc.wait(timeout=START_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise SidecarUnreachable(
            f"ssh to {dest.dest} did not connect within {START_TIMEOUT_S:.0f}s"
        ) from None
    if code != 0:
        raise explain(dest.dest, paths.log.read_text(errors="replace"))
