"""The server's jobs, kept so that none is lost: in SQLite in the output folder (the default:
one server) or in PostgreSQL (`--job-store postgresql://...`: a fleet of servers sharing one
queue), runtime.serve.store_backends, every change committed before it is answered. The MP4s and the
image-to-video jobs' images live in the output folder (shared by a fleet), written there
atomically (runtime.generation.outputs.staged).

A server claims the jobs of a batch (`start`: with PostgreSQL, `FOR UPDATE SKIP LOCKED`, so two
replicas never claim one job) under a lease it renews while it works (`renew`); a lease that
expires (the server killed, its host lost) puts the job back in the queue (`expire`), at most
`max_attempts` claims in all, after which it fails with a reason. Every claim is counted
(`attempts`), and only the claim that holds a job may report its progress and complete it: a
server that lost its lease cannot complete a job twice. A restart of a SQLite server finds the
completed videos and queues again those in progress, with their images. The schema is versioned
in its own table (MIGRATIONS); a server refuses a store of a newer version. Every database
failure comes out as a StoreError, one line saying what to do: the start refuses, the server
retries."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import secrets
import socket
import time
from pathlib import Path
from typing import Any

from runtime.generation import Group, Settings, write_files
from runtime.serve.store_backends import Backend, Executor, StoreError, open_backend
from wan.bounded_read import parse_json

__all__ = ["Job", "JobStore", "QueueFull", "StoreError"]

DATABASE = "jobs.sqlite3"
VIDEOS = "videos"
# An image-to-video job's input_reference, the file as it was uploaded (PNG, JPEG or WebP, read
# again by its batch), at INPUTS/<job id>INPUT; its stored request says it has one.
INPUTS, INPUT = "inputs", ".image"
STATUSES = ("queued", "in_progress", "completed", "failed")
# A job's id, as `add` makes it: the only ids a file's name is made of (content_path).
JOB_ID = re.compile(r"video_[0-9a-f]{24}")
# What a row's text columns may hold: a stored request (two prompts of --max-prompt-chars,
# escaped), and the others (an error message is cut to this when written).
MAX_REQUEST_CHARS = 32 << 20
MAX_TEXT_CHARS = 64 << 10
# The columns every read names (a column dropped by hand is the store's fault, not a KeyError).
COLUMNS = ("seq, id, grp, request, status, progress, created_at, completed_at, error_code, "
           "error_message, attempts, owner")  # fmt: skip
# The stored request's fields the server reads back (runtime.serve.openai_dialect.VideoRequest's, the
# seed and frames filled in) and their JSON types; a row without them is refused at the start.
REQUEST_FIELDS = {"prompt": str, "negative_prompt": str, "size": str, "frames": int,
                  "seed": int, "steps": int}  # fmt: skip
# What a completed video keeps in VIDEOS, by the `variant` of its content: the file's suffix.
CONTENT = {"video": ".mp4", "thumbnail": ".webp", "spritesheet": ".jpg", "frames": ".npy"}
LOCK_TIMEOUT_S = 5.0  # an operation's wait for a lock another process holds (--store-timeout)
MAX_PAGE_BYTES = 1 << 20  # of stored requests in one page of the list: 1,000 short ones
LEASE_S = 60.0  # a claim's lease (--lease), renewed every third of it while the batch runs
MAX_ATTEMPTS = 3  # claims of one job before a lost lease fails it (--max-attempts)
# A shared folder's staged files and orphan images are removed at a start only once this old:
# a younger one may be another replica's write in flight.
SHARED_STALE_S = 3600.0

# The schema, one entry per version, each run once in order and recorded in schema_migrations;
# {serial} and {real} are the backend's column types. Version 1 is the SQLite store of the
# first server (a database of it has no schema_migrations table and is migrated in place).
MIGRATIONS = (
    """CREATE TABLE IF NOT EXISTS jobs (
        seq {serial},
        id TEXT UNIQUE NOT NULL,
        grp TEXT NOT NULL,
        request TEXT NOT NULL,
        status TEXT NOT NULL,
        progress INTEGER NOT NULL DEFAULT 0,
        created_at {real} NOT NULL,
        completed_at {real},
        error_code TEXT,
        error_message TEXT
    )""",
    # The fleet: the build a job runs on (what a replica can claim), who holds it and until when,
    # and how many times it was claimed.
    "ALTER TABLE jobs ADD COLUMN build TEXT",
    "ALTER TABLE jobs ADD COLUMN owner TEXT",
    "ALTER TABLE jobs ADD COLUMN lease_until {real}",
    "ALTER TABLE jobs ADD COLUMN attempts INTEGER NOT NULL DEFAULT 0",
    "CREATE INDEX IF NOT EXISTS jobs_by_status ON jobs (status, seq)",
)


class QueueFull(Exception):
    """The queue holds --max-queue jobs already."""


@dataclasses.dataclass(frozen=True)
class Job:
    """A row of the jobs table read into typed values (`_job`, the row's one schema). A column
    that does not read (a row edited by hand, damaged) is `damage`, that column's name, and
    holds a neutral value instead (None, 0, "failed"): the server fails the job, never itself."""

    id: str  # JOB_ID unless `damage` is "id"
    group: Group | None  # None: the stored group does not read
    request: dict[str, Any] | None  # None: the stored request does not read
    status: str
    progress: int
    created_at: float
    completed_at: float | None
    error: dict[str, str] | None
    attempts: int = 0  # times a server claimed it
    owner: str | None = None  # the replica that holds it, or held it last
    seq: int = 0  # its row's key, whatever else does not read
    damage: str | None = None  # the first column that does not read

    @property
    def unreadable(self) -> str:
        """Why a damaged job fails."""
        return f"its stored {self.damage} does not read: submit the video again"


def default_replica() -> str:
    """A replica's name unless --replica gives one: unique among running servers."""
    return f"{socket.gethostname()}-{os.getpid()}"


class JobStore:
    """The jobs of one output folder, in its SQLite file or in the PostgreSQL database `url`
    (whose replicas share the folder). Thread-safe: the HTTP handlers, the generation worker and
    the lease's renewal share one connection under a lock."""

    def __init__(
        self,
        out_dir: Path,
        timeout: float = LOCK_TIMEOUT_S,
        url: str | None = None,
        replica: str | None = None,
        lease: float = LEASE_S,
        max_attempts: int = MAX_ATTEMPTS,
    ):
        """`timeout`: the seconds an operation waits for a lock another process holds before it
        fails; `replica`: this server's name in a fleet (the jobs it holds); `lease`: the
        seconds a claim lasts unless renewed."""
        self.out_dir = out_dir
        self.videos = out_dir / VIDEOS
        self.inputs = out_dir / INPUTS
        self.videos.mkdir(parents=True, exist_ok=True)
        self.inputs.mkdir(exist_ok=True)
        self.replica = replica or default_replica()
        self.lease, self.max_attempts = lease, max_attempts
        self._claims: dict[str, int] = {}  # the jobs this store's server holds: their attempt
        self._db: Backend = open_backend(url, out_dir, DATABASE, timeout)
        self.where, self.shared, self.path = self._db.where, self._db.shared, self._db.path
        self._migrate()

    def _migrate(self) -> None:
        db = self._db
        with db.transaction() as tx:
            db.serialize(tx)
            tx.execute(
                "CREATE TABLE IF NOT EXISTS schema_migrations ("
                f"version INTEGER PRIMARY KEY, applied_at {db.real} NOT NULL)"
            )
            row = tx.execute("SELECT MAX(version) AS v FROM schema_migrations").fetchone()
            version = row["v"] or 0
            if version > len(MIGRATIONS):
                raise StoreError(
                    f"job store {self.where} has schema version {version}; this server knows "
                    f"versions up to {len(MIGRATIONS)}: run the newer wan-aot that wrote it, or "
                    "give another store"
                )
            for number, statement in enumerate(MIGRATIONS[version:], version + 1):
                tx.execute(statement.format(serial=db.serial, real=db.real))
                tx.execute(
                    f"INSERT INTO schema_migrations (version, applied_at) VALUES (?, {db.now})",
                    (number,),
                )

    def recover(self) -> int:
        """At the start: the database is checked (SQLite: its pages; every job's request), the
        jobs in progress of a SQLite store are queued again (their videos were not written; with
        PostgreSQL, other replicas' jobs: their leases decide), and staged files a killed writer
        left are removed, with the images of no job (`add` or `delete` killed between the file
        and the row); in a shared folder only those SHARED_STALE_S old. Returns the jobs
        queued."""
        stale = time.time() - (SHARED_STALE_S if self.shared else 0)
        for partial in (*self.videos.glob(".*.partial"), *self.inputs.glob(".*.partial")):
            _unlink_older(partial, stale)
        ids = set()
        with self._db.transaction() as db:
            problem = self._db.integrity_problem(db)
            if problem:
                raise StoreError(problem)
            for row in db.execute("SELECT seq, id, request FROM jobs"):
                ids.add(row["id"])
                if _read_request(row["request"]) is None:
                    job_id = row["id"]  # shown only as a valid id: a message stays one line
                    which = job_id if _is_id(job_id) else f"#{row['seq']}"
                    fix = self._db.shell(f"DELETE FROM jobs WHERE seq={int(row['seq'])}")
                    raise StoreError(
                        f"job store {self.where}: job {which}'s request does not read (a JSON "
                        f"object with {', '.join(REQUEST_FIELDS)}): delete it ({fix}) or give "
                        "another store"
                    )
            if not self.shared:
                self._release(db, "status='in_progress'", "the server stopped while running it")
            queued = db.execute("SELECT COUNT(*) AS n FROM jobs WHERE status='queued'").fetchone()
        for image in self.inputs.glob(f"*{INPUT}"):
            if image.name.removesuffix(INPUT) not in ids:
                _unlink_older(image, stale)
        return queued["n"]

    def check(self) -> None:
        """That the store takes writes now (SQLite: its write lock taken and given back)."""
        with self._db.transaction() as db:
            self._db.serialize(db)

    def add(
        self, group: Group, request: dict[str, Any], max_queue: int, image: bytes | None = None
    ) -> Job:
        """A new queued job, unless `max_queue` jobs wait or run already (QueueFull); with
        `image`, its input_reference file, kept until the job is deleted (`image_of`)."""
        job_id = f"video_{secrets.token_hex(12)}"
        if image is not None:  # written before the row: a job never lacks its image
            try:
                write_files({self.input_path(job_id): lambda path: path.write_bytes(image)})
            except OSError as e:  # a WriteError naming the file
                raise StoreError(
                    f"job store {self.inputs}: {e}: free some space or make it writable"
                ) from None
            request = request | {"input_reference": True}
        try:
            with self._db.transaction() as db:
                self._db.serialize(db)  # the count and the insert as one: the queue's bound
                waiting = db.execute(
                    "SELECT COUNT(*) AS n FROM jobs WHERE status IN ('queued', 'in_progress')"
                ).fetchone()["n"]
                if waiting >= max_queue:
                    raise QueueFull(f"the queue is full ({max_queue} videos): retry later")
                db.execute(
                    "INSERT INTO jobs (id, grp, build, request, status, created_at) "
                    "VALUES (?, ?, ?, ?, ?, ?)",
                    (job_id, _group_text(group), group.build, json.dumps(request), "queued",
                     time.time()),
                )  # fmt: skip
                row = db.execute(f"SELECT {COLUMNS} FROM jobs WHERE id=?", (job_id,)).fetchone()
                return _job(row)
        except BaseException:
            self.input_path(job_id).unlink(missing_ok=True)
            raise

    def get(self, job_id: str) -> Job | None:
        with self._db.transaction() as db:
            row = db.execute(f"SELECT {COLUMNS} FROM jobs WHERE id=?", (job_id,)).fetchone()
        return None if row is None else _job(row)

    def page(
        self,
        limit: int = 100,
        after: str | None = None,
        max_bytes: int = MAX_PAGE_BYTES,
        ascending: bool = False,
    ) -> tuple[list[Job], bool]:
        """The newest jobs first (the oldest if `ascending`), from the one after `after` (an id)
        when given: at most `limit` of them and `max_bytes` of their stored requests (one at
        least), and whether more follow."""
        jobs, size = [], 0
        query = (
            f"SELECT {COLUMNS} FROM jobs WHERE seq > COALESCE((SELECT seq FROM jobs WHERE id=?), "
            "0) ORDER BY seq"
            if ascending
            else f"SELECT {COLUMNS} FROM jobs WHERE seq < COALESCE((SELECT seq FROM jobs WHERE "
            "id=?), 9223372036854775807) ORDER BY seq DESC"
        )
        with self._db.transaction() as db:
            for row in db.execute(f"{query} LIMIT ?", (after, limit + 1)):
                request = row["request"]
                size += len(request) if isinstance(request, str) else 0
                if len(jobs) == limit or (jobs and size > max_bytes):
                    return jobs, True
                jobs.append(_job(row))
        return jobs, False

    def queued(self, builds: list[str] | None = None) -> list[Job]:
        """The queued jobs, oldest first; with `builds`, only those of these builds (a replica's:
        the others wait for a replica that serves them)."""
        where, params = "status='queued'", []
        if builds is not None:
            where += f" AND build IN ({_marks(builds)})"
            params = builds
        with self._db.transaction() as db:
            rows = db.execute(
                f"SELECT {COLUMNS} FROM jobs WHERE {where} ORDER BY seq", params
            ).fetchall()
        return [_job(r) for r in rows]

    def counts(self) -> dict[str, int]:
        """Jobs per status."""
        with self._db.transaction() as db:
            found = {r["status"]: r["n"] for r in
                     db.execute("SELECT status, COUNT(*) AS n FROM jobs GROUP BY status")}  # fmt: skip
        return {s: found.get(s, 0) for s in STATUSES}

    def delete(self, job_id: str) -> bool:
        """Remove a job that is not in progress (a queued one is cancelled) and then its files;
        False if it is in progress."""
        with self._db.transaction() as db:
            cursor = db.execute("DELETE FROM jobs WHERE id=? AND status!='in_progress'", (job_id,))
        if cursor.rowcount != 1:
            return False
        if not _is_id(job_id):  # a row whose id was edited: no file is named after it
            return True
        for variant in CONTENT:  # after the row: a kill between them leaves files, not a row
            self.content_path(job_id, variant).unlink(missing_ok=True)
        self.input_path(job_id).unlink(missing_ok=True)
        return True

    def start(self, job_ids: list[str]) -> list[Job]:
        """Of `job_ids`, those still queued (not cancelled, not claimed by another replica
        meanwhile), now claimed by this server under a lease."""
        marks = _marks(job_ids)
        with self._db.transaction() as db:
            claimed = [
                r["id"]
                for r in db.execute(
                    f"SELECT id FROM jobs WHERE id IN ({marks}) AND status='queued' "
                    f"ORDER BY seq {self._db.skip_locked}",
                    job_ids,
                )
            ]
            if not claimed:
                return []
            db.execute(
                "UPDATE jobs SET status='in_progress', progress=0, owner=?, "
                f"lease_until={self._db.now} + ?, attempts=attempts + 1 "
                f"WHERE id IN ({_marks(claimed)})",
                (self.replica, self.lease, *claimed),
            )
            rows = db.execute(
                f"SELECT {COLUMNS} FROM jobs WHERE id IN ({_marks(claimed)}) ORDER BY seq", claimed
            ).fetchall()
        jobs = [_job(r) for r in rows]
        self._claims |= {j.id: j.attempts for j in jobs}
        return jobs

    def renew(self) -> int:
        """This server's leases extended by `lease` from now; the claims it holds."""
        held = list(self._claims.items())
        if not held:
            return 0
        with self._db.transaction() as db:
            for job_id, attempt in held:
                db.execute(
                    f"UPDATE jobs SET lease_until={self._db.now} + ? "
                    "WHERE id=? AND attempts=? AND status='in_progress'",
                    (self.lease, job_id, attempt),
                )
        return len(held)

    def expire(self) -> int:
        """Jobs whose lease ran out (their server killed, or its host lost) queued again, or
        failed with the reason once claimed `max_attempts` times. Returns those queued again."""
        with self._db.transaction() as db:
            return self._release(
                db,
                f"status='in_progress' AND lease_until < {self._db.now}",
                "the server running it stopped renewing its lease (killed, or its host lost)",
            )

    def _release(self, db: Executor, where: str, why: str) -> int:
        """The jobs `where` selects queued again, or failed once claimed `max_attempts` times."""
        db.execute(
            "UPDATE jobs SET status='failed', completed_at=?, error_code='lease_expired', "
            f"error_message=? WHERE {where} AND attempts >= ?",
            (time.time(), f"{why}, {self.max_attempts} times: submit the video again",
             self.max_attempts),
        )  # fmt: skip
        cursor = db.execute(
            f"UPDATE jobs SET status='queued', progress=0, lease_until=NULL WHERE {where}"
        )
        return cursor.rowcount

    def progress(self, job_ids: list[str], percent: int) -> None:
        self._held(job_ids, "progress=?", percent)

    def complete(self, job_id: str) -> bool:
        """Called once the job's MP4 is in place (video_path); False if this server no longer
        holds the job (its lease ran out and another claim took it: the video stays the other
        claim's)."""
        done = self._held([job_id], "status='completed', progress=100, completed_at=?", time.time())
        self._claims.pop(job_id, None)
        return done == 1

    def fail(self, job_ids: list[str], code: str, message: str) -> None:
        """The jobs this server holds, or queued ones (their stored group does not read), failed
        with a reason."""
        assignments = "status='failed', completed_at=?, error_code=?, error_message=?"
        values = (time.time(), code, message[:MAX_TEXT_CHARS])  # what a read takes back
        self._held([i for i in job_ids if i in self._claims], assignments, *values)
        queued = [i for i in job_ids if i not in self._claims]
        if queued:
            with self._db.transaction() as db:
                db.execute(
                    f"UPDATE jobs SET {assignments} WHERE id IN ({_marks(queued)}) "
                    "AND status='queued'",
                    (*values, *queued),
                )
        for job_id in job_ids:
            self._claims.pop(job_id, None)

    def fail_unreadable(self, job: Job) -> None:
        """A queued job whose row does not read (`job.damage`) failed with the reason, found by
        its row's key (its id may be what does not read)."""
        with self._db.transaction() as db:
            db.execute(
                "UPDATE jobs SET status='failed', completed_at=?, error_code='unreadable_job', "
                "error_message=? WHERE seq=? AND status='queued'",
                (time.time(), job.unreadable, job.seq),
            )

    def requeue_in_progress(self) -> None:
        """At shutdown: the jobs of this server's unfinished batch wait again for a server."""
        held = list(self._claims)
        if held:
            with self._db.transaction() as db:
                db.execute(
                    "UPDATE jobs SET status='queued', progress=0, lease_until=NULL "
                    f"WHERE id IN ({_marks(held)}) AND owner=? AND status='in_progress'",
                    (*held, self.replica),
                )
        self._claims.clear()

    def content_path(self, job_id: str, variant: str) -> Path:
        """Where a job's `variant` of CONTENT is kept: its MP4, thumbnail (WebP), spritesheet
        (JPEG), or uint8 frames as .npy (a server run with --save-frames)."""
        return self.videos / f"{_checked_id(job_id)}{CONTENT[variant]}"

    def video_path(self, job_id: str) -> Path:
        return self.content_path(job_id, "video")

    def input_path(self, job_id: str) -> Path:
        """Where an image-to-video job's input_reference file is kept."""
        return self.inputs / f"{_checked_id(job_id)}{INPUT}"

    def image_of(self, job: Job) -> Path | None:
        """The job's input_reference file (image to video; its batch reads it), else None."""
        given = job.request is not None and job.request.get("input_reference") is True
        return self.input_path(job.id) if given else None

    def close(self) -> None:
        self._db.close()

    def _held(self, job_ids: list[str], assignments: str, *values: Any) -> int:
        """`assignments` made to those of `job_ids` this server's claim still holds; how many."""
        changed = 0
        held = [(i, self._claims[i]) for i in job_ids if i in self._claims]
        with self._db.transaction() as db:
            for job_id, attempt in held:
                cursor = db.execute(
                    f"UPDATE jobs SET {assignments} WHERE id=? AND attempts=? "
                    "AND status='in_progress'",
                    (*values, job_id, attempt),
                )
                changed += cursor.rowcount
        return changed


def _marks(values: list[Any]) -> str:
    return ", ".join("?" * len(values))


def _unlink_older(path: Path, before: float) -> None:
    """`path` removed if it was last written before `before` (seconds since the epoch)."""
    try:
        if path.stat().st_mtime <= before:
            path.unlink(missing_ok=True)
    except FileNotFoundError:
        pass


def _is_id(value: Any) -> bool:
    return isinstance(value, str) and JOB_ID.fullmatch(value) is not None


def _checked_id(job_id: str) -> str:
    """`job_id`, which a file's name is made of: a JOB_ID, never a path of its own."""
    if not _is_id(job_id):
        raise ValueError(f"{job_id[:80]!r} is not a job id (a file's name is made of it)")
    return job_id


def _is_int(value: Any, low: int, high: int = 2**63 - 1) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _is_time(value: Any) -> bool:
    """Seconds since the epoch, finite (a database may hold text, NaN or Infinity there)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_text(value: Any, limit: int = MAX_TEXT_CHARS) -> bool:
    """A string of at most `limit` characters that UTF-8 can carry (no lone surrogate: a byte
    that is not UTF-8 reads as one, runtime.serve.store_backends)."""
    if not isinstance(value, str) or len(value) > limit:
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _job(row: Any) -> Job:
    """A row (read by COLUMNS) as a Job: each column checked for its type and range; one that
    does not read is named in `damage` (the first) and replaced by a neutral value."""
    damage: list[str] = []

    def read(what: str, valid: bool, value: Any, neutral: Any = None) -> Any:
        if not valid:
            damage.append(what)
        return value if valid else neutral

    seq, job_id, code, message = row["seq"], row["id"], row["error_code"], row["error_message"]
    group, request = _read_group(row["grp"]), _read_request(row["request"])
    no_error = code is None and message is None
    created_at, completed_at = row["created_at"], row["completed_at"]
    return Job(
        # An id that is not one is still shown (and found) when it is short text.
        id=read("id", _is_id(job_id), job_id, job_id if _is_text(job_id, 256) else f"#{seq}"),
        group=read("batch group", group is not None, group),
        request=read("request", request is not None, request),
        status=read("status", row["status"] in STATUSES, row["status"], "failed"),
        progress=read("progress", _is_int(row["progress"], 0, 100), row["progress"], 0),
        created_at=float(read("created_at", _is_time(created_at), created_at, 0.0)),
        completed_at=read(
            "completed_at", completed_at is None or _is_time(completed_at), completed_at
        ),
        error=read(
            "error",
            no_error or (_is_text(code) and _is_text(message)),
            None if no_error else {"code": code, "message": message},
        ),
        attempts=read("attempts", _is_int(row["attempts"], 0), row["attempts"], 0),
        owner=read("owner", row["owner"] is None or _is_text(row["owner"]), row["owner"]),
        seq=seq,
        damage=damage[0] if damage else None,
    )


def _read_request(text: Any) -> dict[str, Any] | None:
    """A stored request; None where the row holds none (edited by hand, damaged): not bounded
    text, not strict JSON (NaN, deep nesting, huge integers), not an object with
    REQUEST_FIELDS of their types (the integers not negative, the text UTF-8)."""
    request = _parse(text, MAX_REQUEST_CHARS)
    if not isinstance(request, dict):
        return None
    for key, kind in REQUEST_FIELDS.items():
        value = request.get(key)
        if type(value) is not kind or (kind is int and value < 0):
            return None
        if kind is str and not _is_text(value, MAX_REQUEST_CHARS):
            return None
    if "model" in request and not _is_text(request["model"]):
        return None
    return request


def _parse(text: Any, limit: int) -> Any:
    """The strict JSON value of a stored text column, or None."""
    if not _is_text(text, limit):
        return None
    try:
        return parse_json(text.encode("utf-8"), ValueError)
    except ValueError:
        return None


def _group_text(group: Group) -> str:
    return json.dumps([group.build, dataclasses.asdict(group.settings)], sort_keys=True)


def _read_group(text: Any) -> Group | None:
    """A stored group (_group_text); None where the row holds none (edited by hand, damaged)."""
    try:
        build, settings = _parse(text, MAX_TEXT_CHARS)
        group = Group(build, Settings(**settings))
        hash(group)  # every setting a JSON scalar
    except (ValueError, TypeError):
        return None
    return group if _is_text(build) else None
