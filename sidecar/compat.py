"""What Python 3.9 lacks that the sidecar would otherwise use: it runs on the box's own Python.

The sidecar (not the controller) must run on Python 3.9 and newer; `make py39-check` holds it to
that. Each name here is the 3.9 spelling of a newer feature, with the same behaviour.
"""

from __future__ import annotations

import sys

# Keyword arguments for @dataclass: slots on 3.10 and newer (smaller, faster instances); on 3.9
# the instances keep a __dict__, which nothing in the sidecar relies on either way.
SLOTS: dict[str, bool] = {"slots": True} if sys.version_info >= (3, 10) else {}
