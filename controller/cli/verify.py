"""`boxwarden verify DIR [--roster CELL]... [--allow-empty] [--json]`: exact set, size, blake3, probe."""

from __future__ import annotations

from pathlib import Path

import click

from controller import __version__, render
from controller.cli.options import json_flag, open_state, roster_option
from controller.errors import GateRefused
from controller.verify import verify_tree


@click.command("verify")
@click.argument("directory", type=click.Path(exists=True, file_okay=False, path_type=Path))
@roster_option
@click.option(
    "--allow-empty",
    is_flag=True,
    help="The run really produced no artifacts: let a tree with no files verify (recorded in the marker).",
)
@json_flag
def command(directory: Path, roster: tuple[str, ...], allow_empty: bool, as_json: bool) -> None:
    """Verify a pulled tree against its MANIFEST.json; on success write PULL_VERIFIED.json (exit 3 if not)."""
    root = directory.resolve()
    cells: tuple[str, ...] = roster
    if not cells:
        # A tree pulled from a known box is judged against that box's roster, not only the manifest's.
        cells = next((b.roster for b in open_state().boxes() if b.pulled_dir == str(root)), ())
    rep = verify_tree(
        root, roster=cells or None, write_marker=True, verifier_version=__version__, allow_empty=allow_empty
    )
    if as_json:
        render.json_out(rep.to_json())
    else:
        render.verify_report(rep)
    if not rep.ok:
        raise click.exceptions.Exit(GateRefused.exit_code)
