"""The plan file of a fan-out: what it means (boxes, cells, each box's cells) and every way it is
refused before anything starts, each with the line and the field."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import pytest

from controller.errors import UsageError
from controller.plan import parse_plan, plan_json

PROFILES = ("local", "runpod")

GOOD = """\
name = "sweep"
roster = ["a", "b", "c", "d"]

[defaults]
command = ["python", "train.py", "--cell", "{cell}"]

[[box]]
name = "gpu1"
profile = "local"

[[box]]
name = "gpu2"
profile = "runpod"
host = "gpu2"
watch = ["ckpt", "logs"]
price_per_hour = 1.5

[[cell]]
name = "a"
box = "gpu2"

[[cell]]
name = "b"

[[cell]]
name = "c"
box = "any"

[[cell]]
name = "d"
env = { LR = "1e-3" }
"""


def parse(text: str, tmp_path: Path | None = None) -> object:
    return parse_plan(
        text, file="plan.toml", default_name="plan", base=tmp_path or Path("/"), known_profiles=PROFILES
    )


def refused(text: str, tmp_path: Path | None = None) -> str:
    with pytest.raises(UsageError) as e:
        parse(text, tmp_path)
    return str(e.value)


def test_a_plan_spreads_its_cells_and_says_the_same_each_time() -> None:
    plan = parse(GOOD)
    assert plan.name == "sweep" and [b.name for b in plan.boxes] == ["gpu1", "gpu2"]  # type: ignore[attr-defined]
    assigned = {box: [c.name for c in cells] for box, cells in plan.assignment().items()}  # type: ignore[attr-defined]
    # a is gpu2's; b, c and d go where the fewest cells are (the first such box on a tie), in order.
    assert assigned == {"gpu1": ["b", "c"], "gpu2": ["a", "d"]}
    assert plan_json(plan) == plan_json(parse(GOOD))  # type: ignore[arg-type]
    gpu2 = plan.boxes[1]  # type: ignore[attr-defined]
    assert (gpu2.host, gpu2.watch, gpu2.price_per_hour) == ("gpu2", ("ckpt", "logs"), 1.5)
    assert plan.roster == ("a", "b", "c", "d")  # type: ignore[attr-defined]


def test_duplicate_cell_names_are_refused_with_both_lines() -> None:
    text = GOOD.replace('name = "c"', 'name = "a"')
    assert refused(text) == (
        "plan.toml:25: [[cell]] 3 ('a'): field name: 'a' is also the name of [[cell]] 1 (line 18); "
        "give each cell its own"
    )


def test_cells_whose_write_paths_overlap_are_refused() -> None:
    text = GOOD.replace('name = "d"', 'name = "A"').replace('"d"]', '"A"]')
    msg = refused(text)
    assert msg.startswith("plan.toml:29: [[cell]] 'A': field name:")
    assert "'A' and 'a' (line 18) write to the same <watch>/<cell>/" in msg


def test_an_unknown_profile_is_refused() -> None:
    msg = refused(GOOD.replace('profile = "runpod"', 'profile = "runpodd"'))
    assert msg.startswith("plan.toml:11: [[box]] 2 ('gpu2'): field profile: 'runpodd' is no known profile")
    assert "local, runpod" in msg


def test_unsafe_names_are_refused() -> None:
    assert "box name '../gpu' is not allowed" in refused(GOOD.replace('name = "gpu1"', 'name = "../gpu"'))
    msg = refused(GOOD.replace('name = "b"', 'name = "b/../../etc"'))
    assert msg.startswith("plan.toml:22: [[cell]] 2") and "cell name 'b/../../etc' is not allowed" in msg
    assert "queue name" in refused(GOOD.replace('name = "sweep"', 'name = "sweep run"'))


def test_other_mistakes_say_what_to_do() -> None:
    assert "is also the name of [[box]] 1" in refused(GOOD.replace('name = "gpu2"', 'name = "gpu1"'))
    assert "'gpu3' is no [[box]] of this plan" in refused(GOOD.replace('box = "gpu2"', 'box = "gpu3"'))
    assert "'z' is no [[cell]] of this plan" in refused(GOOD.replace('"d"]', '"z"]'))
    assert "give exactly one of profile" in refused(GOOD.replace('profile = "local"', ""))
    head, cells = GOOD.split("[[box]]", 1)[0], "[[cell]]" + GOOD.split("[[cell]]", 1)[1]
    assert "field box: missing" in refused(head + cells)
    one = '[box]\nname = "gpu1"\nprofile = "local"\n\n'
    assert "write [[box]], with double brackets" in refused(head + one + cells)
    assert "unknown" in refused(GOOD.replace("roster = [", 'colour = "blue"\nroster = [')).lower()


def test_a_profile_file_next_to_the_plan_is_taken_if_shipped_or_trusted(tmp_path: Path) -> None:
    shipped = resources.files("boxwarden_profiles").joinpath("runpod.toml").read_text(encoding="utf-8")
    (tmp_path / "runpod.toml").write_text(shipped)  # a copy of a shipped profile is that profile
    plan = parse(GOOD.replace('profile = "runpod"', 'profile_file = "runpod.toml"'), tmp_path)
    assert plan.boxes[1].profile_file == str(tmp_path / "runpod.toml")  # type: ignore[attr-defined]
    assert "is not a file" in refused(
        GOOD.replace('profile = "runpod"', 'profile_file = "nope.toml"'), tmp_path
    )
    # One of its own: its commands would run here at `down`, and its facts decide what is released.
    mine = tmp_path / "mine.toml"
    mine.write_text(shipped.replace('name = "runpod"', 'name = "mine"'))
    text = GOOD.replace('profile = "runpod"', 'profile_file = "mine.toml"')
    msg = refused(text, tmp_path)
    assert msg.startswith(f"plan.toml:13: [[box]] 2 ('gpu2'): field profile_file: '{mine}' is no shipped")
    assert "its meter stop and poll would run on this machine at `down`" in msg
    assert "--trust-plan" in msg and "boxwarden profiles show --profile-file" in msg
    trusted = parse_plan(text, file="plan.toml", default_name="plan", base=tmp_path, trusted=True)
    assert trusted.boxes[1].profile_file == str(mine)


def test_a_plan_whose_ssh_option_runs_a_command_is_refused_unless_trusted() -> None:
    options = 'ssh_options = [\n  "Port=2222",\n  "ProxyCommand=sh -c \'id > /tmp/x\'",\n]\n'
    text = GOOD.replace('host = "gpu2"\n', 'host = "gpu2"\n' + options)
    msg = refused(text)
    assert msg.startswith("plan.toml:17: [[box]] 2 ('gpu2'): field ssh_options: ProxyCommand runs a command")
    assert "--trust-plan" in msg
    # Every such ask is listed at once, each where it is written.
    more = text.replace('name = "gpu1"\n', 'name = "gpu1"\nssh_options = ["SendEnv=AWS_*"]\n')
    lines = refused(more).splitlines()
    assert lines[0].startswith("plan.toml:9: [[box]] 1 ('gpu1'): field ssh_options: SendEnv sends variables")
    assert lines[1].startswith("plan.toml:18: [[box]] 2 ('gpu2'): field ssh_options: ProxyCommand")
    plan = parse_plan(
        text, file="plan.toml", default_name="plan", base=Path("/"), trusted=True, known_profiles=PROFILES
    )
    assert plan.boxes[1].ssh_options == ("Port=2222", "ProxyCommand=sh -c 'id > /tmp/x'")
    bad = GOOD.replace('host = "gpu2"\n', 'host = "gpu2"\nssh_options = ["Port"]\n')
    assert "give KEY=VALUE" in refused(bad)
