"""Every `ssh` command line boxwarden runs, built by pure functions (and checked by unit tests).

The user's OpenSSH does the work, so their `~/.ssh/config`, ProxyJump, agent and certificates
apply. boxwarden adds only what keeps it from hanging (BatchMode: a prompt fails at once instead
of waiting for a keyboard; keepalives; a connect timeout) and its multiplexing; it never sets
anything about host keys, so host-key checking is exactly what the user configured. No remote
command is ever passed unquoted: each argument goes through `shlex.quote`.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from controller.errors import UsageError

# A destination as `ssh` takes it: an alias, host, user@host or ssh://user@host:port. No leading
# `-` (it would be read as an option), no whitespace, no control characters.
_DEST_BAD = re.compile(r"[\s\x00-\x1f\x7f-\x9f]")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_OPTION_KEY = re.compile(r"[A-Za-z][A-Za-z0-9]{0,63}")
OWNED_OPTIONS = frozenset(
    {
        "batchmode",
        "controlmaster",
        "controlpath",
        "controlpersist",
        "exitonforwardfailure",
        "streamlocalbindunlink",
    }
)
"""Options boxwarden sets itself: a user's value for one would break the link or make it hang."""
_RUNS = "runs a command on this machine"
_LOADS = "loads a library into ssh on this machine"
_HOST_KEY = "weakens the check of the box's host key (a machine in the middle could pose as the box)"
_PORTS = "opens ports or sockets between this machine and the box"
PLAN_REFUSED = {
    # Runs or loads code here.
    "proxycommand": f"{_RUNS} to reach the box",
    "proxyusefdpass": "takes the connection from a ProxyCommand, which runs a command on this machine",
    "localcommand": f"{_RUNS} once connected",
    "permitlocalcommand": "lets LocalCommand run a command on this machine",
    "remotecommand": "runs its own command on the box",
    "knownhostscommand": f"{_RUNS} to list host keys",
    "pkcs11provider": _LOADS,
    "securitykeyprovider": _LOADS,
    "xauthlocation": "names a program ssh runs on this machine",
    "match": "`Match exec` runs a command on this machine",
    "include": "reads another config file, which may run commands",
    # Sends data or secrets of this machine, or lets the box act as you.
    "sendenv": "sends variables of this machine's environment to the box (cloud keys, tokens)",
    "setenv": "sets variables in the box's login environment",
    "forwardagent": "hands your SSH agent to the box, which can then log in as you elsewhere",
    "identityagent": "makes ssh use another agent than yours",
    "addkeystoagent": "adds keys to your SSH agent",
    "identityfile": "chooses which of this machine's keys ssh reads and offers",
    "certificatefile": "chooses which of this machine's certificates ssh reads and offers",
    "hostbasedauthentication": "logs in with this machine's own host key",
    "enablesshkeysign": "lets ssh read this machine's host key to log in with it",
    "forwardx11": "hands your X display (its screen and keystrokes) to the box",
    "forwardx11trusted": "hands your X display to the box with no restriction",
    # Weakens the check of the box's host key.
    "stricthostkeychecking": _HOST_KEY,
    "userknownhostsfile": _HOST_KEY,
    "globalknownhostsfile": _HOST_KEY,
    "hostkeyalias": _HOST_KEY,
    "hostkeyalgorithms": _HOST_KEY,
    "checkhostip": _HOST_KEY,
    "verifyhostkeydns": _HOST_KEY + " (it trusts DNS)",
    "updatehostkeys": "rewrites your known_hosts file with keys the box offers",
    "nohostauthenticationforlocalhost": _HOST_KEY,
    # Opens ports.
    "localforward": _PORTS,
    "dynamicforward": _PORTS,
    "remoteforward": "lets the box reach ports or sockets on this machine's side",
    "gatewayports": "lets other machines reach the ports ssh forwards",
    "tunnel": "opens a network device between this machine and the box",
    "tunneldevice": "opens a network device between this machine and the box",
}
"""ssh_config options (man ssh_config) a plan file, which may come from someone else, gives only with
`fanout up --trust-plan`: those that run or load code on this machine, send its data or secrets,
let the box act as you, weaken the check of the box's host key, or open ports. What the user types
(`up --ssh-option`) is theirs. ProxyJump runs only ssh itself (checking the jump host's key as
configured): not listed."""
# The values that make an option of PLAN_REFUSED harmless (the default of each is "none").
_HARMLESS = {
    "permitlocalcommand": ("no",),
    "forwardagent": ("no",),
    "identityagent": ("none", "ssh_auth_sock"),
    "addkeystoagent": ("no",),
    "hostbasedauthentication": ("no",),
    "enablesshkeysign": ("no",),
    "forwardx11": ("no",),
    "forwardx11trusted": ("no",),
    "stricthostkeychecking": ("yes",),
    "checkhostip": ("yes",),
    "verifyhostkeydns": ("no",),
    "updatehostkeys": ("no",),
    "nohostauthenticationforlocalhost": ("no",),
    "gatewayports": ("no",),
    "tunnel": ("no",),
    "proxyusefdpass": ("no",),
}
KEEPALIVE = ("ServerAliveInterval=15", "ServerAliveCountMax=4")
CONNECT_TIMEOUT = "ConnectTimeout=15"
CONTROL_PERSIST = "10m"


def check_destination(dest: str) -> str:
    if not dest or dest.startswith("-") or _DEST_BAD.search(dest):
        raise UsageError(
            f"--host {dest!r} is not an SSH destination: give an alias from ~/.ssh/config or user@host "
            "(no leading '-', no spaces or control characters); put ssh options in --ssh-option KEY=VALUE"
        )
    return dest


def check_option(text: str) -> tuple[str, str]:
    """`KEY=VALUE` as `ssh -o` takes it, for an option boxwarden does not set itself."""
    key, eq, value = text.partition("=")
    if not eq or not _OPTION_KEY.fullmatch(key) or not value.strip() or _CONTROL.search(value):
        raise UsageError(
            f"--ssh-option {text!r}: give KEY=VALUE, e.g. --ssh-option Port=2222 (no control characters)"
        )
    if key.lower() in OWNED_OPTIONS:
        raise UsageError(f"--ssh-option {key}: boxwarden sets {key} itself; leave it out")
    return key, value


PLAN_TAKEN = frozenset(
    {
        "port", "user", "hostname", "proxyjump", "connecttimeout", "connectionattempts",
        "serveraliveinterval", "serveralivecountmax", "tcpkeepalive", "compression", "ipqos",
        "addressfamily", "loglevel", "preferredauthentications", "pubkeyauthentication",
        "passwordauthentication", "kbdinteractiveauthentication", "numberofpasswordprompts",
        "rekeylimit",
    }
)  # fmt: skip
"""The only ssh options a plan may set unasked: where the box is and how long to wait for it. Any
other (the list of what some do is PLAN_REFUSED; new ones come with every OpenSSH release) needs
`fanout up --trust-plan`."""


_NOT_TAKEN = "is none of the options a plan may set unasked (where the box is, how long to wait for it)"


def plan_refuses(key: str, value: str) -> str:
    """What option `key` set to `value` would make ssh do that a plan may not ask unasked ("" if
    nothing: one of PLAN_TAKEN, or a refused one set to a harmless value)."""
    k = key.lower()
    if k in PLAN_TAKEN or (k in PLAN_REFUSED and value.strip().lower() in _HARMLESS.get(k, ("none",))):
        return ""
    return PLAN_REFUSED.get(
        k, "is none of the options a plan may set unasked (where the box is, how long to wait)"
    )


def check_plan_option(text: str, where: str) -> tuple[str, str]:
    """A plan's ssh option, checked as `check_option` does (`where`: the file and line, for the
    message): the option as KEY=VALUE, and what it asks that a plan may not unasked ("": nothing;
    else "KEY why", taken only with `fanout up --trust-plan`: see PLAN_REFUSED)."""
    try:
        key, value = check_option(text)
    except UsageError as e:
        raise UsageError(f"{where}: field ssh_options: {e}") from None
    why = plan_refuses(key, value)
    return f"{key}={value}", f"{key} {why}" if why else ""


@dataclass(frozen=True)
class Destination:
    """A box as `ssh` reaches it: the destination, the user's options, an ssh_config file."""

    dest: str
    options: tuple[str, ...] = ()  # KEY=VALUE, each checked
    config: str = ""  # ssh -F FILE; empty: the user's own ~/.ssh/config

    def base(self) -> list[str]:
        argv = ["ssh"]
        if self.config:
            argv += ["-F", self.config]
        for opt in self.options:  # the user's first: for most options ssh keeps the first value
            argv += ["-o", opt]
        argv += ["-o", "BatchMode=yes", "-o", CONNECT_TIMEOUT]
        for opt in KEEPALIVE:
            argv += ["-o", opt]
        return argv


def remote_command(argv: Sequence[str]) -> str:
    """One command line for the box's login shell, every word quoted: it runs `argv` exactly."""
    return "exec " + " ".join(shlex.quote(a) for a in argv)


def master(d: Destination, control: str, forward: tuple[str, str] | None = None) -> list[str]:
    """Start the ControlMaster in the background once authenticated (-f -N); it persists after the
    last client leaves, so the next command of this box reuses it. `forward`: (local socket, box
    socket) to forward from the start, as `forward` would ask of it later."""
    fwd = ["-L", f"{forward[0]}:{forward[1]}"] if forward else []
    return [
        *d.base(),
        "-o", "ControlMaster=yes",
        "-o", f"ControlPath={control}",
        "-o", f"ControlPersist={CONTROL_PERSIST}",
        "-o", "StreamLocalBindUnlink=yes",
        "-o", "ExitOnForwardFailure=yes",
        *fwd, "-f", "-N", "--", d.dest,
    ]  # fmt: skip


def control(d: Destination, control_path: str, op: str) -> list[str]:
    """`ssh -O check|exit` on the box's master."""
    return [*d.base(), "-o", f"ControlPath={control_path}", "-O", op, "--", d.dest]


def forward(d: Destination, control_path: str, local: str, remote: str, *, cancel: bool = False) -> list[str]:
    """Ask the master to forward the local Unix socket `local` to the box's socket `remote`."""
    op = "cancel" if cancel else "forward"
    return [*d.base(), "-o", f"ControlPath={control_path}", "-O", op, "-L", f"{local}:{remote}", "--", d.dest]


def command(d: Destination, remote_argv: Sequence[str], control_path: str | None) -> list[str]:
    """Run `remote_argv` on the box, through the master when there is one."""
    mux = ["-o", f"ControlPath={control_path}", "-o", "ControlMaster=no"] if control_path else []
    return [*d.base(), *mux, "-T", "--", d.dest, remote_command(remote_argv)]


def tunnel(d: Destination, port: int, remote: str) -> list[str]:
    """A forward of its own from a loopback TCP port to the box's socket (no ControlMaster: what
    OpenSSH on Windows can do)."""
    return [
        *d.base(),
        "-o", "ExitOnForwardFailure=yes",
        "-o", "ControlMaster=no",
        "-o", "ControlPath=none",
        "-N", "-L", f"127.0.0.1:{port}:{remote}", "--", d.dest,
    ]  # fmt: skip
