"""Box services: what each CLI command does, as one coroutine per command (the CLI parses and renders).

They own the translation from user input to a `Box` record and from the sidecar's answers to the
plain rows the renderer shows.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from boxwarden_pb.v1 import sidecar_pb2 as pb

from controller import bootstrap, checks, gate, meterstop, profiles, teardown, templates
from controller.errors import ControllerError, SidecarUnreachable, StateError, UsageError
from controller.manifest import PARTS_DIR, REPLACED_DIR, RESERVED_NAMES
from controller.overlap import pseudo_filesystem, same_dir_above
from controller.pull import Progress, PullReport, pull
from controller.reach import connect
from controller.state import Box, State

NAME_CHARS = "letters, digits, '.', '_' or '-' (at most 64, starting with a letter or digit)"
NAME_RULE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
RUN_ID_CHARS = "letters, digits, '.', '_', ':' or '-' (at most 128, starting with a letter or digit)"
RUN_ID_RULE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")  # SidecarConfig.run_id
# C0 controls (NUL included), DEL and C1 controls: never part of a path a user means to give.
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def check_name(name: str, what: str = "box name") -> str:
    """A box name or a roster cell: one safe path component."""
    if not NAME_RULE.fullmatch(name):
        raise UsageError(f"{what} {name!r} is not allowed: use {NAME_CHARS}")
    return name


def check_run_id(run_id: str) -> str:
    if not RUN_ID_RULE.fullmatch(run_id):
        raise UsageError(f"run id {run_id!r} is not allowed: use {RUN_ID_CHARS}")
    return run_id


def check_path_text(path: Path | str, what: str) -> None:
    """Refuse control characters (a NUL, a newline, an escape) in a path the user gave, and names
    that are not UTF-8 (the box's config, the evidence and every message carry paths as text)."""
    text = str(path)
    if CONTROL.search(text):
        raise UsageError(f"{what} {text!r} contains a control character; give the path without it")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise UsageError(
            f"{what} {text!r} is not valid UTF-8 (a name from another encoding); rename it, or give "
            "another path"
        ) from None


def check_dir_target(path: Path, what: str) -> None:
    """`path` is a directory or can become one: it is not a file, and neither is its nearest
    existing ancestor (`FILE/sub` can never be made)."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        where = "" if probe == path else f" (it is under {probe}, which is not a directory)"
        raise UsageError(f"{what} {path} is not a directory{where}; give a directory")


def check_real_filesystem(path: Path, what: str) -> None:
    """A directory `up` gives the box lies on a filesystem that stores files: on proc, sysfs and the
    like nothing can be sealed or copied (every file would show NOT_DURABLE with an odd error)."""
    kind = pseudo_filesystem(path)
    if kind is not None:
        raise UsageError(
            f"{what} {path} is on a {kind} pseudo-filesystem, which stores no files: give a directory "
            "on a real filesystem"
        )


def durable_dir(url: str) -> Path:
    if CONTROL.search(url):
        raise UsageError(f"durable URL {url!r} contains a control character; give the URL without it")
    u = urlparse(url)
    if u.scheme != "file" or u.netloc not in ("", "localhost") or not u.path.startswith("/"):
        raise UsageError(f"durable URL {url!r}: this version supports file:///absolute/dir only")
    path = unquote(u.path)
    if CONTROL.search(path):  # a %00 or %0a decodes to one
        raise UsageError(f"durable URL {url!r} decodes to a path with a control character; remove it")
    return Path(path)


def prepare_durable(ddir: Path, *, own_default: bool) -> Path:
    """Make the durable directory ready without ever creating a durable volume's parent: a missing
    parent is an unmounted volume, and creating it would put the copies on the box's own disk.
    Only the default durable dir (under the box's own state dir) may be created with its parents."""
    if ddir.exists() and not ddir.is_dir():
        raise UsageError(f"the durable path {ddir} is not a directory; give --durable file:///DIR of one")
    if not own_default and not ddir.is_dir():
        parent = ddir.parent
        if parent.exists() and not parent.is_dir():
            raise UsageError(f"the durable path's parent {parent} is not a directory; give a directory")
        if not parent.is_dir():
            raise UsageError(
                f"the durable directory's parent {parent} does not exist: mount the durable volume "
                f"(or create {parent}) first"
            )
    try:
        ddir.mkdir(parents=own_default, exist_ok=True)
    except OSError as e:
        raise UsageError(f"cannot create the durable directory {ddir}: {e.strerror}") from e
    return ddir.resolve()


@dataclass
class UpOutcome:
    box: Box
    result: bootstrap.UpResult
    profile: profiles.Profile
    findings: list[checks.Finding]
    first_time: bool  # show the platform's danger clocks and conveniences (once per box)


def box_profile(box: Box) -> profiles.Profile:
    """The profile a box was brought up with, re-read and re-validated; refused if its text is not
    the text `up` accepted (the meter-stop command must be the one that was shown and checked)."""
    p = profiles.load_file(Path(box.profile_file)) if box.profile_file else profiles.load(box.profile)
    if box.profile_digest and p.digest != box.profile_digest:
        raise UsageError(
            f"the profile {p.source} changed since `up {box.name}`; run `boxwarden up {box.name}` with it "
            "again to accept the new text (it runs the checks again), or restore the old file"
        )
    return p


async def up(
    state: State,
    name: str,
    *,
    profile: str | None,
    profile_file: Path | None,
    instance_id: str | None,
    workdir: Path,
    watch: Sequence[Path],
    durable: str | None,
    run_id: str | None,
    roster: Sequence[str],
    exclude: Sequence[str] = (),
) -> UpOutcome:
    # Every refusal comes before anything is created, started or recorded.
    check_name(name)
    if run_id is not None:
        check_run_id(run_id)
    given = [(profile_file, "--profile-file"), (workdir, "--workdir"), *((w, "--watch") for w in watch)]
    for path, what in given:
        if path is not None:
            check_path_text(path, what)
    prof = profiles.resolve(profile, profile_file)
    if prof.kind != "local":
        raise UsageError(
            f"profile {prof.name!r} is a remote platform ({prof.kind}); this version runs boxes on this "
            "machine only (a profile of kind local)"
        )
    if instance_id is not None and not templates.PLACEHOLDERS["instance_id"].fullmatch(instance_id):
        raise UsageError(f"instance id {instance_id!r} is not allowed: letters, digits, '.', '_', ':', '-'")
    old = state.find(name)
    # A box whose teardown was interrupted is the same box and run: `up` brings its sidecar back so
    # that a later `down` can finish the teardown with the tree it already pulled and verified.
    running = old is not None and old.status in ("up", "tearing-down")
    if running and old is not None:
        same_file = str(profile_file.resolve()) if profile_file else ""
        if old.profile != prof.name or old.profile_file != same_file:
            raise UsageError(
                f"{name} is up with profile {old.profile_file or old.profile}; `down` it before bringing it "
                "up with another profile (its meter stop must stay the one that was checked)"
            )
        if instance_id is not None and old.instance_id and instance_id != old.instance_id:
            raise UsageError(f"{name} is up as instance {old.instance_id}; `down` it before changing the id")
    effective_id = instance_id or (old.instance_id if running and old is not None else "")
    if "instance_id" in profiles.placeholders(prof) and not effective_id:
        raise UsageError(
            f"profile {prof.name!r} stops the meter with a command that needs the provider's instance id: "
            "give it with --instance-id ID"
        )
    if not watch:
        raise UsageError("name at least one checkpoint directory to watch: --watch DIR")
    for cell in roster:
        check_name(cell, "roster cell")
    for pat in exclude:
        check_exclude(pat)
    box_dir = state.box_dir(name)
    default_url = (box_dir / "durable").resolve().as_uri()
    live = old if old is not None and old.status != "down" else None  # a box not torn down
    url = durable or (live.durable if live is not None else default_url)
    ddir = durable_dir(url)
    for w in watch:
        check_watch_spelling(w if w.is_absolute() else workdir.absolute() / w, workdir)
    workdir = workdir.resolve()
    check_path_text(workdir, "--workdir")
    check_dir_target(workdir, "--workdir")
    watch_abs = [(w if w.is_absolute() else workdir / w).resolve() for w in watch]
    for w in watch_abs:
        check_path_text(w, "--watch")
        check_dir_target(w, "--watch")
    for path, what in [(workdir, "--workdir"), *((w, "--watch") for w in watch_abs), (ddir, "--durable")]:
        check_real_filesystem(path, what)
    _same_claims(name, old, live, watch_abs, ddir, run_id)
    _durable_apart(ddir, watch_abs, box_dir)
    if live is not None and exclude and tuple(exclude) != live.exclude:
        raise UsageError(
            f"{name} excludes {', '.join(live.exclude) or 'nothing'}; `down` it before changing --exclude"
        )
    excludes = tuple(exclude) or (live.exclude if live is not None else ())
    ddir = prepare_durable(ddir, own_default=url == default_url)
    for w in watch_abs:
        try:
            w.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UsageError(f"cannot create the watched directory {w}: {e.strerror}") from e
    findings = checks.run_checks(prof, watch=watch_abs, durable=ddir, home=Path.home())
    errors = [f for f in findings if f.level == "error"]
    if errors:
        raise ControllerError("; ".join(f.message for f in errors))
    fresh = not running
    box = Box(
        name=name,
        profile=prof.name,
        profile_file=str(profile_file.resolve()) if profile_file else "",
        profile_digest=prof.digest,
        instance_id=effective_id,
        box_dir=str(box_dir),
        state_dir=str(box_dir / "sidecar"),
        socket=str(bootstrap.socket_path_for(box_dir)),
        workdir=str(workdir),
        watch=tuple(str(w) for w in watch_abs),
        durable=url,
        run_id=run_id or (old.run_id if old and not fresh else f"{name}-{time.strftime('%Y%m%dT%H%M%S')}"),
        roster=tuple(roster) or (old.roster if old else ()),
        exclude=excludes,
        pulled_dir=old.pulled_dir if old and not fresh else "",
        notices_shown=bool(old and not fresh and old.notices_shown),
    )
    res = await bootstrap.up(box)
    if not res.started and old is not None:
        box = box.with_(
            watch=tuple(res.hello.watch_dirs), durable=res.hello.durable_url, run_id=res.hello.run_id
        )
    first_time = not box.notices_shown
    box = box.with_(sidecar_pid=res.hello.pid, status="up", notices_shown=True)
    # A sidecar answers: whatever an interrupted teardown did to an earlier one (released, stopped,
    # seen gone) no longer says anything about the box, which is watched again and may hold new
    # claims. A later `down` goes through the gate; only a meter stop already sent is remembered.
    state.set_teardown(box, teardown.kept_by_up(state.teardown_steps(name)))
    return UpOutcome(box=box, result=res, profile=prof, findings=findings, first_time=first_time)


def _durable_apart(ddir: Path, watch: list[Path], box_dir: Path) -> None:
    """The durable dir may not overlap a watched dir (either way) nor the box's state: checked here,
    before anything is created, so a refused `up` leaves nothing behind in a watched dir. Paths are
    compared resolved, and directories also by (device, inode): a bind mount is another spelling
    of the same directory that no path comparison sees."""
    d = Path(os.path.realpath(ddir))
    for w in [*watch, box_dir / "sidecar"]:
        r = Path(os.path.realpath(w))
        if d == r or r in d.parents or d in r.parents or same_dir_above(d, r) or same_dir_above(r, d):
            raise UsageError(
                f"the durable dir {ddir} overlaps {w}: the sidecar would claim (and copy) its own copies, or "
                "the copies would live and die with what they protect; put it outside every watched dir"
            )


DURABLE_STORE_NAMES = frozenset(
    {".boxwarden-tmp", ".boxwarden-store-id", ".boxwarden-owner", ".boxwarden-attic"}
)
"""The durable store's own names at the top of a run's corner (the sidecar's, in its RESERVED_TOP)."""
RESERVED_WATCH_NAMES = RESERVED_NAMES | {PARTS_DIR, REPLACED_DIR} | DURABLE_STORE_NAMES
"""With several watched dirs, each one's name starts its artifact paths: not one of a pulled tree's
or the durable store's own (every file below would be unclaimable for good)."""


def check_watch_spelling(given: Path, workdir: Path) -> None:
    """A watched dir reached through a symlink is fixed to the link's target at `up`: re-pointing the
    link (a `latest -> runs/r2` switch) would send new checkpoints where nobody watches. Refused for
    a link below the workdir (a relative --watch) or at the watched dir itself (an absolute one)."""
    base = workdir.absolute()
    parts = given.relative_to(base).parts if given.is_relative_to(base) else (given.name,)
    start = base if given.is_relative_to(base) else given.parent
    cur = start
    for part in parts:
        cur = cur / part
        if cur.is_symlink():
            raise UsageError(
                f"--watch {given}: {cur} is a symlink (to {os.readlink(cur)}); a watched dir is fixed at "
                "`up`, so re-pointing the link would hide new checkpoints: watch the real directory "
                f"({cur.resolve()}) or a directory above the link"
            )
    # The name the box will use: `.bw-parts/x/..` is `.bw-parts`.
    name = given.resolve().name
    if name in RESERVED_WATCH_NAMES or given.name in RESERVED_WATCH_NAMES:
        raise UsageError(
            f"--watch {given}: {name!r} is reserved for boxwarden's own files in a pulled tree or "
            "the durable store; rename the directory"
        )


def check_exclude(pattern: str) -> None:
    """An exclude pattern the sidecar will take: not empty, not everything, no control characters."""
    if (
        not pattern
        or pattern in ("*", "**", "*/*")
        or any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in pattern)
    ):
        raise UsageError(
            f"exclude pattern {pattern!r} is not allowed: give a glob such as '*.log' or 'wandb/*' "
            "(not empty, not everything, no control characters)"
        )


def _same_claims(
    name: str, old: Box | None, live: Box | None, watch: list[Path], ddir: Path, run_id: str | None
) -> None:
    """A box that was not torn down keeps what it watches, where its copies go and its run: its
    claims are about those (its sidecar may have died silently; a new one must not change them).
    A run that was torn down is over: its id is not reused."""
    if old is not None and old.status == "down" and run_id is not None and run_id == old.run_id:
        raise UsageError(f"run {run_id} was torn down; pick a new run id (--run-id)")
    if live is None:
        return
    if {str(w) for w in watch} != set(live.watch):
        raise UsageError(
            f"{name} watches {', '.join(live.watch)}; `down` it before watching other dirs "
            "(its claims are about those)"
        )
    if ddir.resolve() != durable_dir(live.durable).resolve():  # the same dir, however spelled
        raise UsageError(
            f"{name} keeps its durable copies in {live.durable}; `down` it before changing --durable "
            "(its claims are about those)"
        )
    if run_id is not None and live.status in ("up", "tearing-down") and run_id != live.run_id:
        raise UsageError(f"{name} is running run {live.run_id}; `down` it before starting run {run_id}")


async def run_job(box: Box, argv: Sequence[str], cell: str) -> pb.Job:
    if cell:
        check_name(cell, "cell")
    async with connect(box) as c:
        await c.hello()
        return await c.start_job(pb.StartJobRequest(argv=list(argv), cell=cell))


@dataclass
class BoxStatus:
    box: Box
    hello: pb.HelloResponse | None
    health: pb.HealthSnapshot | None
    error: str = ""

    def row(self) -> dict[str, object]:
        r: dict[str, object] = {"box": self.box.name, "profile": self.box.profile, "status": self.box.status}
        if self.hello is None or self.health is None:
            r["sidecar"] = f"unreachable: {self.error}" if self.box.status == "up" else self.box.status
            return r
        a = self.health.artifacts
        running = [j for j in self.health.jobs if j.state == pb.JOB_STATE_RUNNING]
        watch_free = [d.free_bytes for d in self.health.disks if d.role == "watch"]
        r.update(
            sidecar=f"{self.hello.version} pid {self.hello.pid}",
            jobs=f"{len(running)} running / {len(self.health.jobs)}",
            claims=a.sealed,
            durable=a.durable,
            not_durable=a.not_durable_bytes,
            push_lag=f"{a.push_lag_ms / 1000:.1f}s",
            disk_free=min(watch_free) if watch_free else "",
            cpu_percent=round(self.health.self.cpu_percent, 2),
            rss_bytes=self.health.self.rss_bytes,
        )
        return r


async def status(state: State, names: Sequence[str]) -> list[BoxStatus]:
    boxes = [state.get(n) for n in names] if names else state.boxes()
    out = []
    for box in boxes:
        if box.status != "up":
            out.append(BoxStatus(box, None, None))
            continue
        try:
            async with connect(box) as c:
                hello = await c.hello(timeout_s=3.0)
                health = await c.health_once()
            out.append(BoxStatus(box, hello, health))
        except ControllerError as e:
            out.append(BoxStatus(box, None, None, error=str(e)))
    return out


async def pull_box(state: State, box: Box, to: Path, progress: Progress | None = None) -> PullReport:
    check_path_text(to.resolve(), "the pull target")
    async with connect(box) as c:
        await c.hello()
        rep = await pull(
            c, root=to, run_id=box.run_id, instance=box.name, roster=box.roster, progress=progress
        )
    state.set_pulled_dir(box.name, str(to.resolve()))
    return rep


def pulled_dir(box: Box, override: Path | None) -> Path | None:
    if override is not None:
        check_path_text(override.resolve(), "--pulled")
        return override.resolve()
    return Path(box.pulled_dir) if box.pulled_dir else None


async def judge(box: Box, pulled: Path | None, *, confirm: str | None, dry_run: bool) -> gate.Verdict:
    if box.status == "down":
        raise StateError(f"{box.name} is already down")
    if box.status == "meter-unproven":
        raise StateError(
            f"{box.name}: its sidecar is stopped but the meter stop was not proven; check the provider's "
            "console (`boxwarden status` shows the audit)"
        )
    # The meter stop `down` would run must still be the one `up` accepted, and fillable: check it first.
    meterstop.plan(box_profile(box), box)
    async with connect(box) as c:
        ev, early = await gate.gather(c, box, pulled)
    return gate.judge(ev, early, confirm=confirm, dry_run=dry_run)


async def down(
    state: State, box: Box, verdict: gate.Verdict, manual_done: Callable[[str], Awaitable[bool]]
) -> teardown.TeardownResult:
    profile = box_profile(box)
    async with connect(box) as c:
        return await teardown.teardown(state, box, c, verdict, profile, manual_done)


async def logs(box: Box, job_id: str, follow: bool) -> AsyncIterator[bytes]:
    async with connect(box) as c:
        try:
            await c.hello()
        except SidecarUnreachable as e:
            raise ControllerError(f"{e}; the job logs are in {box.box_dir}/sidecar/logs") from e
        async for chunk in c.tail_log(job_id, follow=follow):
            yield chunk.data
