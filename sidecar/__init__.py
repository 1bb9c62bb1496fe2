"""boxwarden sidecar: the on-box daemon that seals, hashes, pushes and proves every artifact.

This package never imports `controller`; the only thing the two share is `boxwarden_pb`.
"""

__version__ = "0.1.0"
