"""How the controller reaches a box's sidecar: the box's connector and a connected client.

A box on this machine is reached on its sidecar's own socket, and the sidecar may exempt this
process's lineage from its stray scan; a remote box through its SSH connector (no exemption). Kept
apart from `controller.boxes` so that commands that only read the box (`artifacts`, `pull`) load only
what they use.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from boxwarden_pb.v1 import sidecar_pb2 as pb

from controller import identity, lastlist
from controller.boxsource import pull
from controller.client import SidecarClient
from controller.connector import Connector, LocalConnector
from controller.errors import ControllerError
from controller.lastlist import Keeper
from controller.pathtext import check_path_text
from controller.pull import Progress, PullReport
from controller.state import Box, State

if TYPE_CHECKING:
    from controller.ssh.connector import SshConnector


def connector_for(box: Box) -> Connector:
    """The box's connector: its sidecar's own socket here, or the SSH link to its box."""
    if not box.host:
        return LocalConnector(box.socket)
    conn = ssh_connector(
        box.host, box.ssh_options, box.ssh_config, home=Path(box.box_dir).parent.parent, name=box.name
    )
    conn.remote_socket = box.socket
    conn.python = box.python
    return conn


def ssh_connector(
    host: str, options: tuple[str, ...], ssh_config: str, *, home: Path, name: str
) -> SshConnector:
    """The SSH connector of box `name` of the controller state at `home` (box_dir is home/boxes/name)."""
    from controller.ssh.argv import Destination
    from controller.ssh.connector import SshConnector

    return SshConnector(Destination(host, options, ssh_config), home=home, tag=name)


async def end_link(box: Box) -> None:
    """Close the box's ControlMaster, if one is up: the end of every `down` and teardown, whatever
    its outcome (torn down, refused, interrupted), so that no login to a box outlives the command
    that judged it. A failure to close it hides no other error."""
    from controller.ssh.connector import SshConnector

    conn = connector_for(box)
    try:
        if isinstance(conn, SshConnector):
            with contextlib.suppress(ControllerError):
                await conn.exit_master()
    finally:
        await conn.close()


@asynccontextmanager
async def link(box: Box) -> AsyncIterator[Connector]:
    conn = connector_for(box)
    try:
        yield conn
    finally:
        await conn.close()


def client(box: Box, conn: Connector) -> SidecarClient:
    """A client that takes answers only from the sidecar the box's record names (controller.identity)."""
    return SidecarClient(conn=conn, expect=identity.of(box))


@asynccontextmanager
async def connect(box: Box) -> AsyncIterator[SidecarClient]:
    """A client of the box's sidecar; it rebuilds the link itself after a transport failure
    (`SidecarClient.reconnect`)."""
    async with link(box) as conn, client(box, conn) as c:
        yield c


async def pull_box(state: State, box: Box, to: Path, progress: Progress | None = None) -> PullReport:
    """Pull the box's claims into `to` (see controller.pull); large ones come over the connector's
    command channel, the rest through the sidecar. The claims list is kept (controller.lastlist)."""
    check_path_text(to.resolve(), "the pull target")
    async with link(box) as conn, client(box, conn) as c:
        hello = await c.hello()
        listing = await c.list_artifacts()
        state.keep_last_list(lastlist.of(box, hello, listing))
        rep = await pull(
            c,
            root=to,
            run_id=box.run_id,
            instance=box.name,
            roster=box.roster,
            progress=progress,
            hello=hello,
            listing=listing,
            sender=conn,
        )
    state.set_pulled_dir(box.name, str(to.resolve()))
    return rep


async def artifacts(box: Box, keep: Keeper | None = None) -> pb.ListArtifactsResponse:
    """The box's claims list; `keep` is handed it with the Hello (the controller keeps the last)."""
    async with connect(box) as c:
        hello = await c.hello()
        listing = await c.list_artifacts()
    if keep is not None:
        keep(hello, listing)
    return listing


async def artifact_pages(
    box: Box, keep: Keeper | None = None
) -> AsyncIterator[pb.ListArtifactsResponse | None]:
    """The listing's pages as they arrive (see SidecarClient.artifact_pages); once the last one
    arrived, `keep` is handed the whole list."""
    pages: list[pb.ListArtifactsResponse] = []
    async with connect(box) as c:
        hello = await c.hello()
        async for page in c.artifact_pages():
            if page is None:
                pages.clear()
            else:
                pages.append(page)
            yield page
    if keep is not None and pages:
        keep(hello, lastlist.merged(pages))


async def stop_job(box: Box, job_id: str, grace_s: int) -> pb.Job:
    async with connect(box) as c:
        await c.hello()
        return await c.stop_job(job_id, grace_s)
