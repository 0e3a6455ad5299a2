"""The two databases a job store can live in, behind one small interface: SQLite in the output
folder (the default, one server) and PostgreSQL (`--job-store postgresql://...`, a fleet of
servers sharing one queue). A backend opens its connection, runs one transaction at a time, says
what a failure means in one line, and spells the few SQL pieces the two write differently;
runtime.job_store writes the queries once, with `?` placeholders."""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

from wan.errors import InputError

# What to do about a SQLite failure, by its primary result code.
_SQLITE_ADVICE = {
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
# PostgreSQL's SQLSTATE classes (the code's first two characters): what to do.
_POSTGRES_ADVICE = {
    "08": "the connection failed or was lost: check that PostgreSQL runs and is reachable",
    "28": "the server refused these credentials: check the user and password in the URL",
    "3D": "the database does not exist: create it (createdb) or name another in the URL",
    "42": "the server refused a statement (the user's privileges, a schema changed by hand?): "
    "give the user the right to create and write tables in this database",
    "53": "the server is out of a resource (disk, memory, connections): free some",
    "55": "another transaction holds a lock (lock_timeout: --store-timeout): retry",
    "57": "the server is shutting down or cancelled the statement: wait until it is back",
}


class StoreError(InputError):
    """The job database cannot be used now (locked, full, damaged, read-only, unreachable, a
    row that does not read): one line naming it, why and what to do."""


class Executor(Protocol):
    """One transaction's statements; rows read by column name."""

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Any: ...


class Backend(Protocol):
    """Where a job store lives."""

    where: str  # the database, as a message names it (no password)
    path: Path | None  # the database's file, when it is one (SQLite)
    shared: bool  # several servers use it at once (claims and leases matter)
    now: str  # SQL for the database's clock in seconds since the epoch (every replica's one clock)
    serial: str  # the jobs table's `seq` column type: increasing ids
    real: str  # a double-precision column type
    skip_locked: str  # after a claim's SELECT: rows another transaction claims are passed over

    def transaction(self) -> contextlib.AbstractContextManager[Executor]: ...

    def serialize(self, db: Executor) -> None:
        """The store's write lock for the rest of the transaction `db`: another server's
        transaction that takes it waits (the schema's migration, the queue's bound)."""

    def integrity_problem(self, db: Executor) -> str | None: ...

    def shell(self, sql: str) -> str:
        """The command line that runs `sql` on the store by hand (a fix a message advises)."""

    def close(self) -> None: ...


class Sqlite:
    """SQLite in WAL mode, every change committed before it is answered: one file the server
    owns (a second server on the folder waits for its lock, --store-timeout)."""

    shared = False
    now = "((julianday('now') - 2440587.5) * 86400.0)"
    serial = "INTEGER PRIMARY KEY AUTOINCREMENT"
    real = "REAL"
    skip_locked = ""  # one writer at a time: the whole database is the lock

    def __init__(self, path: Path, timeout: float):
        self.path, self.where = path, str(path)
        self._lock = threading.Lock()
        try:
            self._db = sqlite3.connect(path, timeout=timeout, check_same_thread=False)
        except sqlite3.Error as e:
            raise StoreError(self._explain(e)) from None
        self._db.row_factory = sqlite3.Row
        with self.transaction() as db:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Executor]:
        """The connection under the lock, in one transaction; a SQLite failure a StoreError."""
        with self._lock:
            try:
                with self._db:
                    yield self._db
            except sqlite3.Error as e:
                raise StoreError(self._explain(e)) from None

    def serialize(self, db: Executor) -> None:
        db.execute("BEGIN IMMEDIATE")

    def integrity_problem(self, db: Executor) -> str | None:
        [problem] = db.execute("PRAGMA quick_check(1)").fetchone()
        if problem == "ok":
            return None
        return self._explain(problem, sqlite3.SQLITE_CORRUPT)

    def shell(self, sql: str) -> str:
        return f'sqlite3 {self.path} "{sql}"'

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _explain(self, e: sqlite3.Error | str, code: int | None = None) -> str:
        if isinstance(e, sqlite3.Error):
            code = getattr(e, "sqlite_errorcode", None)
        advice = _SQLITE_ADVICE.get((code or 0) & 0xFF, "move it away or give another --out-dir")
        return f"job store {self.where}: {' '.join(str(e).split())}: {advice}"  # one line


class Postgres:
    """PostgreSQL through psycopg 3, one connection under a lock (the server's few statements a
    second do not need a pool). A lost connection fails the statement (StoreError, which the
    worker retries with backoff) and the next one connects again."""

    shared = True
    path = None
    now = "EXTRACT(EPOCH FROM clock_timestamp())::double precision"
    serial = "BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY"
    real = "DOUBLE PRECISION"
    skip_locked = "FOR UPDATE SKIP LOCKED"

    def __init__(self, url: str, timeout: float):
        import psycopg  # only a fleet's servers need the driver loaded

        self._psycopg = psycopg
        self.url, self.timeout = url, timeout
        try:
            parts = psycopg.conninfo.conninfo_to_dict(url)
        except psycopg.ProgrammingError as e:
            raise StoreError(
                f"--job-store {url!r} is not a PostgreSQL URL ({' '.join(str(e).split())}): "
                "give postgresql://USER[:PASSWORD]@HOST[:PORT]/DATABASE"
            ) from None
        self.where = "postgresql://{}@{}:{}/{}".format(  # no password in messages
            parts.get("user", ""), parts.get("host", "localhost"), parts.get("port", 5432),
            parts.get("dbname", ""),
        )  # fmt: skip
        self._lock = threading.Lock()
        self._db: Any = None
        with self.transaction():  # a store the start cannot reach fails the start
            pass

    def _connection(self) -> Any:
        if self._db is None or self._db.closed or self._db.broken:
            psycopg = self._psycopg
            lock_ms = max(1, int(self.timeout * 1000))
            self._db = psycopg.connect(
                self.url,
                autocommit=True,  # transactions are explicit: transaction()
                row_factory=psycopg.rows.dict_row,
                connect_timeout=max(1, round(self.timeout)),
                # A server that vanishes without closing the socket is noticed in seconds.
                keepalives=1, keepalives_idle=5, keepalives_interval=2, keepalives_count=3,
                options=f"-c lock_timeout={lock_ms}",
            )  # fmt: skip
        return self._db

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Executor]:
        psycopg = self._psycopg
        with self._lock:
            try:
                db = self._connection()
                with db.transaction():
                    yield _Percent(db)
            except psycopg.Error as e:
                if self._db is not None and self._db.broken:
                    self._db.close()
                raise StoreError(self._explain(e)) from None

    def serialize(self, db: Executor) -> None:
        # One lock number for the whole store, held to the transaction's end.
        db.execute("SELECT pg_advisory_xact_lock(?)", (0x57414E,))

    def integrity_problem(self, db: Executor) -> str | None:
        return None  # the server checks its own pages (data checksums) and keeps them

    def shell(self, sql: str) -> str:
        return f'psql {self.where} -c "{sql}"'

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()

    def _explain(self, e: Exception) -> str:
        state = getattr(e, "sqlstate", None) or _connect_state(str(e))
        advice = _POSTGRES_ADVICE.get(state[:2], "see the server's log")
        return f"job store {self.where}: {' '.join(str(e).split())}: {advice}"  # one line


def _connect_state(message: str) -> str:
    """A failed connection has no SQLSTATE of its own: the class its FATAL line names."""
    if "does not exist" in message and "database" in message:
        return "3D"
    if "authentication failed" in message or "pg_hba.conf" in message:
        return "28"
    return "08"


class _Percent:
    """psycopg's executor for SQL written with SQLite's `?` placeholders (the queries hold no
    `?` or `%` of their own)."""

    def __init__(self, db: Any):
        self._db = db

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Any:
        return self._db.execute(sql.replace("?", "%s"), tuple(params))


def open_backend(url: str | None, out_dir: Path, database: str, timeout: float) -> Backend:
    """`url` (postgresql://...), else SQLite's `database` file in `out_dir`."""
    if url is None:
        return Sqlite(out_dir / database, timeout)
    if not url.startswith(("postgresql://", "postgres://")):
        raise StoreError(
            f"--job-store {url!r}: give postgresql://USER[:PASSWORD]@HOST[:PORT]/DATABASE (or "
            "leave it out: SQLite in --out-dir)"
        )
    return Postgres(url, timeout)
