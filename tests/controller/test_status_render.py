"""What `status` and `drain` print, from the numbers they are given: units, proof kinds, the
at-risk story, and a status table that an 80-column terminal shows whole."""

from __future__ import annotations

import pytest
from boxwarden_pb.v1 import sidecar_pb2 as pb

from controller import render
from controller.drain import DrainReport

MiB = 1 << 20


def row(name: str = "exp1", **over: object) -> dict[str, object]:
    """A status row as `boxes.BoxStatus.row` makes it for a box that answered."""
    r: dict[str, object] = {
        "box": name,
        "profile": "local",
        "status": "up",
        "sidecar": {"version": "0.1.0", "pid": 123456},
        "jobs_running": 1,
        "jobs_total": 2,
        "claims": 5,
        "durable": 4,
        "proofs": {"reread": 4, "server-checksum": 0},
        "durable_only": 0,
        "not_durable": 1234 * MiB,
        "push_lag_s": 42.0,
        "push_bytes_per_s": 45.2 * MiB,
        "disk_free": 115 << 30,
    }
    r.update(over)
    return r


def printed(capsys: pytest.CaptureFixture[str]) -> list[str]:
    out, err = capsys.readouterr()
    assert out == ""  # human text goes to stderr
    return err.splitlines()


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.42, "0.4s"), (9.96, "10.0s"), (42, "42s"), (59.6, "1m00s"), (184, "3m04s"), (7500, "2h05m")],
)
def test_durations(seconds: float, text: str) -> None:
    assert render.human_duration(seconds) == text


@pytest.mark.parametrize(
    ("rate", "text"),
    [
        (0, "-"),
        (512, "512 B/s"),
        (45.2 * MiB, "45.2 MiB/s"),
        (117.7 * MiB, "118 MiB/s"),
        (1.5 * 2**30, "1.5 GiB/s"),
    ],
)
def test_rates(rate: float, text: str) -> None:
    assert render.human_rate(rate) == text


def test_proof_kinds_name_the_kinds_that_have_a_count() -> None:
    assert render.proof_kinds({"reread": 3, "server-checksum": 1}) == "3 reread, 1 server-checksum"
    assert render.proof_kinds({"reread": 0, "server-checksum": 2}) == "2 server-checksum"
    assert render.proof_kinds({"reread": 0, "server-checksum": 0}) == ""


def test_a_status_row_becomes_short_cells() -> None:
    cells, note = render.status_cells(
        row(proofs={"reread": 3, "server-checksum": 1}, durable_only=2, push_lag_s=184.0)
    )
    assert note == ""
    assert cells == [
        ["exp1", "local"],
        ["0.1.0"],
        ["1 running", "of 2"],
        ["4 of 5", "3 reread", "1 server-checksum", "2 durable-only"],
        ["1.2 GiB", "lag 3m04s"],
        ["45.2 MiB/s"],
        ["115.0 GiB"],
    ]
    quiet, _ = render.status_cells(
        row(
            jobs_running=0,
            jobs_total=0,
            durable=0,
            proofs={"reread": 0, "server-checksum": 0},
            not_durable=0,
            push_lag_s=0.0,
            push_bytes_per_s=0.0,
            disk_free=None,
        )
    )
    assert quiet[2:] == [["none"], ["0 of 5"], ["0 B"], ["-"], [""]]


def test_an_unreachable_box_shows_its_story_under_the_table(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    story = "UNREACHABLE (last seen 0h01m02s ago): Hello: the sidecar did not answer (UNAVAILABLE: gone)"
    gone = {
        "box": "b2",
        "profile": "runpod",
        "status": "up",
        "unreachable": True,
        "error": "Hello: the sidecar did not answer (UNAVAILABLE: gone)",
        "last_seen_s": 62.4,
    }
    cells, note = render.status_cells(gone)
    assert (cells[1], note) == (["UNREACHABLE"], story)
    render.status([row(), gone])
    lines = printed(capsys)
    assert f"b2: {story}" in lines
    table = lines[: lines.index(f"b2: {story}")]
    assert all(len(line) <= 80 for line in table), "\n".join(table)


def test_the_status_table_fits_80_columns_without_breaking_a_figure(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    rows = [
        row(),
        row(
            "ablation-07",
            profile="runpod",
            claims=1200,
            durable=1000,
            proofs={"reread": 1000, "server-checksum": 0},
            not_durable=117 * MiB,
            push_lag_s=184.0,
            push_bytes_per_s=117.7 * MiB,
        ),
    ]
    render.status(rows)
    lines = printed(capsys)
    assert all(len(line) <= 80 for line in lines), "\n".join(lines)
    text = "\n".join(lines)
    for figure in ("1000 of 1200", "1000 reread", "117.0 MiB", "lag 3m04s", "118 MiB/s", "45.2 MiB/s"):
        assert figure in text, text


def test_a_narrow_table_wraps_at_spaces_never_through_a_word(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    render.status([row("exp-long-name-2", proofs={"reread": 3, "server-checksum": 1}, durable_only=2)])
    lines = printed(capsys)
    assert all(len(line) <= 80 for line in lines), "\n".join(lines)
    words = " ".join(lines).split()
    for word in ("exp-long-name-2", "server-checksum", "durable-only", "reread"):
        assert word in words


def test_fit_widths_narrows_the_widest_down_to_each_floor_in_turn() -> None:
    # (natural, title wrapped, figures whole, words whole)
    cols = [(10, 10, 10, 10), (11, 9, 9, 5), (17, 17, 15, 15)]
    assert render.fit_widths(cols, 40) == [10, 11, 17]  # it fits: untouched
    assert render.fit_widths(cols, 36) == [10, 9, 17]  # a title wraps first
    assert render.fit_widths(cols, 34) == [10, 9, 15]
    assert render.fit_widths(cols, 30) == [10, 5, 15]
    assert render.fit_widths(cols, 20) == [10, 5, 15]  # never through a word: wider than asked


def progress(**fields: object) -> pb.DrainProgress:
    return pb.DrainProgress(**fields)  # type: ignore[arg-type]


def test_the_at_risk_line() -> None:
    assert render.at_risk_line("b1", progress(done=True)) == (
        "b1: nothing at risk: every claim is durable and nothing waits to be sealed"
    )
    p = progress(at_risk_files=3, at_risk_bytes=1536 * MiB, estimated_s=34.0, push_bytes_per_s=45.2 * MiB)
    assert render.at_risk_line("b1", p) == (
        "b1: at risk: 3 files (1.5 GiB) not durable yet; about 34s at 45.2 MiB/s"
    )
    p = progress(at_risk_files=1, at_risk_bytes=400_000, estimated_s=-1.0, pending=2)
    assert render.at_risk_line("b1", p) == (
        "b1: at risk: 1 file (390.6 KiB) not durable yet; time to push unknown (no push measured "
        "yet); 2 entries not sealed yet (being written, changed or temp-named)"
    )


def test_the_drain_report_names_each_file_at_risk_and_its_error(capsys: pytest.CaptureFixture[str]) -> None:
    claims = [
        pb.Claim(path="cell-a/step-2.pt", size=3 * MiB, push_error="NO_SPACE: won't fit"),
        pb.Claim(path="cell-a/step-1.pt", size=MiB),
    ]
    last = progress(at_risk_files=25, at_risk_bytes=30 * MiB, estimated_s=-1, at_risk=claims, done=True)
    render.drain_report(DrainReport("b1", last, waited=True, timeout_s=5, elapsed_s=5.2))
    lines = printed(capsys)
    assert lines[0].startswith("b1: at risk: 25 files (30.0 MiB) not durable yet")
    assert lines[1:4] == [
        "  cell-a/step-2.pt (3.0 MiB): push error: NO_SPACE: won't fit",
        "  cell-a/step-1.pt (1.0 MiB): not pushed yet",
        "  … and 23 more (`boxwarden artifacts b1`)",
    ]
    assert lines[4].startswith("still at risk after 5.2s (the drain's timeout was 5s)")


def test_a_drain_report_json_carries_numbers() -> None:
    last = progress(
        at_risk_files=1,
        at_risk_bytes=10,
        estimated_s=-1.0,
        pending=2,
        done=True,
        at_risk=[pb.Claim(path="a.pt", size=10, push_error="x")],
    )
    doc = DrainReport("b1", last, waited=False, timeout_s=0, elapsed_s=0.01).to_json()
    assert doc["safe"] is False and doc["estimated_s"] is None and doc["timeout_s"] is None
    assert (doc["at_risk_files"], doc["at_risk_bytes"], doc["pending"]) == (1, 10, 2)
    assert doc["at_risk"] == [
        {"path": "a.pt", "bytes": 10, "blake3": "", "sealed_at_unix_ns": 0, "push_error": "x"}
    ]
    clear = DrainReport("b1", progress(push_bytes_per_s=2.5, done=True), True, 60, 1.0).to_json()
    assert clear["safe"] is True and clear["estimated_s"] == 0.0 and clear["push_bytes_per_s"] == 2.5


def test_drain_progress_off_a_terminal_is_a_plain_line_when_the_figures_change(
    capsys: pytest.CaptureFixture[str],
) -> None:
    a = progress(at_risk_files=2, at_risk_bytes=2 * MiB, estimated_s=-1.0)
    b = progress(at_risk_files=1, at_risk_bytes=MiB, estimated_s=0.5, push_bytes_per_s=2 * MiB)
    with render.drain_progress("b1") as show:
        for p in (a, a, a, b, progress(done=True)):
            show(p)
    assert printed(capsys) == [render.at_risk_line("b1", a), render.at_risk_line("b1", b)]


def test_drain_progress_on_a_terminal_is_a_bar_that_leaves_nothing_behind(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TTY_COMPATIBLE", "1")  # rich takes stderr for a terminal
    a = progress(at_risk_files=2, at_risk_bytes=2 * MiB, estimated_s=-1.0)
    with render.drain_progress("b1") as show:
        show(a)
        show(progress(done=True))
    err = capsys.readouterr().err
    assert "\x1b[?25l" in err  # a live display (the cursor hidden while it runs) ...
    assert err.endswith("\x1b[2K")  # ... erased at the end: the report follows on a clean line
    assert render.at_risk_line("b1", a) + "\n" not in err  # and no plain line


def test_active_alerts_and_stale_probes_are_printed_under_the_table(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    alerts = [
        {
            "kind": "LOSS_NONFINITE",
            "subject": "j1",
            "detail": "non-finite loss: step 2 loss=nan",
            "since_unix_ns": 1,
        },
        {"kind": "DISK_LOW", "subject": "/w", "detail": "[red]/w (watch) is low\x1b[2J", "since_unix_ns": 2},
    ]
    render.status([row(alerts=alerts, stale_probes=["host"]), row("quiet")])
    lines = printed(capsys)
    text = "\n".join(lines)
    assert "exp1: LOSS_NONFINITE j1: non-finite loss: step 2 loss=nan" in text
    assert "exp1: DISK_LOW /w: [red]/w (watch) is low" in text  # the box's text, shown, not obeyed
    assert "\x1b[2J" not in text
    assert "exp1: no fresh reading from host" in text
    assert not [line for line in lines if line.startswith("quiet:")]


LONG_NAME = "ablation-sweep-lr3e-4-wd0.1-warmup500-seed1234-node-" + "c" * 12  # 64 characters


def test_a_long_box_name_never_breaks_a_status_word_at_80_columns(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 25, finding 8: a 64-character name left too little room, and rich broke the words of
    the other columns (`UNREACHABL` / `E`). The name is shortened in its middle; no word breaks."""
    monkeypatch.setenv("COLUMNS", "80")
    assert len(LONG_NAME) == 64
    unreachable = {"box": LONG_NAME, "profile": "generic-ssh", "status": "up", "unreachable": True}
    rows = [
        row(LONG_NAME, proofs={"reread": 3, "server-checksum": 1}, durable_only=2),
        unreachable,
        *(
            {"box": LONG_NAME, "profile": "local", "status": s}
            for s in ("down", "tearing-down", "meter-unproven")
        ),
    ]
    render.status(rows)
    lines = printed(capsys)
    table = [line for line in lines if not line.startswith(LONG_NAME)]  # the notes say the name whole
    assert all(len(line) <= 80 for line in table), [len(x) for x in table]
    words = " ".join(table).split()
    for word in ("UNREACHABLE", "down", "tearing-down", "meter-unproven", "0.1.0", "generic-ssh",
                 "server-checksum", "durable-only", "running", "reread"):  # fmt: skip
        assert word in words, "\n".join(lines)
    shown = {w for w in words if "…" in w}
    assert len(shown) == 1, "\n".join(lines)
    (short,) = shown
    head, tail = short.split("…")
    assert LONG_NAME.startswith(head) and LONG_NAME.endswith(tail) and len(tail) >= 8, short


def test_a_name_is_shortened_only_when_nothing_else_makes_room() -> None:
    assert render.shorten_middle("exp1", 10) == "exp1"
    assert render.shorten_middle("abcdefghijklmnop", 10) == "abcd…lmnop"


def test_a_terminal_too_narrow_for_the_words_gets_them_whole(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "50")
    render.status(
        [row(LONG_NAME, proofs={"reread": 3, "server-checksum": 1}), {"box": "b", "status": "meter-unproven"}]
    )
    words = " ".join(printed(capsys)).split()
    for word in ("meter-unproven", "server-checksum", "running", "MiB/s"):
        assert word in words
