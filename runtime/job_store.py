"""The server's jobs, kept so that none is lost: one SQLite database (the standard library's
sqlite3, WAL mode, every change committed before it is answered) in the output folder, beside
the MP4s and the image-to-video jobs' images, which are written there atomically
(runtime.outputs.staged). A restart finds the completed videos and queues again the ones that
were queued or in progress, with their images. Every SQLite failure comes out as a StoreError,
one line saying what to do: the start refuses, the server retries."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from runtime.batching import Group, Settings
from runtime.outputs import write_files
from wan.errors import InputError

DATABASE = "jobs.sqlite3"
VIDEOS = "videos"
# An image-to-video job's input_reference, the file as it was uploaded (PNG, JPEG or WebP, read
# again by its batch), at INPUTS/<job id>INPUT; its stored request says it has one.
INPUTS, INPUT = "inputs", ".image"
STATUSES = ("queued", "in_progress", "completed", "failed")
# The stored request's fields the server reads back (runtime.openai_dialect.VideoRequest's, the
# seed and frames filled in) and their JSON types; a row without them is refused at the start.
REQUEST_FIELDS = {"prompt": str, "negative_prompt": str, "size": str, "frames": int,
                  "seed": int, "steps": int}  # fmt: skip
# What a completed video keeps in VIDEOS, by the `variant` of its content: the file's suffix.
CONTENT = {"video": ".mp4", "thumbnail": ".webp", "spritesheet": ".jpg", "frames": ".npy"}
LOCK_TIMEOUT_S = 5.0  # an operation's wait for a lock another process holds (--store-timeout)
MAX_PAGE_BYTES = 1 << 20  # of stored requests in one page of the list: 1,000 short ones
# What to do about a SQLite failure, by its primary result code.
_ADVICE = {
    sqlite3.SQLITE_BUSY: "another process holds its lock (a second `runtime serve` on this "
    "--out-dir, a sqlite3 shell?): end it",
    sqlite3.SQLITE_LOCKED: "another connection holds its lock: end it",
    sqlite3.SQLITE_FULL: "the disk is full: free some space",
    sqlite3.SQLITE_READONLY: "it is read-only: make it and its folder writable",
    sqlite3.SQLITE_CANTOPEN: "it or its -wal/-shm file cannot be opened (a folder, no permission, "
    "a read-only disk?): give a writable --out-dir",
    sqlite3.SQLITE_NOTADB: "it is not a SQLite database: move it away (a new one is made, the "
    "videos stay) or give another --out-dir",
    sqlite3.SQLITE_CORRUPT: "it is damaged: move it away (a new one is made, the videos stay) or "
    "give another --out-dir",
    sqlite3.SQLITE_IOERR: "the disk failed to read or write it: check the disk",
}

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    grp TEXT NOT NULL,
    request TEXT NOT NULL,
    status TEXT NOT NULL,
    progress INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    completed_at REAL,
    error_code TEXT,
    error_message TEXT
)
"""


class QueueFull(Exception):
    """The queue holds --max-queue jobs already."""


class StoreError(InputError):
    """The job database cannot be used now (locked, full, damaged, read-only, a row that does
    not read): one line naming it, why and what to do."""


@dataclasses.dataclass(frozen=True)
class Job:
    id: str
    group: Group | None  # None: the stored group does not read (the server fails the job)
    request: dict[str, Any] | None  # None: the stored request does not read (likewise)
    status: str
    progress: int
    created_at: float
    completed_at: float | None
    error: dict[str, str] | None


class JobStore:
    """The jobs of one output folder. Thread-safe: the HTTP handlers and the generation worker
    share one connection under a lock."""

    def __init__(self, out_dir: Path, timeout: float = LOCK_TIMEOUT_S):
        """`timeout`: the seconds an operation waits for a lock another process holds before it
        fails."""
        self.out_dir = out_dir
        self.path = out_dir / DATABASE
        self.videos = out_dir / VIDEOS
        self.inputs = out_dir / INPUTS
        self.videos.mkdir(parents=True, exist_ok=True)
        self.inputs.mkdir(exist_ok=True)
        self._lock = threading.Lock()
        try:
            self._db = sqlite3.connect(self.path, timeout=timeout, check_same_thread=False)
        except sqlite3.Error as e:
            raise StoreError(self._explain(e)) from None
        self._db.row_factory = sqlite3.Row
        with self._transaction() as db:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
            db.execute(_SCHEMA)

    def recover(self) -> int:
        """At the start: the database is checked whole (its pages, every job's request), the jobs
        in progress are queued again (their videos were not written), and staged files a killed
        writer left are removed, with the images of no job (`add` or `delete` killed between
        the file and the row). Returns the jobs queued."""
        for partial in (*self.videos.glob(".*.partial"), *self.inputs.glob(".*.partial")):
            partial.unlink(missing_ok=True)
        ids = set()
        with self._transaction() as db:
            [problem] = db.execute("PRAGMA quick_check(1)").fetchone()
            if problem != "ok":
                raise StoreError(self._explain(problem, sqlite3.SQLITE_CORRUPT))
            for job_id, text in db.execute("SELECT id, request FROM jobs"):
                ids.add(job_id)
                if _read_request(text) is None:
                    raise StoreError(
                        f"job store {self.path}: job {job_id}'s request does not read (a JSON "
                        f"object with {', '.join(REQUEST_FIELDS)}): delete it (sqlite3 "
                        f"{self.path} \"DELETE FROM jobs WHERE id='{job_id}'\") or give another "
                        "--out-dir"
                    )
            db.execute("UPDATE jobs SET status='queued', progress=0 WHERE status='in_progress'")
            (queued,) = db.execute("SELECT COUNT(*) FROM jobs WHERE status='queued'").fetchone()
        for image in self.inputs.glob(f"*{INPUT}"):
            if image.name.removesuffix(INPUT) not in ids:
                image.unlink(missing_ok=True)
        return queued

    def check(self) -> None:
        """That the store takes writes now: its write lock taken and given back."""
        with self._transaction() as db:
            db.execute("BEGIN IMMEDIATE")

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
            with self._transaction() as db:
                (waiting,) = db.execute(
                    "SELECT COUNT(*) FROM jobs WHERE status IN ('queued', 'in_progress')"
                ).fetchone()
                if waiting >= max_queue:
                    raise QueueFull(f"the queue is full ({max_queue} videos): retry later")
                db.execute(
                    "INSERT INTO jobs (id, grp, request, status, created_at) "
                    "VALUES (?, ?, ?, ?, ?)",
                    (job_id, _group_text(group), json.dumps(request), "queued", time.time()),
                )
                return _job(db.execute("SELECT * FROM jobs WHERE id=?", (job_id,)).fetchone())
        except BaseException:
            self.input_path(job_id).unlink(missing_ok=True)
            raise

    def get(self, job_id: str) -> Job | None:
        with self._transaction() as db:
            row = db.execute("SELECT * FROM jobs WHERE id=?", (job_id,)).fetchone()
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
        rows, size = [], 0
        query = (
            "SELECT * FROM jobs WHERE seq > COALESCE((SELECT seq FROM jobs WHERE id=?), 0) "
            "ORDER BY seq"
            if ascending
            else "SELECT * FROM jobs WHERE seq < COALESCE((SELECT seq FROM jobs WHERE id=?), "
            "9223372036854775807) ORDER BY seq DESC"
        )
        with self._transaction() as db:
            cursor = db.execute(query, (after,))
            for row in cursor:
                size += len(row["request"])
                if len(rows) == limit or (rows and size > max_bytes):
                    return [_job(r) for r in rows], True
                rows.append(row)
        return [_job(r) for r in rows], False

    def queued(self) -> list[Job]:
        """The queued jobs, oldest first."""
        with self._transaction() as db:
            rows = db.execute("SELECT * FROM jobs WHERE status='queued' ORDER BY seq").fetchall()
        return [_job(r) for r in rows]

    def counts(self) -> dict[str, int]:
        """Jobs per status."""
        with self._transaction() as db:
            found = dict(db.execute("SELECT status, COUNT(*) FROM jobs GROUP BY status"))
        return {s: found.get(s, 0) for s in STATUSES}

    def delete(self, job_id: str) -> bool:
        """Remove a job that is not in progress (a queued one is cancelled) and then its files;
        False if it is in progress."""
        with self._transaction() as db:
            cursor = db.execute("DELETE FROM jobs WHERE id=? AND status!='in_progress'", (job_id,))
        if cursor.rowcount != 1:
            return False
        for variant in CONTENT:  # after the row: a kill between them leaves files, not a row
            self.content_path(job_id, variant).unlink(missing_ok=True)
        self.input_path(job_id).unlink(missing_ok=True)
        return True

    def start(self, job_ids: list[str]) -> list[Job]:
        """Of `job_ids`, those still queued (not cancelled meanwhile), now in progress."""
        marks = ", ".join("?" * len(job_ids))
        with self._transaction() as db:
            db.execute(
                "UPDATE jobs SET status='in_progress', progress=0 "
                f"WHERE id IN ({marks}) AND status='queued'",
                job_ids,
            )
            rows = db.execute(
                f"SELECT * FROM jobs WHERE id IN ({marks}) AND status='in_progress' ORDER BY seq",
                job_ids,
            ).fetchall()
        return [_job(r) for r in rows]

    def progress(self, job_ids: list[str], percent: int) -> None:
        self._set(job_ids, "progress=?", percent)

    def complete(self, job_id: str) -> None:
        """Called once the job's MP4 is in place (video_path)."""
        self._set([job_id], "status='completed', progress=100, completed_at=?", time.time())

    def fail(self, job_ids: list[str], code: str, message: str) -> None:
        self._set(
            job_ids,
            "status='failed', completed_at=?, error_code=?, error_message=?",
            time.time(),
            code,
            message,
        )

    def requeue_in_progress(self) -> None:
        """At shutdown: the jobs of an unfinished batch wait again for the next start."""
        with self._transaction() as db:
            db.execute("UPDATE jobs SET status='queued', progress=0 WHERE status='in_progress'")

    def content_path(self, job_id: str, variant: str) -> Path:
        """Where a job's `variant` of CONTENT is kept: its MP4, thumbnail (WebP), spritesheet
        (JPEG), or uint8 frames as .npy (a server run with --save-frames)."""
        return self.videos / f"{job_id}{CONTENT[variant]}"

    def video_path(self, job_id: str) -> Path:
        return self.content_path(job_id, "video")

    def input_path(self, job_id: str) -> Path:
        """Where an image-to-video job's input_reference file is kept."""
        return self.inputs / f"{job_id}{INPUT}"

    def image_of(self, job: Job) -> Path | None:
        """The job's input_reference file (image to video; its batch reads it), else None."""
        given = job.request is not None and job.request.get("input_reference") is True
        return self.input_path(job.id) if given else None

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """The connection under the lock, in one transaction; a SQLite failure a StoreError."""
        with self._lock:
            try:
                with self._db:
                    yield self._db
            except sqlite3.Error as e:
                raise StoreError(self._explain(e)) from None

    def _explain(self, e: sqlite3.Error | str, code: int | None = None) -> str:
        if isinstance(e, sqlite3.Error):
            code = getattr(e, "sqlite_errorcode", None)
        advice = _ADVICE.get((code or 0) & 0xFF, "move it away or give another --out-dir")
        return f"job store {self.path}: {' '.join(str(e).split())}: {advice}"  # one line

    def _set(self, job_ids: list[str], assignments: str, *values: Any) -> None:
        marks = ", ".join("?" * len(job_ids))
        with self._transaction() as db:
            db.execute(f"UPDATE jobs SET {assignments} WHERE id IN ({marks})", (*values, *job_ids))


def _job(row: sqlite3.Row) -> Job:
    error = None
    if row["error_code"] is not None:
        error = {"code": row["error_code"], "message": row["error_message"]}
    return Job(
        id=row["id"],
        group=_read_group(row["grp"]),
        request=_read_request(row["request"]),
        status=row["status"],
        progress=row["progress"],
        created_at=row["created_at"],
        completed_at=row["completed_at"],
        error=error,
    )


def _read_request(text: str) -> dict[str, Any] | None:
    """A stored request; None where the row holds none (edited by hand, damaged)."""
    try:
        request = json.loads(text)
    except (ValueError, TypeError, RecursionError):
        return None
    if not isinstance(request, dict) or any(
        type(request.get(k)) is not kind for k, kind in REQUEST_FIELDS.items()
    ):
        return None
    return request


def _group_text(group: Group) -> str:
    return json.dumps([group.build, dataclasses.asdict(group.settings)], sort_keys=True)


def _read_group(text: str) -> Group | None:
    """A stored group (_group_text); None where the row holds none (edited by hand, damaged)."""
    try:
        build, settings = json.loads(text)
        group = Group(build, Settings(**settings))
        hash(group)  # every setting a JSON scalar
    except (ValueError, TypeError, RecursionError):
        return None
    return group if isinstance(build, str) else None
