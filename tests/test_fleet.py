"""A fleet: 3 `runtime serve` replicas (separate processes, cpu builds of the tiny model) on one
real PostgreSQL job store (tests/postgres_server.py) and one shared --out-dir. Every job runs
once and is seen by every replica; a replica killed with SIGKILL mid-batch loses nothing (its
jobs run again elsewhere once its lease ends, counted as a second attempt); PostgreSQL stopped
and started again mid-run: the replicas reconnect and go on."""

from __future__ import annotations

import concurrent.futures
import time

import psycopg
import pytest
from postgres_server import postgres_server
from test_server import Server, decode, request

from runtime.generation.batching import Group, Settings
from runtime.serve.job_store import MIGRATIONS, JobStore, StoreError

LEASE_S = 4  # short, so that a killed replica's jobs come back within the test


@pytest.fixture(scope="module")
def postgres():
    with postgres_server() as server:
        yield server


def replicas(builds, weights, shared, url, names, *extra) -> list[Server]:
    """`names` started together (their loads overlap), each on the store `url` and `shared`."""

    def start(name: str) -> Server:
        return Server(builds, weights, shared, "--job-store", url, "--replica", name, "--lease",
                      str(LEASE_S), "--batch-window", "0.3", *extra)  # fmt: skip

    with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
        return list(pool.map(start, names))


def rows(url: str) -> dict[str, dict]:
    with psycopg.connect(url, row_factory=psycopg.rows.dict_row) as db:
        return {r["id"]: r for r in db.execute("SELECT id, status, owner, attempts FROM jobs")}


def wait_until(condition, timeout: float = 120, every: float = 0.05):
    deadline = time.monotonic() + timeout
    while not (found := condition()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(every)
    return found


def test_a_fleet_runs_each_job_once_through_a_killed_replica_and_a_store_restart(
    small_builds, tiny_weights, tmp_path, postgres
):
    url = postgres.new_database("fleet")
    shared = tmp_path / "shared"
    fleet = replicas(small_builds, tiny_weights, shared, url, ["r0", "r1", "r2"])
    try:
        created = {}  # job id -> the replica it was created on
        for i in range(30):
            answer = fleet[i % 3].post(request(i, steps=4))
            assert answer.status_code == 202, answer.text
            created[answer.json()["id"]] = i % 3
        # r0 killed while it holds a batch: its jobs are in progress under its name.
        wait_until(lambda: any(r["owner"] == "r0" and r["status"] == "in_progress"
                               for r in rows(url).values()))  # fmt: skip
        fleet[0].stop()  # SIGKILL
        # What r0 held as it died (read after the kill: nothing of r0's changes any more).
        held = {
            i for i, r in rows(url).items() if r["owner"] == "r0" and r["status"] == "in_progress"
        }
        assert held
        # PostgreSQL stopped and started again while the others run.
        wait_until(lambda: any(r["status"] == "in_progress" and r["owner"] != "r0"
                               for r in rows(url).values()))  # fmt: skip
        postgres.stop()
        time.sleep(1)
        postgres.start()
        living = {0: fleet[1], 1: fleet[2], 2: fleet[1]}  # a replica the job was not created on
        for job_id, origin in created.items():
            [video] = living[origin].wait([job_id], timeout=300)
            assert video["progress"] == 100
        final = rows(url)
        assert {r["status"] for r in final.values()} == {"completed"}
        for job_id, row in final.items():
            # Run once each, but those r0 held when it was killed: again, on another replica.
            assert row["attempts"] == (2 if job_id in held else 1), (job_id, row)
            assert row["owner"] != "r0" or job_id not in held
        for server in fleet[1:]:
            metrics = server.metrics()
            assert metrics["wan_queue_depth"] == 0 and metrics["wan_compile_count"] == 0
            assert metrics["wan_claims_lost_total"] == 0
        assert sum(s.metrics()["wan_leases_expired_total"] for s in fleet[1:]) == len(held)
        assert 'wan_replica_info{replica="r2"' in fleet[2].client.get("/metrics").text
        # The content through the replica the job was not created on (its MP4 in the shared
        # folder), the same bytes through either.
        for job_id, origin in list(created.items())[::7]:
            first = living[origin].client.get(f"/v1/videos/{job_id}/content")
            assert first.status_code == 200
            (tmp_path / "v.mp4").write_bytes(first.content)
            assert decode(tmp_path / "v.mp4").shape == (5, 96, 64, 3)
            other = fleet[1 if living[origin] is fleet[2] else 2]
            assert other.client.get(f"/v1/videos/{job_id}/content").content == first.content
        # A completed video whose file this replica cannot see: 404 with the reason.
        gone = next(iter(created))
        (shared / "videos" / f"{gone}.mp4").unlink()
        missing = fleet[1].client.get(f"/v1/videos/{gone}/content")
        assert missing.status_code == 404, missing.text
        assert missing.json()["error"]["code"] == "content_missing"
        assert "same --out-dir" in missing.json()["error"]["message"]
        for server in fleet[1:]:
            assert "Traceback" not in server.log.read_text()
    finally:
        for server in fleet:
            server.stop()


def test_the_store_refuses_a_schema_it_does_not_know(postgres, tmp_path):
    """A store migrated by a newer server: refused in one line; a store of this version opens,
    twice (the second start migrates nothing)."""
    url = postgres.new_database("schema")
    JobStore(tmp_path, url=url).close()
    store = JobStore(tmp_path, url=url)
    store.add(Group("g", Settings(steps=2)), {"prompt": "p", "negative_prompt": "", "seed": 1,
              "size": "64x96", "frames": 5, "steps": 2}, 8)  # fmt: skip
    store.close()
    with psycopg.connect(url, autocommit=True) as db:
        versions = [v for (v,) in db.execute("SELECT version FROM schema_migrations ORDER BY 1")]
        assert versions == list(range(1, len(MIGRATIONS) + 1))
        db.execute("INSERT INTO schema_migrations VALUES (%s, 0)", (len(MIGRATIONS) + 1,))
    with pytest.raises(StoreError, match=f"schema version {len(MIGRATIONS) + 1}; this server"):
        JobStore(tmp_path, url=url)


@pytest.mark.parametrize(
    "url, says",
    [("postgresql://postgres:s3cret@127.0.0.1:1/none", "check that PostgreSQL runs"),
     ("mysql://x@y/z", "give postgresql://"),
     ("postgresql://postgres@127.0.0.1:{port}/nosuchdb", "create it")],
)  # fmt: skip
def test_a_store_the_start_cannot_reach_is_one_line(postgres, tmp_path, url, says):
    with pytest.raises(StoreError, match=says) as refused:
        JobStore(tmp_path, timeout=2, url=url.format(port=postgres.port))
    assert "\n" not in str(refused.value) and "s3cret" not in str(refused.value)


def test_a_claim_that_lost_its_lease_writes_nothing(postgres, tmp_path):
    """Replica a's lease runs out while it works: the job goes back to the queue, b claims it
    (a second attempt); a's progress and completion then change nothing, b's do; a third claim
    past --max-attempts fails the job with the reason."""
    url = postgres.new_database("leases")
    a, b = (JobStore(tmp_path, url=url, replica=name, lease=0.2, max_attempts=2)
            for name in ("a", "b"))  # fmt: skip
    job = a.add(Group("g", Settings(steps=2)), {"prompt": "p", "negative_prompt": "", "seed": 1,
                "size": "64x96", "frames": 5, "steps": 2}, 8)  # fmt: skip
    [claimed] = a.start([job.id])
    assert (claimed.owner, claimed.attempts) == ("a", 1)
    assert b.start([job.id]) == []  # held: not b's to claim
    time.sleep(0.4)
    assert b.expire() == 1  # a stopped renewing: back in the queue
    [again] = b.start([job.id])
    assert (again.owner, again.attempts) == ("b", 2)
    a.progress([job.id], 50)
    assert a.complete(job.id) is False
    assert b.get(job.id).progress == 0 and b.get(job.id).status == "in_progress"
    b.progress([job.id], 50)
    assert b.get(job.id).progress == 50
    time.sleep(0.4)
    assert a.expire() == 0  # b's lease ran out too, at its last attempt: failed, not queued
    failed = a.get(job.id)
    assert failed.status == "failed" and failed.error["code"] == "lease_expired"
    assert "2 times" in failed.error["message"]
    assert b.complete(job.id) is False
    for store in (a, b):
        store.close()


def test_a_hung_store_is_503_within_the_timeout(postgres, tmp_path):
    """PostgreSQL stopped with SIGSTOP (it accepts connections and answers nothing) under a
    server with --store-timeout 2: /healthz turns 503 and every call answers 503 within the
    timeout (measured: 2.0 s for a read, at once for POST and /healthz); resumed, the server
    takes and runs videos again."""
    from test_server_faults import app_serving, until

    store = JobStore(tmp_path / "out", timeout=2, url=postgres.new_database("hung"))
    with app_serving(store) as (client, service):
        first = client.post("/v1/videos", json=request(0)).json()["id"]
        until(lambda: client.get(f"/v1/videos/{first}").json()["status"] == "completed", "first")
        postgres.pause()
        try:
            started = time.monotonic()
            until(lambda: client.get("/healthz", timeout=8).status_code == 503, "healthz 200")
            assert time.monotonic() - started < 5
            for method, path in [("GET", "/v1/videos"), ("GET", f"/v1/videos/{first}"),
                                 ("POST", "/v1/videos"), ("GET", "/healthz")]:  # fmt: skip
                started = time.monotonic()
                answer = client.request(method, path, json=request(1), timeout=8)
                took = time.monotonic() - started
                assert answer.status_code == 503 and took < 3, (method, path, took, answer.text)
                assert answer.json()["error"]["code"] == "store_unavailable"
            assert "no answer within 2 s (--store-timeout)" in answer.json()["error"]["message"]
        finally:
            postgres.resume()
        until(lambda: client.get("/healthz").status_code == 200, "healthz stayed 503")
        second = client.post("/v1/videos", json=request(1)).json()["id"]
        until(lambda: client.get(f"/v1/videos/{second}").json()["status"] == "completed", "2nd")
        assert service.worker.is_alive()
