"""The server's jobs, kept so that none is lost: one SQLite database (the standard library's
sqlite3, WAL mode, every change committed before it is answered) in the output folder, beside
the MP4s, which are written there atomically (runtime.outputs.staged). A restart finds the
completed videos and queues again the ones that were queued or in progress."""

from __future__ import annotations

import dataclasses
import json
import secrets
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

from runtime.batching import Group, Settings

DATABASE = "jobs.sqlite3"
VIDEOS = "videos"
STATUSES = ("queued", "in_progress", "completed", "failed")

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


@dataclasses.dataclass(frozen=True)
class Job:
    id: str
    group: Group | None  # None: the stored group does not read (the server fails the job)
    request: dict[str, Any]
    status: str
    progress: int
    created_at: float
    completed_at: float | None
    error: dict[str, str] | None


class JobStore:
    """The jobs of one output folder. Thread-safe: the HTTP handlers and the generation worker
    share one connection under a lock."""

    def __init__(self, out_dir: Path):
        self.out_dir = out_dir
        self.videos = out_dir / VIDEOS
        self.videos.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(out_dir / DATABASE, check_same_thread=False)
        self._db.row_factory = sqlite3.Row
        with self._lock, self._db:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute(_SCHEMA)

    def recover(self) -> int:
        """After a restart: the jobs in progress are queued again (their videos were not
        written), and staged files a killed writer left are removed. Returns the jobs queued."""
        for partial in self.videos.glob(".*.partial"):
            partial.unlink(missing_ok=True)
        with self._lock, self._db:
            self._db.execute(
                "UPDATE jobs SET status='queued', progress=0 WHERE status='in_progress'"
            )
            (queued,) = self._db.execute(
                "SELECT COUNT(*) FROM jobs WHERE status='queued'"
            ).fetchone()
        return queued

    def add(self, group: Group, request: dict[str, Any], max_queue: int) -> Job:
        """A new queued job, unless `max_queue` jobs wait or run already (QueueFull)."""
        job_id = f"video_{secrets.token_hex(12)}"
        with self._lock, self._db:
            if self._waiting() >= max_queue:
                raise QueueFull(f"the queue is full ({max_queue} videos): retry later")
            self._db.execute(
                "INSERT INTO jobs (id, grp, request, status, created_at) VALUES (?, ?, ?, ?, ?)",
                (job_id, _group_text(group), json.dumps(request), "queued", time.time()),
            )
        return self.get(job_id)

    def get(self, job_id: str) -> Job | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM jobs WHERE id=?", (job_id,)).fetchone()
        return None if row is None else _job(row)

    def jobs(self, limit: int = 100, after: str | None = None) -> list[Job]:
        """The newest jobs first, from the one after `after` (an id) when given."""
        with self._lock:
            rows = self._db.execute(
                "SELECT * FROM jobs WHERE seq < COALESCE((SELECT seq FROM jobs WHERE id=?), "
                "9223372036854775807) ORDER BY seq DESC LIMIT ?",
                (after, limit),
            ).fetchall()
        return [_job(r) for r in rows]

    def queued(self) -> list[Job]:
        """The queued jobs, oldest first."""
        with self._lock:
            rows = self._db.execute("SELECT * FROM jobs WHERE status='queued' ORDER BY seq")
            return [_job(r) for r in rows.fetchall()]

    def counts(self) -> dict[str, int]:
        """Jobs per status."""
        with self._lock:
            rows = self._db.execute("SELECT status, COUNT(*) FROM jobs GROUP BY status")
            found = dict(rows.fetchall())
        return {s: found.get(s, 0) for s in STATUSES}

    def delete_queued(self, job_id: str) -> bool:
        """Remove a job that has not started; False if it is not queued."""
        with self._lock, self._db:
            cursor = self._db.execute("DELETE FROM jobs WHERE id=? AND status='queued'", (job_id,))
        return cursor.rowcount == 1

    def start(self, job_ids: list[str]) -> None:
        self._set(job_ids, "status='in_progress', progress=0")

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
        with self._lock, self._db:
            self._db.execute(
                "UPDATE jobs SET status='queued', progress=0 WHERE status='in_progress'"
            )

    def video_path(self, job_id: str) -> Path:
        return self.videos / f"{job_id}.mp4"

    def frames_path(self, job_id: str) -> Path:
        """The video's uint8 frames as .npy (a server run with --save-frames)."""
        return self.videos / f"{job_id}.npy"

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _waiting(self) -> int:
        (count,) = self._db.execute(
            "SELECT COUNT(*) FROM jobs WHERE status IN ('queued', 'in_progress')"
        ).fetchone()
        return count

    def _set(self, job_ids: list[str], assignments: str, *values: Any) -> None:
        marks = ", ".join("?" * len(job_ids))
        with self._lock, self._db:
            self._db.execute(
                f"UPDATE jobs SET {assignments} WHERE id IN ({marks})", (*values, *job_ids)
            )


def _job(row: sqlite3.Row) -> Job:
    error = None
    if row["error_code"] is not None:
        error = {"code": row["error_code"], "message": row["error_message"]}
    return Job(
        id=row["id"],
        group=_read_group(row["grp"]),
        request=json.loads(row["request"]),
        status=row["status"],
        progress=row["progress"],
        created_at=row["created_at"],
        completed_at=row["completed_at"],
        error=error,
    )


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
