"""The controller's own state: one SQLite database under $BOXWARDEN_HOME (default: the XDG state dir).

It remembers each box (how to reach its sidecar, what it watches, its roster, where it was pulled),
the steps of a teardown that has not finished (each recorded before it is taken, so that a `down`
killed at any instruction leaves a trace that `status` shows and the next `down` continues from),
and keeps the teardown audit log; `exclusive` is the per-box lock that lets one `down` run at a
time. Claims live on the box and are asked for fresh by every command that can reach it; the last
complete claims list received from each box is kept too (`controller.lastlist`), as evidence of
what the box claimed then: it is read only when the box is gone (`pull --from durable`, `down
--box-gone`), never in place of asking a box that answers. What the queues of each box's run said
of each cell is kept as well (controller.cellfacts): a box's finished cells outlive its teardown.
"""

from __future__ import annotations

import fcntl
import json
import os
import sqlite3
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from boxwarden_pb.v1 import sidecar_pb2 as pb
from google.protobuf.message import DecodeError

from controller.errors import ControllerError, StateError
from controller.lastlist import DurablePull, LastList

SCHEMA = """
CREATE TABLE IF NOT EXISTS boxes(name TEXT PRIMARY KEY, record TEXT NOT NULL, updated_at_ns INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS teardowns(
    id INTEGER PRIMARY KEY AUTOINCREMENT, box TEXT NOT NULL, at_ns INTEGER NOT NULL, record TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS teardown_steps(
    box TEXT NOT NULL, step TEXT NOT NULL, at_ns INTEGER NOT NULL, detail TEXT NOT NULL,
    PRIMARY KEY (box, step));
CREATE TABLE IF NOT EXISTS events(
    box TEXT NOT NULL, run_id TEXT NOT NULL, seq INTEGER NOT NULL, at_ns INTEGER NOT NULL,
    record TEXT NOT NULL, PRIMARY KEY (box, run_id, seq));
CREATE TABLE IF NOT EXISTS last_claims(
    box TEXT PRIMARY KEY, run_id TEXT NOT NULL, received_at_ns INTEGER NOT NULL,
    manifest_digest TEXT NOT NULL, durable_url TEXT NOT NULL, durable_root TEXT NOT NULL,
    hello BLOB NOT NULL, listing BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS durable_pulls(
    box TEXT PRIMARY KEY, run_id TEXT NOT NULL, manifest_digest TEXT NOT NULL,
    list_received_at_ns INTEGER NOT NULL, pulled_dir TEXT NOT NULL, at_ns INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS cells(
    box TEXT NOT NULL, run_id TEXT NOT NULL, cell TEXT NOT NULL, seen_at_ns INTEGER NOT NULL,
    record TEXT NOT NULL, PRIMARY KEY (box, run_id, cell));
CREATE INDEX IF NOT EXISTS cells_by_name ON cells(cell);
"""  # every statement idempotent: opening a state DB of an older version adds what it lacks


def default_home(env: Mapping[str, str]) -> Path:
    """$BOXWARDEN_HOME, else $XDG_STATE_HOME/boxwarden, else ~/.local/state/boxwarden."""
    if env.get("BOXWARDEN_HOME"):
        return Path(env["BOXWARDEN_HOME"]).expanduser()
    base = env.get("XDG_STATE_HOME") or str(Path(env.get("HOME", "~")).expanduser() / ".local" / "state")
    return Path(base) / "boxwarden"


@dataclass(frozen=True)
class Box:
    name: str
    profile: str
    box_dir: str
    state_dir: str
    socket: str
    workdir: str
    watch: tuple[str, ...]
    durable: str
    run_id: str
    roster: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()  # the user's exclude patterns (given at up; shown in the evidence)
    pulled_dir: str = ""
    sidecar_pid: int = 0
    status: str = "up"
    created_at_ns: int = field(default_factory=time.time_ns)
    profile_file: str = ""  # a user's --profile-file, re-read at `down`; empty: the shipped profile
    profile_digest: str = ""  # blake3 of the profile text `up` accepted; `down` refuses another
    instance_id: str = ""  # the provider's id, for the meter-stop command's {instance_id}
    notices_shown: bool = False  # the platform's danger clocks were shown once for this box
    # A remote box (empty host: this machine). `socket`, `state_dir`, `workdir` and `watch` are
    # paths on the box; `box_dir` is the controller's own directory for it.
    host: str = ""  # the SSH destination (an alias or user@host), checked at `up`
    ssh_options: tuple[str, ...] = ()  # the user's --ssh-option KEY=VALUE, each checked
    ssh_config: str = ""  # ssh -F FILE ($BOXWARDEN_SSH_CONFIG at `up`); empty: the user's own
    python: str = ""  # the box-side python of the sidecar's venv (absolute, on the box)
    last_contact_ns: int = 0  # when the sidecar last answered a command of this controller
    state_on_durable: bool = False  # the sidecar's state and venv live on the durable tier
    durable_credentials: bool = False  # the sidecar reads its store's credentials from its state dir
    keep: str = ""  # retention rules of box-side copies (`up --keep`); empty: every copy stays
    push_rate: int = (
        0  # bytes/s the box's pushes keep to (`up --push-rate`); 0: the sidecar's default, -1: none
    )
    drain_grace_s: int = 0  # the profile's SIGTERM-to-SIGKILL grace the sidecar drains in (0: its default)
    # Health settings (`up --stall-minutes` ...); 0 or "": the sidecar's default.
    stall_s: int = 0  # JOB_STALLED after this long without a log line or a checkpoint
    step_regex: str = ""  # the step in a job's log: a regex with a group (?P<step>...)
    loss_regex: str = ""  # the loss: a regex with a group (?P<loss>...)
    memory_high_percent: int = 0  # MEMORY_HIGH over this share of the box's memory limit
    metrics_port: int = 0  # the Prometheus endpoint on the box's 127.0.0.1 (0: none)
    price_per_hour: float = 0.0  # what the box costs an hour (`up --price-per-hour`); 0: not known
    # A `down --when-safe` follows the box (its pid, since when): it tears it down once safe.
    armed_pid: int = 0
    armed_at_ns: int = 0
    armed_start: str = ""  # that pid's boot id and start time (controller.armed): a reused pid is not it
    # The start nonce of the sidecar `up` started or adopted (controller.identity): an answer from
    # any other is refused. "": a record of an older version (the first answer's is taken).
    sidecar_nonce: str = ""

    def to_json(self) -> dict[str, object]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.__dict__.items()}

    @classmethod
    def from_json(cls, d: Mapping[str, object]) -> Box:
        data: dict[str, Any] = dict(d)
        for key in ("watch", "roster", "exclude", "ssh_options"):
            data[key] = tuple(data.get(key) or ())
        return cls(**data)

    def with_(self, **changes: object) -> Box:
        return replace(self, **changes)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Step:
    """One teardown step, recorded before it was taken: its name, when, and what it was."""

    name: str
    at_ns: int
    detail: str = ""


class State:
    def __init__(self, home: Path) -> None:
        self.home = home
        try:
            home.mkdir(parents=True, exist_ok=True, mode=0o700)
            self._db = sqlite3.connect(home / "state.db", isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.executescript(SCHEMA)
        except (OSError, sqlite3.Error) as e:
            raise StateError(f"cannot open controller state in {home}: {e}") from e

    def close(self) -> None:
        self._db.close()

    @staticmethod
    def peek(home: Path, names: Sequence[str] | None = None) -> list[Box]:
        """The records of boxes `names` (every box if None) as they are, read-only: nothing is
        created or locked, and a home without state has no boxes."""
        db_path = home / "state.db"
        if not db_path.exists():
            return []
        db = sqlite3.connect(f"{db_path.resolve().as_uri()}?mode=ro", uri=True, isolation_level=None)
        try:
            rows = db.execute("SELECT name, record FROM boxes ORDER BY name").fetchall()
        finally:
            db.close()
        wanted = set(names) if names is not None else None
        return [Box.from_json(json.loads(rec)) for name, rec in rows if wanted is None or name in wanted]

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def box_dir(self, name: str) -> Path:
        return self.home / "boxes" / name

    def box_lock(self, name: str) -> Path:
        """The lock `down` and `up` of box `name` hold, one of them at a time (outside the box's
        dir: a refused `up` creates no box dir). `name` must be a checked box name: a path given
        for one would put the lock (and its truncation) anywhere."""
        if not name or "/" in name or name in (".", ".."):
            raise StateError(f"internal: {name!r} is no box name for a lock")
        return self.home / "locks" / f"{name}.lock"

    def put(self, box: Box) -> None:
        with self._tx() as db:
            self._put(db, box)

    @staticmethod
    def _put(db: sqlite3.Connection, box: Box) -> None:
        db.execute(
            "INSERT OR REPLACE INTO boxes(name, record, updated_at_ns) VALUES (?,?,?)",
            (box.name, json.dumps(box.to_json()), time.time_ns()),
        )

    def set_pulled_dir(self, name: str, pulled_dir: str) -> None:
        """Record where the box was last pulled to, on the record as it is now: a pull that ran
        for an hour must not put back the status it read when it began (a `down` since)."""
        with self._tx() as db:
            box = self.find(name)  # read inside the transaction: no write comes between
            if box is not None:
                self._put(db, box.with_(pulled_dir=pulled_dir))

    def touch(self, name: str) -> None:
        """Record that the box's sidecar answered just now (`status` shows how long ago it last did)."""
        with self._tx() as db:
            box = self.find(name)
            if box is not None:
                self._put(db, box.with_(last_contact_ns=time.time_ns()))

    def get(self, name: str) -> Box:
        row = self._db.execute("SELECT record FROM boxes WHERE name = ?", (name,)).fetchone()
        if row is None:
            known = ", ".join(b.name for b in self.boxes()) or "none"
            raise StateError(
                f"no box named {name!r} (known: {known}); start one with `boxwarden up {name} ...`"
            )
        return Box.from_json(json.loads(row[0]))

    def find(self, name: str) -> Box | None:
        row = self._db.execute("SELECT record FROM boxes WHERE name = ?", (name,)).fetchone()
        return Box.from_json(json.loads(row[0])) if row else None

    def boxes(self) -> list[Box]:
        rows = self._db.execute("SELECT record FROM boxes ORDER BY name").fetchall()
        return [Box.from_json(json.loads(r[0])) for r in rows]

    def last_seq(self, box: str, run_id: str) -> int:
        """The sequence number of the last event of the box's run kept here (0: none yet)."""
        row = self._db.execute(
            "SELECT MAX(seq) FROM events WHERE box = ? AND run_id = ?", (box, run_id)
        ).fetchone()
        return int(row[0] or 0)

    def add_event(self, box: str, run_id: str, seq: int, at_ns: int, record: Mapping[str, object]) -> bool:
        """Keep one event of the box's journal; False if it (or a later one) is kept already (another
        `events -f` of the same box got there first): each event is kept once, in order."""
        with self._tx() as db:
            last = db.execute(
                "SELECT MAX(seq) FROM events WHERE box = ? AND run_id = ?", (box, run_id)
            ).fetchone()[0]
            if last is not None and seq <= last:
                return False
            db.execute(
                "INSERT INTO events(box, run_id, seq, at_ns, record) VALUES (?,?,?,?,?)",
                (box, run_id, seq, at_ns, json.dumps(record, sort_keys=True)),
            )
            return True

    def events(self, box: str, run_id: str, after: int = 0) -> list[dict[str, Any]]:
        rows = self._db.execute(
            "SELECT record FROM events WHERE box = ? AND run_id = ? AND seq > ? ORDER BY seq",
            (box, run_id, after),
        ).fetchall()
        return [json.loads(r[0]) for r in rows]

    def keep_last_list(self, last: LastList) -> None:
        """Keep `last` as the box's last claims list (the hello and the listing as their wire bytes:
        every field, proof and durable_only included), unless the one kept is newer: of the same
        run and taken at a later point of the box's own journal (its seq; never this machine's
        clock, which may step back, nor the order in which two commands happened to store theirs)."""
        with self._tx() as db:
            kept = db.execute("SELECT run_id, listing FROM last_claims WHERE box = ?", (last.box,)).fetchone()
            if kept is not None and kept[0] == last.run_id:
                try:
                    newer = pb.ListArtifactsResponse.FromString(kept[1]).seq > last.listing.seq
                except DecodeError:
                    newer = False  # a damaged row is replaced
                if newer:
                    return
            db.execute(
                "INSERT INTO last_claims(box, run_id, received_at_ns, manifest_digest, durable_url, "
                "durable_root, hello, listing) VALUES (?,?,?,?,?,?,?,?) ON CONFLICT(box) DO UPDATE SET "
                "run_id = excluded.run_id, received_at_ns = excluded.received_at_ns, "
                "manifest_digest = excluded.manifest_digest, durable_url = excluded.durable_url, "
                "durable_root = excluded.durable_root, hello = excluded.hello, listing = excluded.listing",
                (
                    last.box,
                    last.run_id,
                    last.received_at_ns,
                    last.manifest_digest,
                    last.durable_url,
                    last.durable_root,
                    last.hello.SerializeToString(),
                    last.listing.SerializeToString(),
                ),
            )

    def last_list(self, box: str) -> LastList | None:
        """The last complete claims list received from `box` (None: none ever was)."""
        row = self._db.execute(
            "SELECT run_id, received_at_ns, durable_url, hello, listing FROM last_claims WHERE box = ?",
            (box,),
        ).fetchone()
        if row is None:
            return None
        try:
            hello = pb.HelloResponse.FromString(row[3])
            listing = pb.ListArtifactsResponse.FromString(row[4])
        except DecodeError as e:  # a damaged row proves nothing
            raise StateError(f"the last claims list kept for {box} cannot be read: {e}") from e
        return LastList(box, row[0], int(row[1]), row[2], hello, listing)

    def record_durable_pull(self, done: DurablePull) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT OR REPLACE INTO durable_pulls(box, run_id, manifest_digest, list_received_at_ns, "
                "pulled_dir, at_ns) VALUES (?,?,?,?,?,?)",
                (
                    done.box,
                    done.run_id,
                    done.manifest_digest,
                    done.list_received_at_ns,
                    done.pulled_dir,
                    done.at_ns,
                ),
            )

    def durable_pull(self, box: str) -> DurablePull | None:
        """The box's last `pull --from durable` that placed every claim (None: none did)."""
        row = self._db.execute(
            "SELECT run_id, manifest_digest, list_received_at_ns, pulled_dir, at_ns FROM durable_pulls "
            "WHERE box = ?",
            (box,),
        ).fetchone()
        return None if row is None else DurablePull(box, row[0], row[1], int(row[2]), row[3], int(row[4]))

    def merge_cells(
        self,
        box: str,
        run_id: str,
        found: Mapping[str, Mapping[str, Any]],
        merge: Callable[[Mapping[str, Any] | None, Mapping[str, Any]], Mapping[str, Any]],
    ) -> None:
        """Keep what a queue listing of the box's run said of each cell (`found`: cell -> record),
        each as `merge(kept, new)` makes it, in one transaction (controller.cellfacts)."""
        now = time.time_ns()
        with self._tx() as db:
            for cell, new in found.items():
                row = db.execute(
                    "SELECT record FROM cells WHERE box = ? AND run_id = ? AND cell = ?", (box, run_id, cell)
                ).fetchone()
                record = merge(json.loads(row[0]) if row else None, new)
                db.execute(
                    "INSERT OR REPLACE INTO cells(box, run_id, cell, seen_at_ns, record) VALUES (?,?,?,?,?)",
                    (box, run_id, cell, now, json.dumps(record, sort_keys=True)),
                )

    def cells(self, names: Sequence[str]) -> list[tuple[str, str, str, int, dict[str, Any]]]:
        """What was kept of cells `names` on every box and run: (box, run id, cell, when, record)."""
        rows: list[tuple[str, str, str, int, dict[str, Any]]] = []
        for name in sorted(set(names)):
            rows += [
                (r[0], r[1], r[2], int(r[3]), json.loads(r[4]))
                for r in self._db.execute(
                    "SELECT box, run_id, cell, seen_at_ns, record FROM cells WHERE cell = ? "
                    "ORDER BY seen_at_ns",
                    (name,),
                )
            ]
        return rows

    def audit(self, box: str, record: Mapping[str, object]) -> int:
        """Append one teardown record (who confirmed, when, evidence digest, actions, results)."""
        with self._tx() as db:
            cur = db.execute(
                "INSERT INTO teardowns(box, at_ns, record) VALUES (?,?,?)",
                (box, time.time_ns(), json.dumps(record, sort_keys=True)),
            )
            assert cur.lastrowid is not None
            return cur.lastrowid

    def torn_down_runs(self, box: str) -> set[str]:
        """The runs of `box` a teardown took down (as far as its audit records name their run)."""
        return {run for run, _ in self.torn_down(box)}

    def torn_down(self, box: str) -> set[tuple[str, str]]:
        """The runs of `box` a teardown took down, each with the instance it ran on."""
        rows = self._db.execute("SELECT record FROM teardowns WHERE box = ?", (box,)).fetchall()
        runs = set()
        for (record,) in rows:
            doc = json.loads(record)
            if doc.get("run_id") and (doc.get("result") or {}).get("gone"):
                runs.add((str(doc["run_id"]), str(doc.get("instance_id") or "")))
        return runs

    def last_audit(self, box: str) -> dict[str, Any] | None:
        """The box's last teardown record (None: none)."""
        row = self._db.execute(
            "SELECT record FROM teardowns WHERE box = ? ORDER BY at_ns DESC, rowid DESC LIMIT 1", (box,)
        ).fetchone()
        return dict(json.loads(row[0])) if row else None

    def last_audit_ns(self, box: str) -> int:
        """When the box's last teardown record was written (0: never)."""
        row = self._db.execute("SELECT MAX(at_ns) FROM teardowns WHERE box = ?", (box,)).fetchone()
        return int(row[0] or 0)

    def teardown_steps(self, box: str) -> dict[str, Step]:
        """The recorded steps of the box's unfinished teardown (empty: none)."""
        rows = self._db.execute(
            "SELECT step, at_ns, detail FROM teardown_steps WHERE box = ? ORDER BY at_ns", (box,)
        ).fetchall()
        return {r[0]: Step(r[0], int(r[1]), r[2]) for r in rows}

    def step(self, box: Box, step: str, detail: str) -> None:
        """Record, before it is taken, that a teardown step of `box` is about to be taken, together
        with the box's record (its status) in one transaction."""
        with self._tx() as db:
            self._put(db, box)
            db.execute(
                "INSERT OR REPLACE INTO teardown_steps(box, step, at_ns, detail) VALUES (?,?,?,?)",
                (box.name, step, time.time_ns(), detail),
            )

    def step_detail(self, box: str, step: str, detail: str) -> None:
        """Add what a step did once it answered (its time stays when it was taken)."""
        with self._tx() as db:
            db.execute("UPDATE teardown_steps SET detail = ? WHERE box = ? AND step = ?", (detail, box, step))

    def set_teardown(self, box: Box, steps: Mapping[str, Step]) -> None:
        """Put back the box's record and exactly `steps` (a teardown that stopped before it changed
        anything irreversible; empty `steps`: none unfinished), in one transaction."""
        with self._tx() as db:
            self._put(db, box)
            db.execute("DELETE FROM teardown_steps WHERE box = ?", (box.name,))
            db.executemany(
                "INSERT INTO teardown_steps(box, step, at_ns, detail) VALUES (?,?,?,?)",
                [(box.name, s.name, s.at_ns, s.detail) for s in steps.values()],
            )


@contextmanager
def exclusive(lock_file: Path, busy: str) -> Iterator[None]:
    """Hold an exclusive lock on `lock_file` (created 0600, its directory 0700) for the block, or
    fail at once: `busy` is the message, with `{pid}` filled by the holder's pid. The kernel drops
    the lock when the holder exits, however it exits."""
    try:
        lock_file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(lock_file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise StateError(f"cannot open the lock {lock_file}: {e.strerror}") from e
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            raise ControllerError(busy.replace("{pid}", holder if holder.isdigit() else "unknown")) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)
    finally:
        os.close(fd)
