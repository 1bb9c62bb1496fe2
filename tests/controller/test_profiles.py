"""Every shipped profile validates; broken ones fail naming file and field; `profiles show` renders
the facts a newcomer must know (RunPod's network volume survives terminate; nothing survives vast.ai's
destroy)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from controller import profiles, templates
from controller.errors import UsageError
from tests.conftest import Bw

SHIPPED = [
    "autodl",
    "china",
    "generic-ssh",
    "k8s",
    "lambda",
    "local",
    "paperspace",
    "runpod",
    "slurm",
    "vastai",
]

GOOD = """
name = "mine"
kind = "ssh"
description = "d"
verified = "2026-11-30"
[meter_stop]
verb = "terminate"
irreversible = true
mode = "argv"
argv = ["cloudctl", "terminate", "--id={instance_id}"]
timeout_s = 60
[meter_stop.poll]
argv = ["cloudctl", "show", "{instance_id}"]
gone_stdout = "not found"
[detach]
primitive = "tmux"
[spot]
available = true
grace_s = 30
signal = "SIGTERM"
[[storage]]
name = "disk"
path = "/data"
survives_stop = true
survives_destroy = false
"""


def test_every_shipped_profile_loads() -> None:
    assert profiles.available() == SHIPPED
    for name in SHIPPED:
        p = profiles.load(name)
        assert p.name == name and p.storage, name
        if p.meter_stop.mode == "argv":
            assert p.meter_stop.poll is not None and p.meter_stop.timeout_s > 0


def write(tmp_path: Path, text: str) -> Path:
    f = tmp_path / "mine.toml"
    f.write_text(text)
    return f


def test_a_good_user_profile_loads_and_fills_only_validated_values(tmp_path: Path) -> None:
    p = profiles.load_file(write(tmp_path, GOOD))
    assert templates.fill(p.meter_stop.argv, {"instance_id": "i-9", "box": "b"}) == [
        "cloudctl",
        "terminate",
        "--id=i-9",
    ]
    with pytest.raises(UsageError, match="not allowed"):
        templates.fill(p.meter_stop.argv, {"instance_id": "x; rm -rf ~"})
    with pytest.raises(UsageError, match="--instance-id"):
        templates.fill(p.meter_stop.argv, {})


@pytest.mark.parametrize(
    ("old", "new", "field", "why"),
    [
        ('kind = "ssh"\n', 'kind = "ssh"\ncolour = "red"\n', "colour", "unknown field"),
        ('description = "d"\n', "", "description", "missing"),
        ("grace_s = 30", 'grace_s = "30"', "spot.grace_s", "must be an integer"),
        ("survives_stop = true", "survives_stop = 1", "storage[0].survives_stop", "true or false"),
        ('verified = "2026-11-30"', 'verified = "last week"', "verified", "not a date"),
        ('name = "mine"', 'name = "yours"', "name", "file is mine.toml"),
        ('mode = "argv"', 'mode = "sometimes"', "meter_stop.mode", "not one of"),
        ('["cloudctl", "terminate"', '["sh", "-c", "cloudctl terminate"', "meter_stop.argv", "runs a shell"),
        ('"--id={instance_id}"', '"--id={token}"', "meter_stop.argv", "unknown placeholder"),
        ('["cloudctl", "show"', '["cloudctl; rm", "show"', "meter_stop.poll.argv", "plain program"),
        ('gone_stdout = "not found"', "", "meter_stop.poll.gone_exit_code", "exactly one"),
        ('path = "/data"', 'path = "data"', "storage[0].path", "absolute"),
        (
            '["cloudctl", "terminate"',
            '["env", "bash", "-c", "cloudctl terminate"',
            "meter_stop.argv",
            "another",
        ),
        ('["cloudctl", "terminate"', '["python3", "-c", "import os"', "meter_stop.argv", "code given"),
        ('["cloudctl", "terminate"', '["ssh", "host", "rm"', "meter_stop.argv", "another"),
        ('["cloudctl", "terminate"', '["/bin/bash5", "x"', "meter_stop.argv", "runs a shell"),
        (
            '["cloudctl", "terminate"',
            '["kubectl", "exec", "p", "--", "sh", "-c"',
            "meter_stop.argv",
            "shell command",
        ),
        (
            'gone_stdout = "not found"',
            "gone_exit_code = 127",
            "meter_stop.poll.gone_exit_code",
            "could not run",
        ),
        (
            'gone_stdout = "not found"',
            'gone_stdout = "not found"\ninterval_s = inf',
            "meter_stop.poll.interval_s",
            "at most",
        ),
        ("timeout_s = 60", "timeout_s = 999999", "meter_stop.timeout_s", "more than a day"),
    ],
)
def test_broken_profiles_name_file_and_field(
    tmp_path: Path, old: str, new: str, field: str, why: str
) -> None:
    assert old in GOOD
    f = write(tmp_path, GOOD.replace(old, new))
    with pytest.raises(UsageError) as e:
        profiles.load_file(f)
    assert str(f) in str(e.value)
    assert f"field {field}:" in str(e.value)
    assert why in str(e.value)


def test_not_toml_at_all(tmp_path: Path) -> None:
    f = write(tmp_path, "name = [unclosed")
    with pytest.raises(UsageError, match=f"{f}: not valid TOML"):
        profiles.load_file(f)


def test_profiles_show_runpod_network_volume_survives_terminate(bw: Bw) -> None:
    doc = bw.json("profiles", "show", "runpod")
    assert doc["meter_stop"]["verb"] == "terminate" and doc["meter_stop"]["irreversible"] is True
    nv = [t for t in doc["storage"] if "network" in t["name"]]
    assert nv and all(t["survives_destroy"] and t["survives_meter_stop"] for t in nv)
    others = [t for t in doc["storage"] if "network" not in t["name"]]
    assert others and not any(t["survives_destroy"] for t in others)
    text = bw.ok("profiles", "show", "runpod").stderr
    assert "IRREVERSIBLE" in text and "terminate" in text
    row = next(line for line in text.splitlines() if "│" in line and "network" in line)
    assert row.count("yes") == 2  # survives stop and survives terminate


def test_profiles_show_vastai_nothing_survives_destroy(bw: Bw) -> None:
    doc = bw.json("profiles", "show", "vastai")
    assert doc["meter_stop"]["verb"] == "destroy" and doc["meter_stop"]["irreversible"] is True
    assert doc["storage"] and not any(t["survives_destroy"] for t in doc["storage"])
    text = bw.ok("profiles", "show", "vastai").stderr
    names = [t["name"] for t in doc["storage"]]
    rows = [line for line in text.splitlines() if "│" in line and any(n in line for n in names)]
    assert rows and all("NO" in line for line in rows)


def test_profiles_list_names_every_platform(bw: Bw) -> None:
    names = [p["name"] for p in bw.json("profiles", "list")["profiles"]]
    assert names == SHIPPED
    assert json.loads(bw.ok("profiles", "list", "--json").stdout)["profiles"][0]["verified"]


def test_nothing_bills_is_only_true_on_your_own_machine(tmp_path: Path) -> None:
    start, end = GOOD.index("[meter_stop]"), GOOD.index("[detach]")
    text = GOOD[:start] + '[meter_stop]\nverb = "none"\nirreversible = false\nmode = "none"\n' + GOOD[end:]
    f = write(tmp_path, text)
    with pytest.raises(UsageError, match=r"field meter_stop.mode: 'none'"):
        profiles.load_file(f)


def test_a_poll_counts_only_what_it_printed_on_stdout_and_only_if_it_ran(tmp_path: Path) -> None:
    import asyncio

    from controller.meterstop import Ran, stop_meter
    from controller.state import Box

    p = profiles.load_file(write(tmp_path, GOOD))
    box = Box("b", "mine", "/x", "/x", "/x.sock", "/x", ("/x",), "file:///d", "r", instance_id="i-1")

    async def no(_: str) -> bool:
        return False

    async def never_sleep(_: float) -> None:
        return None

    answers = iter(
        [
            Ran(0, "deleted", ""),
            Ran(2, "", "error: credentials file not found"),  # "not found" on stderr: not proof
            Ran(127, "", "not found", ran=False),  # could not run: not proof
            Ran(0, "instance i-1: not found", ""),
        ]
    )

    async def run(argv: list[str]) -> Ran:
        return next(answers)

    clock = iter(range(100))
    result = asyncio.run(
        stop_meter(p, box, manual_done=no, run=run, clock=lambda: float(next(clock)), sleep=never_sleep)
    )
    assert result.gone is True and result.polls == 3


def test_a_directory_given_as_a_profile_file_is_refused_with_a_message(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="not a regular file; give --profile-file a TOML file"):
        profiles.load_file(tmp_path)
