"""Fleet operations: `pull --all` and `down --all`, over every box that is up, on one asyncio loop.

Each box goes through the single-box machinery unchanged: `reach.pull_box` for a pull; the gate
(`boxes.judge`) and the teardown (`boxes.down`) that `down NAME --confirm NAME` runs, under the same
per-box lock. What this module adds is the fan-out: every box at once, and each box's failure kept
as its own outcome, never stopping the others.

`down --all` goes in this order: every box's lock taken (a box another `down` or `up` holds is left
out, as an error); every box reached at once, each within its own deadline (one that does not answer
is refused as SIDECAR_UNREACHABLE, and costs no more than that deadline); the boxes that answered
judged at once (a dry run: nothing is confirmed yet); then, once the user confirmed how many (the
CLI asks), the boxes that passed torn down at once, each judged again at the moment of acting.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from controller import armed, boxes, gone, reach, teardown
from controller.errors import ControllerError, GateRefused, Reason
from controller.gate import Verdict
from controller.pull import Progress, PullReport
from controller.state import Box, State, exclusive
from controller.teardown import TeardownResult

REACH_DEADLINE_S = 15.0
"""How long `down --all` waits for one box's sidecar to answer before it refuses that box. Only the
reaching has a deadline: the judging re-verifies each pulled tree on this loop, and a deadline over
it would refuse a box for the time another box's large tree takes."""

ManualDone = Callable[[str], Awaitable[bool]]


def up_boxes(state: State) -> list[Box]:
    """Every box that is up, by name."""
    return sorted((b for b in state.boxes() if b.status == "up"), key=lambda b: b.name)


def live_boxes(state: State) -> list[Box]:
    """Every box not yet down, by name: up, or with a teardown left unfinished (its meter may still
    run: `down --all` must never leave it out)."""
    return sorted((b for b in state.boxes() if b.status != "down"), key=lambda b: b.name)


# -- pull --all ------------------------------------------------------------------------------------


@dataclass
class PullOutcome:
    box: str
    root: Path
    report: PullReport | None = None
    error: str = ""

    def to_json(self) -> dict[str, object]:
        doc = self.report.to_json() if self.report is not None else {"root": str(self.root)}
        return {**doc, "box": self.box, "error": self.error or None}


def pull_targets(fleet: Sequence[Box], to_root: Path | None) -> dict[str, Path]:
    """Each box's tree: the one it was last pulled into, else `<to_root or .>/pulled-<NAME>`."""
    base = to_root if to_root is not None else Path(".")
    return {
        b.name: (Path(b.pulled_dir) if b.pulled_dir else base / f"pulled-{b.name}").resolve() for b in fleet
    }


def shared_trees(targets: dict[str, Path]) -> dict[str, str]:
    """The boxes whose trees are one directory, or one inside another's, each with why: neither is
    pulled (a pull refuses another box's MANIFEST.json, and a tree inside another is EXTRA there)."""
    clash: dict[str, str] = {}
    items = sorted(targets.items())
    for i, (a, tree_a) in enumerate(items):
        for b, tree_b in items[i + 1 :]:
            if tree_a == tree_b or tree_a.is_relative_to(tree_b) or tree_b.is_relative_to(tree_a):
                for name, mine, other, theirs in ((a, tree_a, b, tree_b), (b, tree_b, a, tree_a)):
                    clash.setdefault(
                        name,
                        f"its tree {mine} overlaps {other}'s tree {theirs}: pull one of them on its own "
                        f"into another directory (`boxwarden pull {name} --to DIR`)",
                    )
    return clash


async def pull_all(
    state: State,
    fleet: Sequence[Box],
    targets: dict[str, Path],
    progress: Callable[[str], Progress | None] = lambda name: None,
    ended: Callable[[PullOutcome], None] = lambda outcome: None,
) -> list[PullOutcome]:
    """Pull every box of `fleet` into its tree (`targets`), all at once; `progress(name)` gives the
    box's progress, `ended` is told each box's outcome as it ends. A box that fails (unreachable, a
    transfer error) is an outcome with its error; the others go on."""
    clash = shared_trees(targets)

    async def one(box: Box) -> PullOutcome:
        out = PullOutcome(box.name, targets[box.name])
        if box.name in clash:
            out.error = clash[box.name]
        else:
            try:
                out.report = await reach.pull_box(state, box, out.root, progress(box.name))
            except ControllerError as e:
                out.error = str(e) or type(e).__name__
            except OSError as e:  # the tree cannot be written here (a full disk, a permission)
                out.error = f"{out.root}: {e.strerror or e}"
        ended(out)
        return out

    return list(await asyncio.gather(*(one(b) for b in fleet)))


# -- down --all ------------------------------------------------------------------------------------

ALLOWED, REFUSED, TORN_DOWN, FAILED = "allowed", "refused", "torn-down", "error"


@dataclass
class DownOutcome:
    """One box of `down --all`: `allowed` (passed the gate, not torn down yet), `refused` (with the
    gate's reasons), `torn-down`, or `error` (the message)."""

    box: str
    outcome: str
    reasons: list[Reason] = field(default_factory=list)
    verdict: Verdict | None = None
    teardown: TeardownResult | None = None
    error: str = ""

    @property
    def codes(self) -> list[str]:
        """The reasons' codes, each once, in order."""
        return list(dict.fromkeys(r.code for r in self.reasons))

    def to_json(self) -> dict[str, object]:
        return {
            "box": self.box,
            "outcome": self.outcome,
            "reasons": [r.to_json() for r in self.reasons],
            "verdict": self.verdict.to_json() if self.verdict is not None else None,
            "teardown": self.teardown.to_json() if self.teardown is not None else None,
            "error": self.error or None,
        }


@contextlib.contextmanager
def locked(state: State, fleet: Sequence[Box]) -> Iterator[tuple[list[Box], list[DownOutcome]]]:
    """Each box's lock, as `down NAME` takes it, held for the block (in one order: two of these never
    deadlock): the boxes locked, and an error outcome for each box another command holds."""
    held: list[Box] = []
    busy: list[DownOutcome] = []
    with contextlib.ExitStack() as locks:
        for box in sorted(fleet, key=lambda b: b.name):
            other = f"another `down {box.name}` or an `up {box.name}` is running (pid {{pid}}); wait for it"
            what = armed.blocking(state, box.name, other)  # an armed follower: named, and how to end it
            try:
                locks.enter_context(exclusive(state.box_lock(box.name), what))
            except ControllerError as e:
                busy.append(DownOutcome(box.name, FAILED, error=str(e)))
            else:
                held.append(state.get(box.name))  # read again under its lock, as `down` does
        yield held, busy


async def judge_all(
    state: State,
    fleet: Sequence[Box],
    *,
    accept_server_checksum: bool = False,
    deadline_s: float = REACH_DEADLINE_S,
) -> list[DownOutcome]:
    """The gate's verdict on every box of `fleet`, as `down NAME --dry-run` gives it. Every box is
    reached first, all at once, each within `deadline_s`; those that answered are then judged, all
    at once."""
    silent = await asyncio.gather(*(_silence(b, deadline_s) for b in fleet))

    async def one(box: Box, why: str) -> DownOutcome:
        earlier = teardown.unfinished(state, box)
        if why and earlier is not None:
            # As `down NAME` says it: no gate can run, only the meter is left to settle, one box at
            # a time (its provider's poll, its manual steps); the fleet's count never covers it.
            argv = boxes.box_profile(box).meter_stop.mode == "argv"
            refusal = teardown.unfinished_refusal(box, earlier, resend=argv)
            poll = (
                f"; `boxwarden down {box.name} --confirm {box.name}` asks the provider first and records "
                "the box gone if it says so"
                if argv
                else ""
            )
            return DownOutcome(
                box.name, REFUSED, [Reason(teardown.UNFINISHED_CODE, detail=f"{refusal}{poll}")]
            )
        if why:
            reason = gone.with_hint(Reason("SIDECAR_UNREACHABLE", detail=why), box)
            return DownOutcome(box.name, REFUSED, [reason])
        try:
            v = await boxes.judge(
                box,
                boxes.pulled_dir(box, None),
                confirm=None,
                dry_run=True,
                state=state,
                accept_server_checksum=accept_server_checksum,
            )
        except ControllerError as e:
            return DownOutcome(box.name, FAILED, error=str(e))
        return DownOutcome(box.name, ALLOWED if v.allowed else REFUSED, list(v.reasons), verdict=v)

    return list(await asyncio.gather(*(one(b, w) for b, w in zip(fleet, silent, strict=True))))


async def _silence(box: Box, deadline_s: float) -> str:
    """Why the box's sidecar does not answer within `deadline_s` (link included); "" if it does."""
    try:
        return await asyncio.wait_for(teardown.silence(box, timeout_s=deadline_s, own=True), deadline_s)
    except TimeoutError:
        return f"no answer within {deadline_s:g}s"


async def tear_down(
    state: State,
    fleet: Sequence[Box],
    manual_done: Callable[[str], ManualDone],
    *,
    accept_server_checksum: bool = False,
) -> list[DownOutcome]:
    """Tear down every box of `fleet` (each passed the gate, and the user confirmed how many), all
    at once, each as `down NAME --confirm NAME` does: judged again now (the box may have moved on
    since), and torn down only if the gate still allows it. `manual_done(name)`: what the box's
    teardown asks when its meter is stopped by hand."""

    async def one(box: Box) -> DownOutcome:
        v: Verdict | None = None
        try:
            v = await boxes.judge(
                box,
                boxes.pulled_dir(box, None),
                confirm=box.name,
                dry_run=False,
                state=state,
                accept_server_checksum=accept_server_checksum,
            )
            if not v.allowed:
                return DownOutcome(box.name, REFUSED, list(v.reasons), verdict=v)
            result = await boxes.down(state, box, v, manual_done(box.name))
        except GateRefused as e:  # the release refused: the sidecar keeps watching, as it was
            return DownOutcome(box.name, REFUSED, list(e.reasons), verdict=v, error=str(e))
        except ControllerError as e:
            return DownOutcome(box.name, FAILED, verdict=v, error=str(e))
        if not result.gone:
            return DownOutcome(
                box.name, FAILED, verdict=v, teardown=result, error="the teardown did not prove the box gone"
            )
        return DownOutcome(box.name, TORN_DOWN, verdict=v, teardown=result)

    # All at once: a local box's helpers run in "/" (LocalConnector.run), so one box's release
    # never takes another teardown's launcher for a stray.
    return list(await asyncio.gather(*(one(b) for b in fleet)))


def closed_meanwhile(state: State, outcomes: list[DownOutcome]) -> list[DownOutcome]:
    """The outcomes as they stand now: a box refused because its meter stop was held (by this run
    or an earlier `down`) is down once another box of the run proved the stop of its instance
    (teardown.close_held)."""
    for o in outcomes:
        last = state.last_audit(o.box) or {}
        closed = bool((last.get("result") or {}).get("stopped_by"))  # (written by teardown.close_held)
        if o.outcome == REFUSED and closed and state.get(o.box).status == "down":
            o.outcome, o.error = TORN_DOWN, ""
            o.reasons = [
                Reason(teardown.HELD_CODE, detail="held, then stopped with the last box on its instance")
            ]
    return outcomes
