"""The last claims list the controller received from each box, the last pull of it from the box's
durable store, and what they are evidence of when the box is gone (`GoneBox`).

Whenever a command gets a complete ListArtifacts snapshot from a box (`pull`, `artifacts`, the gate
at `down`), the list is kept in the controller's state with the Hello that came with it (the run,
the watched dirs, the durable URL and the run's durable root). It is evidence of what the box
claimed at that moment, and the only thing left to go by when the box is gone: `pull --from
durable` reads those claims' durable copies, and `down --box-gone` judges them. It never stands in
for the box while the box answers: every command that can ask the box asks it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from boxwarden_pb.v1 import sidecar_pb2 as pb

if TYPE_CHECKING:
    from controller.state import Box, State


@dataclass(frozen=True)
class LastList:
    """One complete claims list of a box's run as it arrived, with the Hello answer beside it."""

    box: str
    run_id: str
    received_at_ns: int
    durable_url: str  # the box's durable URL (Box.durable), its query (endpoint_url, …) included
    hello: pb.HelloResponse
    listing: pb.ListArtifactsResponse

    @property
    def manifest_digest(self) -> str:
        return self.listing.manifest_digest

    @property
    def durable_root(self) -> str:
        """The run's corner of the durable store, as the sidecar named it: `<url>/<box>/<run id>`."""
        return self.hello.durable_root

    @property
    def received_at(self) -> str:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.received_at_ns / 1e9))

    def describe(self) -> str:
        return (
            f"the last claims list received from {self.box} at {self.received_at} (run {self.run_id}, "
            f"{len(self.listing.claims)} claims, manifest {self.manifest_digest[:16]}…)"
        )


def of(box: Box, hello: pb.HelloResponse, listing: pb.ListArtifactsResponse, at_ns: int = 0) -> LastList:
    return LastList(
        box=box.name,
        run_id=hello.run_id or box.run_id,
        received_at_ns=at_ns or time.time_ns(),
        durable_url=box.durable,
        hello=hello,
        listing=listing,
    )


@dataclass(frozen=True)
class DurablePull:
    """A `pull --from durable` that placed every claim of the last list (as it was then)."""

    box: str
    run_id: str
    manifest_digest: str
    list_received_at_ns: int
    pulled_dir: str
    at_ns: int


@dataclass(frozen=True)
class GoneBox:
    """The evidence `down --box-gone` rests on instead of the box's live state."""

    unreachable: str  # what asking the sidecar said
    list_received_at_ns: int  # when the claims list judged was received
    durable_root: str  # the run's corner of the durable store
    durable_pull: str  # the tree a `pull --from durable` of that list filled; "" if none did
    durable_pull_problem: str = ""  # why no such pull counts, when durable_pull is ""
    pending: int = 0  # entries not covered by a claim in that list (lost with the box)
    absence: str = ""  # what proved the box gone (the provider, or no link reaching its host)
    presence: str = ""  # when nothing did: why it may still be there (controller.absence)
    presence_code: str = ""  # and its reason code (controller.absence: HOST_UP or UNPROVEN)

    @property
    def received_at(self) -> str:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.list_received_at_ns / 1e9))

    def to_json(self) -> dict[str, object]:
        return {
            "judged": f"durable bytes from the last claims list received at {self.received_at} "
            "(not the box's live state)",
            "unreachable": self.unreachable,
            "list_received_at_ns": self.list_received_at_ns,
            "durable_root": self.durable_root,
            "durable_pull": self.durable_pull,
            "pending_in_list": self.pending,
            "absence": self.absence,
        }


def merged(pages: list[pb.ListArtifactsResponse]) -> pb.ListArtifactsResponse:
    """One list of a snapshot's pages, in order: the last page's header (digest, totals)."""
    whole = pb.ListArtifactsResponse()
    whole.CopyFrom(pages[-1])
    del whole.claims[:]
    del whole.pending[:]
    for page in pages:
        whole.claims.extend(page.claims)
        whole.pending.extend(page.pending)
    return whole


Keeper = Callable[[pb.HelloResponse, pb.ListArtifactsResponse], None]
"""Called with each complete claims list a command receives from the box."""


def keeper(state: State, box: Box) -> Keeper:
    def keep(hello: pb.HelloResponse, listing: pb.ListArtifactsResponse) -> None:
        state.keep_last_list(of(box, hello, listing))

    return keep
