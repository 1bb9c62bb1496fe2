"""`python -m controller` is `boxwarden`."""

from controller.cli import main

main()
