"""`up --push-rate`: the rate is read as people write it, refused where it cannot be meant, and
reaches the sidecar's config; a box's rate is not changed under a running sidecar."""

from __future__ import annotations

import json

import pytest

from controller.boxes import parse_push_rate
from controller.errors import UsageError
from tests.conftest import Bw

NAME = "ratebox"


@pytest.mark.parametrize(
    ("text", "rate"),
    [
        ("400M", 400_000_000),
        ("1.5G", 1_500_000_000),
        ("250MB/s", 250_000_000),
        ("2000k", 2_000_000),
        ("5000000", 5_000_000),
        ("1GiB", 1 << 30),
        ("512 MiB/s", 512 << 20),
        ("max", -1),
        ("Unlimited", -1),
    ],
)
def test_rates_are_read_as_written(text: str, rate: int) -> None:
    assert parse_push_rate(text) == rate


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "give bytes per second"),
        ("fast", "give bytes per second"),
        ("-5M", "give bytes per second"),
        ("1e9", "give bytes per second"),
        ("3T", "give bytes per second"),
        ("100", "under 1 MB/s: .*did you mean 100M\\?"),
        ("500k", "under 1 MB/s: a checkpoint would take hours to be durable$"),
        ("0", "under 1 MB/s: a checkpoint would take hours to be durable$"),
        ("99999999999G", "over 1 TB/s; for no limit say --push-rate max"),
    ],
)
def test_rates_that_cannot_be_meant_are_refused_with_what_to_do(text: str, why: str) -> None:
    with pytest.raises(UsageError, match="--push-rate .*" + why):
        parse_push_rate(text)


def test_the_rate_reaches_the_sidecar_and_is_not_changed_under_it(bw: Bw) -> None:
    up = ["up", NAME, "--profile", "local", "--workdir", str(bw.cwd), "--watch", "ckpt"]
    r = bw(*up, "--push-rate", "100")
    assert r.returncode == 2 and "did you mean 100M" in r.stderr, r.stderr
    assert not (bw.home / "boxes" / NAME / "sidecar").exists()
    bw.ok(*up, "--push-rate", "250M")
    config = json.loads((bw.home / "boxes" / NAME / "sidecar.json").read_text())
    assert int(config["pushRateBytesS"]) == 250_000_000
    r = bw(*up, "--push-rate", "max")
    assert r.returncode == 2 and "before changing --push-rate" in r.stderr, r.stderr
    bw.ok(*up, "--push-rate", "250000k")  # the same rate, written another way
    bw.ok(*up)  # no --push-rate: the box keeps its own
    config = json.loads((bw.home / "boxes" / NAME / "sidecar.json").read_text())
    assert int(config["pushRateBytesS"]) == 250_000_000


def test_the_default_rate_named_is_no_change(bw: Bw) -> None:
    up = ["up", NAME, "--profile", "local", "--workdir", str(bw.cwd), "--watch", "ckpt"]
    bw.ok(*up)
    bw.ok(*up, "--push-rate", "400M")  # what the sidecar does by default: nothing to change
