"""Teardown on the local profile: runs only after the gate allowed it and the user named the box.

It deletes the box-side copies of exactly the verified manifest's claims (the sidecar re-checks the
manifest digest, re-proves every durable copy, and hashes each file before it unlinks it), stops the
sidecar, and reports "gone" only after the process is gone and its socket no longer answers. If the
release refused, kept a file, or found anything new or running afterwards, the teardown stops THERE
(exit 3, the reasons listed): the sidecar keeps watching and the meter is not touched. Every
teardown is appended to the audit log.
"""

from __future__ import annotations

import getpass
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from controller import meterstop
from controller.bootstrap import wait_gone
from controller.client import SidecarClient
from controller.errors import ControllerError, GateRefused, Reason
from controller.gate import Verdict
from controller.meterstop import MeterResult
from controller.profiles import Profile
from controller.state import Box, State


@dataclass
class TeardownResult:
    box: str
    deleted: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    sidecar_gone: bool = False
    meter: MeterResult | None = None
    audit_id: int = 0

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
        }


async def teardown(
    state: State,
    box: Box,
    client: SidecarClient,
    verdict: Verdict,
    profile: Profile,
    manual_done: Callable[[str], Awaitable[bool]],
) -> TeardownResult:
    if not verdict.allowed or not verdict.confirmed:
        raise ControllerError("internal: teardown called without an allowed, confirmed verdict")
    result = TeardownResult(box=box.name)
    record = _record(box, profile, ["ReleaseArtifacts", "Shutdown", f"meter stop: {profile.meter_stop.verb}"])
    record.update(evidence_digest=verdict.evidence_digest, manifest_digest=verdict.box_manifest_digest)

    async def steps() -> None:
        meterstop.plan(profile, box)  # every placeholder fillable, before anything is released
        hello = await client.hello()
        released = await client.release(verdict.box_manifest_digest)
        result.deleted = list(released.deleted)
        result.kept = list(released.kept)
        if released.refused:
            reasons = [Reason(r.code, r.path, r.detail) for r in released.refused]
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
        await client.shutdown()
        result.sidecar_gone = await wait_gone(box, hello.pid, deadline_s=20.0)
        if not result.sidecar_gone:
            raise ControllerError(
                f"the sidecar of {box.name} (pid {hello.pid}) is still running after Shutdown; "
                f"check `ps -p {hello.pid}` and its log in {box.box_dir}/sidecar.log"
            )
        result.meter = await meterstop.stop_meter(profile, box, manual_done=manual_done)
        meterstop.require_stopped(result.meter)

    return await _audited(state, box, record, result, steps)


async def retry_meter(
    state: State, box: Box, profile: Profile, manual_done: Callable[[str], Awaitable[bool]]
) -> TeardownResult:
    """Run the meter stop again for a box whose data side was torn down but whose meter stop was not
    proven (a poll timeout, a manual step not confirmed)."""
    result = TeardownResult(box=box.name, sidecar_gone=True)
    record = _record(box, profile, [f"meter stop (retry): {profile.meter_stop.verb}"])

    async def steps() -> None:
        result.meter = await meterstop.stop_meter(profile, box, manual_done=manual_done, retry=True)
        meterstop.require_stopped(result.meter)

    return await _audited(state, box, record, result, steps)


def _record(box: Box, profile: Profile, actions: list[str]) -> dict[str, object]:
    return {
        "confirmed_by": getpass.getuser(),
        "host": socket.gethostname(),
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "profile": profile.name,
        "profile_source": profile.source,
        "profile_digest": profile.digest,
        "instance_id": box.instance_id,
        "actions": actions,
    }


async def _audited(
    state: State,
    box: Box,
    record: dict[str, object],
    result: TeardownResult,
    steps: Callable[[], Awaitable[None]],
) -> TeardownResult:
    """Run the teardown steps; whatever happens (Ctrl-C included), append the record to the audit log."""
    try:
        await steps()
    except BaseException as e:
        record["error"] = f"{type(e).__name__}: {e}" if not isinstance(e, ControllerError) else str(e)
        if isinstance(e, GateRefused):
            record["reasons"] = [r.to_json() for r in e.reasons]
        record["result"] = result.to_json()
        state.audit(box.name, record)
        if result.sidecar_gone:
            state.put(box.with_(status="meter-unproven"))
        raise
    record["result"] = result.to_json()
    result.audit_id = state.audit(box.name, record)
    state.put(box.with_(status="down"))
    return result
