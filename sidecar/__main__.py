"""`boxwarden-sidecar --config FILE`: parse arguments, load the config, run the daemon."""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import logging
import signal
import sys
from pathlib import Path

from sidecar import __version__, compat, config
from sidecar.errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="boxwarden-sidecar",
        description="The boxwarden on-box daemon: seals, hashes, pushes and proves every artifact.",
    )
    parser.add_argument(
        "--config", required=True, type=Path, help="SidecarConfig JSON written by the controller"
    )
    parser.add_argument(
        "--nonce", default="", help="This start's token, chosen by `up` (Hello and every answer carry it)"
    )
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.add_argument("--version", action="version", version=f"boxwarden-sidecar {__version__}")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # `kill -USR1 <pid>` writes every thread's stack to the log: what a sidecar that does not stop
    # or answer is waiting for (the tests ask for it before they give up on one).
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    environ = compat.grpc_fork_handlers_off()
    from sidecar import app  # grpc loads here, after the line above

    try:
        settings = config.with_nonce(config.load(args.config), args.nonce)
        asyncio.run(app.run(settings, environ))
    except ConfigError as e:
        print(f"boxwarden-sidecar: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
