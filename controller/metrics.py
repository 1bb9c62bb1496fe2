"""A box's Prometheus endpoint, here: the sidecar serves it on the box's 127.0.0.1 only (`up
--metrics-port`); on a remote box an SSH forward of its own brings it to a loopback port of this
machine for as long as it runs. "Ready" is said only once a scrape through it answered."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable

from controller.errors import ControllerError, UsageError
from controller.ssh import argv as sshargv
from controller.ssh.connector import free_port
from controller.state import Box

READY_S = 30.0
"""How long the forward may take to carry a first scrape."""


def _scrape(url: str, box: Box) -> str:
    """The endpoint's first line (it answers, as `box`'s sidecar: every series carries the box and
    run labels), or why not."""
    try:
        with urllib.request.urlopen(url, timeout=5) as r:  # noqa: S310 - our own http://127.0.0.1 URL
            body: bytes = r.read(1 << 20)
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise ConnectionError(str(getattr(e, "reason", e))) from e
    if b"boxwarden_" not in body:
        raise ConnectionError("it answers, but not with boxwarden's metrics")
    text = body.decode(errors="replace")
    if f'box="{box.name}"' not in text or f'run_id="{box.run_id}"' not in text:
        said = re.search(r'box="([^"]*)"[^}]*run_id="([^"]*)"', text)
        who = f"box {said.group(1)!r}, run {said.group(2)!r}" if said else "no box"
        raise ConnectionError(
            f"it answers with the metrics of {who}, not of box {box.name!r}, run {box.run_id!r}"
        )
    return text.splitlines()[0]


async def serve(box: Box, local_port: int, on_ready: Callable[[str, bool], None]) -> None:
    """Make the box's metrics reachable here and say where (`on_ready(url, forwarded)`). A local
    box's endpoint is checked and returned at once; a remote box's forward runs until it ends or
    this is cancelled (Ctrl-C), and is then ended by its pid."""
    if not box.metrics_port:
        raise UsageError(
            f"box {box.name} serves no metrics: bring it up with `boxwarden up {box.name} ... "
            "--metrics-port PORT` (the same arguments, and the port on the box)"
        )
    if not box.host:
        url = f"http://127.0.0.1:{box.metrics_port}/metrics"
        try:
            await asyncio.to_thread(_scrape, url, box)
        except ConnectionError as e:
            raise ControllerError(
                f"nothing serves {box.name}'s metrics at {url} ({e}): is its sidecar up?"
            ) from e
        on_ready(url, False)
        return
    port = local_port or free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    dest = sshargv.Destination(box.host, box.ssh_options, box.ssh_config)
    argv = sshargv.tunnel(dest, port, f"127.0.0.1:{box.metrics_port}")
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
        cwd="/",  # it runs until Ctrl-C: never in a local box's workdir, where it would be a stray
    )
    try:
        await _until_ready(proc, url, box)
        on_ready(url, True)
        assert proc.stderr is not None
        why = (await proc.stderr.read()).decode(errors="replace").strip()
        code = await proc.wait()
        raise ControllerError(
            f"the forward of {box.name}'s metrics ended (ssh exited {code}): {why or 'no word'}"
        )
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
            await proc.wait()


async def _until_ready(proc: asyncio.subprocess.Process, url: str, box: Box) -> None:
    deadline = time.monotonic() + READY_S
    last = "no answer yet"
    while True:
        if proc.returncode is not None:
            assert proc.stderr is not None
            why = (await proc.stderr.read()).decode(errors="replace").strip()
            raise ControllerError(
                f"ssh to {box.host} could not forward the metrics port: {why or proc.returncode}"
            )
        try:
            await asyncio.to_thread(_scrape, url, box)
            return
        except ConnectionError as e:
            last = str(e)
        if time.monotonic() > deadline:
            raise ControllerError(
                f"{box.name}'s metrics did not answer through the forward within {READY_S:.0f}s ({last}): "
                f"is its sidecar up, with --metrics-port {box.metrics_port}?"
            )
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(proc.wait(), timeout=0.2)
