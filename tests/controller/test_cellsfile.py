"""Queue files (cells.toml) load into typed cells with [defaults] merged under each cell; every broken
file is one UsageError naming the file, the [[cell]] (line, number, name) and the field; the
`--cell a --cell b -- CMD` form names its queue from its command line, stably."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from controller.cellsfile import CellsFile, QueuedCellSpec, cells_from_flags, load_cells, parse_cells
from controller.errors import UsageError

GOOD = """\
name = "lr-sweep"
restart = "on-failure"
max_restarts = 3
restart_backoff = 10.0

[defaults]
command = ["python", "train.py", "--out", "/root/ckpt/{cell}"]
cwd = "/root/work"
env = { WANDB_MODE = "offline", LR = "1e-2" }

[[cell]]
name = "lr-1e-3"
env = { LR = "1e-3" }

[[cell]]  # a comment after the header
name = "lr-3e-4"
command = ["python", "other.py"]
cwd = "/root/other"

[cell.env]
EXTRA = "1"
"""

MINIMAL = """\
[[cell]]
name = "a"
command = ["python", "train.py"]
"""


def parse(text: str, default_name: str = "cells") -> CellsFile:
    return parse_cells(text, file="q/cells.toml", default_name=default_name)


def refused(text: str) -> str:
    with pytest.raises(UsageError) as e:
        parse(text)
    message = str(e.value)
    assert message.startswith("q/cells.toml"), message
    return message


# The happy paths


def test_defaults_merge_under_each_cell_and_a_cell_overrides_them() -> None:
    q = parse(GOOD)
    assert (q.name, q.restart, q.max_restarts, q.restart_backoff) == ("lr-sweep", "on-failure", 3, 10.0)
    first, second = q.cells
    assert first == QueuedCellSpec(
        "lr-1e-3",
        ("python", "train.py", "--out", "/root/ckpt/{cell}"),
        "/root/work",
        {"WANDB_MODE": "offline", "LR": "1e-3"},
    )
    assert second == QueuedCellSpec(
        "lr-3e-4",
        ("python", "other.py"),
        "/root/other",
        {"WANDB_MODE": "offline", "LR": "1e-2", "EXTRA": "1"},
    )


def test_a_minimal_file_takes_its_name_from_the_file_and_leaves_the_policy_to_the_flags(
    tmp_path: Path,
) -> None:
    f = tmp_path / "my-sweep.toml"
    f.write_text(MINIMAL, encoding="utf-8")
    q = load_cells(f)
    assert q == CellsFile(
        "my-sweep", (QueuedCellSpec("a", ("python", "train.py"), "", {}),), None, None, None
    )


def test_cells_keep_their_order() -> None:
    text = '[defaults]\ncommand = ["x"]\n' + "".join(f'[[cell]]\nname = "c{i}"\n' for i in (3, 1, 2))
    assert [c.name for c in parse(text).cells] == ["c3", "c1", "c2"]


def test_a_cell_may_give_its_own_command_without_defaults_and_an_inline_array_works() -> None:
    q = parse('cell = [{ name = "a", command = ["x"] }, { name = "b", command = ["y", "{cell}"] }]')
    assert [(c.name, c.argv) for c in q.cells] == [("a", ("x",)), ("b", ("y", "{cell}"))]


# The file itself


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"nope\.toml: cannot read the queue file"):
        load_cells(tmp_path / "nope.toml")


def test_a_directory_is_not_a_queue_file(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="not a regular file"):
        load_cells(tmp_path)


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "cells.toml")
    with pytest.raises(UsageError, match="not a regular file"):
        load_cells(tmp_path / "cells.toml")


def test_a_path_through_a_file_or_with_a_nul_is_named(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("", encoding="utf-8")
    with pytest.raises(UsageError, match=r"f/cells\.toml: cannot read the queue file: Not a directory"):
        load_cells(tmp_path / "f" / "cells.toml")
    with pytest.raises(UsageError, match="cannot read the queue file: embedded null byte"):
        load_cells(tmp_path / "a\0b.toml")


def test_a_huge_file_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "cells.toml"
    f.write_bytes(MINIMAL.encode() + b"#" * (4 << 20))
    with pytest.raises(UsageError, match="the queue file is at most 4 MiB"):
        load_cells(f)


def test_a_file_that_is_not_utf8_is_named(tmp_path: Path) -> None:
    f = tmp_path / "cells.toml"
    f.write_bytes(b'[[cell]]\nname = "\xff"\n')
    with pytest.raises(UsageError, match=r"cells\.toml: not UTF-8 text \(byte 17\)"):
        load_cells(f)


def test_a_toml_syntax_error_gives_file_line_and_column() -> None:
    message = refused('[[cell]]\nname = "a"\ncommand = [\n\n[[cell]]\nname = "b"\n')
    assert "not valid TOML" in message
    assert re.search(r"line \d+, column \d+", message), message


# Top-level fields


def test_a_bad_queue_name_is_refused() -> None:
    message = refused('name = "a/b"\n' + MINIMAL)
    assert "field name: queue name 'a/b' is not allowed" in message


def test_a_file_stem_that_is_not_a_name_says_to_add_one() -> None:
    with pytest.raises(UsageError) as e:
        parse(MINIMAL, default_name="my sweep")
    assert "queue name (the file's name) 'my sweep' is not allowed" in str(e.value)
    assert 'add name = "..."' in str(e.value)


@pytest.mark.parametrize(
    ("line", "field", "problem"),
    [
        ('restart = "always"', "restart", "'always' is not one of never, on-failure"),
        ("restart = true", "restart", "must be a string"),
        ("max_restarts = 0", "max_restarts", "must be at least 1"),
        ("max_restarts = 2.5", "max_restarts", "must be an integer"),
        ("max_restarts = true", "max_restarts", "must be an integer"),
        ("max_restarts = 4294967296", "max_restarts", "must be at most"),
        ("restart_backoff = 0.05", "restart_backoff", "must be 0.1 to 300 seconds"),
        ("restart_backoff = 301", "restart_backoff", "must be 0.1 to 300 seconds"),
        ("restart_backoff = nan", "restart_backoff", "must be 0.1 to 300 seconds"),
        ('restart_backoff = "10"', "restart_backoff", "must be a number of seconds"),
    ],
)
def test_bad_policy_fields_are_refused(line: str, field: str, problem: str) -> None:
    message = refused(line + "\n" + MINIMAL)
    assert f"q/cells.toml: field {field}: {problem}" in message, message


def test_policy_bounds_are_accepted() -> None:
    q = parse("restart = 'never'\nmax_restarts = 1\nrestart_backoff = 300\n" + MINIMAL)
    assert (q.restart, q.max_restarts, q.restart_backoff) == ("never", 1, 300.0)
    assert parse("restart_backoff = 0.1\n" + MINIMAL).restart_backoff == 0.1


def test_an_unknown_top_level_field_is_refused() -> None:
    assert "field restart_backof: unknown field" in refused("restart_backof = 10\n" + MINIMAL)


# [defaults]


def test_an_unknown_field_in_defaults_is_refused_with_its_line() -> None:
    message = refused('name = "q"\n[defaults]\ncomand = ["x"]\n' + MINIMAL)
    assert "q/cells.toml:2: field defaults.comand: unknown field" in message


def test_a_bad_defaults_command_names_defaults() -> None:
    message = refused('[defaults]\ncommand = "python train.py"\n' + MINIMAL)
    assert (
        "field defaults.command: is the string 'python train.py'; give a list of arguments, never" in message
    )


def test_defaults_must_be_a_table() -> None:
    assert "field defaults: must be a [defaults] table" in refused("defaults = 3\n" + MINIMAL)


# [[cell]] tables


def test_no_cells_is_refused() -> None:
    assert "field cell: missing; add at least one [[cell]] table" in refused('name = "q"\n')
    assert "field cell: is empty" in refused("cell = []\n")


def test_a_single_bracket_cell_table_gets_the_double_bracket_hint() -> None:
    assert "write [[cell]], with double brackets" in refused('[cell]\nname = "a"\ncommand = ["x"]\n')


def test_more_than_1000_cells_is_refused() -> None:
    text = '[defaults]\ncommand = ["x"]\n' + "".join(f'[[cell]]\nname = "c{i}"\n' for i in range(1001))
    assert "field cell: 1001 cells; a queue holds at most 1000" in refused(text)
    text = '[defaults]\ncommand = ["x"]\n' + "".join(f'[[cell]]\nname = "c{i}"\n' for i in range(1000))
    assert len(parse(text).cells) == 1000


def test_a_cell_without_a_name_is_refused_with_its_line_and_number() -> None:
    message = refused(MINIMAL + '\n[[cell]]\ncommand = ["x"]\n')
    assert "q/cells.toml:5: [[cell]] 2: field name: missing" in message


@pytest.mark.parametrize("bad", ["a/b", "..", "", " a", "-a", "x" * 65])
def test_a_cell_name_that_is_not_one_path_component_is_refused(bad: str) -> None:
    message = refused(f'[[cell]]\nname = "{bad}"\ncommand = ["x"]\n')
    assert "q/cells.toml:1: [[cell]] 1: field name:" in message


def test_duplicate_cell_names_name_both_positions() -> None:
    text = '[defaults]\ncommand = ["x"]\n[[cell]]\nname = "a"\n[[cell]]\nname = "b"\n[[cell]]\nname = "a"\n'
    message = refused(text)
    assert (
        "q/cells.toml:7: [[cell]] 3 ('a'): field name: 'a' is also the name of [[cell]] 1 (line 3)" in message
    )


def test_an_unknown_field_in_a_cell_is_refused_naming_the_cell() -> None:
    message = refused(MINIMAL + 'comand = ["y"]\n')
    assert "q/cells.toml:1: [[cell]] 1 ('a'): field comand: unknown field" in message


def test_a_cell_without_a_command_anywhere_is_refused() -> None:
    message = refused('[[cell]]\nname = "a"\n')
    assert "[[cell]] 1 ('a'): field command: missing, and [defaults] has none" in message


@pytest.mark.parametrize(
    ("command", "field", "problem"),
    [
        ('"python train.py"', "command", 'a list of arguments, never a shell string: ["sh", "-c", "..."]'),
        ("[]", "command", "is empty"),
        ('["python", ""]', "command[1]", "is empty"),
        ('["python", 3]', "command[1]", "must be a string, not int 3"),
        ('["python", "a\\u0000b"]', "command[1]", "contains a NUL byte"),
        ("3", "command", "must be a list of arguments"),
    ],
)
def test_a_bad_command_is_refused(command: str, field: str, problem: str) -> None:
    message = refused(f'[[cell]]\nname = "a"\ncommand = {command}\n')
    assert f"q/cells.toml:1: [[cell]] 1 ('a'): field {field}: " in message, message
    assert problem in message, message
    assert "unknown field" not in message


@pytest.mark.parametrize(
    ("cwd", "problem"),
    [
        ('"work"', "must be an absolute path on the box"),
        ('""', "must be an absolute path on the box"),
        ('"/root/a\\u0000b"', "'/root/a\\x00b' contains a NUL byte"),
        ("1", "must be an absolute path on the box, not int 1"),
    ],
)
def test_a_bad_cwd_is_refused(cwd: str, problem: str) -> None:
    message = refused(MINIMAL + f"cwd = {cwd}\n")
    assert "q/cells.toml:1: [[cell]] 1 ('a'): field cwd: " + problem in message, message


@pytest.mark.parametrize(
    ("env", "field", "problem"),
    [
        ('{ "1X" = "a" }', "env['1X']", "is not an environment variable name"),
        ('{ "A-B" = "a" }', "env['A-B']", "is not an environment variable name"),
        ('{ "A\\u0000" = "a" }', "env['A\\x00']", "is not an environment variable name"),
        ('{ "" = "a" }', "env['']", "is not an environment variable name"),
        ("{ LR = 1e-3 }", "env.LR", 'must be a string, not float 0.001; quote it: LR = "..."'),
        ("{ N = 3 }", "env.N", "must be a string, not int 3"),
        ("{ A = { B = 'c' } }", "env.A", "must be a string, not dict"),
        ('{ A = "x\\u0000y" }', "env.A", "'x\\x00y' contains a NUL byte"),
        ('{ BOXWARDEN_JOB_ID = "j" }', "env.BOXWARDEN_JOB_ID", "is set by the sidecar"),
        ('{ BOXWARDEN_CELL = "c" }', "env.BOXWARDEN_CELL", "is set by the sidecar"),
        ('{ BOXWARDEN_RESUME_FROM = "/x" }', "env.BOXWARDEN_RESUME_FROM", "is set by the sidecar"),
        ('"A=1"', "env", "must be a table of NAME = \"value\" strings, not str 'A=1'"),
    ],
)
def test_a_bad_env_is_refused(env: str, field: str, problem: str) -> None:
    message = refused(MINIMAL + f"env = {env}\n")
    assert f"q/cells.toml:1: [[cell]] 1 ('a'): field {field}: {problem}" in message, message


def test_a_sidecar_variable_in_defaults_env_is_refused_too() -> None:
    message = refused('[defaults]\nenv = { BOXWARDEN_CELL = "x" }\n' + MINIMAL)
    assert "q/cells.toml:1: field defaults.env.BOXWARDEN_CELL: is set by the sidecar" in message


def test_env_values_with_newlines_and_unicode_are_kept() -> None:
    q = parse(MINIMAL + 'env = { A = "x\\ny", B = "ü" }\n')
    assert q.cells[0].env == {"A": "x\ny", "B": "ü"}


# Line numbers of [[cell]] headers


def test_a_header_inside_a_multiline_string_drops_lines_rather_than_misplacing_them() -> None:
    text = 'x = """\n[[cell]]\n"""\n' + MINIMAL + '[[cell]]\nname = "b"\n'
    message = refused(text)
    # `x` is unknown, but the missing command of the second cell comes first; without a line.
    assert message.startswith("q/cells.toml: [[cell]] 2 ('b'): field command: missing"), message


def test_quoted_and_indented_headers_and_crlf_still_give_lines() -> None:
    text = (
        '[defaults]\r\ncommand = ["x"]\r\n  [[ "cell" ]]  # one\r\nname = "a"\r\n[[cell]]\r\nname = "a/"\r\n'
    )
    assert refused(text).startswith("q/cells.toml:5: [[cell]] 2: field name:")


def test_a_line_separator_in_a_string_does_not_shift_the_line_numbers() -> None:
    text = 'name = "q"\n[defaults]\ncommand = ["x\u2028\x85"]\n[[cell]]\nname = "a"\ntypo = 1\n'
    assert refused(text).startswith("q/cells.toml:4: [[cell]] 1 ('a'): field typo: unknown field")


# The --cell form


def test_flags_give_every_cell_the_same_argv_with_the_placeholder_left_in() -> None:
    q = cells_from_flags(["a", "b"], ["python", "train.py", "--out", "/ckpt/{cell}"], name="sweep")
    argv = ("python", "train.py", "--out", "/ckpt/{cell}")
    assert q == CellsFile(
        "sweep", (QueuedCellSpec("a", argv, "", {}), QueuedCellSpec("b", argv, "", {})), None, None, None
    )


def test_the_flags_queue_name_is_stable_and_follows_its_command_line() -> None:
    name = cells_from_flags(["a", "b"], ["python", "t.py"], name=None).name
    assert re.fullmatch(r"cells-[0-9a-f]{10}", name)
    assert cells_from_flags(("a", "b"), ("python", "t.py"), name=None).name == name
    others = {
        cells_from_flags(["a", "b"], ["python", "u.py"], name=None).name,
        cells_from_flags(["b", "a"], ["python", "t.py"], name=None).name,
        cells_from_flags(["a"], ["python", "t.py"], name=None).name,
        cells_from_flags(["a", "b"], ["python", "t.py", ""], name=None).name,
        cells_from_flags(["a", "bpython"], ["t.py"], name=None).name,
    }
    assert name not in others and len(others) == 5


@pytest.mark.parametrize(
    ("cells", "argv", "name", "problem"),
    [
        ([], ["x"], None, "no --cell given"),
        (["a/b"], ["x"], None, "cell 'a/b' is not allowed"),
        (["a", "a"], ["x"], None, "--cell a is given twice"),
        (["a"], [], None, "no command given"),
        (["a"], [""], None, "no command given"),
        (["a"], ["x", "a\0b"], None, "argument 1 of the command ('a\\x00b') contains a NUL byte"),
        (["a"], ["x"], "no/good", "queue name 'no/good' is not allowed"),
        ([f"c{i}" for i in range(1001)], ["x"], None, "1001 cells; a queue holds at most 1000"),
    ],
)
def test_bad_flags_are_refused(cells: list[str], argv: list[str], name: str | None, problem: str) -> None:
    with pytest.raises(UsageError) as e:
        cells_from_flags(cells, argv, name=name)
    assert problem in str(e.value)
