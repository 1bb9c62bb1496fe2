"""How the controller reaches a box's sidecar: its gRPC target and a connected client.

Every box runs on this machine today, so the target is the sidecar's own socket and the sidecar
may exempt this process's lineage from its stray scan. Kept apart from `controller.boxes` so that
read-only commands (`artifacts`) load only what they use.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from boxwarden_pb.v1 import sidecar_pb2 as pb

from controller.client import SidecarClient, lineage
from controller.state import Box


def target(box: Box) -> str:
    return f"unix:{box.socket}"


@asynccontextmanager
async def connect(box: Box) -> AsyncIterator[SidecarClient]:
    async with SidecarClient(target(box), caller=lineage()) as c:
        yield c


async def artifacts(box: Box) -> pb.ListArtifactsResponse:
    async with connect(box) as c:
        await c.hello()
        return await c.list_artifacts()


async def artifact_pages(box: Box) -> AsyncIterator[pb.ListArtifactsResponse | None]:
    """The listing's pages as they arrive (see SidecarClient.artifact_pages)."""
    async with connect(box) as c:
        await c.hello()
        async for page in c.artifact_pages():
            yield page


async def stop_job(box: Box, job_id: str, grace_s: int) -> pb.Job:
    async with connect(box) as c:
        await c.hello()
        return await c.stop_job(job_id, grace_s)
