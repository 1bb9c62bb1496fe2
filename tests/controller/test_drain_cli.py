"""`drain` and `status` through the real CLI: its options and exit codes, a sidecar too old for
drain (a real gRPC server that knows only Hello, as a sidecar before Drain did), and the figures
`status` gives of a real sidecar's pushes, as numbers and as an 80-column table."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from boxwarden_pb.v1 import sidecar_pb2 as pb
from boxwarden_pb.v1 import sidecar_pb2_grpc

from controller import __version__
from controller.identity import KEY
from controller.state import Box, State
from tests.conftest import Bw, save_weights, wait_until

NAME = "d1"


def test_drain_with_nothing_at_risk_says_so_and_exits_0(bw: Bw) -> None:
    p = bw.up(NAME)
    save_weights(p["watch"] / "cell-a" / "w.safetensors", seed=1)
    bw.wait_durable(NAME, 1)
    r = bw.ok("drain", NAME)
    assert r.stdout == "" and "nothing at risk" in r.stderr
    doc = bw.json("drain", NAME, "--wait", "--timeout", "30")
    assert doc["safe"] is True and doc["waited"] is True and doc["timeout_s"] == 30
    assert (doc["at_risk_files"], doc["at_risk_bytes"], doc["pending"], doc["at_risk"]) == (0, 0, 0, [])


def test_drain_usage(bw: Bw) -> None:
    bw.up(NAME)
    r = bw("drain", NAME, "--timeout", "5")
    assert r.returncode == 2 and "--timeout goes with --wait" in r.stderr
    assert bw("drain", NAME, "--wait", "--timeout", "0").returncode == 2
    r = bw("drain", "nobox")
    assert r.returncode == 1 and "nobox" in r.stderr


class OldSidecar(sidecar_pb2_grpc.SidecarServicer):
    """A sidecar from before Drain: it answers Hello (as box old1, run r1, with the state dir and
    store of its record); every call it does not know is UNIMPLEMENTED."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir

    def Hello(self, request: pb.HelloRequest, context: Any) -> pb.HelloResponse:
        context.send_initial_metadata(((KEY, "old1 r1 0123456789abcdef0123"),))
        durable = (self.state_dir / "durable").as_uri()
        return pb.HelloResponse(
            version=__version__,
            pid=1,
            box_name="old1",
            run_id="r1",
            durable_url=durable,
            state_dir=str(self.state_dir),
        )


@pytest.fixture
def old_sidecar(bw: Bw, tmp_path: Path) -> Iterator[str]:
    socket = tmp_path / "old.sock"
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    # The stubs call the base's methods abstract; at run time each answers UNIMPLEMENTED: the point.
    sidecar_pb2_grpc.add_SidecarServicer_to_server(OldSidecar(tmp_path), server)  # type: ignore[abstract]
    server.add_insecure_port(f"unix:{socket}")
    server.start()
    state = State(bw.home)
    try:
        state.put(
            Box(
                name="old1",
                profile="local",
                box_dir=str(bw.home / "boxes" / "old1"),
                state_dir=str(tmp_path),
                socket=str(socket),
                workdir=str(bw.cwd),
                watch=(str(bw.cwd / "ckpt"),),
                durable=(tmp_path / "durable").as_uri(),
                run_id="r1",
            )
        )
    finally:
        state.close()
    try:
        yield "old1"
    finally:
        server.stop(grace=None)


def test_a_sidecar_too_old_for_drain_is_told_plainly(bw: Bw, old_sidecar: str) -> None:
    for args in (("drain", old_sidecar), ("drain", old_sidecar, "--wait", "--json")):
        r = bw(*args)
        assert r.returncode == 1, r.stderr
        assert r.stdout == ""
        assert f"{old_sidecar}: the box's sidecar is too old for drain" in r.stderr
        assert "UNIMPLEMENTED" not in r.stderr.split("too old", 1)[0]


def test_status_gives_the_push_figures_as_numbers_and_in_80_columns(bw: Bw) -> None:
    p = bw.up(NAME)
    save_weights(p["watch"] / "cell-a" / "w.safetensors", seed=1, size=250_000)  # ~1 MB
    bw.wait_durable(NAME, 1)
    # The sidecar's health snapshot is taken once an interval: await one taken after the push.
    row = wait_until(lambda: next((r for r in bw.json("status")["boxes"] if r.get("durable") == 1), None))
    assert row["proofs"] == {"reread": 1, "server-checksum": 0}
    assert (row["claims"], row["durable"], row["durable_only"], row["not_durable"]) == (1, 1, 0, 0)
    assert row["push_lag_s"] == 0 and isinstance(row["push_lag_s"], float)
    assert isinstance(row["push_bytes_per_s"], float) and row["push_bytes_per_s"] > 0
    assert (row["jobs_running"], row["jobs_total"]) == (0, 0)
    narrow = {**bw.env, "COLUMNS": "80"}
    bw.env = narrow
    lines = bw.ok("status").stderr.splitlines()
    assert all(len(line) <= 80 for line in lines), "\n".join(lines)
    table = "\n".join(lines)
    assert "1 of 1" in table and "1 reread" in table and "MiB/s" in table
    json.dumps(row, allow_nan=False)  # plain numbers: no NaN or infinity either
