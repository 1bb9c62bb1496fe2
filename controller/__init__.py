"""boxwarden controller: the CLI on the user's machine that launches, watches, pulls, verifies and gates.

This package never imports `sidecar`; the only thing the two share is `boxwarden_pb`.
"""

__version__ = "0.1.0"
