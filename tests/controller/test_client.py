"""The client against a real sidecar that stops answering: nothing may hang."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import pytest
from boxwarden_pb.v1 import sidecar_pb2 as pb

from controller.client import SidecarClient
from controller.errors import SidecarUnreachable
from tests.conftest import Bw, save_ckpt


def test_a_frozen_sidecar_is_unreachable_not_a_hang(bw: Bw) -> None:
    p = bw.up("b1")
    save_ckpt(p["watch"] / "a.pt", seed=1)
    bw.wait_durable("b1", 1)
    pid = bw.sidecar_pids()[0]
    target = "unix:" + json.loads((bw.home / "boxes" / "b1" / "sidecar.json").read_text())["socketPath"]
    os.kill(pid, signal.SIGSTOP)
    try:

        async def read() -> None:
            async with SidecarClient(target, timeout_s=2) as c:
                req = pb.ReadArtifactRequest(path="a.pt")
                async for _ in c._stream("ReadArtifact", lambda: c.stub.ReadArtifact(req), idle_s=1.0):
                    pass

        with pytest.raises(SidecarUnreachable):
            asyncio.run(read())
        row = bw.json("status")["boxes"][0]
        assert row["unreachable"] is True and row["error"]
    finally:
        os.kill(pid, signal.SIGCONT)
