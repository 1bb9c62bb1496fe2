"""`down NAME --confirm NAME --when-safe`: tear a box down the moment it is safe, not a minute later.

The controller follows the box: while a job runs or its queue has cells to run, it waits; then it
pulls the claims (resumably, into the pulled tree), verifies the tree as `verify` does, and asks the
usual gate with the name the user confirmed. The moment the gate passes, the usual teardown runs
(the release, the sidecar stop, the meter stop). Until then nothing is torn down: a box that does
not answer, whose evidence never completes, or whose release the sidecar refuses (a job waiting to
be started again, a file changed since it was verified) is followed until the user ends it
(Ctrl-C), never torn down; each new reason is told as it changes. What can never pass is refused at
once instead: a pull destination that overlaps what it proves, or a run that left nothing at all
(unless `allow_empty`). A box whose teardown was interrupted is continued: through the gate while
its sidecar answers, else as `down NAME --confirm NAME` continues it (only the meter is left).
While it follows, the box is marked armed in the controller's state (controller.armed; `watch`
shows it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

from boxwarden_pb.v1 import sidecar_pb2 as pb

from controller import __version__, armed, boxes, cellfacts, meterstop, reach, released, teardown
from controller.errors import ControllerError, GateRefused, Reason, StateError, UsageError
from controller.overlap import destination_problem, overlap_problem
from controller.state import Box, State
from controller.verify import read_marker, verify_tree

POLL_S = 5.0
ASK_S = 10.0  # how long one look at the box may take


def silent(box: Box, said: str) -> str:
    """A wait for a sidecar that does not answer: only `up` brings a dead one back, and `up` waits
    for this follower, so it says how to get out."""
    return (
        f"an answer from its sidecar ({said}; if it died, stop this follower, run `boxwarden up "
        f"{box.name}` to start it again, then arm it again)"
    )


async def waiting_for(box: Box, pull_to: Path, state: State | None = None) -> list[str]:
    """What the box still runs (jobs, queued cells), or that it does not answer; [] when idle.
    Refuses (UsageError) a pull destination that overlaps what it would prove: that never passes.
    With `state`, what the box's queues say is kept (controller.cellfacts)."""
    try:
        async with asyncio.timeout(ASK_S), reach.connect(box) as c:
            hello = await c.hello()
            health = await c.health_once()
            found = await c.list_queues(brief=True)
    except (ControllerError, TimeoutError) as e:
        return [silent(box, str(e) or f"none within {ASK_S:.0f} s")]
    if state is not None:
        cellfacts.learn(state, box, found)
    problem = overlap_problem(pull_to, hello) or destination_problem(pull_to)
    if problem:
        raise UsageError(f"--pull-to {pull_to}: {problem}; nothing was torn down")
    out = [f"job {j.id} to end" for j in health.jobs if j.state == pb.JOB_STATE_RUNNING]
    for q in found:
        left = [c.spec.cell for c in q.cells if c.state in (pb.CELL_PENDING, pb.CELL_RUNNING)]
        if left and not q.stopped:
            out.append(f"queue {q.name}'s cells {', '.join(left)}")
    return out


def may_start_again(j: pb.Job) -> bool:
    """The job failed and its restart policy may start it again (the sidecar's rule: a nonzero exit
    or a signal, restarts left). A job stopped while it waited reads the same here (the listing
    does not say which restarts are still due), so this only ever keeps a follower waiting."""
    return (
        j.state == pb.JOB_STATE_EXITED
        and j.exit_code != 0
        and j.restart == "on-failure"
        and j.restarts < j.max_restarts
    )


async def follow(
    state: State,
    name: str,
    pull_to: Path,
    *,
    poll_s: float,
    report: Callable[[str], None],
    manual_done: Callable[[str], Awaitable[bool]],
    allow_empty: bool = False,
) -> teardown.TeardownResult:
    """Follow box `name` until the gate passes, then tear it down; `report` gets each new reason
    it still waits. Raises StateError if the box is down meanwhile (another `down`)."""
    said: list[str] = []
    told = False
    held: list[str] = []  # the boxes its meter stop waits for, last seen
    armed.arm(state, name)
    try:
        while True:
            box = state.get(name)
            if box.status == "down" and held:
                return _closed_with_instance(box)
            if box.status == "down":
                raise StateError(f"{name} is down now: nothing left to tear down when safe")
            earlier = teardown.unfinished(state, box)
            quiet = await teardown.silence(box, own=True) if earlier is not None else ""
            if earlier is not None and quiet and earlier.sidecar_seen_gone:
                # An interrupted teardown saw its sidecar gone: no gate can run, only the meter is
                # left to settle, as `down NAME --confirm NAME` settles it.
                profile = boxes.box_profile(box)
                listed = ""
                if profile.meter_stop.mode == "argv" and earlier.meter_stop_sent:
                    # Its stop was sent: until the provider shows it gone (an instance slow to end),
                    # wait, asking the provider only (each settling attempt is an audit record).
                    word, listed = await meterstop.provider_says(profile, box)
                    listed = "" if word == meterstop.GONE else listed
                held = []
                argv = profile.meter_stop.mode == "argv"
                ended = (
                    argv
                    and earlier.held_only
                    and (await meterstop.provider_says(profile, box))[0] == meterstop.GONE
                )
                if earlier.held_only and not ended:
                    # (asked without an audit record each look; an instance gone already holds nothing)
                    also = await teardown.sidecars_beside_if_reachable(box, profile, state)
                    held = teardown.holding(state, box, also)
                if not listed and not held:
                    report(f"continuing its teardown: {earlier.describe()}")
                    try:
                        return await teardown.retry_meter(state, box, profile, manual_done)
                    except teardown.MeterHeld as e:
                        held = [r.detail for r in e.reasons]
                    except GateRefused as e:  # the provider disagrees with boxes that answer: wait
                        held = [_line(r) for r in e.reasons]
                why = [_held(box, held)] if held else [f"the provider to show it gone ({listed})"]
            elif earlier is not None and quiet:  # silent for now (paused, restarting, dead): wait
                why = [silent(box, quiet)]
            if earlier is not None and quiet:
                if why != said:
                    said = why
                    report("waiting for " + "; ".join(why))
                await asyncio.sleep(poll_s)
                continue
            if earlier is not None and not told:  # its sidecar answers: through the whole gate again
                told = True
                report(f"its teardown did not finish ({earlier.describe()}): continued through the gate")
            why = await waiting_for(box, pull_to, state)
            if not why:
                why = await _evidence(state, box, pull_to, allow_empty)
            if not why:
                verdict = await boxes.judge(box, pull_to, confirm=name, dry_run=False, state=state)
                why = [f"{r.code} {r.path}".strip() for r in verdict.reasons]
                passes = verdict.allowed
                if passes:
                    try:  # (asked here, without an audit record each look)
                        await teardown.provider_lists(boxes.box_profile(box), box, None)
                    except GateRefused as e:
                        passes = False
                        why = [_line(r) for r in e.reasons] + [
                            "the provider to list the instance (run the follower from where it does)"
                        ]
                if passes:
                    report("the gate passed: tearing down")
                    try:
                        return await boxes.down(state, state.get(name), verdict, manual_done)
                    except teardown.MeterHeld as e:  # released, its sidecar gone: the meter waits
                        held = [r.detail for r in e.reasons]
                        why = [_held(box, held)]
                    except GateRefused as e:  # only the release refuses so: the box is as it was, watched
                        why = [f"the release: {_line(r)}" for r in e.reasons] or [str(e)]
            if why != said:
                said = why
                report("waiting for " + "; ".join(why))
            await asyncio.sleep(poll_s)
    finally:
        armed.disarm(state, name)


def _closed_with_instance(box: Box) -> teardown.TeardownResult:
    """The box whose stop was held is down: the last box on its instance proved the stop."""
    ms = boxes.box_profile(box).meter_stop
    meter = meterstop.MeterResult(
        mode=ms.mode,
        verb=ms.verb,
        gone=True,
        detail=f"stopped with the last box on instance {box.instance_id} (its audit record says which)",
    )
    return teardown.TeardownResult(box=box.name, sidecar_gone=True, meter=meter)


def _held(box: Box, holders: list[str]) -> str:
    said = "; ".join(holders)
    if teardown.unsure(said):
        return f"the host to say who else is at work on instance {box.instance_id}, whose meter it is {said}"
    return f"the other boxes at work on instance {box.instance_id} to go down, whose meter it is too ({said})"


async def _evidence(state: State, box: Box, pull_to: Path, allow_empty: bool) -> list[str]:
    """Pull, then verify as `verify DIR` does (the tree against its manifest, then a marker): what
    is still missing ([] when the tree verified). A run that left nothing at all never passes
    without `allow_empty`: refused (GateRefused)."""
    if await _released_here(state, box, pull_to):
        # Verified before this teardown's release deleted the box's claims: the gate hashes it again
        # as it stands (a pull now would list them retired, and the roster would find nothing).
        return []
    try:
        rep = await reach.pull_box(state, box, pull_to)
    except ControllerError as e:
        return [f"the pull ({e})"]
    if rep.unavailable:
        return [f"the pull: {', '.join(sorted(rep.unavailable))} unavailable"]
    checked = await asyncio.to_thread(
        verify_tree,
        pull_to,
        roster=box.roster or None,
        write_marker=True,
        verifier_version=__version__,
        allow_empty=allow_empty,
    )
    why = [f"{r.code} {r.path}".strip() for r in checked.reasons]
    if any(r.code == "EMPTY" for r in checked.reasons):
        try:
            async with reach.connect(box) as c:
                await c.hello()
                listing = await c.list_artifacts()
                jobs = await c.list_jobs()  # every job, ended ones too (the health snapshot's are live)
        except ControllerError as e:
            return [*why, f"an answer from its sidecar ({e})"]
        again = [j.id for j in jobs.jobs if may_start_again(j)]
        if again and not listing.total_claims:  # it may yet write: not empty for good
            return [
                f"EMPTY (nothing claimed yet; job {', '.join(again)} failed and its restart policy may start "
                "it again. If it was stopped, nothing more will come: Ctrl-C, then arm it with "
                "--allow-empty or leave it to `down`)"
            ]
        if not listing.total_claims and not listing.total_pending:  # idle, and nothing on the way
            raise GateRefused(
                f"{box.name} runs nothing and its watched dirs hold nothing: an empty run never passes the "
                "gate. If it produced nothing on purpose, arm it with --allow-empty; nothing was torn down",
                [Reason("EMPTY", detail="no claims, nothing in flight, no job or cell to run")],
            )
    return why


async def _released_here(state: State, box: Box, pull_to: Path) -> bool:
    """This teardown's release deleted the box's claims (its answer was lost) and the tree holds
    them as its marker verified them (controller.released). A verify now would find a box that
    claims nothing, call the run empty and remove that marker: the gate judges the tree as it is."""
    if teardown.asked_release(state, box) is None:
        return False
    try:
        marker = read_marker(pull_to)
        async with reach.connect(box) as c:
            await c.hello()
            listing = await c.list_artifacts()
            if listing.total_claims or listing.total_pending:
                return False
            freed = await released.gather(c, box, pull_to, teardown.asked_release(state, box))
    except ControllerError:
        return False
    return marker is not None and freed is not None and freed.proves(str(marker.get("manifest_digest", "")))


def _line(r: Reason) -> str:
    """A refusal of the release with its detail (which job, which file): what to wait for."""
    return " ".join(x for x in (r.code, r.path, f"({r.detail})" if r.detail else "") if x)
