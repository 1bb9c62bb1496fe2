"""A real OpenSSH server on 127.0.0.1 and dedicated Unix users whose home is "the box".

Fixtures (registered in tests/conftest.py):

* `sshd` (session): one `/usr/sbin/sshd` per pytest process (so one per xdist worker) on a free
  loopback port, in a throwaway 0755 dir under /tmp. Yields an `Sshd`.
* `ssh_box` (function): a factory, `ssh_box(name="a") -> Box`. Each call makes a new Unix user
  (`bwt` + 8 hex) with its home under the sshd dir and the client key in its authorized_keys, and adds
  `Host <name>` to the test's one ssh_config (`ssh_box.config`, also `box.config`), so the system
  `ssh -F CONFIG NAME ...` reaches that user. After the test (pass or fail) every process of the user
  is stopped by PID (SIGTERM, then SIGKILL), the user and its group are deleted and its home removed.
  The session teardown removes any user this process made that is still there; the next session
  sweeps the users, sshd and dir left by a test process that died (tagged with its PID and start time).

Needs root (useradd/userdel/runuser) and openssh-server (`make sysdeps`).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import secrets
import select
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

SSHD = "/usr/sbin/sshd"
RUNUSER = shutil.which("runuser", path="/usr/sbin:/sbin:/usr/bin:/bin") or "/usr/sbin/runuser"
USER_PREFIX = "bwt"
GECOS_TAG = "boxwarden test box"
DIR_PREFIX = "bw-ssh-"
BLOCKED_INDEX = "http://127.0.0.1:9/simple"
# What the box user's commands get from `run_as_box` (sshd gives its own: HOME, USER, PATH, ...).
BOX_PATH = "/usr/local/bin:/usr/bin:/bin"

KnownHostsKind = Literal["good", "empty", "wrong"]

# Users made by this process and not yet deleted: the session teardown removes what is left.
_CREATED: dict[str, Path] = {}


# ------------------------------------------------------------------ processes


def _uids_of(pid: int) -> tuple[set[int], str] | None:
    """(real/effective/saved uids, state letter) of `pid`, or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    uids: set[int] = set()
    state = "?"
    for line in text.splitlines():
        if line.startswith("Uid:"):
            uids = {int(x) for x in line.split()[1:4]}
        elif line.startswith("State:"):
            state = line.split()[1]
    return uids, state


def uid_pids(uid: int, *, zombies: bool = False) -> list[int]:
    """PIDs of processes whose real, effective or saved uid is `uid` (zombies only if asked)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        info = _uids_of(int(entry))
        if info is None or uid not in info[0]:
            continue
        if zombies or info[1] not in ("Z", "X"):
            found.append(int(entry))
    return found


def _ppid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _start_time(pid: int) -> str | None:
    """The start time (clock ticks after boot) of a live `pid`; None when gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def _owner_tag() -> str:
    """`PID.STARTTIME` of this process: names it even after its PID is reused."""
    return f"{os.getpid()}.{_start_time(os.getpid())}"


def _owner_gone(tag: str) -> bool:
    """Whether the process named by `tag` has exited (a zombie has: PID 1 here reaps lazily)."""
    pid, _, start = tag.partition(".")
    return not pid.isdigit() or _start_time(int(pid)) != start


def _signal_pid(pid: int, sig: signal.Signals, *, uid: int | None = None) -> None:
    """Signal one process by PID. A pidfd pins the process, so when `uid` is given and still matches
    after the pidfd is open, the signal reaches that very process and never a reused PID."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return  # gone
    try:
        if uid is not None:
            info = _uids_of(pid)
            if info is None or uid not in info[0]:
                return
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(fd, sig)
    finally:
        os.close(fd)


def _stop_pidfds(fds: list[int], *, grace: float, limit: float) -> None:
    """SIGTERM the processes behind `fds` (pidfds: immune to PID reuse), SIGKILL those still running
    after `grace` s, wait until all have exited or `limit` s passed, and close the fds."""
    try:
        for fd in fds:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(fd, signal.SIGTERM)
        start = time.monotonic()
        killed = False
        running = list(fds)
        while running and time.monotonic() - start < limit:
            # A pidfd polls readable once its process has exited.
            done = set(select.select(running, [], [], 0.05)[0])
            running = [fd for fd in running if fd not in done]
            if running and not killed and time.monotonic() - start > grace:
                for fd in running:
                    with contextlib.suppress(ProcessLookupError):
                        signal.pidfd_send_signal(fd, signal.SIGKILL)
                killed = True
    finally:
        for fd in fds:
            os.close(fd)


def kill_uid_processes(uid: int, *, grace: float = 3.0, limit: float = 20.0) -> list[int]:
    """Stop every live process of `uid`: SIGTERM, SIGKILL after `grace` s; returns the PIDs still
    alive at `limit` (empty on success). Never by name: each PID is checked to still be `uid`'s."""
    deadline = time.monotonic() + limit
    termed: dict[int, float] = {}
    while True:
        pids = uid_pids(uid)
        now = time.monotonic()
        if not pids or now > deadline:
            return pids
        for pid in pids:
            if pid not in termed:
                _signal_pid(pid, signal.SIGTERM, uid=uid)
                termed[pid] = now
            elif now - termed[pid] > grace:
                _signal_pid(pid, signal.SIGKILL, uid=uid)
        time.sleep(0.02)


def _wait_popen(proc: subprocess.Popen[bytes], limit: float) -> None:
    """Reap a child we started; SIGTERM, then SIGKILL it (by PID) if it outlives `limit`."""
    try:
        proc.wait(timeout=limit)
        return
    except subprocess.TimeoutExpired:
        proc.terminate()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


# ------------------------------------------------------------------ sshd


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _keygen(path: Path) -> str:
    """An ed25519 key pair at `path` (+.pub); returns the public line 'ssh-ed25519 AAAA...'."""
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "bw-test", "-f", str(path)],
        check=True,
        capture_output=True,
        stdin=subprocess.DEVNULL,
    )
    kind, blob = path.with_name(path.name + ".pub").read_text().split()[:2]
    return f"{kind} {blob}"


def _banner_ok(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            s.settimeout(2)
            return s.recv(64).startswith(b"SSH-2.0-OpenSSH")
    except OSError:
        return False


@dataclass
class Sshd:
    """A running sshd. `dir` (0755) holds `homes/` and the log; `private` (0700, root only) holds the
    keys, and each test's ssh_config dir."""

    dir: Path
    private: Path
    port: int
    pid: int
    proc: subprocess.Popen[bytes]
    config: Path  # sshd_config
    log: Path
    host_key: str  # "ssh-ed25519 AAAA..." of the server
    wrong_host_key: str  # another ed25519 key, for the changed-host-key case
    client_key: Path  # private key whose .pub is in every box's authorized_keys
    client_pub: str
    started_in: float  # seconds from Popen to "accepts connections"

    @property
    def homes(self) -> Path:
        return self.dir / "homes"

    def known_hosts_line(self, key: str | None = None) -> str:
        return f"[127.0.0.1]:{self.port} {key or self.host_key}\n"

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""


def _sshd_config(d: Path, private: Path, port: int) -> str:
    return f"""\
Port {port}
ListenAddress 127.0.0.1
HostKey {private / "host_key"}
PidFile {d / "sshd.pid"}
AuthorizedKeysFile .ssh/authorized_keys
StrictModes no
UsePAM no
PermitRootLogin no
PasswordAuthentication no
KbdInteractiveAuthentication no
PubkeyAuthentication yes
AllowTcpForwarding yes
AllowStreamLocalForwarding yes
StreamLocalBindUnlink yes
X11Forwarding no
MaxStartups 200
MaxSessions 200
LoginGraceTime 60
UseDNS no
PrintMotd no
PrintLastLog no
Subsystem sftp internal-sftp
LogLevel VERBOSE
"""


def _start_sshd(d: Path, private: Path, attempts: int = 5) -> tuple[subprocess.Popen[bytes], int, float]:
    """Start sshd on a free port; when another process takes the port first, try another one."""
    cfg = d / "sshd_config"
    log = d / "sshd.log"
    failures: list[str] = []
    for attempt in range(attempts):
        port = free_port()
        cfg.write_text(_sshd_config(d, private, port))
        if log.exists():
            log.rename(d / f"sshd.log.attempt{attempt}")
        t0 = time.monotonic()
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [SSHD, "-D", "-e", "-f", str(cfg)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        listening = f"Server listening on 127.0.0.1 port {port}"
        deadline = t0 + 20
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                break
            if listening in log.read_text(errors="replace") and _banner_ok(port):
                return proc, port, time.monotonic() - t0
            time.sleep(0.01)
        text = log.read_text(errors="replace")
        if proc.poll() is None:
            _wait_popen_stop(proc)
            pytest.fail(f"sshd did not accept connections on port {port} within 20 s; its log:\n{text}")
        failures.append(f"port {port}: rc {proc.returncode}: {text.strip()}")
        if not re.search(r"Address already in use|Bind to port|Cannot bind any address", text):
            pytest.fail(f"sshd exited with {proc.returncode} at start; its log:\n{text}")
    pytest.fail("sshd could not bind a free port:\n" + "\n".join(failures))


def _wait_popen_stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
    _wait_popen(proc, 10)


def _stop_sshd(proc: subprocess.Popen[bytes]) -> None:
    # Per-connection sshds (root monitors) are the listener's children until it exits; stop them too.
    fds = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _ppid(int(entry)) == proc.pid:
            with contextlib.suppress(OSError):
                fd = os.pidfd_open(int(entry))
                if _ppid(int(entry)) == proc.pid:  # still that child, now pinned by the pidfd
                    fds.append(fd)
                else:
                    os.close(fd)
    _wait_popen_stop(proc)
    _stop_pidfds(fds, grace=3, limit=15)


@contextlib.contextmanager
def running_sshd() -> Iterator[Sshd]:
    """A real sshd on 127.0.0.1, its keys and its box homes; everything removed at the end (the
    benchmarks use it too). RuntimeError if it cannot run here."""
    if not os.access(SSHD, os.X_OK):
        raise RuntimeError(f"{SSHD} is missing: install openssh-server (`make sysdeps`)")
    if os.geteuid() != 0:
        raise RuntimeError("the sshd/ssh_box fixtures need root (useradd, userdel, runuser)")
    sweep_stale()
    d = Path(tempfile.mkdtemp(prefix=DIR_PREFIX, dir="/tmp"))
    proc: subprocess.Popen[bytes] | None = None
    try:
        (d / "owner").write_text(_owner_tag())
        d.chmod(0o755)  # box users traverse it to reach their homes
        private = d / "private"
        private.mkdir(mode=0o700)
        (d / "homes").mkdir(mode=0o755)
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
        host_key = _keygen(private / "host_key")
        wrong_host_key = _keygen(private / "wrong_host_key")
        client_pub = _keygen(private / "client_key")
        proc, port, started_in = _start_sshd(d, private)
        yield Sshd(
            dir=d,
            private=private,
            port=port,
            pid=proc.pid,
            proc=proc,
            config=d / "sshd_config",
            log=d / "sshd.log",
            host_key=host_key,
            wrong_host_key=wrong_host_key,
            client_key=private / "client_key",
            client_pub=client_pub,
            started_in=started_in,
        )
    finally:
        problems = [p for name in list(_CREATED) for p in delete_user(name)]
        if proc is not None:
            _stop_sshd(proc)
        shutil.rmtree(d, ignore_errors=True)
        if problems:
            raise RuntimeError("ssh_box session cleanup: " + "; ".join(problems))


@pytest.fixture(scope="session")
def sshd() -> Iterator[Sshd]:
    """A real sshd on 127.0.0.1 for this pytest process (each xdist worker gets its own)."""
    try:
        with running_sshd() as server:
            yield server
    except RuntimeError as e:
        pytest.fail(str(e), pytrace=False)


# ------------------------------------------------------------------ users


def _user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def _group_exists(name: str) -> bool:
    return subprocess.run(["getent", "group", name], capture_output=True).returncode == 0


def _shadow_tool(argv: list[str], *, limit: float = 30.0) -> subprocess.CompletedProcess[str]:
    """Run useradd/userdel/groupdel, retrying while another process holds the passwd/group lock."""
    deadline = time.monotonic() + limit
    while True:
        r = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if r.returncode == 0 or "lock" not in r.stderr.lower() or time.monotonic() > deadline:
            return r
        time.sleep(0.1)


def create_user(home_root: Path) -> tuple[str, int, int, Path]:
    """A new user `bwt<8 hex>` with a personal group, shell bash, home `home_root/<name>` (made, owned
    by the user, 0755). The password field is `*` (no password, not locked): with `UsePAM no`, sshd
    refuses a locked (`!`) account even for key logins."""
    for _ in range(10):
        name = USER_PREFIX + secrets.token_hex(4)
        home = home_root / name
        if _user_exists(name) or _group_exists(name):
            continue
        _CREATED[name] = home
        gecos = f"{GECOS_TAG} owner={_owner_tag()}"
        r = _shadow_tool(
            ["useradd", "-M", "-d", str(home), "-s", "/bin/bash", "-U", "-p", "*", "-c", gecos, name]
        )
        if r.returncode == 0:
            break
        if r.returncode == 9 and not _user_exists(name):  # name taken between check and add (group)
            del _CREATED[name]
            continue
        delete_user(name)
        pytest.fail(f"useradd {name} failed ({r.returncode}): {r.stderr.strip()}")
    else:
        pytest.fail("could not find a free bwt user name in 10 tries")
    try:
        pw = pwd.getpwnam(name)
        home.mkdir(mode=0o755)
        home.chmod(0o755)
        os.chown(home, pw.pw_uid, pw.pw_gid)
    except BaseException:
        delete_user(name)
        raise
    return name, pw.pw_uid, pw.pw_gid, home


def delete_user(name: str) -> list[str]:
    """Stop every process of `name` (by PID), delete the user and its group, remove its home.
    Returns the problems met (empty when all went well); never raises."""
    problems: list[str] = []
    home = _CREATED.get(name)
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        pw = None
    if pw is not None:
        home = home or Path(pw.pw_dir)
        start = time.monotonic()
        while True:
            left = kill_uid_processes(pw.pw_uid)
            if left:
                problems.append(f"{name}: processes {left} survived SIGKILL")
            # userdel refuses (8) while a process of the user exists; should it still refuse once
            # none is left alive (a zombie: PID 1 on this VM reaps orphans lazily), force it.
            force = ["-f"] if left or time.monotonic() - start > 3 else []
            r = _shadow_tool(["userdel", *force, name])
            if r.returncode == 0 or not _user_exists(name):
                break
            if r.returncode != 8 or force:
                problems.append(f"userdel {name} failed ({r.returncode}): {r.stderr.strip()}")
                break
            time.sleep(0.05)
    if _group_exists(name):
        r = _shadow_tool(["groupdel", name])
        if r.returncode != 0:
            problems.append(f"groupdel {name} failed ({r.returncode}): {r.stderr.strip()}")
    if home is not None and home.name == name and DIR_PREFIX in str(home):
        shutil.rmtree(home, ignore_errors=True)
        if home.exists():
            problems.append(f"{home} could not be removed")
    if not _user_exists(name):
        _CREATED.pop(name, None)
    return problems


def sweep_stale() -> list[str]:
    """Clean what a test process that is gone left behind (e.g. a SIGKILLed pytest): its users (tagged
    `owner=PID.STARTTIME` in GECOS) with their processes, then its sshd (the PID in its dir's sshd.pid,
    checked against the command line we start it with) and its dir. What live test processes own is
    left alone. Returns what was swept."""
    swept = []
    for pw in pwd.getpwall():
        m = re.fullmatch(rf"{GECOS_TAG} owner=(\S+)", pw.pw_gecos)
        if m and pw.pw_name.startswith(USER_PREFIX) and _owner_gone(m.group(1)):
            delete_user(pw.pw_name)
            swept.append(pw.pw_name)
    for d in Path("/tmp").glob(DIR_PREFIX + "*"):
        try:
            owner = (d / "owner").read_text().strip()
        except OSError:
            continue
        if not _owner_gone(owner):
            continue
        with contextlib.suppress(OSError, ValueError):
            pid = int((d / "sshd.pid").read_text())
            fd = os.pidfd_open(pid)
            try:
                # sshd rewrites its title: "sshd: /usr/sbin/sshd -D -e -f CFG [listener] ..."
                title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                ours = os.readlink(f"/proc/{pid}/exe") == SSHD and f" -f {d / 'sshd_config'} " in f"{title} "
            except OSError:
                ours = False
            if ours:
                _stop_pidfds([fd], grace=3, limit=10)  # closes fd
            else:
                os.close(fd)
        shutil.rmtree(d, ignore_errors=True)
        swept.append(str(d))
    return swept


# ------------------------------------------------------------------ boxes


@dataclass
class Box:
    """One "remote box": a Unix user reached as `ssh -F config alias`; its home is the box's disk."""

    name: str
    alias: str  # the Host alias in `config` (== name)
    user: str
    uid: int
    gid: int
    home: Path
    config: Path  # the test's ssh_config; holds a Host entry for every box of the test
    port: int
    sshd: Sshd = field(repr=False)
    _cfgdir: Path = field(repr=False)
    _spawned: list[subprocess.Popen[bytes]] = field(default_factory=list, repr=False)

    # -- ssh --------------------------------------------------------

    def host_block(self, known_hosts: Path) -> str:
        return (
            f"Host {self.alias}\n"
            f"    HostName 127.0.0.1\n"
            f"    Port {self.port}\n"
            f"    User {self.user}\n"
            f"    IdentityFile {self.sshd.client_key}\n"
            f"    IdentitiesOnly yes\n"
            f"    UserKnownHostsFile {known_hosts}\n"
            f"    GlobalKnownHostsFile /dev/null\n"
            f"    StrictHostKeyChecking yes\n"
            f"    KexAlgorithms curve25519-sha256\n"  # half the handshake time of the default
        )

    def config_with_known_hosts(self, kind: KnownHostsKind) -> Path:
        """A new ssh_config with only this box's Host entry, whose known_hosts (a fresh file of its
        own) is `good` (the real host key), `empty` (host unknown) or `wrong` (another key for
        [127.0.0.1]:port: a changed host key)."""
        n = len(list(self._cfgdir.glob(f"ssh_config.{self.alias}.*")))
        known = self._cfgdir / f"known_hosts.{self.alias}.{kind}.{n}"
        line = {"good": self.sshd.known_hosts_line(), "empty": "", "wrong": None}[kind]
        if line is None:
            line = self.sshd.known_hosts_line(self.sshd.wrong_host_key)
        known.write_text(line)
        cfg = self._cfgdir / f"ssh_config.{self.alias}.{kind}.{n}"
        cfg.write_text(self.host_block(known))
        return cfg

    def ssh_argv(self, *opts: str, config: Path | None = None) -> list[str]:
        """`ssh -F CONFIG -o BatchMode=yes OPTS... ALIAS`: append the remote command (or use -N...)."""
        return ["ssh", "-F", str(config or self.config), "-o", "BatchMode=yes", *opts, self.alias]

    def ssh(
        self,
        cmd: str | Sequence[str],
        *,
        opts: Sequence[str] = (),
        config: Path | None = None,
        input: str | None = None,
        timeout: float = 60,
    ) -> subprocess.CompletedProcess[str]:
        """Run `cmd` on the box through the real ssh client. A str goes to the remote shell as is; a
        sequence is shell-quoted first."""
        remote = cmd if isinstance(cmd, str) else shlex.join(cmd)
        return subprocess.run(
            [*self.ssh_argv(*opts, config=config), remote],
            input=input,
            stdin=subprocess.DEVNULL if input is None else None,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    # -- local, as the box user --------------------------------------

    def _env(self, env: dict[str, str] | None) -> dict[str, str]:
        base = {
            "PATH": BOX_PATH,
            "HOME": str(self.home),
            "USER": self.user,
            "LOGNAME": self.user,
            "SHELL": "/bin/bash",
            "LANG": "C.UTF-8",
        }
        return {**base, **(env or {})}

    def run_as_box(
        self,
        argv: Sequence[str],
        *,
        input: str | None = None,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        timeout: float = 60,
    ) -> subprocess.CompletedProcess[str]:
        """Run `argv` locally as the box user (`runuser -u USER --`), in its home, with a clean env."""
        return subprocess.run(
            [RUNUSER, "-u", self.user, "--", *argv],
            input=input,
            stdin=subprocess.DEVNULL if input is None else None,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self._env(env),
            cwd=cwd or self.home,
        )

    def spawn_as_box(
        self,
        argv: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        stdout: int | None = subprocess.DEVNULL,
        stderr: int | None = subprocess.DEVNULL,
    ) -> subprocess.Popen[bytes]:
        """Start `argv` in the background as the box user; the teardown stops and reaps it."""
        proc = subprocess.Popen(
            [RUNUSER, "-u", self.user, "--", *argv],
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
            env=self._env(env),
            cwd=cwd or self.home,
        )
        self._spawned.append(proc)
        return proc

    def processes(self) -> list[int]:
        """PIDs of the live processes owned by the box user (from /proc)."""
        return uid_pids(self.uid)

    # -- box state ----------------------------------------------------

    def write_file(self, rel: str, text: str, mode: int = 0o644) -> Path:
        """Write HOME/rel (and its missing parent dirs), owned by the box user."""
        path = self.home / rel
        missing = [p for p in reversed(path.relative_to(self.home).parents) if not (self.home / p).exists()]
        path.parent.mkdir(parents=True, exist_ok=True)
        for p in missing:
            os.chown(self.home / p, self.uid, self.gid)
        path.write_text(text)
        path.chmod(mode)
        os.chown(path, self.uid, self.gid)
        return path

    def block_index(self) -> None:
        """Make the box's package index unreachable: pip's user config and PIP_INDEX_URL in .bashrc
        (non-interactive ssh commands) and .profile (login shells) point at 127.0.0.1:9, with no
        retries, so `pip download/install` fails within seconds."""
        self.write_file(
            ".config/pip/pip.conf",
            f"[global]\nindex-url = {BLOCKED_INDEX}\nretries = 0\ntimeout = 5\n",
        )
        line = f"export PIP_INDEX_URL={BLOCKED_INDEX} PIP_RETRIES=0\n"
        for rc in (".bashrc", ".profile"):
            old = (self.home / rc).read_text() if (self.home / rc).exists() else ""
            self.write_file(rc, old + line)

    def _teardown(self) -> list[str]:
        problems = delete_user(self.user)
        for proc in self._spawned:  # runuser (root) exits once the user's process is gone
            _wait_popen(proc, 10)
        return problems


class SshBoxFactory:
    """`ssh_box(name="a") -> Box`; all boxes of one test share `ssh_box.config`."""

    def __init__(self, sshd: Sshd) -> None:
        self.sshd = sshd
        self.dir = Path(tempfile.mkdtemp(prefix="cfg-", dir=sshd.private))  # 0700, root only
        self.config = self.dir / "ssh_config"
        self.known_hosts = self.dir / "known_hosts"
        self.known_hosts.write_text(sshd.known_hosts_line())
        self.config.write_text("")
        self.boxes: dict[str, Box] = {}

    def __call__(self, name: str = "a") -> Box:
        if name in self.boxes:
            raise ValueError(f"this test already has a box named {name!r}")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
            raise ValueError(f"{name!r} is not a plain Host alias")
        user, uid, gid, home = create_user(self.sshd.homes)
        box = Box(name, name, user, uid, gid, home, self.config, self.sshd.port, self.sshd, self.dir)
        self.boxes[name] = box
        box.write_file(".ssh/authorized_keys", self.sshd.client_pub + "\n", mode=0o600)
        (home / ".ssh").chmod(0o700)
        with self.config.open("a") as f:
            f.write(box.host_block(self.known_hosts))
        return box

    def close(self) -> list[str]:
        problems = [p for box in reversed(self.boxes.values()) for p in box._teardown()]
        shutil.rmtree(self.dir, ignore_errors=True)
        return problems


@pytest.fixture
def ssh_box(sshd: Sshd) -> Iterator[SshBoxFactory]:
    """Factory of boxes (dedicated users reached through the session's sshd); see the module doc."""
    factory = SshBoxFactory(sshd)
    try:
        yield factory
    finally:
        problems = factory.close()
        if problems:
            pytest.fail("ssh_box teardown: " + "; ".join(problems))
