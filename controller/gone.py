"""Closing a box whose sidecar is gone: `down NAME --confirm NAME --box-gone`.

A sidecar that does not answer may be a cut link while the box still writes checkpoints, so `down`
refuses it (SIDECAR_UNREACHABLE) unless the user says the box is gone (preempted, destroyed). Then
the gate judges what is left of it: the last claims list the controller received from the box
(`controller.lastlist`), and the tree a `pull --from durable` filled with every claim of exactly
that list, verified. The verdict, the evidence document and the teardown's audit record say that
durable bytes from the last claims list received at that time were judged, not the box's live
state. A sidecar that answers is not gone: `--box-gone` then refuses (BOX_ANSWERS); neither is a box
whose host answers while its sidecar is dead (SIDECAR_DEAD_HOST_UP, controller.absence): only the
provider's word proves it gone, or, where no provider can be asked, a host no link reaches and the
user's word that the console shows it gone (else GONE_UNPROVEN). Entries that the last list could not
cover (files being written then) are lost with the box: the gate names each (LOST_WITH_BOX) until
the user accepts that (`--accept-lost`).

At a real `down`, every claim's durable copy is read back here and hashed again before the meter
stop, as the sidecar's release re-proves them on a box that answers; one missing or changed stops
the teardown (NOT_DURABLE) and the meter is not touched. Nothing is released and no Shutdown is
sent: the sidecar does not answer. Its end is recorded as the user's word.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

from controller import fromdurable, gate, meterstop, teardown
from controller.absence import Absence
from controller.errors import ControllerError, GateRefused, Reason, StateError
from controller.lastlist import DurablePull, GoneBox, LastList
from controller.profiles import Profile
from controller.state import Box, State

BOX_ANSWERS = "BOX_ANSWERS"


def answers_reason(box: Box) -> Reason:
    return Reason(
        BOX_ANSWERS,
        detail=f"--box-gone, but the sidecar of {box.name} answers: the box is not gone; `down {box.name}` "
        "without --box-gone judges its live state",
    )


def with_hint(r: Reason, box: Box) -> Reason:
    """SIDECAR_UNREACHABLE with what to do if the box is really gone (not a cut link)."""
    if r.code != "SIDECAR_UNREACHABLE":
        return r
    n = box.name
    return Reason(
        r.code,
        r.path,
        f"{r.detail}. If the box is gone (preempted, destroyed) and not only out of reach: "
        f"`boxwarden pull {n} --from durable`, `boxwarden verify DIR`, "
        f"then `down {n} --confirm {n} --box-gone`",
    )


async def gather(
    state: State, box: Box, pulled: Path | None, unreachable: str, absent: Absence
) -> tuple[gate.Evidence, list[Reason]]:
    """The evidence of a gone box: that it is gone (`absent`: asked of the provider and the host,
    controller.absence), its last claims list, the last pull of that list from durable storage, and
    the pulled tree re-verified (see `gate.gather_tree`)."""
    ev = gate.Evidence(box=box.name, pulled_dir=str(pulled or ""))
    reasons: list[Reason] = []
    try:
        last = fromdurable.last_list(state, box)
    except StateError as e:
        reasons.append(
            Reason("SIDECAR_UNREACHABLE", detail=f"{unreachable}; --box-gone has nothing to judge: {e}")
        )
        await gate.gather_tree(ev, reasons, box, pulled, None)
        return ev, reasons
    gate.fill_claims(ev, last.hello, last.listing)
    done = state.durable_pull(box.name)
    problem = durable_pull_problem(box, last, done, pulled)
    ev.gone = GoneBox(
        unreachable=unreachable,
        list_received_at_ns=last.received_at_ns,
        durable_root=last.durable_root or last.durable_url,
        durable_pull=done.pulled_dir if done is not None and not problem else "",
        durable_pull_problem=problem,
        pending=len(last.listing.pending),
        absence=absent.how if absent.proven else "",
        presence="" if absent.proven else absent.how,
        presence_code="" if absent.proven else absent.code,
    )
    await gate.gather_tree(ev, reasons, box, pulled, last.hello)
    return ev, reasons


def durable_pull_problem(box: Box, last: LastList, done: DurablePull | None, pulled: Path | None) -> str:
    """Why the tree judged is not a pull from durable storage of exactly the last claims list; ""
    when it is."""
    again = f"run `boxwarden pull {box.name} --from durable --to DIR`, then `boxwarden verify DIR`"
    if done is None:
        return f"no pull from durable storage of {box.name} placed every claim yet: {again}"
    if (done.run_id, done.manifest_digest) != (last.run_id, last.manifest_digest):
        return (
            f"the last pull from durable storage ({done.pulled_dir}) was of the claims list "
            f"{done.manifest_digest[:16]}…, and the last list received is {last.manifest_digest[:16]}…: "
            + again
        )
    if pulled is None or str(pulled.resolve()) != done.pulled_dir:
        return (
            f"the tree judged ({pulled or 'none'}) is not the one `pull --from durable` filled "
            f"({done.pulled_dir}): judge that one (--pulled {done.pulled_dir})"
        )
    return ""


async def down(
    state: State,
    box: Box,
    verdict: gate.Verdict,
    profile: Profile,
    manual_done: Callable[[str], Awaitable[bool]],
    credentials: Path | None,
) -> teardown.TeardownResult:
    """The teardown of a gone box, after the gate allowed it and the user named the box: every
    durable copy read back and hashed here, then the meter stop; audited, refusals included."""
    if not verdict.allowed or not verdict.confirmed or verdict.gone is None:
        raise ControllerError("internal: a gone box's teardown called without an allowed, confirmed verdict")
    gone = verdict.gone
    last = fromdurable.last_list(state, box)
    judged = gone.to_json()["judged"]
    result = teardown.TeardownResult(box=box.name, judged=str(judged))
    earlier = teardown.unfinished(state, box)
    record = teardown.record_of(
        box,
        profile,
        ["--box-gone: read every durable copy back here", f"meter stop: {profile.meter_stop.verb}"],
    )
    record.update(
        evidence_digest=verdict.evidence_digest,
        manifest_digest=verdict.box_manifest_digest,
        accepted_server_checksum=verdict.accepted_server_checksum,
        gate=judged,
        box_gone=gone.to_json(),
    )
    tearing = box.with_(status="tearing-down")

    async def steps() -> None:
        meterstop.plan(profile, box)  # every placeholder fillable, before anything is done
        if last.manifest_digest != verdict.box_manifest_digest:
            raise GateRefused(
                f"another claims list of {box.name} arrived since the gate judged it: run down again",
                [Reason("MANIFEST_STALE", detail=f"the last list is now {last.manifest_digest[:16]}…")],
            )
        reader = fromdurable.open_reader(last, box, credentials)
        try:
            problems = await fromdurable.reprove(last, reader)
        finally:
            await reader.close()
        if problems:
            raise GateRefused(
                f"{len(problems)} durable copies of {box.name} no longer hash to their claims when read back "
                "from here; nothing was done and the meter was not touched",
                problems,
            )
        if await teardown.sidecar_answers(box):
            raise GateRefused(
                f"the sidecar of {box.name} answers now; the meter was not touched", [answers_reason(box)]
            )
        state.step(tearing, teardown.SIDECAR_GONE, teardown.GONE_BY_WORD)
        retry = earlier is not None and earlier.meter_stop_sent
        # (the provider first: the gate may have taken its word that the instance is gone)
        await teardown.meter_step(
            state, box, profile, result, manual_done, retry=retry, send=True, poll_first=True
        )
        result.sidecar_gone = True  # the user's word, and no answer (checked again just below)
        if await teardown.sidecar_answers(box):
            result.sidecar_gone = False
            raise ControllerError(
                f"a sidecar answers on {box.name} after its meter stop: the box was not gone; "
                "see `boxwarden status`"
            )

    return await teardown.audited(state, box, record, result, steps)
