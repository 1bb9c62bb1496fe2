"""Bootstrap of a remote box: probe it, and give the sidecar its own venv there, installed from a
wheelhouse this controller built (the box needs no package index).

Round trips over the box's ControlMaster: one probe (python, platform, free space, existing venvs),
which also makes boxwarden's own directories there private; when the venv for this wheelhouse is
missing, one copy of the wheelhouse and one install. `up` then runs `sidecar.launch` with the
venv's python (by absolute path: the login PATH is not the venv's).

Trust: the box installs only what this controller hashed. Every file sent is checked on the box
against the sha256 computed here before anything runs (pip's own wheel is run from the
wheelhouse), and pip installs with --require-hashes from requirements pinned to those digests: a
wheel changed after it was hashed, or one in the box's wheel directory that was not sent, fails
the install, saying which.

The state root (`~/.boxwarden`, or `<tier>/.boxwarden` with --state-on-durable), its `boxes/`,
`venvs/` and `wheels/`, and `~/.boxwarden/s/` (sockets) are 0700. The probe makes missing ones so
and tightens existing ones that others can enter (an older boxwarden made them under the login's
umask, usually 0755): they are boxwarden's by name and nothing in them is meant for another user,
so a chmod takes nothing from anyone. One that belongs to another user, or is not a directory, is
refused: boxwarden cannot make it private, and whoever owns it could change what the box runs. A
symbolic link there is refused unless the SSH user owns it (whoever owns a link chose where it
leads, whatever the owner of its target); the SSH user's own link is judged by what it leads to.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import blake3

from controller import wheelhouse
from controller.connector import BEGIN, END, Connector
from controller.errors import ControllerError, UsageError

logger = logging.getLogger(__name__)

STATE_ROOT = "~/.boxwarden"
MIN_FREE_BYTES = 200 << 20  # the venv (about 60 MB) and the wheelhouse beside it while it installs
MIN_FREE_INODES = 20_000
NO_PYTHON = 97
CONTROL = re.compile(r"[\x00-\x20\x7f-\x9f]")

# Runs with whatever python3 the box has (3.6 and up must at least say what they are).
PROBE = f"""
import json, os, platform, stat, sys, sysconfig
root = os.path.expanduser(sys.argv[1])
try:
    libc = os.confstr("CS_GNU_LIBC_VERSION") or ""
except (AttributeError, ValueError, OSError):
    libc = ""
out = {{"executable": sys.executable, "python": "%d.%d.%d" % sys.version_info[:3],
       "implementation": sys.implementation.name, "machine": platform.machine(), "libc": libc,
       "gil_disabled": bool(sysconfig.get_config_var("Py_GIL_DISABLED")),
       "home": os.path.expanduser("~"), "root": root}}
p = root
while not os.path.exists(p):
    p = os.path.dirname(p)
st = os.statvfs(p)
out["free_bytes"] = st.f_bavail * st.f_frsize
out["free_inodes"] = st.f_favail if st.f_files else -1
out["writable"] = os.access(p, os.W_OK | os.X_OK)
out["writable_dir"] = p
out["cgroup"] = "v2" if os.path.exists("/sys/fs/cgroup/cgroup.controllers") else "v1"
out["private"], out["tightened"] = [], []
if out["writable"] or os.path.lexists(root):
    sockets = os.path.join(out["home"], ".boxwarden")
    dirs = [root] + [os.path.join(root, n) for n in ("boxes", "venvs", "wheels")]
    for d in [sockets, os.path.join(sockets, "s")]:
        if d not in dirs:
            dirs.append(d)
    for d in dirs:  # each made 0700, or tightened if it is ours; the first that is neither stops
        try:
            if d == root and not os.path.isdir(os.path.dirname(d)):
                os.makedirs(os.path.dirname(d))
            os.mkdir(d, 0o700)
            continue
        except FileExistsError:
            pass
        except OSError as e:
            out["private"].append([d, "cannot create it: %s" % e.strerror])
            break
        try:
            st = os.lstat(d)  # a link is judged by its own owner first: whoever owns it chose where it leads
            if stat.S_ISLNK(st.st_mode) and st.st_uid == os.getuid():
                st = os.stat(d)  # the SSH user's own link: what it leads to is judged
        except OSError as e:
            out["private"].append([d, "cannot look at it: %s" % e.strerror])
            break
        if stat.S_ISLNK(st.st_mode):
            who = (st.st_uid, os.getuid())
            out["private"].append([d, "it is a symbolic link of uid %d, not of the SSH user (uid %d)" % who])
        elif not stat.S_ISDIR(st.st_mode):
            out["private"].append([d, "it is not a directory"])
        elif st.st_uid != os.getuid():
            who = (st.st_uid, os.getuid())
            out["private"].append([d, "it belongs to uid %d, not to the SSH user (uid %d)" % who])
        elif st.st_mode & 0o077:
            os.chmod(d, 0o700)
            out["tightened"].append([d, "%o" % stat.S_IMODE(st.st_mode)])
        if out["private"]:
            break
venvs = os.path.join(root, "venvs")
out["venvs"] = sorted(d for d in (os.listdir(venvs) if os.path.isdir(venvs) else [])
                      if os.path.exists(os.path.join(venvs, d, ".complete")))
sys.stdout.write("\\n{BEGIN}\\n" + json.dumps(out) + "\\n{END}\\n")
"""

# $1 python, then the probe's arguments. Finds a python3 when the login PATH has none called so.
FIND_PYTHON = (
    "for py in python3 python3.13 python3.12 python3.11 python3.10 python3.9 python; do "
    'if command -v "$py" >/dev/null 2>&1; then exec "$py" - "$@"; fi; done; '
    f"echo 'no python3 on the box' >&2; exit {NO_PYTHON}"
)

# Run by the box's python3 before anything of the wheelhouse runs: the wheel directory holds exactly
# the files sent ($2: "sha256  name" lines, as hashed here), each with those bytes.
CHECK = """
import hashlib, os, sys
wheels, sums = sys.argv[1], sys.argv[2]
want = dict(reversed(line.split("  ", 1)) for line in sums.splitlines() if line)
problems = []
for name in sorted(set(os.listdir(wheels)) | set(want)):
    path = os.path.join(wheels, name)
    if name not in want:
        problems.append("%s: a file the controller did not send" % name)
    elif not os.path.isfile(path) or os.path.islink(path):
        problems.append("%s: missing, or not a plain file" % name)
    else:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        if h.hexdigest() != want[name]:
            found = (name, h.hexdigest(), want[name])
            problems.append("%s: sha256 %s here, but the controller sent %s" % found)
if problems:
    sys.stderr.write(
        "the wheels in %s are not the ones the controller hashed and sent, so nothing was installed "
        "(the directory is removed: run up again; if this repeats, the wheelhouse on the controller's "
        "side changes while it is sent):\\n  %s\\n" % (wheels, "\\n  ".join(problems)))
    sys.exit(4)
"""

# $5 empty: pip runs from its wheel in the wheelhouse ($4), with no index and no config of the
# box's, and installs exactly the requirements $8, each pinned to the sha256 the controller computed
# (--require-hashes); $5 an index URL (--box-index): the venv's own pip, the box's index and
# configuration, and the sidecar wheel sent ($6). $7: what CHECK is given, $9: CHECK.
INSTALL = """
set -eu
root=$1 digest=$2 py=$3 pipwhl=$4 index=$5 spec=$6 sums=$7 reqs=$8 check=$9
wheels="$root/wheels/$digest"
"$py" -c "$check" "$wheels" "$sums" || { rm -rf "$wheels"; exit 4; }
tmp="$root/venvs/.new-$digest-$$"
trap 'rm -rf "$tmp"' EXIT
if [ -z "$index" ]; then without=--without-pip; else without=; fi
"$py" -m venv $without "$tmp" || {
  echo "cannot create a venv with $py: install its venv module" \
    "(Debian/Ubuntu: apt-get install python3-venv)" >&2
  exit 3; }
if [ -z "$index" ]; then
  printf '%s' "$reqs" > "$tmp/boxwarden-requirements.txt"
  PIP_CONFIG_FILE=/dev/null "$tmp/bin/python" "$wheels/$pipwhl/pip" install --isolated --no-input \
    --quiet --no-cache-dir --disable-pip-version-check \
    --no-index --find-links "$wheels" --require-hashes -r "$tmp/boxwarden-requirements.txt"
else
  "$tmp/bin/python" -m pip install --no-input --quiet --disable-pip-version-check \
    --index-url "$index" --find-links "$wheels" "$spec"
fi
touch "$tmp/.complete"
if [ -e "$root/venvs/$digest" ]; then rm -rf "$tmp"; else mv "$tmp" "$root/venvs/$digest"; fi
trap - EXIT
rm -rf "$wheels"
"""


@dataclass(frozen=True)
class Probe:
    python: str  # the box's python3 (absolute)
    version: str
    platform: dict[str, Any]  # what wheelhouse.BoxPlatform.from_probe reads
    home: str
    root: str  # the state root on the box, `~` expanded
    free_bytes: int
    free_inodes: int
    writable: bool
    writable_dir: str
    cgroup: str
    venvs: tuple[str, ...]
    # boxwarden's directories that others could enter, made 0700 now: (dir, its mode before)
    tightened: tuple[tuple[str, str], ...] = ()

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Probe:
        return cls(
            python=str(d["executable"]),
            version=str(d["python"]),
            platform=d,
            home=str(d["home"]),
            root=str(d["root"]),
            free_bytes=int(d["free_bytes"]),
            free_inodes=int(d["free_inodes"]),
            writable=bool(d["writable"]),
            writable_dir=str(d["writable_dir"]),
            cgroup=str(d["cgroup"]),
            venvs=tuple(d["venvs"]),
            tightened=tuple((str(a), str(b)) for a, b in d["tightened"]),
        )


def _answer(out: bytes) -> dict[str, Any] | None:
    text = out.decode(errors="replace")
    _, found, rest = text.partition(BEGIN)
    body, end, _ = rest.partition(END)
    return json.loads(body) if found and end else None


async def probe(conn: Connector, dest: str, state_root: str = STATE_ROOT) -> Probe:
    """One round trip: what python, platform and room the box has, and which venvs it already has."""
    done = await conn.run(
        ["/bin/sh", "-c", FIND_PYTHON, "sh", state_root], stdin=PROBE.encode(), timeout_s=60
    )
    if done.returncode == NO_PYTHON:
        raise ControllerError(
            f"{dest} has no python3 on its PATH: install Python 3.9 or newer there (e.g. `apt-get install -y "
            "python3 python3-venv`, or a conda env on the login PATH), then run `up` again"
        )
    answer = _answer(done.stdout)
    if done.returncode != 0 or answer is None:
        err = done.stderr.decode(errors="replace").strip()[-800:]
        raise ControllerError(f"probing {dest} failed (exit {done.returncode}): {err or 'no output'}")
    if answer["private"]:
        (where, why), *_ = answer["private"]
        raise ControllerError(
            f"{dest}: {where} must be a private directory of the SSH user's (0700), and {why}: boxwarden "
            "keeps the sidecar's venv, state and socket only where no other user can change them; "
            "remove it (or have its owner remove it) and run up again"
        )
    found = Probe.from_json(answer)
    for where, mode in found.tightened:
        logger.info("%s: %s was mode %s, others could enter it; made it 0700", dest, where, mode)
    return found


def check_room(p: Probe, dest: str, need_bytes: int) -> None:
    if not p.writable:
        raise ControllerError(
            f"{dest}: {p.writable_dir} is not writable, so the sidecar's state ({p.root}) cannot be "
            "made there: make the home directory writable for the SSH user"
        )
    if p.free_bytes < need_bytes:
        raise ControllerError(
            f"{dest}: only {p.free_bytes >> 20} MiB free under {p.writable_dir}; the sidecar's venv needs "
            f"{need_bytes >> 20} MiB: free some space there first"
        )
    if 0 <= p.free_inodes < MIN_FREE_INODES:
        raise ControllerError(
            f"{dest}: only {p.free_inodes} inodes free under {p.writable_dir}; the sidecar's venv needs "
            f"about {MIN_FREE_INODES}: free some there first"
        )


def check_index_url(url: str) -> str:
    """--box-index: an http(s) or file URL without credentials (they would show in the box's
    process list: keep them in the box's pip.conf or .netrc)."""
    u = urlsplit(url)
    if (
        u.scheme not in ("http", "https", "file")
        or CONTROL.search(url)
        or (u.scheme != "file" and not u.netloc)
    ):
        raise UsageError(f"--box-index {url!r}: give the URL of a package index (https://host/simple)")
    if u.username or u.password:
        raise UsageError(
            "--box-index: leave the credentials out of the URL (they would show in the box's process list); "
            "put them in the box's pip.conf or ~/.netrc"
        )
    return url


async def ensure_venv(
    conn: Connector,
    dest: str,
    p: Probe,
    cache_root: Path,
    *,
    box_index: str | None = None,
    progress: Any = None,
    extras: tuple[str, ...] = (),
) -> str:
    """The box-side python of the sidecar's venv for this controller's wheelhouse (or, with
    `box_index`, for the sidecar wheel and the box's own index), installed if the box does not have
    it yet. `extras`: the sidecar's optional extras the box needs (wheelhouse.EXTRAS)."""
    extras = tuple(sorted(set(extras)))
    if box_index:
        # The sidecar wheel from here, its dependencies from the box's own index.
        wheel = wheelhouse.sidecar_wheel(cache_root / "sidecar-only")
        tagged = wheel.read_bytes() + b"\0" + box_index.encode() + b"\0" + ",".join(extras).encode()
        digest = "index-" + blake3.blake3(tagged).hexdigest()[:32]
        pip_wheel, directory = "", wheel.parent
        pin = functools.partial(wheelhouse.pin_alone, wheel)
    else:
        plat = wheelhouse.BoxPlatform.from_probe(p.platform)
        house = wheelhouse.build(plat, cache_root, progress=progress, extras=extras)
        digest, pip_wheel, directory = house.digest, house.pip_wheel, house.dir
        pin = functools.partial(wheelhouse.pin, house, plat, extras)
    venv_python = f"{p.root}/venvs/{digest}/bin/python"
    if digest in p.venvs:
        return venv_python
    pinned = pin()  # hashed now: the box checks what it gets against these digests
    files = [directory / name for name in pinned.files]
    check_room(p, dest, MIN_FREE_BYTES + sum(f.stat().st_size for f in files))
    logger.info("installing the sidecar's venv on %s (%d wheels)", dest, len(files))
    await conn.put(files, f"{p.root}/wheels/{digest}")
    sums = "".join(f"{sha}  {name}\n" for name, sha in sorted(pinned.files.items()))
    spec = wheelhouse.sidecar_spec(extras)
    argv = ["/bin/sh", "-c", INSTALL, "sh", p.root, digest, p.python, pip_wheel, box_index or "", spec]
    argv += [sums, pinned.requirements, CHECK]
    done = await conn.run(argv, timeout_s=900)
    if done.returncode != 0:
        err = done.stderr.decode(errors="replace").strip()[-1500:]
        where = f" from {box_index} (without --box-index the box needs no index at all)" if box_index else ""
        raise ControllerError(
            f"installing the sidecar on {dest}{where} failed (nothing was left running):\n{err}"
        )
    return venv_python
