"""Profiles: each platform's truth as typed, validated data (schema: profiles/README.md).

Shipped profiles live in the package `boxwarden_profiles`; a user's own file is read with the same
validation. Every problem is a UsageError naming the file, the field and the fix. Command templates
are argv lists whose `{placeholders}` may only be filled from validated values: a template that could
run a shell is refused here, before anything can run it.
"""

from __future__ import annotations

import datetime as dt
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import blake3

from controller.errors import UsageError
from controller.templates import BRACES, check_template
from controller.tomlfields import Fields, read_text

KINDS = ("local", "ssh-rental", "cloud-api", "ssh", "slurm", "k8s")
MODES = ("argv", "manual", "none")
CHECKS = ("durable_writable", "inode_headroom", "watch_tier")


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


def placeholders(profile: Profile) -> set[str]:
    """The placeholders the profile's commands need."""
    ms = profile.meter_stop
    argvs = [*ms.argv, *(ms.poll.argv if ms.poll else ())]
    return {name for arg in argvs for name in BRACES.findall(arg)}


def parse(data: Mapping[str, Any], *, file: str, stem: str, digest: str = "") -> Profile:
    f = Fields(data, "", file)
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


def _date(f: Fields, default: str, *, required: bool = False) -> str:
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


def _meter_stop(t: Fields, verified: str) -> MeterStop:
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


def _tier(t: Fields, verified: str) -> Tier:
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
    if not (tier.path.startswith("/") or tier.path == "~" or tier.path.startswith("~/")):
        raise t.fail("path", f"{tier.path!r} must be absolute (or ~, or start with ~/)")
    t.done()
    return tier


MAX_PROFILE_BYTES = 1 << 20


def load_file(path: Path) -> Profile:
    """Read and validate a profile file (a user's own, or a shipped one): a regular file of at most
    1 MiB of UTF-8, checked on the open file before reading (a FIFO or /dev/zero would never end)."""
    text = read_text(path, what="the profile", option="--profile-file", max_bytes=MAX_PROFILE_BYTES)
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
