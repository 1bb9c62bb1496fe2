"""Fleet operations through the real CLI with real local boxes: `pull --all` pulls every box that is
up at once, each into its own tree, and a box whose sidecar was killed fails alone; `down --all`
tears down exactly the boxes whose evidence is complete, after one confirmation of how many, and
lists the others with the gate's reason codes; and the usage errors of both."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from controller.state import State
from tests.conftest import Bw, pid_alive, save_weights, wait_until

BOXES = ("fa", "fb", "fc")
W = "best.safetensors"


def three_boxes(bw: Bw) -> dict[str, dict[str, Path]]:
    """Three local boxes, each watching its own directory, each with cell-a checkpointed (a real
    safetensors file and a metrics file), every claim durable."""
    paths = {}
    for i, name in enumerate(BOXES):
        p = bw.up(name, "--roster", "cell-a", watch=f"ckpt-{name}")
        save_weights(p["watch"] / "cell-a" / W, seed=10 + i)
        (p["watch"] / "cell-a" / "metrics.json").write_text(json.dumps({"box": name}))
        paths[name] = p
    for name in BOXES:
        bw.wait_durable(name, 2)
    return paths


def files_of(d: Path) -> dict[str, bytes]:
    """Every file under `d` but the pull's and verify's own, by path."""
    own = {"MANIFEST.json", "PULL_VERIFIED.json"}
    return {
        p.relative_to(d).as_posix(): p.read_bytes()
        for p in sorted(d.rglob("*"))
        if p.is_file() and p.name not in own and not p.relative_to(d).as_posix().startswith(".bw-")
    }


def sidecar_pid(bw: Bw, name: str) -> int:
    return int((bw.home / "boxes" / name / "sidecar" / "sidecar.pid").read_text().strip())


def statuses(bw: Bw) -> dict[str, str]:
    return {b.name: b.status for b in State.peek(bw.home)}


def by_box(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {b["box"]: b for b in doc["boxes"]}


def test_pull_all_pulls_every_box_into_its_own_tree_and_a_dead_box_fails_alone(
    bw: Bw, tmp_path: Path
) -> None:
    paths = three_boxes(bw)
    root = tmp_path / "trees"
    doc = bw.json("pull", "--all", "--to-root", str(root))
    assert (doc["pulled"], doc["failed"]) == (3, 0)
    got = by_box(doc)
    assert sorted(got) == list(BOXES)
    for name in BOXES:
        tree = (root / f"pulled-{name}").resolve()
        assert got[name]["error"] is None and got[name]["root"] == str(tree)
        assert got[name]["fetched"] == [f"cell-a/{W}", "cell-a/metrics.json"]
        assert files_of(tree) == files_of(paths[name]["watch"])  # each box's own bytes, and only those
        assert json.loads((tree / "MANIFEST.json").read_text())["instance"] == name
        bw.ok("verify", str(tree))

    # fc's sidecar is killed; fa and fb checkpoint again. A second `pull --all` pulls into the trees
    # recorded by the first (no --to-root), and fc fails without stopping the others.
    dead = sidecar_pid(bw, "fc")
    os.kill(dead, signal.SIGKILL)
    wait_until(lambda: not pid_alive(dead), what="fc's sidecar to die")
    for i, name in enumerate(("fa", "fb")):
        save_weights(paths[name]["watch"] / "cell-b" / W, seed=20 + i)
        bw.wait_durable(name, 3)
    r = bw("pull", "--all")
    assert r.returncode == 1, r.stderr
    assert "error: fc: " in r.stderr and "pulled 2 of 3 boxes; 1 failed: fc" in r.stderr
    for name in ("fa", "fb"):
        assert f"  {name} [" in r.stderr and f"] cell-b/{W}" in r.stderr  # a line per file, with its box
        tree = root / f"pulled-{name}"
        assert files_of(tree) == files_of(paths[name]["watch"])
        bw.ok("verify", str(tree))
    assert not (root / "pulled-fc" / "cell-b").exists()

    doc = bw.json("pull", "--all", code=1)
    assert (doc["pulled"], doc["failed"]) == (2, 1)
    got = by_box(doc)
    assert got["fc"]["error"] and "did not answer" in got["fc"]["error"]
    assert got["fc"]["root"] == str((root / "pulled-fc").resolve())
    for name in ("fa", "fb"):
        assert got[name]["error"] is None
        assert got[name]["fetched"] == [] and len(got[name]["skipped"]) == 3

    # The box that does not answer is refused by `down --all` with the gate's reason; nothing changes.
    dry = bw.json("down", "--all", "--dry-run", code=3)
    outcome = {b["box"]: (b["outcome"], [r["code"] for r in b["reasons"]]) for b in dry["boxes"]}
    assert outcome == {
        "fa": ("allowed", []),
        "fb": ("allowed", []),
        "fc": ("refused", ["SIDECAR_UNREACHABLE"]),
    }
    assert statuses(bw) == dict.fromkeys(BOXES, "up")


def test_down_all_tears_down_exactly_the_boxes_whose_evidence_is_complete(bw: Bw, tmp_path: Path) -> None:
    paths = three_boxes(bw)
    root = tmp_path / "trees"
    bw.json("pull", "--all", "--to-root", str(root))
    for name in BOXES:
        bw.ok("verify", str(root / f"pulled-{name}"))
    # fc checkpoints again after its pull: a claim its verified tree does not hold.
    save_weights(paths["fc"]["watch"] / "cell-a" / "step-2.safetensors", seed=99)
    bw.wait_durable("fc", 3)
    pids = {name: sidecar_pid(bw, name) for name in BOXES}
    on_box = {name: files_of(paths[name]["watch"]) for name in BOXES}

    def unchanged() -> None:
        assert all(pid_alive(pid) for pid in pids.values())
        assert {name: files_of(paths[name]["watch"]) for name in BOXES} == on_box
        assert statuses(bw) == dict.fromkeys(BOXES, "up")

    dry = bw.json("down", "--all", "--dry-run", code=3)
    outcome = {b["box"]: (b["outcome"], [r["code"] for r in b["reasons"]]) for b in dry["boxes"]}
    assert outcome == {"fa": ("allowed", []), "fb": ("allowed", []), "fc": ("refused", ["MANIFEST_STALE"])}
    assert (dry["dry_run"], dry["passing"], dry["confirmed"]) == (True, 2, False)
    assert by_box(dry)["fa"]["verdict"]["allowed"] is True
    unchanged()
    r = bw("down", "--all", "--dry-run")
    assert r.returncode == 3
    assert "ALLOWED fa" in r.stderr and "ALLOWED fb" in r.stderr and "REFUSED fc: MANIFEST_STALE" in r.stderr
    unchanged()

    # A count that is not the number of boxes that pass: refused, nothing torn down.
    r = bw("down", "--all", "--confirm-count", "3")
    assert r.returncode == 3, r.stderr
    assert "--confirm-count 3, but 2 boxes pass the gate (fa, fb): nothing was torn down" in r.stderr
    unchanged()
    # No count, and no terminal to ask on: refused, saying which count would confirm.
    doc = bw.json("down", "--all", code=3)
    assert doc["confirmed"] is False and [x["code"] for x in doc["reasons"]] == ["NOT_CONFIRMED"]
    assert "--confirm-count 2 (fa, fb)" in doc["reasons"][0]["detail"]
    assert all(b["teardown"] is None for b in doc["boxes"])
    unchanged()

    doc = bw.json("down", "--all", "--confirm-count", "2", code=3)
    assert doc["confirmed"] is True
    got = by_box(doc)
    for name in ("fa", "fb"):
        assert got[name]["outcome"] == "torn-down" and got[name]["error"] is None
        assert got[name]["teardown"]["gone"] is True
        assert sorted(got[name]["teardown"]["deleted"]) == [f"cell-a/{W}", "cell-a/metrics.json"]
        assert not pid_alive(pids[name])
        assert files_of(paths[name]["watch"]) == {}  # the box-side copies of the verified claims
        assert files_of(root / f"pulled-{name}") == on_box[name]  # the pulled tree stays
    assert got["fc"]["outcome"] == "refused" and got["fc"]["teardown"] is None
    assert [x["code"] for x in got["fc"]["reasons"]] == ["MANIFEST_STALE"]
    assert pid_alive(pids["fc"]) and files_of(paths["fc"]["watch"]) == on_box["fc"]
    assert statuses(bw) == {"fa": "down", "fb": "down", "fc": "up"}

    # Only fc is up now, and it still does not pass: nothing to confirm, listed with its reason.
    r = bw("down", "--all")
    assert r.returncode == 3 and "REFUSED fc: MANIFEST_STALE" in r.stderr
    assert pid_alive(pids["fc"])


def down_all_on_a_terminal(bw: Bw, answer: str) -> subprocess.CompletedProcess[str]:
    """`down --all` with a terminal as its stdin (so it asks), answered with `answer`."""
    main, side = os.openpty()
    try:
        os.write(main, answer.encode() + b"\n")
        return subprocess.run(
            [sys.executable, "-m", "controller", "down", "--all"],
            cwd=bw.cwd,
            env=bw.env,
            stdin=side,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        os.close(side)
        os.close(main)


def test_down_all_asks_for_the_count_on_a_terminal(bw: Bw, tmp_path: Path) -> None:
    paths = {name: bw.up(name, watch=f"ckpt-{name}") for name in ("fa", "fb")}
    for name in ("fa", "fb"):
        save_weights(paths[name]["watch"] / "cell-a" / W, seed=1)
    for name in ("fa", "fb"):
        bw.wait_durable(name, 1)
    bw.ok("pull", "--all", "--to-root", str(tmp_path / "trees"))
    bw.ok("verify", str(tmp_path / "trees" / "pulled-fa"))  # fb's tree is not verified
    r = down_all_on_a_terminal(bw, "2")
    assert r.returncode == 3, r.stderr
    assert "Tear down 1 box: fa? Type 1 to confirm:" in r.stderr
    assert "'2' is not 1: nothing was torn down" in r.stderr
    assert statuses(bw) == {"fa": "up", "fb": "up"} and files_of(paths["fa"]["watch"])
    r = down_all_on_a_terminal(bw, "1")
    assert r.returncode == 3, r.stderr
    assert "ALLOWED fa" in r.stderr and "REFUSED fb: NOT_VERIFIED" in r.stderr
    assert "fa: deleted 1 verified box-side copies" in r.stderr
    assert "not torn down fb: NOT_VERIFIED" in r.stderr and "torn down 1 of 2 boxes: fa" in r.stderr
    assert statuses(bw) == {"fa": "down", "fb": "up"}


def test_with_no_box_up_there_is_nothing_to_do(bw: Bw) -> None:
    r = bw("pull", "--all")
    assert r.returncode == 0 and "no box is up" in r.stderr
    assert bw.json("pull", "--all") == {"boxes": [], "pulled": 0, "failed": 0}
    r = bw("down", "--all")
    assert r.returncode == 0 and "no box is up" in r.stderr
    assert bw.json("down", "--all")["boxes"] == []


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("pull", "b1", "--all"), "give a box NAME or --all, not both"),
        (("pull",), "name the box to pull (or --all"),
        (("pull", "--all", "--to", "x"), "--to names one box's tree"),
        (("pull", "b1", "--to-root", "x"), "--to-root goes with --all"),
        (("pull", "--all", "--from", "durable"), "--all pulls from the boxes that are up"),
        (("down", "b1", "--all"), "give a box NAME or --all, not both: NAME goes with one box"),
        (("down",), "name the box to tear down (or --all"),
        (("down", "--all", "--confirm", "b1"), "--confirm goes with one box"),
        (("down", "--all", "--box-gone"), "--box-gone goes with one box"),
        (("down", "b1", "--confirm-count", "1"), "--confirm-count goes with --all"),
        (("down", "--all", "--dry-run", "--confirm-count", "1"), "cannot go with --dry-run"),
        (("down", "--all", "--confirm-count", "-1"), "--confirm-count"),
    ],
)
def test_usage_errors(bw: Bw, args: tuple[str, ...], says: str) -> None:
    r = bw(*args)
    assert r.returncode == 2, r.stderr
    assert says in r.stderr and "internal error" not in r.stderr


def test_boxes_whose_trees_overlap_are_not_pulled(tmp_path: Path) -> None:
    from controller.fleetops import shared_trees

    a, c, d = (tmp_path / n for n in ("a", "c", "d"))
    clash = shared_trees({"fa": a, "fb": a, "fc": c, "fd": c / "inner", "fe": d})
    assert sorted(clash) == ["fa", "fb", "fc", "fd"]
    assert f"its tree {c / 'inner'} overlaps fc's tree {c}" in clash["fd"]
    assert "`boxwarden pull fa --to DIR`" in clash["fa"]
