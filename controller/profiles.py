"""Profiles: each platform's truth as typed, validated data (schema: profiles/README.md).

Shipped profiles live in the package `boxwarden_profiles`; a user's own file is read with the same
validation. Every problem is a UsageError naming the file, the field and the fix. Command templates
are argv lists whose `{placeholders}` may only be filled from validated values: a template that could
run a shell is refused here, before anything can run it.
"""

from __future__ import annotations

import datetime as dt
import math
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import blake3

from controller.errors import UsageError

KINDS = ("local", "ssh-rental", "cloud-api", "ssh", "slurm", "k8s")
MODES = ("argv", "manual", "none")
CHECKS = ("durable_writable", "inode_headroom", "watch_tier")
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
_BRACES = re.compile(r"\{([^{}]*)\}")


@dataclass(frozen=True)
class Poll:
    argv: tuple[str, ...]
    gone_exit_code: int | None
    gone_stdout: str | None
    interval_s: float


@dataclass(frozen=True)
class MeterStop:
    verb: str
    irreversible: bool
    mode: str
    argv: tuple[str, ...]
    manual: str
    timeout_s: int
    poll: Poll | None
    note: str
    verified: str  # when these facts were last checked (the profile's date unless given here)


@dataclass(frozen=True)
class Tier:
    name: str
    path: str
    survives_stop: bool
    survives_destroy: bool
    cap: str
    durable_default: bool
    note: str
    verified: str


@dataclass(frozen=True)
class Spot:
    available: bool
    grace_s: int
    signal: str


@dataclass(frozen=True)
class DangerClock:
    name: str
    after: str
    effect: str
    verified: str


@dataclass(frozen=True)
class Profile:
    name: str
    kind: str
    description: str
    verified: str
    sources: tuple[str, ...]
    meter_stop: MeterStop
    detach: str
    detach_note: str
    spot: Spot
    storage: tuple[Tier, ...]
    danger_clocks: tuple[DangerClock, ...]
    mirrors: Mapping[str, str]
    inode_cap: int | None
    inode_note: str
    gotchas: tuple[str, ...]
    checks: tuple[str, ...]
    inode_min_free: int
    source: str  # where it was read from: "shipped" or the file's path
    digest: str  # blake3 of the file's text: what `up` accepted is what `down` runs

    def survives_meter_stop(self, tier: Tier) -> bool:
        """Whether a tier's data is still there after this platform's meter-stop verb."""
        return tier.survives_destroy if self.meter_stop.irreversible else tier.survives_stop

    def tier_for(self, path: str, home: str) -> Tier | None:
        """The tier a box path lands on: the tier whose mount is the longest prefix of it."""
        best: tuple[int, Tier] | None = None
        for t in self.storage:
            mount = home + t.path[1:] if t.path.startswith("~") else t.path
            mount = mount.rstrip("/") or "/"
            inside = path == mount or path.startswith(mount.rstrip("/") + "/")
            if inside and (best is None or len(mount) > best[0]):
                best = (len(mount), t)
        return best[1] if best else None


class _Fields:
    """One TOML table being read: typed getters that remember what was read, so that anything left
    over is reported as an unknown field."""

    def __init__(self, data: Mapping[str, Any], where: str, file: str) -> None:
        self._data = data
        self._where = where
        self._file = file
        self._seen: set[str] = set()

    def fail(self, key: str, problem: str) -> UsageError:
        field = f"{self._where}.{key}" if self._where else key
        return UsageError(f"{self._file}: field {field}: {problem} (the schema is in profiles/README.md)")

    def _get(self, key: str, kind: type | tuple[type, ...], what: str, required: bool) -> Any:
        self._seen.add(key)
        if key not in self._data:
            if required:
                raise self.fail(key, f"missing; add {what}")
            return None
        value = self._data[key]
        # bool is an int in Python; a TOML boolean is never a number here.
        if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _as_tuple(kind)):
            raise self.fail(key, f"must be {what}, not {type(value).__name__} {value!r}")
        return value

    def text(self, key: str, *, required: bool = True, default: str = "") -> str:
        v = self._get(key, str, "a string", required)
        if v is not None and required and not v.strip():
            raise self.fail(key, "must not be empty")
        return default if v is None else str(v)

    def flag(self, key: str, *, required: bool = True, default: bool = False) -> bool:
        v = self._get(key, bool, "true or false", required)
        return default if v is None else bool(v)

    def integer(
        self, key: str, *, required: bool = True, default: int | None = None, minimum: int = 0
    ) -> int | None:
        v = self._get(key, int, "an integer", required)
        if v is None:
            return default
        if v < minimum:
            raise self.fail(key, f"must be at least {minimum}, not {v}")
        return int(v)

    def number(self, key: str, *, default: float, maximum: float) -> float:
        v = self._get(key, (int, float), "a number", False)
        if v is None:
            return default
        if not math.isfinite(v) or not 0 < v <= maximum:
            raise self.fail(key, f"must be a number above 0 and at most {maximum:g}, not {v}")
        return float(v)

    def texts(self, key: str, *, required: bool = False) -> tuple[str, ...]:
        v = self._get(key, list, "an array of strings", required)
        if v is None:
            return ()
        if not all(isinstance(x, str) and x for x in v):
            raise self.fail(key, "must be an array of non-empty strings")
        return tuple(v)

    def table(self, key: str) -> _Fields:
        v = self._get(key, dict, f"a [{key}] table", True)
        return _Fields(v, f"{self._where}.{key}" if self._where else key, self._file)

    def tables(self, key: str) -> list[_Fields]:
        v = self._get(key, list, f"an array of [[{key}]] tables", False)
        if v is None:
            return []
        if not all(isinstance(x, dict) for x in v):
            raise self.fail(key, f"must be an array of [[{key}]] tables")
        return [_Fields(x, f"{key}[{i}]", self._file) for i, x in enumerate(v)]

    def optional_table(self, key: str) -> _Fields | None:
        return self.table(key) if key in self._data else None

    def done(self) -> None:
        unknown = sorted(set(self._data) - self._seen)
        if unknown:
            raise self.fail(unknown[0], "unknown field; remove it or check its spelling")


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _base(arg: str) -> str:
    """A program's name without its directory or version suffix (`/usr/bin/bash5.2` → `bash`)."""
    return re.sub(r"[0-9.\-]+$", "", arg.rsplit("/", 1)[-1])


def check_template(argv: tuple[str, ...], f: _Fields, key: str) -> None:
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
        for name in _BRACES.findall(arg):
            if name not in PLACEHOLDERS:
                allowed = ", ".join("{" + p + "}" for p in PLACEHOLDERS)
                raise f.fail(key, f"unknown placeholder {{{name}}} in {arg!r}; allowed: {allowed}")
        if "{" in _BRACES.sub("", arg) or "}" in _BRACES.sub("", arg):
            raise f.fail(key, f"unbalanced brace in {arg!r}")


def placeholders(profile: Profile) -> set[str]:
    """The placeholders the profile's commands need."""
    ms = profile.meter_stop
    argvs = [*ms.argv, *(ms.poll.argv if ms.poll else ())]
    return {name for arg in argvs for name in _BRACES.findall(arg)}


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

        out.append(_BRACES.sub(sub, arg))
    return out


def parse(data: Mapping[str, Any], *, file: str, stem: str, digest: str = "") -> Profile:
    f = _Fields(data, "", file)
    name = f.text("name")
    if name != stem:
        raise f.fail("name", f"is {name!r} but the file is {stem}.toml; make them the same")
    kind = f.text("kind")
    if kind not in KINDS:
        raise f.fail("kind", f"{kind!r} is not one of {', '.join(KINDS)}")
    verified = _date(f, "", required=True)
    ms = _meter_stop(f.table("meter_stop"), verified)
    if ms.mode == "none" and kind != "local":
        raise f.fail("meter_stop.mode", f"'none' (nothing bills) is only true of kind local, not {kind}")
    detach = f.table("detach")
    detach_primitive, detach_note = detach.text("primitive"), detach.text("note", required=False)
    detach.done()
    sp = f.table("spot")
    spot = Spot(sp.flag("available"), sp.integer("grace_s") or 0, sp.text("signal", required=False))
    if spot.available and spot.grace_s and not spot.signal:
        raise sp.fail("signal", "a preempted job gets a grace period, so name the signal that starts it")
    sp.done()
    storage = tuple(_tier(t, verified) for t in f.tables("storage"))
    if sum(t.durable_default for t in storage) > 1:
        raise f.fail("storage", "more than one tier has durable_default = true; keep one")
    clocks = []
    for c in f.tables("danger_clocks"):
        clocks.append(DangerClock(c.text("name"), c.text("after"), c.text("effect"), _date(c, verified)))
        c.done()
    mirrors: dict[str, str] = {}
    mt = f.optional_table("mirrors")
    if mt is not None:
        for key in ("pip_index", "hf_endpoint", "note"):
            value = mt.text(key, required=False)
            if value:
                mirrors[key] = value
        mt.done()
    checks = f.texts("checks") or CHECKS
    for check in checks:
        if check not in CHECKS:
            raise f.fail("checks", f"unknown check {check!r}; known: {', '.join(CHECKS)}")
    profile = Profile(
        name=name,
        kind=kind,
        description=f.text("description"),
        verified=verified,
        sources=f.texts("sources"),
        meter_stop=ms,
        detach=detach_primitive,
        detach_note=detach_note,
        spot=spot,
        storage=storage,
        danger_clocks=tuple(clocks),
        mirrors=mirrors,
        inode_cap=f.integer("inode_cap", required=False),
        inode_note=f.text("inode_note", required=False),
        gotchas=f.texts("gotchas"),
        checks=checks,
        inode_min_free=f.integer("inode_min_free", required=False, default=10000) or 0,
        source=file,
        digest=digest,
    )
    f.done()
    return profile


_DATE = re.compile(r"\d{4}-\d{2}(-\d{2})?")


def _date(f: _Fields, default: str, *, required: bool = False) -> str:
    """`verified`: a date (YYYY-MM-DD, or YYYY-MM when only the month is known); `default` if absent."""
    value = f.text("verified", required=required)
    if not value:
        return default
    ok = _DATE.fullmatch(value) is not None
    if ok:
        try:
            dt.date.fromisoformat(value if len(value) == 10 else value + "-01")
        except ValueError:
            ok = False
    if not ok:
        raise f.fail("verified", f"{value!r} is not a date like 2026-11-30 (or 2026-11)")
    return value


def _meter_stop(t: _Fields, verified: str) -> MeterStop:
    verb, irreversible, mode = t.text("verb"), t.flag("irreversible"), t.text("mode")
    if mode not in MODES:
        raise t.fail("mode", f"{mode!r} is not one of {', '.join(MODES)}")
    argv = t.texts("argv", required=mode == "argv")
    if argv:
        check_template(argv, t, "argv")
    manual = t.text("manual", required=mode == "manual")
    timeout = t.integer("timeout_s", required=mode == "argv", default=0, minimum=1) or 0
    if timeout > 86400:
        raise t.fail("timeout_s", f"{timeout} is more than a day; a meter stop that slow needs a human")
    poll = None
    if mode == "argv":
        p = t.table("poll")
        pargv = p.texts("argv", required=True)
        check_template(pargv, p, "argv")
        code = p.integer("gone_exit_code", required=False, minimum=0)
        if code in (126, 127):
            raise p.fail("gone_exit_code", f"{code} means the poll command could not run; it proves nothing")
        text = p.text("gone_stdout", required=False) or None
        if (code is None) == (text is None):
            raise p.fail(
                "gone_exit_code", "give exactly one of gone_exit_code or gone_stdout (proof it is gone)"
            )
        poll = Poll(pargv, code, text, p.number("interval_s", default=5.0, maximum=3600))
        p.done()
    note = t.text("note", required=False)
    when = _date(t, verified)
    t.done()
    return MeterStop(verb, irreversible, mode, argv, manual, timeout, poll, note, when)


def _tier(t: _Fields, verified: str) -> Tier:
    tier = Tier(
        name=t.text("name"),
        path=t.text("path"),
        survives_stop=t.flag("survives_stop"),
        survives_destroy=t.flag("survives_destroy"),
        cap=t.text("cap", required=False),
        durable_default=t.flag("durable_default", required=False),
        note=t.text("note", required=False),
        verified=_date(t, verified),
    )
    if not (tier.path.startswith("/") or tier.path.startswith("~")):
        raise t.fail("path", f"{tier.path!r} must be absolute (or start with ~)")
    t.done()
    return tier


def load_file(path: Path) -> Profile:
    """Read and validate a profile file (a user's own, or a shipped one)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise UsageError(f"{path}: cannot read the profile: {e.strerror}") from e
    return _loads(text, file=str(path), stem=path.stem)


def _loads(text: str, *, file: str, stem: str) -> Profile:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"{file}: not valid TOML: {e}") from e
    return parse(data, file=file, stem=stem, digest=blake3.blake3(text.encode()).hexdigest())


def available() -> list[str]:
    root = resources.files("boxwarden_profiles")
    return sorted(p.name.removesuffix(".toml") for p in root.iterdir() if p.name.endswith(".toml"))


def load(name: str) -> Profile:
    """A shipped profile by name."""
    if name not in available():
        names = ", ".join(available())
        raise UsageError(f"unknown profile {name!r}; available: {names} (or --profile-file PATH)")
    text = resources.files("boxwarden_profiles").joinpath(f"{name}.toml").read_text(encoding="utf-8")
    return _loads(text, file=f"profiles/{name}.toml", stem=name)


def resolve(name: str | None, file: Path | None) -> Profile:
    """The profile named on the command line: --profile NAME or --profile-file PATH (not both)."""
    if (name is None) == (file is None):
        raise UsageError("give exactly one of --profile NAME or --profile-file PATH")
    return load_file(file) if file is not None else load(str(name))
