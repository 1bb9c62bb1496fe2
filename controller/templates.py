"""Command templates in profiles: argv lists whose `{placeholders}` may only be filled from validated
values. Anything that could run a shell, run code given on its command line, hide the real program
behind a wrapper, or take unvalidated input is refused when the profile is read."""

from __future__ import annotations

import re
from collections.abc import Mapping

from controller.errors import UsageError
from controller.tomlfields import Fields

PLACEHOLDERS = {
    "instance_id": re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}"),
    "box": re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}"),
}
SHELLS = frozenset(
    {
        "sh",
        "bash",
        "zsh",
        "dash",
        "fish",
        "ksh",
        "mksh",
        "csh",
        "tcsh",
        "ash",
        "busybox",
        "eval",
        "exec",
        "source",
    }
)
# Programs that run another program (or a remote shell): the real command would hide behind them.
WRAPPERS = frozenset(
    {
        "env",
        "sudo",
        "doas",
        "nice",
        "ionice",
        "chrt",
        "timeout",
        "nohup",
        "setsid",
        "xargs",
        "stdbuf",
        "command",
        "time",
        "watch",
        "ssh",
        "rsh",
        "su",
        "runuser",
        "script",
    }
)
# Interpreters that take code on the command line.
INTERPRETERS = re.compile(r"(python|perl|ruby|node|nodejs|php|lua|tclsh|awk|gawk|osascript)[0-9.]*")
CODE_FLAGS = frozenset({"-c", "-e", "-E", "--eval", "--command", "-r"})
SHELL_META = re.compile(r"[;&|`$<>()*?\s\\\"']")
BRACES = re.compile(r"\{([^{}]*)\}")


def _base(arg: str) -> str:
    """A program's name without its directory or version suffix (`/usr/bin/bash5.2` → `bash`)."""
    return re.sub(r"[0-9.\-]+$", "", arg.rsplit("/", 1)[-1])


def check_template(argv: tuple[str, ...], f: Fields, key: str) -> None:
    """Refuse anything that could make a profile command run a shell, run code given on its command
    line, hide the real program behind a wrapper, or take unvalidated input."""
    if not argv:
        raise f.fail(key, "must name a program and its arguments")
    program = _base(argv[0])
    if program in SHELLS:
        raise f.fail(key, f"runs a shell ({argv[0]!r}); give the program and its arguments directly")
    if program in WRAPPERS:
        raise f.fail(key, f"runs {argv[0]!r}, which runs another command; name the real program directly")
    if INTERPRETERS.fullmatch(program) and any(a in CODE_FLAGS for a in argv[1:]):
        raise f.fail(key, f"runs code given on the command line ({argv[0]!r} -c/-e); name a program instead")
    for i, arg in enumerate(argv[1:], start=1):
        if _base(arg) in SHELLS and i + 1 < len(argv) and argv[i + 1].startswith("-c"):
            raise f.fail(key, f"passes a shell command ({arg!r} {argv[i + 1]!r}); give the program directly")
    if SHELL_META.search(argv[0]) or "{" in argv[0]:
        raise f.fail(key, f"program {argv[0]!r} must be a plain program name or path, without placeholders")
    for arg in argv:
        for name in BRACES.findall(arg):
            if name not in PLACEHOLDERS:
                allowed = ", ".join("{" + p + "}" for p in PLACEHOLDERS)
                raise f.fail(key, f"unknown placeholder {{{name}}} in {arg!r}; allowed: {allowed}")
        if "{" in BRACES.sub("", arg) or "}" in BRACES.sub("", arg):
            raise f.fail(key, f"unbalanced brace in {arg!r}")


def fill(argv: tuple[str, ...], values: Mapping[str, str]) -> list[str]:
    """The argv with placeholders replaced; every value is checked against its pattern first."""
    out = []
    for arg in argv:

        def sub(m: re.Match[str]) -> str:
            name = m.group(1)
            value = values.get(name, "")
            if not value:
                raise UsageError(
                    f"the meter-stop command needs {{{name}}}: give it at `up` (--instance-id ID)"
                )
            if not PLACEHOLDERS[name].fullmatch(value):
                raise UsageError(f"{name} {value!r} is not allowed in a command")
            return value

        out.append(BRACES.sub(sub, arg))
    return out
