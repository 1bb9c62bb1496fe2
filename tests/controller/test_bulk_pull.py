"""The bulk path of a pull (controller.rawcopy + sidecar.send): large claims come over the
connector's command channel straight into the part file; what does not arrive intact is read again
through the sidecar. A real local sidecar; the sender is the real `python -m sidecar.send` unless a
test swaps in a hostile one."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from controller import boxsource, rawcopy, reach
from controller.boxsource import pull
from controller.client import SidecarClient
from controller.connector import Completed
from controller.digest import path_key
from controller.errors import ControllerError
from controller.pull import PullReport
from controller.state import State
from tests.conftest import Bw, pid_alive, save_ckpt

Argv = Callable[[Sequence[str]], Sequence[str]]


class Swapped:
    """A connector whose box-side sender is replaced, per call, by what `swap` makes of its argv."""

    def __init__(self, inner: rawcopy.Runner, swap: Argv) -> None:
        self.inner = inner
        self.python = inner.python
        self.swap = swap
        self.calls: list[list[str]] = []

    async def run(
        self,
        argv: Sequence[str],
        *,
        stdin: bytes = b"",
        stdout: int | None = None,
        timeout_s: float | None = 60.0,
    ) -> Completed:
        self.calls.append(list(argv))
        return await self.inner.run(self.swap(argv), stdin=stdin, stdout=stdout, timeout_s=timeout_s)


class Seen:
    def __init__(self) -> None:
        self.updates: dict[str, list[int]] = {}

    def start(self, files: int, total_bytes: int) -> None:
        pass

    def update(self, path: str, got: int, size: int) -> None:
        self.updates.setdefault(path, []).append(got)


def pull_over(
    bw: Bw, name: str, to: Path, swap: Argv | None = None, progress: Seen | None = None
) -> tuple[PullReport, list[list[str]]]:
    state = State(bw.home)
    try:
        box = state.get(name)
    finally:
        state.close()

    async def go() -> tuple[PullReport, list[list[str]]]:
        async with reach.link(box) as conn, SidecarClient(conn=conn) as c:
            sender = Swapped(conn, swap or (lambda argv: argv))
            hello = await c.hello()
            rep = await pull(
                c,
                root=to,
                run_id=box.run_id,
                instance=box.name,
                roster=box.roster,
                hello=hello,
                sender=sender,
                progress=progress,
            )
            return rep, sender.calls

    return asyncio.run(go())


@pytest.fixture
def two_claims(bw: Bw, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    monkeypatch.setattr(boxsource, "BULK_MIN", 100_000)
    p = bw.up("b1")
    save_ckpt(p["watch"] / "cell-a" / "big.pt", seed=1, size=400_000)  # ~1.6 MB: bulk
    save_ckpt(p["watch"] / "cell-a" / "small.pt", seed=2, size=100)  # below BULK_MIN: gRPC
    bw.wait_durable("b1", 2)
    return p


def test_large_claims_come_over_the_bulk_path_small_ones_through_the_sidecar(
    bw: Bw, two_claims: dict[str, Path]
) -> None:
    seen = Seen()
    rep, calls = pull_over(bw, "b1", bw.cwd / "pulled", progress=seen)
    assert [c[c.index("sidecar.send") + 1] for c in calls] == ["cell-a/big.pt"]
    assert sorted(rep.fetched) == ["cell-a/big.pt", "cell-a/small.pt"] and not rep.restarted
    for name in ("big.pt", "small.pt"):
        assert (bw.cwd / "pulled" / "cell-a" / name).read_bytes() == (
            two_claims["watch"] / "cell-a" / name
        ).read_bytes()
    size = (two_claims["watch"] / "cell-a" / "big.pt").stat().st_size
    got = seen.updates["cell-a/big.pt"]
    assert got == sorted(got) and got[-1] == size
    bw.ok("verify", str(bw.cwd / "pulled"))


def test_a_bulk_resume_sends_only_the_rest_and_the_digest_covers_the_whole_file(
    bw: Bw, two_claims: dict[str, Path]
) -> None:
    src = (two_claims["watch"] / "cell-a" / "big.pt").read_bytes()
    parts = bw.cwd / "pulled" / ".bw-parts"
    parts.mkdir(parents=True, mode=0o700)
    (parts / f"{path_key('cell-a/big.pt')}.part").write_bytes(src[:500_000])
    rep, calls = pull_over(bw, "b1", bw.cwd / "pulled")
    (call,) = calls
    at = call.index("sidecar.send")
    assert call[at + 1 : at + 4] == ["cell-a/big.pt", "500000", str(len(src) - 500_000)]
    small = (two_claims["watch"] / "cell-a" / "small.pt").stat().st_size
    assert rep.resumed == {"cell-a/big.pt": 500_000}
    assert rep.bytes_fetched == len(src) - 500_000 + small, rep
    assert (bw.cwd / "pulled" / "cell-a" / "big.pt").read_bytes() == src


def _zeros(argv: Sequence[str]) -> list[str]:
    """A sender that sends as many bytes as asked, all of them zero."""
    at = list(argv).index("sidecar.send")
    length = argv[at + 3]
    code = "import os,sys; n=int(sys.argv[1]); b=bytes(1<<20)\nwhile n>0: n-=os.write(1, b[:min(n, len(b))])"
    return [sys.executable, "-c", code, length]


def test_a_bulk_copy_of_other_bytes_is_read_again_through_the_sidecar(
    bw: Bw, two_claims: dict[str, Path]
) -> None:
    rep, calls = pull_over(bw, "b1", bw.cwd / "pulled", swap=_zeros)
    assert len(calls) == 1, "after one bad bulk copy the sidecar's own read is used"
    assert rep.restarted == ["cell-a/big.pt"]
    pulled = bw.cwd / "pulled" / "cell-a" / "big.pt"
    assert pulled.read_bytes() == (two_claims["watch"] / "cell-a" / "big.pt").read_bytes()
    bw.ok("verify", str(bw.cwd / "pulled"))


def test_a_sender_that_sends_more_than_asked_is_stopped_before_it_fills_the_disk(
    bw: Bw, two_claims: dict[str, Path], tmp_path: Path
) -> None:
    pidfile = tmp_path / "endless.pid"

    def endless(argv: Sequence[str]) -> list[str]:
        code = (
            "import os,sys; open(sys.argv[1],'w').write(str(os.getpid())); b=bytes(1<<20)\n"
            "while True: os.write(1, b)"
        )
        return [sys.executable, "-c", code, str(pidfile)]

    rep, calls = pull_over(bw, "b1", bw.cwd / "pulled", swap=endless)
    assert rep.restarted == [] and "cell-a/big.pt" in rep.fetched
    assert len(calls) == 1 and not pid_alive(int(pidfile.read_text()))
    pulled = bw.cwd / "pulled" / "cell-a" / "big.pt"
    assert pulled.read_bytes() == (two_claims["watch"] / "cell-a" / "big.pt").read_bytes()
    assert not (bw.cwd / "pulled" / ".bw-parts").exists()


def test_a_sender_that_refuses_hands_over_to_the_sidecar(
    bw: Bw, two_claims: dict[str, Path], tmp_path: Path
) -> None:
    elsewhere = tmp_path / "not-a-watched-dir"
    elsewhere.mkdir()

    def wrong_roots(argv: Sequence[str]) -> list[str]:  # the real sender, looking in the wrong place
        at = list(argv).index("sidecar.send")
        return [*argv[: at + 4], str(elsewhere)]

    rep, calls = pull_over(bw, "b1", bw.cwd / "pulled", swap=wrong_roots)
    assert len(calls) == 1 and not rep.restarted
    assert (bw.cwd / "pulled" / "cell-a" / "big.pt").read_bytes() == (
        two_claims["watch"] / "cell-a" / "big.pt"
    ).read_bytes()


def test_a_sender_gone_silent_is_a_broken_link_killed_and_resumed(
    bw: Bw, two_claims: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rawcopy, "STALL_S", 1.0)
    pidfile = tmp_path / "stalled.pid"
    src = (two_claims["watch"] / "cell-a" / "big.pt").read_bytes()
    first = True

    def stall_once(argv: Sequence[str]) -> Sequence[str]:
        nonlocal first
        if not first:
            return argv
        first = False
        code = (
            "import os,sys,time; open(sys.argv[1],'w').write(str(os.getpid()))\n"
            "src=open(sys.argv[2],'rb').read(); os.write(1, src[:300000]); time.sleep(120)"
        )
        return [sys.executable, "-c", code, str(pidfile), str(two_claims["watch"] / "cell-a" / "big.pt")]

    rep, calls = pull_over(bw, "b1", bw.cwd / "pulled", swap=stall_once)
    assert len(calls) == 2
    at = calls[1].index("sidecar.send")
    assert calls[1][at + 2] == "300000", "the second attempt resumes after the bytes the first one left"
    assert not pid_alive(int(pidfile.read_text())), "the silent sender was killed"
    assert (bw.cwd / "pulled" / "cell-a" / "big.pt").read_bytes() == src
    assert not rep.restarted


def test_when_neither_path_brings_the_claim_s_bytes_nothing_is_placed(
    bw: Bw, two_claims: dict[str, Path]
) -> None:
    big = two_claims["watch"] / "cell-a" / "big.pt"

    def zeros_then_gone(argv: Sequence[str]) -> list[str]:
        big.unlink()  # the sidecar's own read, next, finds nothing either
        return _zeros(argv)

    with pytest.raises(ControllerError, match=r"big\.pt"):
        pull_over(bw, "b1", bw.cwd / "pulled", swap=zeros_then_gone)
    assert not (bw.cwd / "pulled" / "cell-a" / "big.pt").exists()


def test_a_connector_without_a_sender_on_the_box_falls_back(bw: Bw, two_claims: dict[str, Path]) -> None:
    """A box whose venv predates sidecar.send: `No module named sidecar.send` is a refusal."""

    def old_box(argv: Sequence[str]) -> list[str]:
        at = list(argv).index("sidecar.send")
        return [*argv[:at], "sidecar.no_such_module", *argv[at + 1 :]]

    rep, calls = pull_over(bw, "b1", bw.cwd / "pulled", swap=old_box)
    assert len(calls) == 1 and sorted(rep.fetched) == ["cell-a/big.pt", "cell-a/small.pt"]
    assert (
        os.path.getsize(bw.cwd / "pulled" / "cell-a" / "big.pt")
        == two_claims["watch"].joinpath("cell-a", "big.pt").stat().st_size
    )
