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
        ("max", -1),
        ("Unlimited", -1),
    ],
)
def test_rates_are_read_as_written(text: str, rate: int) -> None:
    assert parse_push_rate(text) == rate


@pytest.mark.parametrize("text", ["", "fast", "-5M", "100", "0", "1e9", "3T"])
def test_rates_that_cannot_be_meant_are_refused(text: str) -> None:
    with pytest.raises(UsageError, match="--push-rate"):
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
    bw.ok(*up)  # no --push-rate: the box keeps its own
