"""`python -m controller` and the `boxwarden` script."""

from __future__ import annotations

import os
import sys


def main() -> None:
    # First the SSH masters the command will need, so that their logins run while the CLI loads.
    from controller import warm

    warm.start(sys.argv[1:], os.environ)
    from controller.cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
