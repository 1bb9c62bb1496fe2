"""A fake cloud provider CLI for tests, with the traps real ones have.

    fake_provider.py create ID [--linger N] [--stuck]   an instance exists ("running")
    fake_provider.py delete ID                           answers "deleted" at once, but the instance only
                                                         becomes "terminating"...
    fake_provider.py show ID                             ...and `show` keeps answering "terminating" (exit 0)
                                                         for N more calls, then "not found" (exit 1, a 404);
                                                         a --stuck instance never goes away
    fake_provider.py vanish ID                           the provider finally finished (a later retry sees it)
State (instances and a log of every call) is a JSON file named by $FAKE_PROVIDER_STATE.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    state_path = Path(os.environ["FAKE_PROVIDER_STATE"])
    state = json.loads(state_path.read_text()) if state_path.exists() else {"instances": {}, "calls": []}
    verb, ident, *rest = argv
    state["calls"].append([verb, ident])
    inst = state["instances"].get(ident)
    code = 0
    if verb == "create":
        linger = int(rest[rest.index("--linger") + 1]) if "--linger" in rest else 2
        state["instances"][ident] = {"status": "running", "linger": linger, "stuck": "--stuck" in rest}
        print(f"created {ident}")
    elif verb == "delete":
        if inst is None or inst["status"] == "terminating":
            print(f"error: no instance {ident}", file=sys.stderr)
            code = 1
        else:
            inst["status"] = "terminating"
            print(f"deleted {ident}")  # a lie, as real providers tell it: it is only terminating
    elif verb == "show":
        if inst is None:
            print(f"not found: {ident}")
            code = 1
        else:
            print(inst["status"])
            if inst["status"] == "terminating" and not inst["stuck"]:
                inst["linger"] -= 1
                if inst["linger"] < 0:
                    del state["instances"][ident]
    elif verb == "vanish":
        state["instances"].pop(ident, None)
    else:
        print(f"unknown verb {verb}", file=sys.stderr)
        code = 2
    tmp = state_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, state_path)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
