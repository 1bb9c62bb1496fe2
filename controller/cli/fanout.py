"""`boxwarden fanout up PLAN`: one plan, many boxes (see controller.plan, controller.fanout)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import click

from controller import fanout, plan, render
from controller.cli.options import json_flag, open_state


@click.group("fanout")
def command() -> None:
    """Run an ablation's cells over several boxes from one plan file."""


@command.command("up")
@click.argument("plan_file", metavar="PLAN", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--yes", is_flag=True, help="Apply a plan that differs from the one last applied without asking."
)
@click.option(
    "--trust-plan",
    is_flag=True,
    help="Take what a plan may not ask unasked: a profile_file of its own (its commands run here at "
    "`down`), ssh options that run code here, send this machine's secrets, weaken host-key checking "
    "or open ports (ProxyCommand, SendEnv, StrictHostKeyChecking=no, LocalForward, ...): only for a "
    "plan you read and trust.",
)
@click.option(
    "--rerun",
    multiple=True,
    metavar="CELL",
    help="Run CELL again though it finished (repeatable); without it a finished cell never runs again.",
)
@click.option(
    "--restart-box",
    "restart_box",
    multiple=True,
    metavar="NAME",
    help="Start box NAME again though it was torn down (repeatable), for its cells that did not finish "
    "and those of --rerun; without it a torn-down box stays down.",
)
@json_flag
def up(
    plan_file: Path,
    yes: bool,
    trust_plan: bool,
    rerun: tuple[str, ...],
    restart_box: tuple[str, ...],
    as_json: bool,
) -> None:
    """Bring up every box of PLAN at once and queue each box's cells on it (again: idempotent)."""
    p = plan.load_plan(plan_file, trusted=trust_plan)
    state = open_state()

    def notify(lines: list[str]) -> None:
        for line in lines:
            render.info(render.esc(line))

    def confirm(changes: list[str]) -> bool:
        render.warn(f"plan {p.name} differs from the one last applied:")
        for line in changes:
            render.info(f"  {render.esc(line)}")
        if yes:
            return True
        if not sys.stdin.isatty():
            render.error("run again with --yes to apply it")
            return False
        return click.confirm("apply it?", default=False, err=True)

    outcomes = asyncio.run(
        fanout.up(
            state,
            p,
            plan_file.resolve().parent,
            confirm=confirm,
            notify=notify,
            rerun=rerun,
            restart=restart_box,
        )
    )
    failed = [o for o in outcomes if o.error]
    if as_json:
        render.json_out({"plan": p.name, "boxes": [o.to_json() for o in outcomes]})
    else:
        for o in outcomes:
            cells = ", ".join(o.queued) or "no cells"
            if o.error:
                render.error(f"{o.box}: {o.error}")
            elif o.up == "down":
                render.info(f"{render.esc(o.box)}: torn down, left down")
            else:
                render.info(f"{render.esc(o.box)}: {o.up}; queue {p.name} {o.queue}: {render.esc(cells)}")
        render.info(f"follow them with: boxwarden queue BOX {p.name} --wait (or boxwarden status)")
    if failed:
        raise click.exceptions.Exit(1)
