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
INTERPRETERS = re.compile(
    r"(python|pypy|perl|ruby|node|nodejs|bun|php|lua|luajit|tclsh|wish|julia|Rscript|osascript|expect)"
    r"[0-9.]*"
)
# Interpreters whose first operand is the program itself: any use runs code from the command line.
CODE_OPERAND = frozenset({"awk", "gawk", "mawk", "nawk", "sed"})
# Short options (as letters) and long options that run code given on the command line, over all the
# interpreters above (python -c; perl -e -E -M; ruby -e; node -e -p; php -r -R -B -E; julia -e -E).
# A letter counts anywhere in a short-option cluster (`-Sc`, `-cprint(1)`, `-pe`): the code flag's
# value may be glued on. This also refuses a few harmless clusters (`-Wignore`, `python3 -B`); a
# profile command has no need of them.
CODE_LETTERS = frozenset("ceEprRBM")
CODE_LONG = frozenset({"--eval", "--command", "--print", "--exec", "--execute", "--code", "--run"})
SHELL_META = re.compile(r"[;&|`$<>()*?\s\\\"']")
BRACES = re.compile(r"\{([^{}]*)\}")


def _base(arg: str) -> str:
    """A program's name without its directory or version suffix (`/usr/bin/bash5.2` → `bash`)."""
    return re.sub(r"[0-9.\-]+$", "", arg.rsplit("/", 1)[-1])


def code_flag(arg: str) -> bool:
    """Whether an interpreter's argument runs code given on the command line: a code option alone
    (`-c`), in a short-option cluster or with its value glued on (`-Sc`, `-cprint(1)`, `-E1`), or a
    long code option, alone or with `=` (`--eval`, `--eval=...`)."""
    if arg.startswith("--"):
        return arg.split("=", 1)[0] in CODE_LONG
    return arg.startswith("-") and any(ch in CODE_LETTERS for ch in arg[1:])


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
    if program in CODE_OPERAND:
        raise f.fail(key, f"runs {argv[0]!r}, whose program is given on the command line; name a program")
    for i, arg in enumerate(argv):
        if i and _base(arg) in SHELLS and i + 1 < len(argv) and argv[i + 1].startswith("-"):
            raise f.fail(key, f"passes a shell command ({arg!r} {argv[i + 1]!r}); give the program directly")
        # The program, or a command handed on after `--` (`kubectl exec p -- python3 -c ...`).
        runs = (i == 0 or argv[i - 1] == "--") and INTERPRETERS.fullmatch(_base(arg))
        flag = next((a for a in argv[i + 1 :] if code_flag(a)), None) if runs else None
        if flag is not None:
            raise f.fail(
                key,
                f"runs code given on the command line ({arg!r} {flag!r}); name a program instead "
                "(an option's value goes as its own argument: -W ignore, not -Wignore)",
            )
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
