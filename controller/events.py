"""The box's event journal, kept by the controller: every event once, in order, however often the
link to the box breaks.

The controller stores the last sequence number it kept per box and run; WatchEvents resumes after
it. A transport failure while following rebuilds the link (with backoff) and resumes from the last
event kept, so the kept journal has no gap a reconnect made and no duplicate.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from boxwarden_pb.v1 import sidecar_pb2 as pb
from google.protobuf import json_format

from controller.errors import ControllerError, SidecarMismatch, SidecarUnreachable
from controller.reach import connect
from controller.state import Box, State

logger = logging.getLogger(__name__)

OnEvent = Callable[[dict[str, Any]], None]


def record(ev: pb.Event) -> dict[str, Any]:
    d = json_format.MessageToDict(
        ev, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    d["seq"], d["at_unix_ns"] = ev.seq, ev.at_unix_ns  # int64s as numbers, not strings
    d["kind"] = pb.EventKind.Name(ev.kind)
    return d


def _run_over(state: State, box: Box) -> str:
    """Why following the run `box` names has no point any more ("" while it goes on): the box was
    torn down, or brought up again as another run."""
    now = state.find(box.name)
    if now is None or now.status == "down":
        return f"{box.name} is down: the events of run {box.run_id} end here"
    if now.run_id != box.run_id:
        return (
            f"{box.name} is now run {now.run_id}, brought up again since: the events of run {box.run_id} "
            f"end here; `boxwarden events {box.name} -f` follows the new run"
        )
    return ""


async def fetch(state: State, box: Box, *, follow: bool, on_event: OnEvent) -> int:
    """Keep the box's events after the last one kept, calling `on_event` for each new one; with
    `follow`, keep following (reconnecting after transport failures) until cancelled. Returns how
    many events were kept."""
    kept = 0
    async with connect(box) as c:
        await c.hello()
        while True:
            after = state.last_seq(box.name, box.run_id)
            try:
                async for ev in c.watch_events(after, follow=follow):
                    if ev.seq <= after:
                        continue  # replayed again after a reconnect: kept already
                    rec = record(ev)
                    after = ev.seq
                    # Another follower of this box may have kept it first: shown here all the same.
                    kept += state.add_event(box.name, box.run_id, ev.seq, ev.at_unix_ns, rec)
                    on_event(rec)
                if not follow:
                    return kept
            except (SidecarUnreachable, SidecarMismatch) as e:
                if not follow:
                    raise
                logger.warning("%s: the link broke (%s); reconnecting", box.name, e)
            while True:  # until the link is back (to the box's own sidecar); Ctrl-C ends it
                over = _run_over(state, box)
                if over:
                    raise ControllerError(over)
                try:
                    await c.reconnect()
                    await c.hello(timeout_s=5.0)
                    c.reconnects = 0
                    break
                except SidecarUnreachable as e:
                    logger.info("%s: not yet (%s)", box.name, e)
                except SidecarMismatch as e:  # until `up` records the sidecar it (re)started
                    over = _run_over(state, box)
                    if over:
                        raise ControllerError(over) from e
                    logger.warning("%s: %s", box.name, e)
