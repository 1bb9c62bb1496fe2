"""Start the SSH masters a command will need while Python still loads the rest of the CLI.

`boxwarden pull NAME` for a box whose master is down spends a login (0.1–0.3 s) and the CLI's
imports (about 0.3 s) one after the other; started here, first thing, the login runs meanwhile.
Best effort: on any doubt (no state yet, a name that is no remote box, tcp mode) nothing starts,
and whatever goes wrong here is met again, and reported, by the command itself.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from controller.state import State, default_home

BOX_COMMANDS = frozenset({"status", "pull", "artifacts", "logs", "events", "run", "stop", "down", "drain"})
MAX_BOXES = 16


def box_names(argv: Sequence[str]) -> tuple[str, tuple[str, ...]]:
    """The command and the box names it is given (`status` takes several, the others one), read
    from argv as the CLI will parse it; options are skipped, and a value that follows one is never
    taken for a name (a name that is not a box only means nothing is warmed)."""
    words = [a for a in argv if not a.startswith("-")]
    if not words or words[0] not in BOX_COMMANDS:
        return "", ()
    command = words[0]
    after = list(argv[argv.index(command) + 1 :])
    names: list[str] = []
    for a in after:
        if a.startswith("-"):
            break
        names.append(a)
    return command, tuple(names if command == "status" else names[:1])


def start(argv: Sequence[str], env: Mapping[str, str]) -> list[threading.Thread]:
    """Start, each in a daemon thread, the master of every remote box the command will reach."""
    from controller.ssh import argv as sshargv
    from controller.ssh import master

    command, names = box_names(argv)
    threads: list[threading.Thread] = []
    with contextlib.suppress(Exception):  # a bad BOXWARDEN_SSH_MODE, a state being written...
        if not command or master.default_mode(env) != "master":
            return []
        for box in State.peek(default_home(env), names or None)[:MAX_BOXES]:
            if not box.host or box.status == "down":
                continue
            dest = sshargv.Destination(box.host, box.ssh_options, box.ssh_config)
            paths = master.LinkPaths.for_box(Path(box.box_dir).parent.parent, box.name, dest)
            t = threading.Thread(target=_quietly, args=(master.ensure, dest, paths, box.socket), daemon=True)
            t.start()
            threads.append(t)
    return threads


def _quietly(fn: object, *args: object) -> None:
    with contextlib.suppress(Exception):
        fn(*args)  # type: ignore[operator]
