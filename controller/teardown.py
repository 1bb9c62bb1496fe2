"""Teardown on the local profile: runs only after the gate allowed it and the user named the box.

It deletes the box-side copies of exactly the verified manifest's claims (the sidecar re-checks the
manifest digest and refuses on any change), stops the sidecar, and reports "gone" only after the
process is gone and its socket no longer answers. Every teardown is appended to the audit log.
"""

from __future__ import annotations

import getpass
import socket
import time
from dataclasses import dataclass, field

from controller.bootstrap import wait_gone
from controller.client import SidecarClient
from controller.errors import ControllerError
from controller.gate import Verdict
from controller.state import Box, State


@dataclass
class TeardownResult:
    box: str
    deleted: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    gone: bool = False
    audit_id: int = 0

    def to_json(self) -> dict[str, object]:
        return {
            "box": self.box,
            "deleted": self.deleted,
            "kept": self.kept,
            "gone": self.gone,
            "audit_id": self.audit_id,
        }


async def teardown(state: State, box: Box, client: SidecarClient, verdict: Verdict) -> TeardownResult:
    if not verdict.allowed or not verdict.confirmed:
        raise ControllerError("internal: teardown called without an allowed, confirmed verdict")
    result = TeardownResult(box=box.name)
    record: dict[str, object] = {
        "confirmed_by": getpass.getuser(),
        "host": socket.gethostname(),
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "evidence_digest": verdict.evidence_digest,
        "manifest_digest": verdict.box_manifest_digest,
        "profile": box.profile,
        "actions": ["ReleaseArtifacts", "Shutdown"],
    }
    try:
        hello = await client.hello()
        released = await client.release(verdict.box_manifest_digest)
        result.deleted = list(released.deleted)
        result.kept = list(released.kept)
        await client.shutdown()
        result.gone = await wait_gone(box, hello.pid, deadline_s=20.0)
    except ControllerError as e:
        record["error"] = str(e)
        record["result"] = result.to_json()
        state.audit(box.name, record)
        raise
    record["result"] = result.to_json()
    result.audit_id = state.audit(box.name, record)
    state.put(box.with_(status="down" if result.gone else box.status))
    if not result.gone:
        raise ControllerError(
            f"the sidecar of {box.name} (pid {hello.pid}) is still running after Shutdown; "
            f"check `ps -p {hello.pid}` and its log in {box.box_dir}/sidecar.log"
        )
    return result
