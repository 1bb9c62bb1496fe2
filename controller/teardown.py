"""Teardown on the local profile: runs only after the gate allowed it and the user named the box.

It deletes the box-side copies of exactly the verified manifest's claims (the sidecar re-checks the
manifest digest, re-proves every durable copy, and hashes each file before it unlinks it), stops the
sidecar, and reports "gone" only after the process is gone and its socket no longer answers. If the
release refused, kept a file, or found anything new or running afterwards, the teardown stops THERE
(exit 3, the reasons listed): the sidecar keeps watching and the meter is not touched. Every
teardown is appended to the audit log.

Each step (release, sidecar stop, meter stop) is recorded in the controller state BEFORE it is
taken. `unfinished` is the one place that reads those records back: a teardown that did not end
with the meter proven stopped (a poll timeout, a Ctrl-C, a `kill -9`) is continued by the next
`down`. If the sidecar answers again (the user ran `up`), that `down` is a normal one, through the
whole gate. If it does not, nothing watches the box: `retry_meter` polls first and records "gone"
only when the poll shows it; otherwise it refuses, and sends the stop again only on the user's
explicit `--resend-stop` (audited as sent without a gate). A stop held back because other boxes
were at work on the instance (METER_HELD) was never sent: it is sent once none is left.
"""

from __future__ import annotations

import getpass
import shlex
import socket
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from controller import absence, meterstop, released, remote
from controller.bootstrap import wait_gone
from controller.client import SidecarClient
from controller.connector import Connector, launch
from controller.durable import CREDENTIALS_NAME
from controller.errors import ControllerError, GateRefused, Reason, SidecarRefused, SidecarUnreachable
from controller.gate import Verdict
from controller.meterstop import MeterResult
from controller.profiles import Profile
from controller.reach import connector_for, end_link, link
from controller.state import Box, State, Step

RELEASE, SHUTDOWN, SIDECAR_GONE, METER_STOP = "release", "shutdown", "sidecar_gone", "meter_stop"
METER_HELD = "meter_held"
"""The meter stop was not sent: other boxes were still at work on the instance (whose meter it is).
The box stays unfinished until a stop of its instance is proven (its own `down` again, or the last
of them)."""
STEP_ORDER = (RELEASE, SHUTDOWN, SIDECAR_GONE, METER_HELD, METER_STOP)
GONE_BY_WORD = "does not answer; gone by the user's word (--box-gone)"
"""The SIDECAR_GONE step of a teardown of a box proven gone (controller.gone): its host is gone too."""
# What stays true of the box once a sidecar answers `up` again: its meter stop may have been sent
# (the next stop polls first). The other steps were taken on a sidecar that is not the one watching.
KEPT_BY_UP = (METER_STOP, RELEASE)
"""(A release asked for stays on record across `up`: what it deleted on the box is deleted still,
and its manifest is what the gate may take as "released by this teardown": controller.released.)"""
UNFINISHED_CODE = "TEARDOWN_UNFINISHED"
HELD_CODE = "METER_HELD"


class MeterHeld(GateRefused):
    """The meter stop was held: other boxes are still at work on the instance."""


def asked_release(state: State, box: Box) -> released.ReleaseAsked | None:
    """The release the box's unfinished teardown asked for, if it asked one (controller.released)."""
    return released.release_asked(state.teardown_steps(box.name).get(RELEASE))


def when(at_ns: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at_ns / 1e9)) if at_ns else "an unknown time"


@dataclass(frozen=True)
class Unfinished:
    """An earlier teardown of the box took the recorded steps and did not end with the meter proven
    stopped (or the user's word for a manual stop)."""

    box: str
    status: str
    steps: Mapping[str, Step]

    @property
    def meter_stop_sent(self) -> bool:
        return METER_STOP in self.steps

    @property
    def held_only(self) -> bool:
        """Only the hold kept the stop from being sent: the gate passed and the sidecar was seen gone."""
        return METER_HELD in self.steps and SIDECAR_GONE in self.steps and not self.meter_stop_sent

    @property
    def sidecar_seen_gone(self) -> bool:
        """This teardown saw its sidecar gone after the release (`up` again drops the step)."""
        return SIDECAR_GONE in self.steps

    def describe(self) -> str:
        """One line: what was done and when, e.g. `... meter stop sent 2026-12-01T12:03:00Z, not proven`."""
        said = {
            RELEASE: "release of box-side copies requested",
            SHUTDOWN: "sidecar stop requested",
            SIDECAR_GONE: "sidecar seen gone",
            METER_HELD: "meter stop held",
            METER_STOP: "meter stop sent",
        }
        parts = []
        for name in STEP_ORDER:
            s = self.steps.get(name)
            if s is not None:
                shown = released.RELEASE_OF.sub(
                    lambda m: f"release of manifest {m.group(1)[:16]}…: ", s.detail
                )
                detail = f" ({shown})" if s.detail and name in (RELEASE, METER_HELD) else ""
                parts.append(f"{said[name]} {when(s.at_ns)}{detail}")
        parts.append("not proven" if self.meter_stop_sent else "meter stop not sent")
        return ", ".join(parts)

    def to_json(self) -> dict[str, object]:
        return {
            "status": self.status,
            "steps": {n: {"at": when(s.at_ns), "detail": s.detail} for n, s in self.steps.items()},
            "summary": self.describe(),
        }


def kept_by_up(steps: Mapping[str, Step]) -> dict[str, Step]:
    """The steps of an interrupted teardown that still hold once `up` has a sidecar answering."""
    return {name: s for name, s in steps.items() if name in KEPT_BY_UP}


def unfinished(state: State, box: Box) -> Unfinished | None:
    """Whether a `down` of `box` continues an earlier teardown, and from which step. The one place
    that decides it (from the recorded steps; a `meter-unproven` box of a version that kept no steps
    sent its stop when its last audit record was written)."""
    if box.status == "down":
        return None
    steps = state.teardown_steps(box.name)
    if not steps and box.status == "meter-unproven":
        steps = {METER_STOP: Step(METER_STOP, state.last_audit_ns(box.name), "recorded without steps")}
    if not steps and box.status == "up":
        return None
    return Unfinished(box.name, box.status, steps)


async def sidecar_answers(box: Box, timeout_s: float = 3.0, *, own: bool = False) -> bool:
    """Does the box's sidecar answer (any version; `own`: of its own run)? If it does, something
    watches the box again."""
    return not await silence(box, timeout_s, own=own)


async def silence(box: Box, timeout_s: float = 3.0, *, own: bool = False) -> str:
    """Why the box's sidecar does not answer; "" when it answers (any version). `own`: only a
    sidecar of the box's own run counts (another run's in the same state dir, say another
    controller's box of the same name, is not this box answering)."""
    conn = connector_for(box)
    try:
        async with SidecarClient(conn=conn) as c:
            hello = await c.hello(timeout_s=timeout_s, check_version=False)
            if own and hello.run_id and hello.run_id != box.run_id:
                return (
                    f"a sidecar of another run ({hello.run_id}) answers at its socket, not run {box.run_id}"
                )
    except SidecarUnreachable as e:
        return str(e) or "no answer"
    except SidecarRefused:
        return ""  # something answered, if only to refuse
    except ControllerError as e:
        # The link itself is refused (a remote box re-created with another host key, say): nothing
        # answers through it, which is all this asks.
        return str(e) or "no link"
    finally:
        await conn.close()
    return ""


def up_command(box: Box) -> str:
    """The `up` that restarts the box's sidecar as it was (so the gate can check the box again)."""
    argv = ["boxwarden", "up", box.name]
    argv += ["--profile-file", box.profile_file] if box.profile_file else ["--profile", box.profile]
    if box.instance_id:
        argv += ["--instance-id", box.instance_id]
    if box.host:
        argv += ["--host", box.host]
        for opt in box.ssh_options:
            argv += ["--ssh-option", opt]
        if box.state_on_durable:
            argv += ["--state-on-durable"]
    argv += ["--workdir", box.workdir]
    for w in box.watch:
        argv += ["--watch", w]
    argv += ["--durable", box.durable]
    for cell in box.roster:
        argv += ["--roster", cell]
    for pat in box.exclude:
        argv += ["--exclude", pat]
    return shlex.join(argv)


def unfinished_refusal(box: Box, u: Unfinished, poll_said: str = "", *, resend: bool = True) -> GateRefused:
    """Fail closed: the box may still run, nothing watches it, and nothing proves it gone. `resend`:
    the profile has a stop command that `--resend-stop` could send."""
    sent = u.steps.get(METER_STOP)
    if sent is not None:
        head = f"the meter stop of {box.name} was sent at {when(sent.at_ns)} but never proven"
    elif u.held_only:
        held = u.steps[METER_HELD]
        return held_refusal(box, held.detail, resend=resend, held_at_ns=held.at_ns)
    else:
        head = f"the teardown of {box.name} stopped before its meter stop was sent ({u.describe()})"
    poll = f"; the provider's poll does not say it is gone ({poll_said})" if poll_said else ""
    then = "pull, verify and"
    if released.release_asked(u.steps.get(RELEASE)) is not None and SIDECAR_GONE not in u.steps:
        # Its release may have deleted the box's claims: the tree verified for it is judged as it is.
        then = (
            "without pulling or verifying again (the release may have deleted what the box claimed; "
            f"the tree verified for it, {box.pulled_dir or 'the one you pulled'}, is judged as it is),"
        )
    return GateRefused(
        f"{head}{poll}. The box may still be running and nothing watches it (its sidecar does not "
        "answer), so nothing was sent. To let the gate check the box again, restart its sidecar: "
        f"`{up_command(box)}`, then {then} `boxwarden down {box.name} --confirm {box.name}`"
        + (
            ". If you know the box is being destroyed anyway, "
            f"`boxwarden down {box.name} --confirm {box.name} --resend-stop` sends the stop again "
            "without a gate (the audit record says so)"
            if resend
            else ""
        ),
        [Reason(UNFINISHED_CODE, detail=u.describe())],
    )


@dataclass
class TeardownResult:
    box: str
    deleted: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    sidecar_gone: bool = False
    meter: MeterResult | None = None
    audit_id: int = 0
    judged: str = ""  # --box-gone: what the gate judged instead of the box's live state

    @property
    def gone(self) -> bool:
        """The box is down: its sidecar is gone and its meter is proven stopped (or needs none)."""
        if not self.sidecar_gone or self.meter is None:
            return False
        return self.meter.gone or self.meter.manual_confirmed

    def to_json(self) -> dict[str, object]:
        return {
            "box": self.box,
            "deleted": self.deleted,
            "kept": self.kept,
            "sidecar_gone": self.sidecar_gone,
            "meter": self.meter.to_json() if self.meter else None,
            "gone": self.gone,
            "audit_id": self.audit_id,
            "judged": self.judged,
        }


async def teardown(
    state: State,
    box: Box,
    client: SidecarClient,
    conn: Connector,
    verdict: Verdict,
    profile: Profile,
    manual_done: Callable[[str], Awaitable[bool]],
) -> TeardownResult:
    if not verdict.allowed or not verdict.confirmed:
        raise ControllerError("internal: teardown called without an allowed, confirmed verdict")
    result = TeardownResult(box=box.name)
    earlier = unfinished(state, box)  # a `down` after `up` again: its meter stop may have been sent
    record = record_of(
        box, profile, ["ReleaseArtifacts", "Shutdown", f"meter stop: {profile.meter_stop.verb}"]
    )
    record.update(
        evidence_digest=verdict.evidence_digest,
        manifest_digest=verdict.box_manifest_digest,
        accepted_server_checksum=verdict.accepted_server_checksum,
    )
    if earlier is not None:
        record["continues"] = earlier.to_json()
    tearing = box.with_(status="tearing-down")

    async def steps() -> None:
        meterstop.plan(profile, box)  # every placeholder fillable, before anything is released
        hello = await client.hello()
        await provider_lists(profile, box, earlier)
        before = state.teardown_steps(box.name)
        state.step(tearing, RELEASE, released.release_detail(verdict.box_manifest_digest, "no answer yet"))
        answer = await client.release(
            verdict.box_manifest_digest, accept_server_checksum=verdict.accepted_server_checksum
        )
        result.deleted = list(answer.deleted)
        result.kept = list(answer.kept)
        did = f"{len(result.deleted)} deleted, {len(result.kept)} kept"
        state.step_detail(box.name, RELEASE, released.release_detail(verdict.box_manifest_digest, did))
        if answer.refused:
            state.set_teardown(box, before)  # the sidecar keeps watching: the box is as it was
            reasons = [Reason(r.code, r.path, r.detail) for r in answer.refused]
            what = (
                "refused, nothing was deleted"
                if not result.deleted
                else f"deleted {len(result.deleted)} files"
            )
            raise GateRefused(
                f"the release on {box.name} {what}, and the box is not ready to be torn down; the "
                "sidecar keeps watching and the meter was not touched. Deal with the reasons below, "
                f"then pull, verify and `down {box.name}` again",
                reasons,
            )
        state.step(tearing, SHUTDOWN, f"pid {hello.pid}")
        await client.shutdown()
        result.sidecar_gone = await wait_gone(
            box, conn, hello.pid, deadline_s=20.0, forget_credentials=True, torn_down=True
        )
        if not result.sidecar_gone:
            where = f" on {box.host}" if box.host else ""
            raise ControllerError(
                f"the sidecar of {box.name} (pid {hello.pid}{where}) is still running after Shutdown; "
                f"check `ps -p {hello.pid}`{where} and its log in {Path(box.state_dir).parent}/sidecar.log"
            )
        # Only now is it known that nothing watches (or seals) anything after the release: a
        # teardown stopped before this line never lets a later `down` skip the gate.
        state.step(tearing, SIDECAR_GONE, f"pid {hello.pid}")
        # The gate passed just now: the stop may be sent (again: an earlier one polls first).
        retry = earlier is not None and earlier.meter_stop_sent
        on_box = await sidecars_beside(conn, box, profile, state)
        await meter_step(state, box, profile, result, manual_done, retry=retry, send=True, also=on_box)
        if await sidecar_answers(box):
            # Something started a sidecar while the meter stopped (`up` waits for this `down`; a
            # sidecar started by hand does not): the box is watched and may run jobs again.
            result.sidecar_gone = False
            raise ControllerError(
                f"a sidecar answers on {box.name} again, after its meter stop: something started one "
                "during the teardown, so the box is not gone; see `boxwarden status`"
            )

    return await audited(state, box, record, result, steps)


async def provider_lists(profile: Profile, box: Box, earlier: Unfinished | None) -> None:
    """Before anything is released: the box's sidecar answers, so its instance is there (whatever
    an earlier stop did: the box was brought up again since); a provider that does not list it is
    being asked in another account, region or context than at `up` (its "not found" would later
    read as "gone" while the instance bills on). Refused, nothing done."""
    if profile.meter_stop.mode != "argv":
        return
    word, said = await meterstop.provider_says(profile, box)
    if word == meterstop.LISTED:
        return
    what = meterstop.unlisted(word, box)
    raise GateRefused(
        f"the provider {what} ({said}) while the sidecar of {box.name} answers on it: its CLI may be pointed "
        "at another account, region or context than at `up`. Nothing was released and the meter was not "
        f"touched; run `down {box.name}` again from where the provider lists the instance",
        [Reason("PROVIDER_DISAGREES", detail=said)],
    )


async def retry_meter(
    state: State,
    box: Box,
    profile: Profile,
    manual_done: Callable[[str], Awaitable[bool]],
    *,
    resend_stop: bool = False,
) -> TeardownResult:
    """Continue a teardown whose sidecar no longer answers (so no gate can run): only the meter is
    left to settle. The poll runs first and "gone" is recorded only when it shows it; a box still
    there gets the stop again only with `resend_stop` (the user's word that it is being destroyed
    anyway), otherwise this refuses (exit 3) and says how to let the gate check the box again."""
    u = unfinished(state, box) or Unfinished(box.name, box.status, {})
    ms = profile.meter_stop
    # (A meter stop kept across `up` again says nothing of the sidecar that `up` started.)
    seen_gone = u.sidecar_seen_gone or u.status == "meter-unproven"
    # The sidecar does not answer, which does not make it gone: only its end seen after the
    # release, or the provider's word that the whole box is gone, says so.
    result = TeardownResult(box=box.name, sidecar_gone=seen_gone)
    actions = [f"meter stop (retry, poll first): {ms.verb}"]
    if resend_stop:
        actions.append(
            "--resend-stop: the stop is sent again WITHOUT a gate if the poll does not show it gone"
        )
    record = record_of(box, profile, actions)
    record.update(continues=u.to_json(), resend_stop=resend_stop, gate="not run: the sidecar does not answer")

    async def steps() -> None:
        if ms.mode != "argv" and not seen_gone:
            # No provider can say whether the box is gone (no meter, or a console only the user
            # sees), and the sidecar's end after the release was never seen: it may have lived on
            # (a Ctrl-C before Shutdown) and sealed more since. Neither "gone" nor the console
            # steps without a gate; an `argv` stop polls the provider first and sends nothing
            # again without --resend-stop.
            raise unfinished_refusal(box, u, resend=False)
        # A stop only held back by other boxes on the instance was never sent: the gate passed and
        # the sidecar was seen gone, so it is sent now that none is left (the poll first). A stop
        # that would only poll asks nobody; one that would send (or show) asks the box who else is
        # at work there.
        send = resend_stop or u.held_only
        # A box proven gone (--box-gone) has no host to ask; any other, even one whose sidecar was
        # seen gone (a dead sidecar says nothing of its instance), has its host asked before the
        # provider's "gone" is taken.
        proven_gone = SIDECAR_GONE in u.steps and u.steps[SIDECAR_GONE].detail == GONE_BY_WORD
        also: list[str] = []
        if send or ms.mode == "manual":
            # (a box proven gone, or one the user says is being destroyed: no link is nobody there)
            gone = SIDECAR_GONE in u.steps and u.steps[SIDECAR_GONE].detail == GONE_BY_WORD
            also = await sidecars_beside_if_reachable(
                box, profile, state, destroyed_anyway=resend_stop or gone
            )
        settled = False
        try:
            meter = await meter_step(
                state,
                box,
                profile,
                result,
                manual_done,
                retry=True,
                send=send,
                also=also,
                ask_host=not proven_gone,
            )
            settled = meter.gone or meter.manual_confirmed
        finally:
            if seen_gone or settled:  # an earlier teardown may have stopped before it forgot them
                record["credentials"] = await forget_credentials(box, close_run=settled)
        result.sidecar_gone = seen_gone or meter.gone
        if ms.mode == "argv" and not meter.gone and not meter.sent:
            raise unfinished_refusal(box, u, meter.last_poll)

    return await audited(state, box, record, result, steps)


async def meter_step(
    state: State,
    box: Box,
    profile: Profile,
    result: TeardownResult,
    manual_done: Callable[[str], Awaitable[bool]],
    *,
    retry: bool,
    send: bool,
    also: Sequence[str] = (),
    poll_first: bool | None = None,
    ask_host: bool = False,
) -> MeterResult:
    """The meter stop, its step recorded before the command runs; an unproven stop leaves the box
    `meter-unproven` (the next `down` polls first). The meter is the instance's: while another box
    may still be at work on the same instance, nothing is sent and the box stays unfinished
    (MeterHeld): its next `down` asks again and sends the stop once none is left, and a stop of the
    instance that another box's teardown proves closes it. `also`: boxes the box itself says are at
    work there (another controller's too). `poll_first` (default: `retry`): ask the provider first
    (an instance gone already needs no stop and is held by nobody). `ask_host`: the box's host is
    asked too before the provider's "gone" is taken (no teardown saw its sidecar end)."""
    ms = profile.meter_stop
    if (retry if poll_first is None else poll_first) and ms.mode == "argv":
        # Gone already (another box's stop, the provider's own end): nothing is sent, nothing held.
        word, said = await meterstop.provider_says(profile, box)
        if word == meterstop.GONE:
            await _none_answers(state, box, also, said, ask_host=ask_host)
            result.meter = MeterResult(mode=ms.mode, verb=ms.verb, gone=True, polls=1, last_poll=said)
            result.meter.detail = f"gone: the provider's poll showed it ({said}; nothing sent again)"
            close_held(state, box, profile, result.meter)
            return result.meter
    acts = send or ms.mode == "manual"  # (a retry that only polls sends nothing anyone could be under)
    sharing = holding(state, box, also) if acts else []
    if sharing and ms.mode != "none":
        result.meter = MeterResult(mode=ms.mode, verb=ms.verb, shared_with=sharing, detail="held")
        detail = "; ".join(sharing)
        state.step(box.with_(status="meter-unproven"), METER_HELD, detail)
        raise held_refusal(box, detail, resend=ms.mode == "argv")
    try:
        result.meter = await meterstop.stop_meter(
            profile,
            box,
            manual_done=manual_done,
            retry=retry,
            send=send,
            before_send=lambda what: state.step(box.with_(status="tearing-down"), METER_STOP, what),
        )
        held = result.meter.mode == "argv" and not result.meter.gone and not result.meter.sent
        if not held:  # held: still there and not sent again; the caller refuses
            meterstop.require_stopped(result.meter)
            close_held(state, box, profile, result.meter)
        return result.meter
    except BaseException:
        if METER_STOP in state.teardown_steps(box.name):
            state.put(box.with_(status="meter-unproven"))
        raise


async def _none_answers(
    state: State, box: Box, also: Sequence[str], said: str, *, ask_host: bool = False
) -> None:
    """The provider says the instance is gone: refused (PROVIDER_DISAGREES) if a box on it answers
    (this controller's box whose own sidecar answers, or one the box says runs there; with
    `ask_host`, the box's own host answering a login): the provider is being asked in another
    account, region or context."""
    alive = [n for n in sharing_instance(state, box) if await sidecar_answers(state.get(n), own=True)]
    alive += [e for e in also if "(its sidecar runs" in e]
    if ask_host and box.host:
        kind, detail = await absence.host_reach(box)
        if kind == absence.ANSWERS:
            alive.append(f"{box.name}'s host {box.host} ({detail})")
    if alive:
        raise GateRefused(
            f"the provider says {box.instance_id} is gone ({said}) while boxes on it answer "
            f"({'; '.join(alive)}): its CLI may be pointed at another account, region or context than at "
            f"`up`. Nothing was done; run `down {box.name}` again from where the provider lists the instance",
            [Reason("PROVIDER_DISAGREES", detail=said)],
        )


def holding(state: State, box: Box, also: Sequence[str] = ()) -> list[str]:
    """Who holds the instance's meter stop: this controller's boxes on it (sharing_instance), and
    `also`, the boxes the box itself says are at work there."""
    known = sharing_instance(state, box)
    return [*known, *(n for n in also if n.partition(" ")[0] not in known)]


NO_LINK_SAID = "(no link reaches the host"
"""How a holder entry starts when no link reached the host at all (`--resend-stop` then sends)."""


def unsure(holders: str) -> bool:
    """Whether every holder is only a host that could not say who is at work there (an entry in
    parentheses), none a box known to be at work."""
    return all(h.startswith("(") for h in holders.split("; "))


def held_refusal(box: Box, holders: str, *, resend: bool, held_at_ns: int = 0) -> MeterHeld:
    """`resend`: the profile has a stop command that `--resend-stop` could send. `held_at_ns`: the
    holders are the ones recorded then (not asked now)."""
    n = box.name
    instance = box.instance_id or "(none named)"
    done = (
        f"Every step of the teardown of {n} before the meter stop is done; it is unfinished until the meter "
        "stops."
    )
    again = (
        f"`boxwarden down {n} --confirm {n}` asks the provider first (an instance gone already is closed), "
        "then the box, and sends the stop once nothing holds it"
    )
    if held_at_ns:
        return MeterHeld(
            f"the meter stop of {n} was held at {when(held_at_ns)}, when the box said this of instance "
            f"{instance}, whose meter it is: {holders}. {done} {again}",
            [Reason(HELD_CODE, detail=holders)],
        )
    if unsure(holders):
        no_link = all(h.startswith(NO_LINK_SAID) for h in holders.split("; "))
        if resend and no_link:
            out = (
                f". If you know the instance is being destroyed anyway, `boxwarden down {n} --confirm {n} "
                "--resend-stop` sends the stop without asking (the audit record says so)"
            )
        else:
            out = (
                ". If you know nothing else is at work there, stop the instance at the provider yourself; "
                "the next `down` finds it gone"
            )
        return MeterHeld(
            f"the meter of {n} was NOT stopped: the host could not say whether other boxes are at work on "
            f"instance {instance}, whose meter it is {holders}. {done} {again}{out}",
            [Reason(HELD_CODE, detail=holders)],
        )
    return MeterHeld(
        f"the meter of {n} was NOT stopped: other boxes are still at work on instance {instance}, whose "
        f"meter it is ({holders}). {done} Once they are down, `boxwarden down {n} --confirm {n}` asks the "
        "box again and stops the meter (a box no controller of yours knows stays at work there until you "
        "deal with it on the box)",
        [Reason(HELD_CODE, detail=holders)],
    )


def close_held(state: State, box: Box, profile: Profile, meter: MeterResult) -> None:
    """The meter of `box`'s instance is proven stopped (or the user did the console steps): this
    controller's boxes whose stop was only held back on that instance are down with it. The same
    instance means the same id under the same profile text (the same stop, the same provider and
    account); a box of any other is left held, and its own `down` asks its own provider."""
    if not box.instance_id or not box.profile_digest or meter.mode == "none":
        return
    for b in state.boxes():
        if b.name == box.name or b.status == "down" or b.instance_id != box.instance_id:
            continue
        if b.profile_digest != box.profile_digest or meterstop.plan(profile, b) != meterstop.plan(
            profile, box
        ):
            continue  # (a stop filled from the box's name too is another stop)
        u = unfinished(state, b)
        if u is None or not u.held_only:
            continue
        record = {
            "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "instance_id": b.instance_id,
            "run_id": b.run_id,
            "actions": [
                f"meter stop held ({u.steps[METER_HELD].detail}), then stopped by the teardown of {box.name}"
            ],
            "continues": u.to_json(),
            "result": {"meter": meter.to_json(), "gone": True, "stopped_by": box.name},
        }
        state.audit(b.name, record)
        state.set_teardown(b.with_(status="down"), {})


def sharing_instance(state: State, box: Box) -> list[str]:
    """The other boxes whose sidecar may still run on `box`'s instance (the same instance id, under
    any profile: a copy of it, or another spelling of the same stop, stops the same instance):
    every box not down, but one whose teardown saw its sidecar gone. Stopping the instance's meter
    would stop theirs."""
    if not box.instance_id:
        return []
    out = []
    for b in state.boxes():
        if b.name == box.name or b.status == "down" or b.instance_id != box.instance_id:
            continue
        if SIDECAR_GONE not in state.teardown_steps(b.name):
            out.append(b.name)
    return sorted(out)


async def sidecars_beside(conn: Connector, box: Box, profile: Profile, state: State) -> list[str]:
    """The boxes that may still be at work on the box's host beside this one, as the host says (any
    controller's, in any of the user's state roots, this machine's other state homes for a box on
    this machine), each with why. Fails closed: a host that cannot say is an answer that holds the
    meter stop. The runs this controller tore down are over, wherever the box still shows them open
    (a teardown of a gone box could not reach it to close them)."""
    roots = [remote.STATE_ROOT, *(f"{t.path.rstrip('/')}/.boxwarden" for t in profile.storage)]
    # (by state dir and instance: another controller's run of the same name and id, in a state dir
    # of the same path on another machine or instance, is not one of these)
    closed = {
        b.state_dir: [list(r) for r in sorted(runs)]
        for b in state.boxes()
        if (runs := state.torn_down(b.name))
    }
    req = {
        "state_dir": box.state_dir,
        "run_id": box.run_id,  # (its own state dir counts too, for a run that is not this one)
        "roots": roots,
        "instance_id": box.instance_id,
        "closed": closed,
    }
    try:
        answer = await launch(conn, "siblings", req, timeout_s=30)
    except ControllerError as e:
        return [f"(the host could not say which boxes run beside {box.name}: {e})"]
    entries = answer.get("entries")
    if entries is None:  # an older box-side launch: names of running sidecars only
        return [f"{name} (its sidecar runs on the box)" for name in answer.get("running", [])]
    # (a root that cannot be read names no box: the host cannot say what runs there)
    return [
        f"({e['name']} {e['why']}: the host cannot say which boxes run there)"
        if not e.get("run") and str(e.get("why", "")).startswith("cannot be read")
        else f"{e['name']} ({e['why']})"
        for e in entries
    ]


async def sidecars_beside_if_reachable(
    box: Box, profile: Profile, state: State, *, destroyed_anyway: bool = False
) -> list[str]:
    """As sidecars_beside, for a teardown continued without its sidecar. A host no link reaches
    cannot say who is at work there (its sshd stopped, a firewall): that holds the stop, unless the
    user said the box is being destroyed anyway (`--resend-stop`: `destroyed_anyway`)."""
    if not box.host:
        async with link(box) as conn:
            return await sidecars_beside(conn, box, profile, state)
    try:
        async with link(box) as conn:
            await conn.run(["true"], timeout_s=30)
            return await sidecars_beside(conn, box, profile, state)
    except ControllerError as e:
        kind, said = await absence.host_reach(box)  # (a login refused is a host that answers)
        if kind == absence.NO_LINK and destroyed_anyway:
            return []
        if kind == absence.NO_LINK:
            return [f"{NO_LINK_SAID} ({said}): it cannot say which boxes run beside {box.name})"]
        if kind == absence.CANNOT_TELL:
            return [f"(this machine cannot tell whether the host is there ({said}), so it cannot say which "
                    f"boxes run beside {box.name}: {e})"]  # fmt: skip
        return [f"(the host answers ({said}) but could not say which boxes run beside {box.name}: {e})"]


async def forget_credentials(box: Box, *, close_run: bool = False) -> str:
    """Remove the store's credentials from a box whose sidecar is gone (a teardown interrupted
    after the sidecar's stop left them there); with `close_run` (its meter settled), also mark its
    run over on the box as a teardown that saw its sidecar gone does (no controller starts it
    again, no meter stop there waits for it). What happened, for the audit. Never raises: a box
    out of reach keeps them, and the audit says so."""
    if not box.durable_credentials and not close_run:
        return ""
    req: dict[str, object] = {"state_dir": box.state_dir, "pid": 0}
    if box.durable_credentials:
        req["forget"] = f"{box.state_dir}/{CREDENTIALS_NAME}"
    if close_run:
        req["torn_down"] = box.run_id
    what = " (and its run closed)" if close_run and box.durable_credentials else ""
    try:
        async with link(box) as conn:
            answer = await launch(conn, "gone", req, timeout_s=30)
    except ControllerError as e:
        return (
            f"not removed from the box{what}: {e}"
            if box.durable_credentials
            else f"run not closed on the box: {e}"
        )
    if not answer.get("gone"):
        return "kept: a sidecar holds the box's state dir again"
    return f"removed from the box{what}" if box.durable_credentials else "run closed on the box"


def record_of(box: Box, profile: Profile, actions: list[str]) -> dict[str, object]:
    return {
        "confirmed_by": getpass.getuser(),
        "host": socket.gethostname(),
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "profile": profile.name,
        "profile_source": profile.source,
        "profile_digest": profile.digest,
        "instance_id": box.instance_id,
        "run_id": box.run_id,
        "actions": actions,
    }


async def audited(
    state: State,
    box: Box,
    record: dict[str, object],
    result: TeardownResult,
    steps: Callable[[], Awaitable[None]],
) -> TeardownResult:
    """Run the teardown steps; whatever happens (Ctrl-C included), append the record to the audit
    log and close the box's ControlMaster. Only a teardown that ended with the meter settled marks
    the box down (and forgets its steps)."""
    try:
        await steps()
    except BaseException as e:
        record["error"] = f"{type(e).__name__}: {e}" if not isinstance(e, ControllerError) else str(e)
        if isinstance(e, GateRefused):
            record["reasons"] = [r.to_json() for r in e.reasons]
        record["result"] = result.to_json()
        state.audit(box.name, record)
        raise
    finally:
        await end_link(box)  # no login to the box outlives its teardown, however it ended
    record["result"] = result.to_json()
    result.audit_id = state.audit(box.name, record)
    state.set_teardown(box.with_(status="down"), {})
    return result
