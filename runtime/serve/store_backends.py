"""The two databases a job store can live in, behind one small interface: SQLite in the output
folder (the default, one server) and PostgreSQL (`--job-store postgresql://...`, a fleet of
servers sharing one queue). A backend opens its connection, runs one transaction at a time, says
what a failure means in one line, and spells the few SQL pieces the two write differently;
runtime.serve.job_store writes the queries once, with `?` placeholders."""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
import re
import shlex
import socket
import sqlite3
import threading
import time
import urllib.parse
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any, Protocol

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
    """SQLite in WAL mode, every change committed before it is answered: one file one server
    owns. The server holds a lock beside it (`server_lock`: a second server on the folder is
    refused), and every transaction first checks that the file at the path is still the one it
    opened (moved, deleted or replaced while serving: a store fault, not a fresh start)."""

    shared = False
    now = "((julianday('now') - 2440587.5) * 86400.0)"
    serial = "INTEGER PRIMARY KEY AUTOINCREMENT"
    real = "REAL"
    skip_locked = ""  # one writer at a time: the whole database is the lock

    def __init__(self, path: Path, timeout: float):
        self.path, self.where = path, str(path)
        self._lock = threading.Lock()
        self._owner = server_lock(path)  # before the file is touched: a running server's own
        try:
            self._db = sqlite3.connect(path, timeout=timeout, check_same_thread=False)
        except sqlite3.Error as e:
            self._owner.close()
            raise StoreError(self._explain(e)) from None
        self._db.row_factory = sqlite3.Row
        # Bytes that are not UTF-8 in a row read as lone surrogates, which the row's checks
        # refuse (runtime.serve.job_store): that job fails, not every query that reads the row.
        self._db.text_factory = _surrogates
        self._identity: tuple[int, int] | None = None  # the file's, once it exists
        try:
            with self.transaction() as db:
                db.execute("PRAGMA journal_mode=WAL")
                db.execute("PRAGMA synchronous=FULL")
            self._identity = _identity(path)
        except (StoreError, OSError):
            self.close()
            raise

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Executor]:
        """The connection under the lock, in one transaction; a SQLite failure a StoreError."""
        with self._lock:
            self._check_identity()
            try:
                with self._db:
                    yield self._db
            except sqlite3.Error as e:
                raise StoreError(self._explain(e)) from None

    def _check_identity(self) -> None:
        """The file at the path is the one opened: SQLite keeps writing to a moved or deleted
        file (and a file put in its place is not this server's), so the jobs would vanish at
        the next start while their videos stay."""
        if self._identity is None:
            return
        try:
            found = _identity(self.path)
        except OSError:
            found = None
        if found != self._identity:
            raise StoreError(
                f"job store {self.where} was moved, deleted or replaced while the server ran: "
                "put the server's file back at that path (the jobs are in it), or restart the "
                "server to use the file now there"
            )

    def serialize(self, db: Executor) -> None:
        db.execute("BEGIN IMMEDIATE")

    def integrity_problem(self, db: Executor) -> str | None:
        [problem] = db.execute("PRAGMA quick_check(1)").fetchone()
        if problem == "ok":
            return None
        return self._explain(problem, sqlite3.SQLITE_CORRUPT)

    def shell(self, sql: str) -> str:
        return f"sqlite3 {shlex.quote(str(self.path))} {shlex.quote(sql)}"

    def close(self) -> None:
        with self._lock:
            self._db.close()
            self._owner.close()  # the folder free for the next server

    def _explain(self, e: sqlite3.Error | str, code: int | None = None) -> str:
        if isinstance(e, sqlite3.Error):
            code = getattr(e, "sqlite_errorcode", None)
        advice = _SQLITE_ADVICE.get((code or 0) & 0xFF, "move it away or give another --out-dir")
        return f"job store {self.where}: {' '.join(str(e).split())}: {advice}"  # one line


def _surrogates(data: bytes) -> str:
    return data.decode("utf-8", "surrogateescape")


def _identity(path: Path) -> tuple[int, int]:
    stat = os.stat(path)
    return stat.st_dev, stat.st_ino


def server_lock(database: Path) -> IO[bytes]:
    """The lock one server holds on a SQLite store while it runs (an flock on DATABASE.lock
    beside it, freed by the kernel when the server's process ends, however it ends; NFS
    carries it to other hosts), recording who holds it; a second server is refused in one line
    naming the first. Open: the lock held until it is closed."""
    path = database.with_name(f"{database.name}.lock")
    try:
        # Unbuffered: nothing left to write at close (a full disk fails the line, not the close).
        held = open(path, "a+b", buffering=0)  # noqa: SIM115 (held for the server's lifetime)
    except OSError as e:
        raise StoreError(
            f"job store {database}: its lock file {path} cannot be opened ({e.strerror}): give a "
            "writable --out-dir"
        ) from None
    try:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        held.seek(0)
        text = held.read(200).decode(errors="replace")  # a file anyone could have written
        holder = " ".join("".join(c if c.isprintable() else " " for c in text).split())
        holder = holder or "its pid unknown"
        held.close()
        raise StoreError(
            f"job store {database} is in use by another runtime serve ({holder}): stop it, or "
            "give this one another --out-dir (servers share one queue through --job-store "
            "postgresql://...)"
        ) from None
    with contextlib.suppress(OSError):  # who holds it: for the refusal above, not the lock
        held.truncate(0)
        held.write(f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
    return held


class Postgres:
    """PostgreSQL through psycopg 3, one connection under a lock (the server's few statements a
    second do not need a pool). A lost connection fails the statement (StoreError, which the
    worker retries with backoff) and the next one connects again. Every transaction ends within
    `timeout` seconds, its wait for the lock included: the server bounds each statement
    (statement_timeout, lock_timeout) and, for a server that answers nothing (stopped, its host
    hung), the connection is cut at the deadline (`_Cutoff`). Connecting again waits what is
    left of it, at least 2 s (libpq's least connect_timeout). While the server answers nothing,
    a transaction that finds another one running fails at once."""

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
                redact(
                    f"--job-store {redact(url, url)!r} is not a PostgreSQL URL "
                    f"({' '.join(str(e).split())}): give "
                    "postgresql://USER[:PASSWORD]@HOST[:PORT]/DATABASE",
                    url,
                )
            ) from None
        self.where = "postgresql://{}@{}:{}/{}".format(  # no password in messages
            parts.get("user", ""), parts.get("host", "localhost"), parts.get("port", 5432),
            parts.get("dbname", ""),
        )  # fmt: skip
        self._lock = threading.Lock()
        self._db: Any = None
        self._unanswered = False  # the last transaction got no answer in time
        with self.transaction():  # a store the start cannot reach fails the start
            pass

    def _connection(self, seconds: float) -> Any:
        """The connection, connected again if it was lost, within `seconds` (at least 2)."""
        if self._db is None or self._db.closed or self._db.broken:
            psycopg = self._psycopg
            ms = max(1, int(self.timeout * 1000))
            self._db = psycopg.connect(
                self.url,
                autocommit=True,  # transactions are explicit: transaction()
                row_factory=psycopg.rows.dict_row,
                connect_timeout=max(2, math.ceil(seconds)),
                # A server that vanishes without closing the socket is noticed in seconds.
                keepalives=1, keepalives_idle=5, keepalives_interval=2, keepalives_count=3,
                options=f"-c lock_timeout={ms} -c statement_timeout={ms}",
            )  # fmt: skip
        return self._db

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Executor]:
        psycopg = self._psycopg
        deadline = time.monotonic() + self.timeout
        # The holder is cut at its deadline; while the server answers nothing, a transaction
        # waits for no other's (each would add its own timeout): one at a time finds out.
        if not self._lock.acquire(timeout=0 if self._unanswered else self.timeout):
            raise StoreError(self._no_answer())
        cutoff = None
        try:
            db = self._connection(deadline - time.monotonic())
            cutoff = _Cutoff(db, deadline - time.monotonic())
            with db.transaction():
                yield _Percent(db)
            self._unanswered = False
        except psycopg.Error as e:
            if self._db is not None and self._db.broken:
                self._db.close()
            hung = (cutoff and cutoff.fired) or isinstance(e, psycopg.errors.ConnectionTimeout)
            self._unanswered = bool(hung)
            raise StoreError(self._no_answer() if hung else self._explain(e)) from None
        finally:
            if cutoff is not None and cutoff.stop():  # cut after the end: useless now
                self._db.close()
            self._lock.release()

    def serialize(self, db: Executor) -> None:
        # One lock number for the whole store, held to the transaction's end.
        db.execute("SELECT pg_advisory_xact_lock(?)", (0x57414E,))

    def integrity_problem(self, db: Executor) -> str | None:
        return None  # the server checks its own pages (data checksums) and keeps them

    def shell(self, sql: str) -> str:
        return f"psql {shlex.quote(self.where)} -c {shlex.quote(sql)}"

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()

    def _no_answer(self) -> str:
        return (
            f"job store {self.where}: no answer within {self.timeout:g} s (--store-timeout): "
            "check that PostgreSQL runs and answers (a stopped or hung server, a lost network?)"
        )

    def _explain(self, e: Exception) -> str:
        state = getattr(e, "sqlstate", None) or _connect_state(str(e))
        advice = _POSTGRES_ADVICE.get(state[:2], "see the server's log")
        message = f"job store {self.where}: {' '.join(str(e).split())}: {advice}"  # one line
        return redact(message, self.url)


class _Cutoff:
    """A transaction's deadline on a psycopg connection: past it the connection's socket is
    shut down, which ends whatever libpq waits for (a server that answers nothing: stopped,
    its host hung) with an error, and the connection is broken."""

    def __init__(self, db: Any, seconds: float):
        self._db, self.fired, self._done = db, False, False
        self._guard = threading.Lock()
        self._timer = threading.Timer(max(0.0, seconds), self._cut)
        self._timer.daemon = True
        self._timer.start()

    def _cut(self) -> None:
        with self._guard:
            if self._done:
                return
            self.fired = True
            # A connection closed meanwhile has nothing to cut.
            with (
                contextlib.suppress(Exception),
                socket.socket(fileno=os.dup(self._db.pgconn.socket)) as s,
            ):
                s.shutdown(socket.SHUT_RDWR)

    def stop(self) -> bool:
        """No cut from now on; whether the connection was cut."""
        with self._guard:
            self._done = True
        self._timer.cancel()
        return self.fired


def redact(text: str, url: str) -> str:
    """`text` without the password `url` holds (in its user info or a password= parameter,
    as written and percent-decoded): a message may quote the URL, or a parser's view of it."""
    rest = url.partition("://")[2]
    # The user info ends at an `@`: the last one or, as libpq may read it, the first.
    userinfos = (rest.rpartition("@")[0], rest.partition("@")[0] if "@" in rest else "")
    secrets = [u.partition(":")[2] for u in userinfos]
    secrets += re.findall(r"[?&]password=([^&]*)", url)
    for secret in sorted({*secrets, *map(urllib.parse.unquote, secrets)}, key=len, reverse=True):
        if secret:
            text = text.replace(secret, "***")
    return text


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
            f"--job-store {redact(url, url)!r}: give "
            "postgresql://USER[:PASSWORD]@HOST[:PORT]/DATABASE (or leave it out: SQLite in "
            "--out-dir)"
        )
    return Postgres(url, timeout)
