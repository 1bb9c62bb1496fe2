"""Box services: what each CLI command does, as one coroutine per command (the CLI parses and renders).

They own the translation from user input to a `Box` record and from the sidecar's answers to the
plain rows the renderer shows.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import os
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

from boxwarden_pb.v1 import sidecar_pb2 as pb
from google.protobuf import json_format

from controller import (
    __version__,
    absence,
    bootstrap,
    checks,
    gate,
    gone,
    lastlist,
    meterstop,
    profiles,
    reach,
    teardown,
    templates,
)
from controller import durable as durable_url
from controller.client import SidecarClient
from controller.connector import Connector, LocalConnector, launch
from controller.errors import (
    ControllerError,
    SidecarMismatch,
    SidecarUnreachable,
    StateError,
    UsageError,
    VersionMismatch,
)
from controller.manifest import PARTS_DIR, REPLACED_DIR, RESERVED_NAMES
from controller.pathtext import check_path_text
from controller.reach import connect
from controller.ssh import argv as sshargv
from controller.ssh.connector import SshConnector
from controller.state import Box, State

NAME_CHARS = "letters, digits, '.', '_' or '-' (at most 64, starting with a letter or digit)"
NAME_RULE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
RUN_ID_CHARS = "letters, digits, '.', '_', ':' or '-' (at most 128, starting with a letter or digit)"
RUN_ID_RULE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")  # SidecarConfig.run_id
# C0 controls (NUL included), DEL and C1 controls: never part of a path a user means to give.


def check_name(name: str, what: str = "box name") -> str:
    """A box name or a roster cell: one safe path component."""
    if not NAME_RULE.fullmatch(name):
        raise UsageError(f"{what} {name!r} is not allowed: use {NAME_CHARS}")
    return name


def check_run_id(run_id: str) -> str:
    if not RUN_ID_RULE.fullmatch(run_id):
        raise UsageError(f"run id {run_id!r} is not allowed: use {RUN_ID_CHARS}")
    return run_id


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
    workdir: str | None,
    watch: Sequence[str],
    durable: str | None,
    run_id: str | None,
    roster: Sequence[str],
    exclude: Sequence[str] = (),
    host: str | None = None,
    ssh_options: Sequence[str] = (),
    ssh_config: str = "",
    box_index: str | None = None,
    state_on_durable: bool = False,
    durable_credentials: Path | None = None,
    keep: str | None = None,
    push_rate: str | None = None,
    health: HealthOptions | None = None,
    price_per_hour: float | None = None,
    adopt: bool = False,
    profile_digest: str | None = None,
) -> UpOutcome:
    """`adopt`: take over the sidecar that runs the box (started by another controller, or before
    this controller's state was lost): its run, store, watched dirs and settings are taken from its
    Hello, none given here. Without it, a sidecar this controller did not start is refused.
    `profile_digest`: the text the profile file must still have (as a plan read and trusted it)."""
    # Every refusal comes before anything is created, started or recorded.
    check_name(name)
    if adopt:
        _check_adopt(
            watch=watch,
            durable=durable,
            run_id=run_id,
            exclude=exclude,
            keep=keep,
            push_rate=push_rate,
            health=health,
            workdir=workdir,
        )
    workdir = "." if workdir is None else workdir
    (health or HealthOptions()).check()
    if keep is not None:
        check_keep(keep)
    rate = parse_push_rate(push_rate) if push_rate is not None else None
    if run_id is not None:
        check_run_id(run_id)
    given = [(profile_file, "--profile-file"), (workdir, "--workdir"), *((w, "--watch") for w in watch)]
    for path, what in given:
        if path is not None:
            check_path_text(path, what)
    prof = profiles.resolve(profile, profile_file)
    if profile_digest is not None and prof.digest != profile_digest:
        raise UsageError(
            f"the profile file {profile_file} changed since the plan was read (its meter stop may be "
            "another now): nothing was done; run `fanout up` again to read it, and see the difference"
        )
    options: tuple[str, ...] = ()
    if state_on_durable and host is None:
        raise UsageError("--state-on-durable goes with --host DEST (a remote box)")
    if box_index is not None:
        if host is None:
            raise UsageError("--box-index goes with --host DEST (a remote box)")
        from controller.remote import check_index_url

        check_index_url(box_index)
    if host is not None:
        host = sshargv.check_destination(host)
        options = tuple("=".join(sshargv.check_option(o)) for o in ssh_options)
        if prof.kind not in REMOTE_KINDS:
            raise UsageError(
                f"profile {prof.name!r} is of kind {prof.kind}; --host takes a profile of kind "
                f"{', '.join(REMOTE_KINDS)} (`boxwarden profiles list`)"
            )
    else:
        if ssh_options:
            raise UsageError("--ssh-option goes with --host DEST (a remote box)")
        if prof.kind != "local":
            raise UsageError(
                f"profile {prof.name!r} is a remote platform ({prof.kind}): give the box's SSH destination "
                "with --host DEST (an alias from ~/.ssh/config, or user@host)"
            )
    if instance_id is not None and not templates.PLACEHOLDERS["instance_id"].fullmatch(instance_id):
        raise UsageError(f"instance id {instance_id!r} is not allowed: letters, digits, '.', '_', ':', '-'")
    old = state.find(name)
    # A box whose teardown was interrupted is the same box and run: `up` brings its sidecar back so
    # that a later `down` can finish the teardown with the tree it already pulled and verified.
    running = old is not None and old.status in ("up", "tearing-down")
    if old is not None and old.status != "down":
        # A box not torn down (a meter stop never proven included) keeps its profile, instance and
        # host: its meter stop, sent or to be sent, is about them.
        is_ = "is up" if running else f"is {old.status} (its meter stop not proven)"
        same_file = str(profile_file.resolve()) if profile_file else ""
        if old.profile != prof.name or old.profile_file != same_file:
            raise UsageError(
                f"{name} {is_} with profile {old.profile_file or old.profile}; `down` it before bringing it "
                "up with another profile (its meter stop must stay the one that was checked)"
            )
        if instance_id is not None and old.instance_id and instance_id != old.instance_id:
            raise UsageError(f"{name} {is_} as instance {old.instance_id}; `down` it before changing the id")
        if (host or "") != old.host:
            was = f"on {old.host}" if old.host else "on this machine"
            raise UsageError(f"{name} {is_} {was}; `down` it before bringing it up elsewhere")
    effective_id = instance_id or (old.instance_id if old is not None and old.status != "down" else "")
    if "instance_id" in profiles.placeholders(prof) and not effective_id:
        raise UsageError(
            f"profile {prof.name!r} stops the meter with a command that needs the provider's instance id: "
            "give it with --instance-id ID"
        )
    if not watch and not adopt:
        raise UsageError("name at least one checkpoint directory to watch: --watch DIR")
    for cell in roster:
        check_name(cell, "roster cell")
    for pat in exclude:
        check_exclude(pat)
    live = old if old is not None and old.status != "down" else None  # a box not torn down
    if live is not None and state_on_durable and not live.state_on_durable:
        raise UsageError(
            f"{name} keeps its sidecar's state in ~/.boxwarden on the box; `down` it before moving its state "
            "to the durable tier (--state-on-durable): its ledger holds the claims of its run"
        )
    if live is not None and keep is not None and keep != live.keep:
        raise UsageError(f"{name} keeps {live.keep or 'every box copy'}; `down` it before changing --keep")
    if (
        live is not None
        and rate is not None
        and effective_push_rate(rate) != effective_push_rate(live.push_rate)
    ):
        raise UsageError(
            f"{name} pushes at {show_push_rate(live.push_rate)}; `down` it before changing --push-rate"
        )
    if live is not None and exclude and tuple(exclude) != live.exclude:
        raise UsageError(
            f"{name} excludes {', '.join(live.exclude) or 'nothing'}; `down` it before changing --exclude"
        )
    # The durable store the box will keep: a bucket, or a directory (None: the default directory).
    target = durable if durable is not None else (live.durable if live is not None else None)
    bucket = target is not None and not durable_url.parse(target).is_dir
    credentials = None
    if durable_credentials is not None:
        if not bucket and not adopt:  # (an adopted sidecar's store is known once it is asked)
            raise UsageError(
                "--durable-credentials goes with an s3:// --durable URL (a directory needs none)"
            )
        credentials = durable_url.read_credentials(durable_credentials)
    spec = UpSpec(
        name=name,
        prof=prof,
        profile_file=profile_file,
        instance_id=effective_id,
        old=old,
        live=live,
        running=running,
        workdir=workdir,
        watch=tuple(watch),
        durable=durable,
        run_id=run_id,
        roster=tuple(roster),
        exclude=tuple(exclude) or (live.exclude if live is not None else ()),
        keep=keep if keep is not None else (live.keep if live is not None else ""),
        health=(health or HealthOptions()).merged(live),
        price_per_hour=price_per_hour
        if price_per_hour is not None
        else (live.price_per_hour if live is not None else 0.0),
        push_rate=_push_rate(rate, live),
        host=host or "",
        options=options,
        ssh_config=ssh_config if host else "",
        credentials=credentials,
        ours=live.sidecar_nonce if live is not None else None,
        adopt=adopt,
    )
    box_dir = state.box_dir(name)
    if host is None:
        # A box not torn down keeps the socket its sidecar was started on.
        socket = live.socket if live is not None else str(bootstrap.socket_path_for(box_dir))
        where = Where(box_dir=box_dir, state_root=box_dir, python="", socket=socket)
        default_url = (box_dir / "durable").resolve().as_uri()
        return await _up_on(state, spec, LocalConnector(socket), where, default_url)
    conn = reach.ssh_connector(host, options, spec.ssh_config, home=state.home, name=name)
    try:
        on_durable = state_on_durable or (live is not None and live.state_on_durable)
        # The sidecar's venv there needs boto3 for a bucket, prometheus_client for its metrics.
        extras = (*(("metrics",) if spec.health.metrics_port else ()), *(("s3",) if bucket else ()))
        if adopt:  # what the adopted sidecar needs is known only once it is asked: whatever it may
            extras = ("metrics", "s3")
        where, default_url = await _remote_where(
            state, name, conn, host, prof, box_dir, box_index, on_durable, extras, live
        )
        return await _up_on(state, spec, conn, where, default_url)
    finally:
        await conn.close()


REMOTE_KINDS = ("ssh", "ssh-rental", "cloud-api")


@dataclass(frozen=True)
class HealthOptions:
    """`up`'s health settings (None: keep the box's; a new box: the sidecar's default)."""

    stall_s: int | None = None
    step_regex: str | None = None
    loss_regex: str | None = None
    memory_high_percent: int | None = None
    metrics_port: int | None = None

    def check(self) -> None:
        for pattern, group, flag in (
            (self.step_regex, "step", "--step-regex"),
            (self.loss_regex, "loss", "--loss-regex"),
        ):
            if pattern is None:
                continue
            try:
                compiled = re.compile(pattern)
            except re.error as e:
                raise UsageError(f"{flag} {pattern!r} is not a regular expression: {e}") from None
            if group not in compiled.groupindex:
                raise UsageError(
                    f"{flag} {pattern!r} needs a named group (?P<{group}>...) around the {group}"
                )

    @classmethod
    def of(cls, box: Box) -> HealthOptions:
        return cls(box.stall_s, box.step_regex, box.loss_regex, box.memory_high_percent, box.metrics_port)

    def merged(self, live: Box | None) -> HealthOptions:
        """Each setting given, else the live box's, else the default ("" or 0): none left None."""
        base = HealthOptions.of(live) if live is not None else HealthOptions(0, "", "", 0, 0)
        return dataclasses.replace(
            base, **{f.name: v for f in dataclasses.fields(self) if (v := getattr(self, f.name)) is not None}
        )


@dataclass(frozen=True)
class UpSpec:
    """What `up` was asked for, checked as text (the box checks the paths)."""

    name: str
    prof: profiles.Profile
    profile_file: Path | None
    instance_id: str
    old: Box | None
    live: Box | None
    running: bool
    workdir: str
    watch: tuple[str, ...]
    durable: str | None
    run_id: str | None
    roster: tuple[str, ...]
    exclude: tuple[str, ...]
    host: str
    options: tuple[str, ...]
    ssh_config: str
    credentials: str | None = None  # the text of --durable-credentials (never shown, never kept here)
    keep: str = ""  # retention rules (`--keep`), checked as text; the sidecar reads them
    health: HealthOptions = HealthOptions(0, "", "", 0, 0)  # every setting resolved (see merged)
    price_per_hour: float = 0.0
    push_rate: int = 0  # bytes/s of the box's pushes (`--push-rate`); 0: the sidecar's default, -1: none
    ours: str | None = None  # the nonce of the sidecar this controller started (None: no live record)
    adopt: bool = False  # take over the running sidecar (`up --adopt`): the fields below come from it
    adopted_credentials: bool = False  # the adopted sidecar reads its store's credentials from its state dir


@dataclass(frozen=True)
class Where:
    """Where a box keeps the sidecar: paths on the box, and its venv's python (empty: this one)."""

    box_dir: Path  # the controller's own directory for the box
    state_root: Path  # on the box: holds sidecar/ (the state dir), sidecar.json, sidecar.log
    python: str
    socket: str
    state_on_durable: bool = False


async def _remote_where(
    state: State,
    name: str,
    conn: SshConnector,
    host: str,
    prof: profiles.Profile,
    box_dir: Path,
    box_index: str | None,
    state_on_durable: bool,
    extras: tuple[str, ...] = (),
    live: Box | None = None,
) -> tuple[Where, str]:
    """Probe the remote box and give it the sidecar's venv: where its state lives, its python.
    `state_on_durable`: the state and the venv live on the profile's durable tier (they survive a
    stop); the socket stays on the box's own disk (a network filesystem may hold no socket)."""
    from controller import remote, wheelhouse

    tier = next((t for t in prof.storage if t.durable_default), None)
    state_root = remote.STATE_ROOT
    if state_on_durable:
        if tier is None:
            raise UsageError(
                f"--state-on-durable: profile {prof.name!r} names no durable tier (durable_default); keep "
                "the state in ~/.boxwarden, or use a profile that names one"
            )
        state_root = f"{tier.path.rstrip('/')}/.boxwarden"
    probe = await remote.probe(conn, host, state_root)
    cache = wheelhouse.default_cache_root(os.environ)
    python = await remote.ensure_venv(conn, host, probe, cache, box_index=box_index, extras=extras)
    root = Path(probe.root) / "boxes" / name
    socket = root / "sidecar" / "sidecar.sock"
    if state_on_durable or len(os.fsencode(socket)) > bootstrap.MAX_SOCKET_PATH:
        socket = bootstrap.short_socket(Path(probe.home) / ".boxwarden" / "s", str(root))
    if live is not None and live.socket:
        socket = Path(live.socket)  # a box not torn down keeps the socket its sidecar was started on
    if ":" in str(socket):
        raise ControllerError(
            f"{host}: the sidecar's socket path {socket} holds a ':', which an SSH forward cannot carry"
        )
    if tier is not None:
        base = probe.home + tier.path[1:] if tier.path.startswith("~") else tier.path
        default_url = Path(base, "boxwarden").as_uri()
    else:
        default_url = (root / "durable").as_uri()
    conn.remote_socket = str(socket)
    conn.python = python
    where = Where(box_dir, root, python, str(socket), state_on_durable)
    return where, default_url


def _check_adopt(**given: object) -> None:
    """`up --adopt` takes what the sidecar runs with from the sidecar: nothing of it may be given (but
    the store's credentials: a dead sidecar's may have left the box with a failed start)."""
    flags = {
        "watch": "--watch",
        "durable": "--durable",
        "run_id": "--run-id",
        "exclude": "--exclude",
        "keep": "--keep",
        "push_rate": "--push-rate",
        "workdir": "--workdir",
    }
    named = [flag for key, flag in flags.items() if given[key]]
    health = given["health"]
    if isinstance(health, HealthOptions) and health != HealthOptions():
        named.append("the health options")
    if named:
        raise UsageError(
            f"--adopt takes the run, store, watched dirs and settings from the running sidecar: leave out "
            f"{', '.join(named)} (change them with `up` once the box is adopted)"
        )


async def _adopted(spec: UpSpec, conn: Connector, where: Where) -> UpSpec:
    """`spec` with what the sidecar that runs the box says it runs with (`up --adopt`); a dead one's
    last config, kept on the box, when none answers (it is started again with it)."""
    state_dir = str(where.state_root / "sidecar")
    hello = await bootstrap.answering(conn)
    if hello is None:
        cfg = await _last_config(conn, where, spec)
        ours: str | None = None  # none runs: the one `up` starts is this controller's
    else:
        if hello.box_name != spec.name or hello.state_dir != state_dir:
            raise SidecarMismatch(
                f"--adopt: the sidecar that answers on {where.socket} runs box {hello.box_name!r} with the "
                f"state dir {hello.state_dir}, not {spec.name!r} with {state_dir}; nothing was adopted"
            )
        if hello.version != __version__:
            raise VersionMismatch(
                f"--adopt: the sidecar of {spec.name} runs boxwarden {hello.version}, this controller is "
                f"{__version__}; adopt it with that version, or `down` it from the controller that started it"
            )
        cfg, ours = hello.config, hello.nonce
    if cfg.profile != spec.prof.name:
        raise UsageError(
            f"--adopt: the sidecar of {spec.name} was started with profile {cfg.profile!r}: give --profile "
            f"{cfg.profile} (its meter stop is that profile's)"
        )
    if spec.credentials is not None and durable_url.parse(cfg.durable_url).is_dir:
        raise UsageError(
            f"--adopt: {spec.name} keeps its copies in {cfg.durable_url}, a directory: it needs no "
            "--durable-credentials"
        )
    if spec.old is not None and spec.old.status == "down" and spec.old.run_id == cfg.run_id:
        raise UsageError(f"--adopt: run {cfg.run_id} of {spec.name} was torn down by this controller")
    return dataclasses.replace(
        spec,
        workdir=cfg.workdir,
        watch=tuple(cfg.watch_dirs),
        durable=cfg.durable_url,
        run_id=cfg.run_id,
        exclude=tuple(cfg.exclude_patterns),
        keep=cfg.keep,
        push_rate=cfg.push_rate_bytes_s,
        health=HealthOptions(
            cfg.stall_s, cfg.step_regex, cfg.loss_regex, cfg.memory_high_percent, cfg.metrics_port
        ),
        ours=ours,
        adopted_credentials=bool(cfg.durable_credentials_file),
    )


async def _last_config(conn: Connector, where: Where, spec: UpSpec) -> pb.SidecarConfig:
    """The config the box's last sidecar ran with (`up --adopt` of a dead one)."""
    answer = await launch(conn, "config", {"config_path": str(where.state_root / "sidecar.json")})
    if answer.get("running") is not None:
        raise SidecarUnreachable(
            f"--adopt: a sidecar (pid {answer['running']}) holds the state of {spec.name} but does not "
            f"answer on {where.socket}; wait for it to finish starting, or stop it, and `up --adopt` again"
        )
    if not answer.get("config"):
        raise UsageError(
            f"--adopt: no sidecar answers for {spec.name} on {spec.host or 'this machine'} and none ran "
            f"there ({where.state_root} holds no config)"
            + (
                ""
                if where.state_on_durable or not spec.host
                else "; if it keeps its state on the durable tier, add --state-on-durable"
            )
            + ": nothing to adopt here; `up` without --adopt starts one"
        )
    cfg = json_format.ParseDict(answer["config"], pb.SidecarConfig(), ignore_unknown_fields=True)
    if cfg.run_id and answer.get("torn_down") == cfg.run_id:
        raise UsageError(
            f"--adopt: run {cfg.run_id} of {spec.name} on {spec.host or 'this machine'} was torn down (its "
            "teardown marked it over on the box): there is nothing to adopt; `up` without --adopt starts "
            "a new run"
        )
    return cfg


async def _up_on(state: State, spec: UpSpec, conn: Connector, where: Where, default_url: str) -> UpOutcome:
    if spec.adopt:
        spec = await _adopted(spec, conn, where)
    old, live, prof, name = spec.old, spec.live, spec.prof, spec.name
    url = spec.durable or (live.durable if live is not None else default_url)
    target = durable_url.parse(url)
    state_dir = where.state_root / "sidecar"
    # The paths as the box sees them: checked and resolved there (symlinks, files in the way,
    # pseudo-filesystems, the durable dir apart from the watched ones); nothing is created yet.
    facts = await launch(
        conn,
        "resolve",
        {
            "workdir": spec.workdir if spec.host else str(Path(spec.workdir).absolute()),
            "watch": list(spec.watch),
            "durable": str(target.dir or ""),  # an object store: nothing to resolve on the box
            "state_dir": str(state_dir),
            "reserved": sorted(RESERVED_WATCH_NAMES),
            "tiers": [t.path for t in prof.storage],
        },
    )
    check_path_text(facts["workdir"], "--workdir")
    watch_abs = [str(w) for w in facts["watch"]]
    for w in watch_abs:
        check_path_text(w, "--watch")
    # A directory as the box resolved it; a bucket as given (it is off the box: on no tier of it).
    durable = Path(facts["durable"]).as_uri() if target.is_dir else url
    ddir = str(facts["durable"]) if target.is_dir else url
    _same_claims(name, old, live, watch_abs, ddir, spec.run_id, state.torn_down_runs(name))
    findings = checks.watch_tier(
        prof, watch_abs, facts["durable"] if target.is_dir else None, facts["real"], facts["tiers"]
    )
    if live is not None and live.profile_digest and live.profile_digest != prof.digest:
        stop = " ".join(prof.meter_stop.argv) if prof.meter_stop.mode == "argv" else prof.meter_stop.mode
        findings.append(
            checks.Finding(
                "warn",
                "profile_changed",
                f"the profile {prof.source} changed since {name} was last brought up: its meter stop is "
                f"now {stop!r}, and this text is the one `down` will run",
            )
        )
    errors = [f for f in findings if f.level == "error"]
    if errors:
        raise ControllerError("; ".join(f.message for f in errors))
    fresh = not spec.running
    box = Box(
        name=name,
        profile=prof.name,
        profile_file=str(spec.profile_file.resolve()) if spec.profile_file else "",
        profile_digest=prof.digest,
        instance_id=spec.instance_id,
        box_dir=str(where.box_dir),
        state_dir=str(state_dir),
        socket=where.socket,
        workdir=facts["workdir"],
        watch=tuple(watch_abs),
        durable=durable,
        durable_credentials=spec.credentials is not None
        or spec.adopted_credentials
        or bool(live is not None and live.durable_credentials and live.durable == durable),
        run_id=spec.run_id
        or (old.run_id if old and not fresh else f"{name}-{time.strftime('%Y%m%dT%H%M%S')}"),
        roster=spec.roster or (old.roster if old else ()),
        exclude=spec.exclude,
        keep=spec.keep,
        push_rate=spec.push_rate,
        drain_grace_s=prof.spot.grace_s,
        pulled_dir=old.pulled_dir if old and not fresh else "",
        notices_shown=bool(old and not fresh and old.notices_shown),
        host=spec.host,
        ssh_options=spec.options,
        ssh_config=spec.ssh_config,
        python=where.python,
        state_on_durable=where.state_on_durable,
        stall_s=spec.health.stall_s or 0,
        step_regex=spec.health.step_regex or "",
        loss_regex=spec.health.loss_regex or "",
        memory_high_percent=spec.health.memory_high_percent or 0,
        metrics_port=spec.health.metrics_port or 0,
        price_per_hour=spec.price_per_hour,
    )
    findings += await _instance_listed(prof, box, old)
    # Health settings the running sidecar does not have: it is restarted to read them (its jobs
    # and queues go on).
    reconfigure = live is not None and HealthOptions.of(live) != spec.health
    box_checks = {
        **checks.box_side_request(prof, durable_dir=target.is_dir),
        "durable_dir": facts["durable"] if target.is_dir else "",
        "own_default": url == default_url,
    }
    res = await bootstrap.up(
        box,
        conn,
        box_checks,
        credentials=spec.credentials,
        reconfigure=reconfigure,
        ours=spec.ours,
        # The runs this controller knows of the box: its record's (not down), the one `--adopt`
        # takes over; and those it tore down (taken only where no other start opened them again).
        known_runs=[
            *([old.run_id] if old is not None and old.status != "down" else []),
            *([box.run_id] if spec.adopt else []),
        ],
        closed_runs=sorted(state.torn_down_runs(name)),
    )
    findings += [checks.Finding.from_json(f) for f in res.findings]
    first_time = not box.notices_shown
    box = box.with_(
        sidecar_pid=res.hello.pid,
        sidecar_nonce=res.hello.nonce,
        status="up",
        notices_shown=True,
        last_contact_ns=time.time_ns(),
    )
    # A sidecar answers: whatever an interrupted teardown did to an earlier one (released, stopped,
    # seen gone) no longer says anything about the box, which is watched again and may hold new
    # claims. A later `down` goes through the gate; only a meter stop already sent is remembered.
    state.set_teardown(box, teardown.kept_by_up(state.teardown_steps(name)))
    return UpOutcome(box=box, result=res, profile=prof, findings=findings, first_time=first_time)


async def _instance_listed(prof: profiles.Profile, box: Box, old: Box | None) -> list[checks.Finding]:
    """Where the profile can ask its provider, the instance must be one it lists now: `down` takes
    its later "not found" for "gone", which says nothing of an id the provider never had (a typo,
    another account or region). A provider that cannot be asked refuses a new box's `up`; for a box
    already up on that instance (its sidecar restarted, its keys rotated) it is a warning."""
    if prof.meter_stop.mode != "argv":
        return []
    word, said = await meterstop.provider_says(prof, box)
    if word == meterstop.LISTED:
        return []
    # (listed at that box's own `up`, under this very profile text)
    known = (
        old is not None
        and old.status != "down"
        and old.instance_id == box.instance_id
        and old.profile_digest == prof.digest
    )
    if word == meterstop.UNANSWERED and known:
        return [checks.Finding("warn", "provider", f"the provider could not be asked whether it lists "
                               f"{box.instance_id} ({said}); it listed it at the last `up`")]  # fmt: skip
    what = meterstop.unlisted(word, box)
    raise UsageError(
        f"the provider {what} ({said}): `down {box.name}` would stop and poll instance "
        f"{box.instance_id}, so it must be one the provider lists now. Check --instance-id (and the provider "
        "CLI's account or region), then run `up` again"
    )


RESERVED_WATCH_NAMES = RESERVED_NAMES | {PARTS_DIR, REPLACED_DIR} | durable_url.STORE_NAMES
"""With several watched dirs, each one's name starts its artifact paths: not one of a pulled tree's
or the durable store's own (every file below would be unclaimable for good)."""


KEEP_RULE = re.compile(r"(last|every)=[1-9][0-9]*|best=[A-Za-z0-9._-]+:[^,:\s]+(:min|:max)?")


def check_keep(rules: str) -> None:
    """Retention rules the sidecar will take: `last=N`, `every=K`, `best=FILE:KEY[:min|max]`,
    comma-separated (the sidecar reads them; this only refuses what cannot be one)."""
    for rule in (r.strip() for r in rules.split(",")):
        if not KEEP_RULE.fullmatch(rule) or rule.startswith("best=.."):
            raise UsageError(
                f"--keep rule {rule!r} is not one of last=N, every=K, best=FILE:KEY[:min|max] "
                "(e.g. --keep last=3,best=metrics.json:loss,every=10)"
            )


PUSH_RATE = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*(?:([kmg])(i?)b?)?(?:/s)?", re.IGNORECASE)
NO_PUSH_LIMIT = ("max", "none", "unlimited")
MIN_PUSH_RATE = 10**6  # the sidecar refuses less (sidecar.storage.pace.MIN_RATE)
MAX_PUSH_RATE = 10**12  # a terabyte per second: any more is a typo (and the config holds an int64)
DEFAULT_PUSH_RATE = 400 * 10**6  # what the sidecar does with 0 (sidecar.storage.pace.DEFAULT_RATE)


def parse_push_rate(text: str) -> int:
    """`--push-rate`: bytes per second (`400M`, `1.5G`, `250MB/s`: K, M, G are powers of 1000;
    KiB, MiB, GiB of 1024), or `max` for no limit (-1). Below 1 MB/s is refused: `--push-rate 100`
    surely meant 100M."""
    t = text.strip()
    if t.lower() in NO_PUSH_LIMIT:
        return -1
    m = PUSH_RATE.fullmatch(t)
    if m is None:
        raise UsageError(
            f"--push-rate {text!r}: give bytes per second, e.g. 200M or 1G, or 'max' for no limit"
        )
    number, unit, binary = m.group(1), (m.group(2) or "").lower(), bool(m.group(3))
    rate = int(float(number) * (1024 if binary else 1000) ** " kmg".index(unit or " "))
    if rate < MIN_PUSH_RATE:
        hint = f"; did you mean {number}M?" if not unit and float(number) > 0 else ""
        raise UsageError(
            f"--push-rate {text!r} is {rate} bytes/s, under 1 MB/s: a checkpoint would take hours to be "
            f"durable{hint}"
        )
    if rate > MAX_PUSH_RATE:
        raise UsageError(f"--push-rate {text!r} is over 1 TB/s; for no limit say --push-rate max")
    return rate


def _push_rate(rate: int | None, live: Box | None) -> int:
    """The rate to record: a live box keeps its own unless another one is given (400M names the
    default it runs: no change, so its sidecar's config stays as it is)."""
    if live is None:
        return rate or 0
    if rate is None or effective_push_rate(rate) == effective_push_rate(live.push_rate):
        return live.push_rate
    return rate


def effective_push_rate(rate: int) -> int:
    """The rate a box's sidecar keeps to (-1: none), from the rate recorded for it (0: the default)."""
    return DEFAULT_PUSH_RATE if rate == 0 else rate


def show_push_rate(rate: int) -> str:
    rate = effective_push_rate(rate)
    return "no limit" if rate < 0 else f"{rate / 1e6:g} MB/s"


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
    name: str,
    old: Box | None,
    live: Box | None,
    watch: list[str],
    ddir: str,
    run_id: str | None,
    torn: Collection[str] = (),
) -> None:
    """A box that was not torn down keeps what it watches, where its copies go and its run: its
    claims are about those (its sidecar may have died silently; a new one must not change them).
    A run that was torn down is over (the last one, or any its audit records name): its id is not
    reused."""
    over = {*torn, *([old.run_id] if old is not None and old.status == "down" else [])}
    if run_id is not None and run_id in over and (live is None or run_id != live.run_id):
        raise UsageError(f"run {run_id} of {name} was torn down; pick a new run id (--run-id)")
    if live is None:
        return
    if set(watch) != set(live.watch):
        raise UsageError(
            f"{name} watches {', '.join(live.watch)}; `down` it before watching other dirs "
            "(its claims are about those)"
        )
    kept_dir = durable_url.parse(live.durable).dir
    kept = str(kept_dir) if kept_dir is not None else live.durable
    # A record of an earlier version may hold a local box's path as it was given.
    if kept_dir is not None and not live.host:
        kept = os.path.realpath(kept)
    if ddir != kept:  # both resolved on the box: the same dir, however spelled
        raise UsageError(
            f"{name} keeps its durable copies in {live.durable}; `down` it before changing --durable "
            "(its claims are about those)"
        )
    if run_id is not None and live.status in ("up", "tearing-down") and run_id != live.run_id:
        raise UsageError(f"{name} is running run {live.run_id}; `down` it before starting run {run_id}")


@dataclass(frozen=True)
class RestartPolicy:
    """`run --restart`: what the sidecar does when the job fails (see StartJobRequest)."""

    restart: str = "never"
    max_restarts: int = 3
    backoff_s: float = 10.0


async def run_job(box: Box, argv: Sequence[str], cell: str, policy: RestartPolicy | None = None) -> pb.Job:
    if cell:
        check_name(cell, "cell")
    p = policy or RestartPolicy()
    req = pb.StartJobRequest(argv=list(argv), cell=cell, restart=p.restart)
    if p.restart != "never":
        req.max_restarts, req.restart_backoff_s = p.max_restarts, p.backoff_s
    async with connect(box) as c:
        await c.hello()
        return await c.start_job(req)


@dataclass
class BoxStatus:
    box: Box
    hello: pb.HelloResponse | None
    health: pb.HealthSnapshot | None
    error: str = ""

    def last_seen_s(self) -> float | None:
        """Seconds since the sidecar last answered this controller (None: never)."""
        if not self.box.last_contact_ns:
            return None
        return round(max(0, time.time_ns() - self.box.last_contact_ns) / 1e9, 1)

    def row(self) -> dict[str, object]:
        """The box for `status --json` (STATUS_SCHEMA): numbers, booleans and enum strings only,
        absent values null; prose only in `error` and the alerts' `detail`."""
        r: dict[str, object] = {
            "box": self.box.name,
            "profile": self.box.profile,
            "status": self.box.status,
            "host": self.box.host or None,
            "last_contact_unix_ns": self.box.last_contact_ns or None,
            "last_seen_s": self.last_seen_s(),
        }
        if self.hello is None or self.health is None:
            if self.box.status == "up":
                r.update(unreachable=True, error=self.error)
            return r
        h = self.health
        a = h.artifacts
        running = [j for j in h.jobs if j.state == pb.JOB_STATE_RUNNING]
        watch_free = [d.free_bytes for d in h.disks if d.role == "watch"]
        r.update(
            unreachable=False,
            error="",
            sidecar={"version": self.hello.version, "pid": self.hello.pid},
            jobs_running=len(running),
            jobs_total=len(h.jobs),
            # When the last job ended, while none runs (the box idles since): null otherwise.
            jobs_ended_unix_ns=None
            if running or not h.jobs
            else max(j.ended_at_unix_ns for j in h.jobs) or None,
            price_per_hour=self.box.price_per_hour or None,
            up_since_unix_ns=self.box.created_at_ns,
            claims=a.sealed,
            durable=a.durable,
            # Every durable claim is proven one way or the other: what the store's checksum alone
            # did not prove was read back.
            proofs={"reread": a.durable - a.server_checksum, "server-checksum": a.server_checksum},
            durable_only=a.durable_only,
            not_durable=a.not_durable_bytes,
            push_lag_s=a.push_lag_ms / 1000,
            push_bytes_per_s=round(a.push_bytes_per_s, 1),
            last_checkpoint_unix_ns=a.newest_sealed_unix_ns or None,
            disk_free=min(watch_free) if watch_free else None,
            disks=[
                {
                    "path": d.path,
                    "role": d.role,
                    "free_bytes": d.free_bytes,
                    "total_bytes": d.total_bytes,
                    "free_inodes": d.free_inodes,
                    "total_inodes": d.total_inodes,
                }
                for d in h.disks
            ],
            gpus=[
                {
                    "index": g.index,
                    "name": g.name,
                    "utilization_percent": g.utilization_percent
                    if g.HasField("utilization_percent")
                    else None,
                    "memory_used_bytes": g.memory_used_bytes if g.HasField("memory_used_bytes") else None,
                    "memory_total_bytes": g.memory_total_bytes if g.HasField("memory_total_bytes") else None,
                }
                for g in h.gpus
            ],
            progress=[
                {
                    "job_id": j.id,
                    "cell": j.cell or None,
                    "step": j.progress.step if j.progress.HasField("step") else None,
                    # JSON has no NaN: a non-finite loss is null, and counted in `nonfinite`.
                    "loss": j.progress.loss
                    if j.progress.HasField("loss") and math.isfinite(j.progress.loss)
                    else None,
                    "nonfinite": j.progress.nonfinite,
                    "steps_per_s": j.progress.steps_per_s if j.progress.HasField("steps_per_s") else None,
                }
                for j in running
            ],
            cpu_percent=round(h.self.cpu_percent, 2),
            rss_bytes=h.self.rss_bytes,
            alerts=[
                {
                    "kind": pb.EventKind.Name(a.kind) if a.kind in pb.EventKind.values() else str(a.kind),
                    "subject": a.subject,
                    "detail": a.detail,
                    "since_unix_ns": a.since_unix_ns,
                }
                for a in h.alerts
            ],
            stale_probes=[p.name for p in h.probes if p.stale],
        )
        return r


STATUS_SCHEMA = 2
"""`status --json`'s schema version (README "status --json"): 2 has numbers and enums only."""
STATUS_DEADLINE_S = 10.0
"""How long `status` waits for one box; every box is asked at once, so a hung one costs no more."""


async def status(
    state: State, names: Sequence[str], *, deadline_s: float = STATUS_DEADLINE_S
) -> list[BoxStatus]:
    """Every box (or the named ones) asked at once, each within `deadline_s`."""
    boxes = [state.get(n) for n in names] if names else state.boxes()

    async def one(box: Box) -> BoxStatus:
        if box.status != "up":
            return BoxStatus(box, None, None)
        try:
            hello, health = await asyncio.wait_for(_ask(box), deadline_s)
        except TimeoutError:
            return BoxStatus(box, None, None, error=f"no answer within {deadline_s:.0f}s")
        except ControllerError as e:
            return BoxStatus(box, None, None, error=str(e))
        state.touch(box.name)
        return BoxStatus(box.with_(last_contact_ns=time.time_ns()), hello, health)

    return list(await asyncio.gather(*(one(b) for b in boxes)))


async def _ask(box: Box) -> tuple[pb.HelloResponse, pb.HealthSnapshot]:
    async with connect(box) as c:
        hello = await c.hello(timeout_s=3.0)
        health = await c.health_once()
    return hello, health


def pulled_dir(box: Box, override: Path | None) -> Path | None:
    if override is not None:
        check_path_text(override.resolve(), "--pulled")
        return override.resolve()
    return Path(box.pulled_dir) if box.pulled_dir else None


async def judge(
    box: Box,
    pulled: Path | None,
    *,
    confirm: str | None,
    dry_run: bool,
    state: State | None = None,
    accept_server_checksum: bool = False,
    box_gone: bool = False,
    accept_lost: bool = False,
    console_shows_gone: bool = False,
) -> gate.Verdict:
    """The gate's verdict on the box (see controller.gate). `state`: where the claims list received
    is kept (and, with `box_gone`, the last one read: controller.gone)."""
    if box.status == "down":
        raise StateError(f"{box.name} is already down")
    if box.status == "meter-unproven":
        raise StateError(
            f"{box.name}: its sidecar is stopped but the meter stop was not proven; check the provider's "
            "console (`boxwarden status` shows the audit)"
        )
    # The meter stop `down` would run must still be the one `up` accepted, and fillable: check it first.
    profile = box_profile(box)
    meterstop.plan(profile, box)
    if box_gone and state is None:
        raise ControllerError("internal: --box-gone judges the claims list kept in the controller state")
    silent = await teardown.silence(box) if box_gone else ""
    if silent and state is not None:
        absent = await absence.prove(box, profile, console_shows_gone=console_shows_gone)
        ev, early = await gone.gather(state, box, pulled, silent, absent)
        ev.accepted_lost = accept_lost
    else:
        keep = lastlist.keeper(state, box) if state is not None else None
        async with reach.link(box) as conn:
            try:
                async with reach.client(box, conn) as c:
                    asked = teardown.asked_release(state, box) if state is not None else None
                    ev, early = await gate.gather(c, box, pulled, keep=keep, release=asked)
                    if state is not None and not early:
                        await _learn_cells(state, box, c)
            except SidecarUnreachable as e:  # the link itself could not be built
                ev, early = await gate.gather(None, box, pulled, unreachable=str(e))
        if box_gone:
            early.append(gone.answers_reason(box))
        else:
            early = [gone.with_hint(r, box) for r in early]
    ev.accepted_server_checksum = accept_server_checksum
    return gate.judge(ev, early, confirm=confirm, dry_run=dry_run)


async def _learn_cells(state: State, box: Box, c: SidecarClient) -> None:
    """What the box's queues say of its cells, kept here before a teardown can take the box away:
    a later `fanout up` knows which cells finished on it (controller.cellfacts). Best effort: a
    box whose queues cannot be read now is judged all the same."""
    from controller import cellfacts  # (it reads queue records, which need this module)

    with contextlib.suppress(ControllerError):
        cellfacts.learn(state, box, await c.list_queues(brief=True))


async def down(
    state: State, box: Box, verdict: gate.Verdict, manual_done: Callable[[str], Awaitable[bool]]
) -> teardown.TeardownResult:
    profile = box_profile(box)
    # (the teardown closes the box's link at its end, however it ends)
    async with reach.link(box) as conn, reach.client(box, conn) as c:
        return await teardown.teardown(state, box, c, conn, verdict, profile, manual_done)


async def logs(box: Box, job_id: str, follow: bool) -> AsyncIterator[bytes]:
    async with connect(box) as c:
        try:
            await c.hello()
        except SidecarUnreachable as e:
            where = f" on {box.host}" if box.host else ""
            raise ControllerError(f"{e}; the job logs are in {box.state_dir}/logs{where}") from e
        async for chunk in c.tail_log(job_id, follow=follow):
            yield chunk.data
