"""Ledger: the sidecar's crash-safe record of claims, the event journal and the jobs (SQLite, WAL).

Invariants this module keeps (each in ONE transaction):
- at most one *current* claim per artifact path; a claim whose file changed is superseded by a new
  claim, never edited;
- every claim is created together with its ARTIFACT_SEALED event, whose seq it carries;
- a claim is marked durable only while it is still current;
- the artifact counters (`counts`) move with every change, so the health tick never scans claims.
`synchronous=FULL`: the claim that supersedes an old one must be on disk before the new bytes are
renamed over the old durable copy, or a power cut could leave a durable claim naming wrong bytes.
The connection is used from the event-loop thread only.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sqlite3
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sidecar.compat import SLOTS
from sidecar.identity import FileIdentity
from sidecar.jobs import JobRecord

logger = logging.getLogger(__name__)

SCHEMA = """
CREATE TABLE IF NOT EXISTS events(
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    at_ns INTEGER NOT NULL, kind TEXT NOT NULL, path TEXT NOT NULL DEFAULT '',
    job_id TEXT NOT NULL DEFAULT '', detail TEXT NOT NULL DEFAULT '',
    size INTEGER NOT NULL DEFAULT 0, blake3 TEXT NOT NULL DEFAULT '');
CREATE TABLE IF NOT EXISTS claims(
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    path TEXT NOT NULL, size INTEGER NOT NULL, blake3 TEXT NOT NULL,
    dev INTEGER NOT NULL, ino INTEGER NOT NULL, mtime_ns INTEGER NOT NULL,
    sealed_at_ns INTEGER NOT NULL, seq INTEGER NOT NULL,
    current INTEGER NOT NULL DEFAULT 1,
    durable INTEGER NOT NULL DEFAULT 0, durable_at_ns INTEGER NOT NULL DEFAULT 0,
    push_error TEXT NOT NULL DEFAULT '', ended_reason TEXT NOT NULL DEFAULT '');
CREATE UNIQUE INDEX IF NOT EXISTS claims_one_current ON claims(path) WHERE current = 1;
CREATE INDEX IF NOT EXISTS claims_durable_by_path ON claims(path, id) WHERE durable = 1;
CREATE INDEX IF NOT EXISTS claims_not_durable ON claims(sealed_at_ns) WHERE current = 1 AND durable = 0;
CREATE TABLE IF NOT EXISTS jobs(id TEXT PRIMARY KEY, record TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS queues(name TEXT PRIMARY KEY, record TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


@dataclass(frozen=True, **SLOTS)
class ClaimRow:
    id: int
    path: str
    size: int
    blake3: str
    identity: FileIdentity
    sealed_at_ns: int
    seq: int
    durable: bool
    durable_at_ns: int
    push_error: str
    proven_at_ns: int = 0
    proof: str = ""  # how the durable copy was last proven ("reread", "server-checksum"); "" if not durable
    durable_only: bool = False  # retention deleted the box-side copy after a re-read proved its durable one


@dataclass(**SLOTS)
class Counts:
    """Current claims in numbers, kept up to date by every ledger change (no scan per health tick)."""

    sealed: int = 0
    sealed_bytes: int = 0
    durable: int = 0
    durable_bytes: int = 0

    def add(self, size: int, durable: bool, sign: int) -> None:
        self.sealed += sign
        self.sealed_bytes += sign * size
        if durable:
            self.durable += sign
            self.durable_bytes += sign * size


@dataclass(frozen=True, **SLOTS)
class Summary:
    server_checksum: int = 0  # current durable claims proven by the store's checksum only
    durable_only: int = 0  # current claims whose box copy retention deleted
    newest: ClaimRow | None = None  # the most recently sealed current claim


@dataclass(frozen=True, **SLOTS)
class EventRow:
    seq: int
    at_ns: int
    kind: str
    path: str
    job_id: str
    detail: str
    size: int
    blake3: str


class Ledger:
    def __init__(self, path: Path) -> None:
        self._db = sqlite3.connect(path, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(SCHEMA)
        cols = {r["name"] for r in self._db.execute("PRAGMA table_info(claims)")}
        for col in ("ctime_ns", "proven_at_ns"):
            if col not in cols:  # a ledger written by an older version: its claims re-hash once
                self._db.execute(f"ALTER TABLE claims ADD COLUMN {col} INTEGER NOT NULL DEFAULT 0")
        if "kept_at" not in cols:
            self._db.execute("ALTER TABLE claims ADD COLUMN kept_at TEXT NOT NULL DEFAULT ''")
        if "proof" not in cols:  # an older ledger: every proof it recorded was a re-read
            self._db.execute("ALTER TABLE claims ADD COLUMN proof TEXT NOT NULL DEFAULT ''")
            self._db.execute("UPDATE claims SET proof = 'reread' WHERE durable = 1")
        if "durable_only" not in cols:
            self._db.execute("ALTER TABLE claims ADD COLUMN durable_only INTEGER NOT NULL DEFAULT 0")
        self.counts = Counts()
        for r in self._db.execute(
            "SELECT durable, count(*) AS n, COALESCE(SUM(size), 0) AS b FROM claims WHERE current = 1"
            " GROUP BY durable"
        ):
            self.counts.sealed += r["n"]
            self.counts.sealed_bytes += r["b"]
            if r["durable"]:
                self.counts.durable += r["n"]
                self.counts.durable_bytes += r["b"]
        self.ledger_id = self.meta_default("ledger_id", uuid.uuid4().hex)
        # The current claims, mirrored in memory: a listing of 100,000 reads no rows and sorts
        # nothing unless something changed. Every change re-reads its row after its transaction
        # committed (`_reload`), so the mirror never shows what the database does not hold.
        self._current: dict[str, ClaimRow] = {}
        self._sorted: list[ClaimRow] | None = None
        self.version = 0
        # Moves only when a claim starts or ends (not when one's state changes): what retention's
        # choice of checkpoints depends on.
        self.members = 0
        self._summary, self._summary_at = Summary(), -1
        self._reload_all()

    def close(self) -> None:
        self._db.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    # -- events ---------------------------------------------------------------------------------

    def _event(
        self,
        db: sqlite3.Connection,
        kind: str,
        *,
        path: str = "",
        job_id: str = "",
        detail: str = "",
        size: int = 0,
        blake3: str = "",
    ) -> int:
        cur = db.execute(
            "INSERT INTO events(at_ns, kind, path, job_id, detail, size, blake3) VALUES (?,?,?,?,?,?,?)",
            (time.time_ns(), kind, path, job_id, detail, size, blake3),
        )
        assert cur.lastrowid is not None
        return cur.lastrowid

    def add_event(self, kind: str, *, path: str = "", job_id: str = "", detail: str = "") -> int:
        with self._tx() as db:
            return self._event(db, kind, path=path, job_id=job_id, detail=detail)

    def events_after(self, seq: int, limit: int = 1000) -> list[EventRow]:
        rows = self._db.execute(
            "SELECT * FROM events WHERE seq > ? ORDER BY seq LIMIT ?", (seq, limit)
        ).fetchall()
        return [EventRow(**dict(r)) for r in rows]

    def last_seq(self) -> int:
        row = self._db.execute("SELECT MAX(seq) FROM events").fetchone()
        return int(row[0] or 0)

    # -- claims ---------------------------------------------------------------------------------

    # -- meta ---------------------------------------------------------------------------------

    def meta(self, key: str) -> str | None:
        row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row["value"])

    def set_meta(self, key: str, value: str) -> None:
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)", (key, value))

    def meta_default(self, key: str, value: str) -> str:
        """The value recorded under `key`; `value`, recorded now, if there is none yet."""
        with self._tx() as db:
            db.execute("INSERT OR IGNORE INTO meta(key, value) VALUES (?, ?)", (key, value))
        found = self.meta(key)
        assert found is not None
        return found

    # -- claims ---------------------------------------------------------------------------------

    def _uncount(self, db: sqlite3.Connection, path: str) -> None:
        for r in db.execute("SELECT size, durable FROM claims WHERE current = 1 AND path = ?", (path,)):
            self.counts.add(r["size"], bool(r["durable"]), -1)

    def add_claim(self, path: str, size: int, blake3: str, ident: FileIdentity) -> ClaimRow:
        """Record a new current claim, superseding the previous one for the same path."""
        now = time.time_ns()
        with self._tx() as db:
            self._uncount(db, path)
            db.execute(
                "UPDATE claims SET current = 0, ended_reason = 'superseded' WHERE path = ? AND current = 1",
                (path,),
            )
            seq = self._event(db, "ARTIFACT_SEALED", path=path, size=size, blake3=blake3)
            db.execute(
                "INSERT INTO claims(path, size, blake3, dev, ino, mtime_ns, ctime_ns, sealed_at_ns, seq)"
                " VALUES (?,?,?,?,?,?,?,?,?)",
                (path, size, blake3, ident.dev, ident.ino, ident.mtime_ns, ident.ctime_ns, now, seq),
            )
        self.counts.add(size, False, 1)
        self.members += 1
        self._reload(path)
        claim = self.current(path)
        assert claim is not None
        return claim

    def refresh_identity(self, claim_id: int, ident: FileIdentity) -> None:
        """The file was re-read and hashes to its claim: remember its new identity (a metadata-only
        change such as `touch` or `chmod`, or a rewrite with the same bytes). No new claim."""
        with self._tx() as db:
            db.execute(
                "UPDATE claims SET dev = ?, ino = ?, mtime_ns = ?, ctime_ns = ? WHERE id = ? AND current = 1"
                " AND size = ?",
                (ident.dev, ident.ino, ident.mtime_ns, ident.ctime_ns, claim_id, ident.size),
            )
        self._reload_id(claim_id)

    def add_changed_event(self, path: str, detail: str) -> None:
        self.add_event("ARTIFACT_CHANGED", path=path, detail=detail)

    def mark_durable(self, claim_id: int, proof: str, *, note: str = "") -> bool:
        """Mark a claim durable, proven by `proof`; False (and nothing changes) if it is no longer
        current. `note`: added to the ARTIFACT_DURABLE event's detail."""
        with self._tx() as db:
            row = db.execute(
                "SELECT path, durable FROM claims WHERE id = ? AND current = 1", (claim_id,)
            ).fetchone()
            if row is None:
                return False
            now = time.time_ns()
            if row["durable"]:
                db.execute(
                    "UPDATE claims SET proven_at_ns = ?, proof = ? WHERE id = ?", (now, proof, claim_id)
                )
                durable_already = True
            else:
                durable_already = False
                db.execute(
                    "UPDATE claims SET durable = 1, durable_at_ns = ?, proven_at_ns = ?, proof = ?,"
                    " push_error = '' WHERE id = ?",
                    (now, now, proof, claim_id),
                )
                detail = f"proof: {proof}" + (f"; {note}" if note else "")
                self._event(db, "ARTIFACT_DURABLE", path=row["path"], detail=detail)
        self._reload(row["path"])
        if not durable_already:
            claim = self._current.get(row["path"])
            assert claim is not None and claim.id == claim_id
            self.counts.durable += 1
            self.counts.durable_bytes += claim.size
        return True

    def set_durable_only(self, claim_id: int, flag: bool) -> bool:
        """Record that the box-side copy of a current, durable claim is deleted (or back); False if
        the claim is not current (or, to set it, not durable)."""
        with self._tx() as db:
            row = db.execute(
                "SELECT path FROM claims WHERE id = ? AND current = 1 AND (durable = 1 OR ? = 0)",
                (claim_id, int(flag)),
            ).fetchone()
            if row is None:
                return False
            db.execute("UPDATE claims SET durable_only = ? WHERE id = ?", (int(flag), claim_id))
        self._reload(row["path"])
        return True

    def summary(self) -> Summary:
        """What the health stream shows of the current claims beyond `counts`; computed once per
        change of the claims, not per call."""
        if self._summary_at != self.version:
            claims = self._current.values()
            self._summary = Summary(
                server_checksum=sum(1 for c in claims if c.durable and c.proof == "server-checksum"),
                durable_only=sum(1 for c in claims if c.durable_only),
                newest=max(claims, key=lambda c: c.seq, default=None),
            )
            self._summary_at = self.version
        return self._summary

    def mark_not_durable(self, claim_id: int, why: str) -> None:
        """A durable copy that no longer hashes equal: the claim is not durable any more."""
        with self._tx() as db:
            row = db.execute(
                "SELECT path, size, durable FROM claims WHERE id = ? AND current = 1", (claim_id,)
            ).fetchone()
            if row is None:
                return
            if row["durable"]:
                self.counts.durable -= 1
                self.counts.durable_bytes -= row["size"]
            db.execute(
                "UPDATE claims SET durable = 0, durable_at_ns = 0, proof = '', push_error = ? WHERE id = ?",
                (why, claim_id),
            )
            self._event(db, "PUSH_FAILED", path=row["path"], detail=why)
        self._reload(row["path"])

    def mark_push_failed(self, claim_id: int, error: str) -> None:
        """Record why a push failed; the journal hears of it once per distinct reason."""
        with self._tx() as db:
            row = db.execute(
                "SELECT path, push_error FROM claims WHERE id = ? AND current = 1", (claim_id,)
            ).fetchone()
            if row is None or row["push_error"] == error:
                return
            db.execute("UPDATE claims SET push_error = ? WHERE id = ?", (error, claim_id))
            self._event(db, "PUSH_FAILED", path=row["path"], detail=error)
        self._reload(row["path"])

    def end_claim(self, path: str, reason: str, event: str) -> bool:
        """The claimed file left the box (deleted, renamed away, released): its claim is no longer current."""
        with self._tx() as db:
            self._uncount(db, path)
            cur = db.execute(
                "UPDATE claims SET current = 0, ended_reason = ? WHERE path = ? AND current = 1",
                (reason, path),
            )
            if cur.rowcount == 0:
                return False
            self._event(db, event, path=path, detail=reason)
        self.members += 1
        self._reload(path)
        return True

    def retired_copy(self, path: str) -> ClaimRow | None:
        """The claim whose durable copy lies at `path` if that claim ended because its file left the
        box (deleted, renamed away, released) and its copy was not kept aside yet: a new copy for
        the same path must not replace it. A claim superseded by a rewrite of its file is not one.
        A durable-only claim counts whether or not it is durable now: its copy is the only one left
        (a store error at a later proof must not let a new file's copy replace it)."""
        row = self._db.execute(
            "SELECT * FROM claims WHERE path = ? AND (durable = 1 OR durable_only = 1)"
            " ORDER BY id DESC LIMIT 1",
            (path,),
        ).fetchone()
        if row is None or row["current"] or row["ended_reason"] == "superseded" or row["kept_at"]:
            return None
        return _claim(row)

    def mark_kept(self, claim_id: int, where: str | None) -> None:
        """The ended claim's durable copy now lies at `where` (None: it was not there to keep)."""
        with self._tx() as db:
            row = db.execute("SELECT path FROM claims WHERE id = ? AND current = 0", (claim_id,)).fetchone()
            if row is None:
                return
            db.execute("UPDATE claims SET kept_at = ? WHERE id = ?", (where or "-", claim_id))
            if where is not None:
                self._event(
                    db,
                    "DURABLE_MOVED_ASIDE",
                    path=row["path"],
                    detail=f"a new file took the path of one that left the box; the old copy lies at {where}",
                )
            else:
                self._event(
                    db,
                    "DURABLE_MISSING",
                    path=row["path"],
                    detail="the durable copy of a file that left the box was no longer at its path (moved to "
                    "the attic when the path changed kind, or removed from the store)",
                )

    def claim_by_id(self, claim_id: str) -> ClaimRow | None:
        """Any claim, current or ended, by its id (given as text, as it appears in a file name)."""
        if not claim_id.isdigit():
            return None
        row = self._db.execute("SELECT * FROM claims WHERE id = ?", (int(claim_id),)).fetchone()
        return _claim(row) if row else None

    def current(self, path: str) -> ClaimRow | None:
        return self._current.get(path)

    def current_claims(self) -> list[ClaimRow]:
        """Every current claim, sorted by path bytes (a fresh list; the rows are shared)."""
        if self._sorted is None:
            self._sorted = sorted(
                self._current.values(), key=lambda c: c.path.encode("utf-8", "surrogateescape")
            )
        return list(self._sorted)

    def _changed(self) -> None:
        self._sorted = None
        self.version += 1

    def _reload(self, path: str) -> None:
        """Mirror one path's current claim (or its absence) after a committed change."""
        row = self._db.execute("SELECT * FROM claims WHERE path = ? AND current = 1", (path,)).fetchone()
        if row is None:
            self._current.pop(path, None)
        else:
            self._current[path] = _claim(row)
        self._changed()

    def _reload_id(self, claim_id: int) -> None:
        row = self._db.execute("SELECT path FROM claims WHERE id = ? AND current = 1", (claim_id,)).fetchone()
        if row is not None:
            self._reload(row["path"])

    def _reload_all(self) -> None:
        # Positional rows and no per-row dict lookups: 100,000 rows at start and after a store change.
        cur = self._db.cursor()
        cur.row_factory = None
        rows = cur.execute(
            "SELECT id, path, size, blake3, dev, ino, mtime_ns, ctime_ns, sealed_at_ns, seq, durable,"
            " durable_at_ns, push_error, proven_at_ns, proof, durable_only FROM claims WHERE current = 1"
        ).fetchall()
        self._current = {
            p: ClaimRow(
                i, p, sz, b3, FileIdentity(dv, ino, sz, mt, ct), sa, sq, bool(du), da, pe, pa, pr, bool(do)
            )
            for (i, p, sz, b3, dv, ino, mt, ct, sa, sq, du, da, pe, pa, pr, do) in rows
        }
        self._changed()

    def oldest_not_durable_ns(self) -> int:
        """sealed_at of the oldest current claim that is not durable; 0 if none (an index lookup)."""
        row = self._db.execute(
            "SELECT MIN(sealed_at_ns) FROM claims WHERE current = 1 AND durable = 0"
        ).fetchone()
        return int(row[0] or 0)

    def not_durable(self) -> list[ClaimRow]:
        rows = self._db.execute(
            "SELECT * FROM claims WHERE current = 1 AND durable = 0 ORDER BY sealed_at_ns DESC"
        ).fetchall()
        return [_claim(r) for r in rows]

    def bind_store(self, key: str) -> int:
        """Record which durable store the claims are proven in. If it is not the one they were
        proven in (another URL, or a new store id: an emptied or re-mounted volume), every current
        claim goes back to not durable, to be pushed and proven again. Returns how many."""
        with self._tx() as db:
            row = db.execute("SELECT value FROM meta WHERE key = 'store'").fetchone()
            reset = 0
            if row is not None and row["value"] != key:
                for r in db.execute("SELECT size FROM claims WHERE current = 1 AND durable = 1"):
                    self.counts.durable -= 1
                    self.counts.durable_bytes -= r["size"]
                reset = db.execute(
                    "UPDATE claims SET durable = 0, durable_at_ns = 0, proof = '',"
                    " push_error = 'the durable store changed; pushing again'"
                    " WHERE current = 1 AND durable = 1"
                ).rowcount
                self._event(db, "PUSH_FAILED", detail=f"durable store changed ({row['value']} -> {key})")
            db.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('store', ?)", (key,))
        if reset:
            self._reload_all()
        return reset

    # -- jobs (implements sidecar.jobs.JobStore) -------------------------------------------------

    def save_job(self, job: JobRecord) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT OR REPLACE INTO jobs(id, record) VALUES (?, ?)",
                (job.id, json.dumps(dataclasses.asdict(job))),
            )

    def load_jobs(self) -> list[JobRecord]:
        rows = self._db.execute("SELECT record FROM jobs").fetchall()
        return [JobRecord(**json.loads(r["record"])) for r in rows]

    # -- queues (implements sidecar.cellqueue.QueueStore) ------------------------------------------

    def save_queue(self, name: str, record: dict[str, Any]) -> None:
        with self._tx() as db:
            db.execute(
                "INSERT OR REPLACE INTO queues(name, record) VALUES (?, ?)", (name, json.dumps(record))
            )

    def delete_queue(self, name: str) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM queues WHERE name = ?", (name,))

    def load_queues(self) -> list[dict[str, Any]]:
        rows = self._db.execute("SELECT record FROM queues").fetchall()
        return [json.loads(r["record"]) for r in rows]


def _claim(row: sqlite3.Row) -> ClaimRow:
    return ClaimRow(
        id=row["id"],
        path=row["path"],
        size=row["size"],
        blake3=row["blake3"],
        identity=FileIdentity(
            dev=row["dev"],
            ino=row["ino"],
            size=row["size"],
            mtime_ns=row["mtime_ns"],
            ctime_ns=row["ctime_ns"],
        ),
        sealed_at_ns=row["sealed_at_ns"],
        seq=row["seq"],
        durable=bool(row["durable"]),
        durable_at_ns=row["durable_at_ns"],
        push_error=row["push_error"],
        proven_at_ns=row["proven_at_ns"],
        proof=row["proof"],
        durable_only=bool(row["durable_only"]),
    )
