"""A teardown whose release finished on the box but whose answer never came back (a link cut during
a long release, a `down` killed then): the box claims nothing any more, and a later `down` (or a
follower armed again) must continue it through the gate, not refuse it as a run that produced
nothing.

The gate takes "released by this teardown" only when each of these holds, and refuses as before
(EMPTY, MANIFEST_STALE) otherwise:
- the controller's record shows a teardown of the box whose release step names the manifest the
  release was asked for (recorded before the release is asked, and only once a gate allowed it for
  exactly that manifest; kept across an `up` that brought a dead sidecar back);
- the box answers now, claims nothing and has nothing waiting to be claimed (the gate's other
  checks, jobs and strays, still hold);
- the box's own journal says a release deleted some of its claims (ARTIFACT_RELEASED);
- the pulled tree holds, among its files and its retired files (a pull since keeps them, listed as
  retired), those the journal says were released since that step, and they are exactly the claims
  of that manifest, the one its verification marker is bound to: the claims the gate verified before
  it allowed this release (not an older tree of the run, not an earlier run's release). The gate
  hashes every byte of the tree again, as always.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from boxwarden_pb.v1 import sidecar_pb2 as pb

from controller.client import SidecarClient
from controller.digest import manifest_digest
from controller.errors import ControllerError
from controller.manifest import MANIFEST_NAME, ManifestFile, read_manifest
from controller.state import Box, Step

CHECK = "released by this teardown"

RELEASE_OF = re.compile(r"^release of manifest ([0-9a-f]{64}): ")


def release_detail(manifest_digest: str, what: str) -> str:
    """A teardown's RELEASE step's detail: which manifest the release was asked for, then what it did."""
    return f"release of manifest {manifest_digest}: {what}"


@dataclass(frozen=True)
class ReleaseAsked:
    """The release an unfinished teardown asked for: of which manifest, and when."""

    manifest_digest: str
    at_ns: int


def release_asked(step: Step | None) -> ReleaseAsked | None:
    """The release a teardown's RELEASE `step` asked for, if it names one."""
    m = RELEASE_OF.match(step.detail) if step is not None else None
    return ReleaseAsked(m.group(1), step.at_ns) if m and step is not None else None


@dataclass(frozen=True)
class Released:
    """What a release of the box deleted (its journal) and what the pulled tree holds of it."""

    paths: frozenset[str]  # every path the box's journal says a release deleted since it was asked
    held: tuple[ManifestFile, ...]  # the tree's files and retired files at those paths
    asked: str  # the manifest the recorded release step was asked for

    @property
    def digest(self) -> str:
        """The manifest digest of the released claims as the tree holds them ("" if it holds none)."""
        return manifest_digest(self.held) if self.held else ""

    def proves(self, marker_digest: str) -> bool:
        """The tree holds exactly the claims of the manifest this teardown's release was asked for,
        each one released since, and its marker was verified against that manifest."""
        return bool(self.held) and self.digest == marker_digest == self.asked


async def gather(
    client: SidecarClient, box: Box, pulled_dir: Path | None, asked: ReleaseAsked | None
) -> Released | None:
    """What the release `asked` (the box's unfinished teardown's, controller.teardown.release_asked)
    deleted and what the tree holds of it; None where that cannot be said (no release asked, no
    tree, no journal, no manifest): the gate then judges as for any run."""
    if pulled_dir is None or asked is None:
        return None
    try:
        manifest = read_manifest(pulled_dir / MANIFEST_NAME)
        paths = {
            ev.path
            async for ev in client.watch_events(0, follow=False)
            if ev.kind == pb.ARTIFACT_RELEASED and ev.path and ev.at_unix_ns >= asked.at_ns
        }
    except ControllerError:
        return None
    held = tuple(f for f in (*manifest.files, *manifest.retired) if f.path in paths)
    return Released(frozenset(paths), held, asked.manifest_digest)


def detail(r: Released) -> str:
    """The evidence row: what the release deleted, and that the tree holds it."""
    return (
        f"the box claims nothing now: {len(r.held)} claims were deleted on it by the release this "
        f"teardown asked for (its journal), each held by the pulled tree as verified before "
        f"({r.digest[:16]}…)"
    )
