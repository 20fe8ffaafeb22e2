"""psycopg 3 against asyncpg on the store's PostgreSQL workload: group commits, point reads, pooled readers.

    python bench/pg_drivers.py [--rounds 5] [--rows 2048] [--reads 10000] [--loop uvloop|asyncio]

A throwaway PostgreSQL server (``tests/postgres.py``: Debian's binaries, fsync on) runs for the whole benchmark,
with one database holding tables shaped like the store's: ``trajectories`` (seeded with --trajectories rows),
``blobs(hash text primary key, body bytea)`` and ``model_calls`` (the store's 23 columns: 12 TEXT, of which the
JSON ones are 200 to 2,000 bytes, 4 INTEGER, 3 DOUBLE PRECISION, 4 BYTEA of about 1 KB; a foreign key to
``trajectories`` and the (trajectory_id, seq) index). Three shapes:

1. ``commit``: the writer's group commit. One transaction per batch of B calls (B = 1, 16, 64): ``executemany``
   of B ``model_calls`` rows, B upserts of their trajectories (``ON CONFLICT (id) DO UPDATE SET n = t.n + 1``)
   and B ``INSERT ... ON CONFLICT DO NOTHING`` into ``blobs`` (half of them hashes already there), the batches
   committed one after the other. Drivers: a psycopg sync connection driven from the event loop through
   ``run_in_executor`` on a single worker thread (how the store's writer works), a psycopg ``AsyncConnection``,
   and asyncpg (``executemany`` inside ``conn.transaction()``). Commits/s, rows/s, CPU per commit.
2. ``point``: ``SELECT head_hash, n FROM trajectories WHERE id = $1`` one after another on the event loop:
   psycopg ``AsyncConnection`` and asyncpg, and a psycopg sync connection called on the loop thread as a
   reference (what blocking the loop would cost). µs per query.
3. ``pool``: --tasks asyncio tasks each doing --per-task point reads, every read taking a connection from a pool
   of --pool: ``psycopg_pool.AsyncConnectionPool`` against ``asyncpg.create_pool``, as it comes (it sends a reset
   query on every release) and with ``reset=`` a no-op (as psycopg_pool does by default). Each sample is
   --pool-runs runs back to back; wall time per run, queries/s.

Client CPU is this process's ``time.process_time()`` (every thread, the writer's worker included): what the
gateway pays on its cores. Server CPU is the PostgreSQL processes' user + system time from /proc (10 ms ticks),
which on a machine that runs both is paid on the same cores. Every connection is opened, and every statement run
a few times (so both drivers have prepared it), before anything is timed. The drivers are interleaved (A, B, C,
A, B, C, ..., each round starting one further on) for --rounds rounds; medians are reported, with the spread
(max - min over the median) of the time per operation and the ratios asyncpg / psycopg. Before each round the
script waits (up to --quiet-wait s) until other work on the machine is under --quiet-threshold % of a core, and
says how much other work ran during each round. The event loop is uvloop by default, as ``harness serve`` runs it.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import json
import os
import platform
import random
import re
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import asyncpg  # noqa: E402
import psycopg  # noqa: E402
import psycopg_pool  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from bench.procstat import CLK_TCK, tree_cpu_seconds  # noqa: E402
from tests.postgres import PostgresServer, _bin_dir  # noqa: E402

console = Console(width=None if sys.stdout.isatty() else 140)

SCHEMA = """
CREATE TABLE trajectories (
    id TEXT PRIMARY KEY,
    source TEXT NOT NULL,
    tenant TEXT,
    status TEXT NOT NULL,
    head_hash TEXT,
    n INTEGER NOT NULL DEFAULT 0,
    metadata TEXT,
    created_at DOUBLE PRECISION NOT NULL,
    updated_at DOUBLE PRECISION NOT NULL
);
CREATE TABLE blobs (
    hash TEXT PRIMARY KEY,
    body BYTEA NOT NULL
);
CREATE TABLE model_calls (
    id TEXT PRIMARY KEY,
    trajectory_id TEXT NOT NULL REFERENCES trajectories(id) ON DELETE CASCADE,
    seq INTEGER NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    backend TEXT,
    model TEXT,
    adapter TEXT,
    stream INTEGER NOT NULL DEFAULT 0,
    request_messages TEXT NOT NULL,
    tools_hash TEXT,
    params TEXT,
    response TEXT,
    response_messages TEXT,
    status TEXT NOT NULL,
    error TEXT,
    prompt_tokens INTEGER,
    completion_tokens INTEGER,
    latency_ms DOUBLE PRECISION,
    ttft_ms DOUBLE PRECISION,
    prompt_token_ids BYTEA,
    completion_token_ids BYTEA,
    completion_logprobs BYTEA,
    completion_sampled_logprobs BYTEA
);
CREATE INDEX model_calls_trajectory ON model_calls(trajectory_id, seq);
"""

# Written with asyncpg's $n placeholders; psycopg gets the same text with %s (each $n appears once, in order).
INSERT_CALL = (
    "INSERT INTO model_calls (id, trajectory_id, seq, created_at, backend, model, adapter, stream, request_messages, "
    "tools_hash, params, response, response_messages, status, error, prompt_tokens, completion_tokens, latency_ms, "
    "ttft_ms, prompt_token_ids, completion_token_ids, completion_logprobs, completion_sampled_logprobs) VALUES "
    "($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, $19, $20, $21, $22, $23)"
)
UPSERT_TRAJECTORY = (
    "INSERT INTO trajectories AS t (id, source, status, head_hash, n, created_at, updated_at) "
    "VALUES ($1, 'gateway', 'open', $2, 1, $3, $4) "
    "ON CONFLICT (id) DO UPDATE SET n = t.n + 1, head_hash = excluded.head_hash, updated_at = excluded.updated_at"
)
INSERT_BLOB = "INSERT INTO blobs (hash, body) VALUES ($1, $2) ON CONFLICT DO NOTHING"
POINT_READ = "SELECT head_hash, n FROM trajectories WHERE id = $1"


def for_psycopg(sql: str) -> str:
    return re.sub(r"\$\d+", "%s", sql)


# -- data -------------------------------------------------------------------------------------------


@dataclass
class Batch:
    """One group commit's parameters, built before the clock starts so both drivers time only the database."""

    calls: list[tuple[Any, ...]]
    upserts: list[tuple[Any, ...]]
    blobs: list[tuple[Any, ...]]


class Data:
    """Deterministic rows shaped like the store's; every call id is new, every trajectory id is a seeded one."""

    def __init__(self, trajectories: int, seed: int = 7) -> None:
        self.rng = random.Random(seed)
        self.trajectory_ids = [f"traj_{i:08d}_{self.rng.getrandbits(48):012x}" for i in range(trajectories)]
        self.next_call = 0
        words = "the model called a tool and read back the census figures for the city before answering".split()

        def text(size: int) -> str:
            out: list[str] = []
            while sum(len(w) + 1 for w in out) < size:
                out.append(self.rng.choice(words))
            return " ".join(out)

        # A pool of distinct JSON payloads per column, so rows differ (TOAST compresses each value on its own).
        self.requests = [json.dumps([{"role": "system", "content": text(600)},
                                     {"role": "user", "content": text(self.rng.randint(300, 1300))}])
                         for _ in range(32)]
        self.params = [json.dumps({"temperature": 0.7, "max_tokens": 256, "top_p": 1.0, "stop": None,
                                   "user": text(100)}) for _ in range(8)]
        self.responses = [json.dumps({"id": f"chatcmpl-{i}", "object": "chat.completion", "choices": [
            {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text(600)}}]})
            for i in range(32)]
        self.response_messages = [json.dumps([{"role": "assistant", "content": text(500)}]) for _ in range(32)]
        # Token ids and logprobs are packed arrays: incompressible-looking bytes of about 1 KB.
        self.bytea = [self.rng.randbytes(self.rng.randint(900, 1200)) for _ in range(64)]
        self.known_blobs = [self.rng.randbytes(1024) for _ in range(256)]

    def blob_row(self, body: bytes) -> tuple[str, bytes]:
        return hashlib.sha256(body).hexdigest(), body

    def batch(self, size: int) -> Batch:
        now = time.time()
        calls, upserts, blobs = [], [], []
        pick = self.rng.choice
        for _ in range(size):
            self.next_call += 1
            traj = self.rng.choice(self.trajectory_ids)
            call_id = f"call_{self.next_call:010d}_{self.rng.getrandbits(64):016x}"
            calls.append((call_id, traj, self.next_call, now, "upstream", "bench-model", None, 0, pick(self.requests),
                          hashlib.sha256(call_id.encode()).hexdigest(), pick(self.params), pick(self.responses),
                          pick(self.response_messages), "ok", None, self.rng.randint(200, 4000),
                          self.rng.randint(10, 600), self.rng.uniform(50, 3000), self.rng.uniform(5, 300),
                          pick(self.bytea), pick(self.bytea), pick(self.bytea), pick(self.bytea)))
            upserts.append((traj, hashlib.sha256(call_id.encode()).hexdigest(), now, now))
            # Half the bodies are already stored (a repeated system prompt or tool spec): the DO NOTHING path.
            body = pick(self.known_blobs) if self.rng.random() < 0.5 else self.rng.randbytes(1024)
            blobs.append(self.blob_row(body))
        return Batch(calls, upserts, blobs)


def seed(url: str, data: Data) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(SCHEMA)
        now = time.time()
        with conn.cursor() as cur, cur.copy("COPY trajectories (id, source, tenant, status, head_hash, n, metadata, "
                                            "created_at, updated_at) FROM STDIN") as copy:
            for tid in data.trajectory_ids:
                copy.write_row((tid, "gateway", "bench", "open", hashlib.sha256(tid.encode()).hexdigest(), 0,
                                '{"task": "bench"}', now, now))
        with conn.cursor() as cur:
            cur.executemany(for_psycopg(INSERT_BLOB), [data.blob_row(b) for b in data.known_blobs])
        conn.execute("ANALYZE")


# -- measuring --------------------------------------------------------------------------------------




@dataclass
class Sample:
    wall: float  # seconds
    cpu: float  # seconds of this process, all threads
    server: float  # seconds of the PostgreSQL server's processes
    ops: int


class Meter:
    """Clocks for one measurement: wall, this process's CPU, and the server's CPU (from /proc).

    The server shares this machine's cores, so a driver that makes the server work harder (text against binary
    parameters, an extra statement per call) shows there; and the machine's busy time less both is what someone
    else's work took from the run.
    """

    def __init__(self, data_dir: Path) -> None:
        self.postmaster = int((data_dir / "postmaster.pid").read_text().split()[0])

    def server_seconds(self) -> float:
        # The postmaster and its children (backends, writers); our connections' backends live for the whole run.
        return tree_cpu_seconds(self.postmaster)

    @staticmethod
    def machine_busy_seconds() -> float:
        """CPU seconds (summed over cores) the machine's processes have run since boot.

        Interrupt time is left out: most of it here is the loopback traffic between this process and the server,
        which no process is charged for, so it would read as someone else's work.
        """
        with open("/proc/stat") as f:
            user, nice, system = (int(x) for x in f.readline().split()[1:4])
        return (user + nice + system) / CLK_TCK

    async def wait_until_quiet(self, threshold_pct: float, max_wait: float) -> float:
        """Wait until other work stays under threshold_pct of one core for a second; the seconds waited.

        Nothing of ours runs between measurements, so what is busy then is someone else's (on a shared machine,
        test suites), and it skews the figures both ways: it takes cores, and it may also keep idle cores from
        sleeping, which can make short round trips faster than they are on a quiet machine.
        """
        if threshold_pct <= 0:
            return 0.0
        started = time.monotonic()
        while True:
            busy0, own0, server0 = self.machine_busy_seconds(), time.process_time(), self.server_seconds()
            await asyncio.sleep(1.0)
            other = (self.machine_busy_seconds() - busy0) - (time.process_time() - own0) - (self.server_seconds()
                                                                                           - server0)
            waited = time.monotonic() - started
            if other * 100 < threshold_pct or waited >= max_wait:
                return waited - 1.0

    async def measure(self, work: Callable[[], Awaitable[None]], ops: int) -> Sample:
        # Collect first, so one driver's garbage is not collected on the next one's clock.
        gc.collect()
        server0 = self.server_seconds()
        cpu0, wall0 = time.process_time(), time.perf_counter()
        await work()
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        return Sample(wall, cpu, self.server_seconds() - server0, ops)


def median(samples: list[Sample], key: Callable[[Sample], float]) -> float:
    return statistics.median(key(s) for s in samples)


def per_op_ms(s: Sample) -> float:
    return s.wall / s.ops * 1000


def cpu_ms(s: Sample) -> float:
    return s.cpu / s.ops * 1000


def per_op_us(s: Sample) -> float:
    return s.wall / s.ops * 1e6


def cpu_us(s: Sample) -> float:
    return s.cpu / s.ops * 1e6


def server_ms(s: Sample) -> float:
    return s.server / s.ops * 1000


def server_us(s: Sample) -> float:
    return s.server / s.ops * 1e6


def spread(samples: list[Sample], key: Callable[[Sample], float]) -> str:
    values = [key(s) for s in samples]
    mid = statistics.median(values)
    return f"{(max(values) - min(values)) / mid * 100:.0f}%" if mid and len(values) > 1 else "-"


# -- shape 1: group commit --------------------------------------------------------------------------


class Writer:
    name: str

    async def commit(self, batch: Batch) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        pass


class PsycopgThreadWriter(Writer):
    """The store's way: a sync connection owned by one worker thread, each commit handed over from the loop."""

    name = "psycopg sync, worker thread"

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pg-writer")
        self.sql = (for_psycopg(INSERT_CALL), for_psycopg(UPSERT_TRAJECTORY), for_psycopg(INSERT_BLOB))

    @classmethod
    async def open(cls, url: str) -> PsycopgThreadWriter:
        return cls(psycopg.connect(url, autocommit=True))

    def _commit(self, batch: Batch) -> None:
        with self.conn.transaction(), self.conn.cursor() as cur:
            cur.executemany(self.sql[0], batch.calls)
            cur.executemany(self.sql[1], batch.upserts)
            cur.executemany(self.sql[2], batch.blobs)

    async def commit(self, batch: Batch) -> None:
        await asyncio.get_running_loop().run_in_executor(self.pool, self._commit, batch)

    async def close(self) -> None:
        self.pool.shutdown()
        self.conn.close()


class PsycopgAsyncWriter(Writer):
    name = "psycopg async"

    def __init__(self, conn: psycopg.AsyncConnection[Any]) -> None:
        self.conn = conn
        self.sql = (for_psycopg(INSERT_CALL), for_psycopg(UPSERT_TRAJECTORY), for_psycopg(INSERT_BLOB))

    @classmethod
    async def open(cls, url: str) -> PsycopgAsyncWriter:
        return cls(await psycopg.AsyncConnection.connect(url, autocommit=True))

    async def commit(self, batch: Batch) -> None:
        async with self.conn.transaction(), self.conn.cursor() as cur:
            await cur.executemany(self.sql[0], batch.calls)
            await cur.executemany(self.sql[1], batch.upserts)
            await cur.executemany(self.sql[2], batch.blobs)

    async def close(self) -> None:
        await self.conn.close()


class AsyncpgWriter(Writer):
    name = "asyncpg"

    def __init__(self, conn: asyncpg.Connection) -> None:
        self.conn = conn

    @classmethod
    async def open(cls, url: str) -> AsyncpgWriter:
        return cls(await asyncpg.connect(url))

    async def commit(self, batch: Batch) -> None:
        async with self.conn.transaction():
            await self.conn.executemany(INSERT_CALL, batch.calls)
            await self.conn.executemany(UPSERT_TRAJECTORY, batch.upserts)
            await self.conn.executemany(INSERT_BLOB, batch.blobs)

    async def close(self) -> None:
        await self.conn.close()


async def commit_sample(meter: Meter, writer: Writer, data: Data, size: int, commits: int) -> Sample:
    batches = [data.batch(size) for _ in range(commits)]

    async def work() -> None:
        for batch in batches:
            await writer.commit(batch)

    return await meter.measure(work, commits)


# -- shape 2: sequential point reads ----------------------------------------------------------------


Reader = Callable[[list[str]], Awaitable[None]]


def psycopg_async_reader(conn: psycopg.AsyncConnection[Any]) -> Reader:
    sql = for_psycopg(POINT_READ)

    async def read(ids: list[str]) -> None:
        for tid in ids:
            cur = await conn.execute(sql, (tid,))
            if await cur.fetchone() is None:
                raise RuntimeError(f"trajectory {tid} not found")

    return read


def psycopg_sync_reader(conn: psycopg.Connection[Any]) -> Reader:
    sql = for_psycopg(POINT_READ)

    async def read(ids: list[str]) -> None:
        # Blocks the loop for each query on purpose: the reference for what an await costs on top.
        for tid in ids:
            if conn.execute(sql, (tid,)).fetchone() is None:
                raise RuntimeError(f"trajectory {tid} not found")

    return read


def asyncpg_reader(conn: asyncpg.Connection) -> Reader:
    async def read(ids: list[str]) -> None:
        for tid in ids:
            if await conn.fetchrow(POINT_READ, tid) is None:
                raise RuntimeError(f"trajectory {tid} not found")

    return read


# -- shape 3: pooled concurrent readers -------------------------------------------------------------


def psycopg_pool_reader(pool: psycopg_pool.AsyncConnectionPool[Any]) -> Reader:
    sql = for_psycopg(POINT_READ)

    async def read(ids: list[str]) -> None:
        # One checkout per query, as a request handler would do it.
        for tid in ids:
            async with pool.connection() as conn:
                cur = await conn.execute(sql, (tid,))
                if await cur.fetchone() is None:
                    raise RuntimeError(f"trajectory {tid} not found")

    return read


def asyncpg_pool_reader(pool: asyncpg.Pool) -> Reader:
    async def read(ids: list[str]) -> None:
        for tid in ids:
            if await pool.fetchrow(POINT_READ, tid) is None:
                raise RuntimeError(f"trajectory {tid} not found")

    return read


async def concurrent_sample(meter: Meter, read: Reader, data: Data, tasks: int, per_task: int,
                            runs: int = 1) -> Sample:
    """``runs`` back-to-back runs of ``tasks`` x ``per_task`` reads, as one sample."""
    plans = [[[data.rng.choice(data.trajectory_ids) for _ in range(per_task)] for _ in range(tasks)]
             for _ in range(runs)]

    async def work() -> None:
        for plan in plans:
            await asyncio.gather(*(read(ids) for ids in plan))

    # One run takes a third of a second, which the machine's noise swamps; several make one steadier sample.
    return await meter.measure(work, runs * tasks * per_task)


# -- the run ----------------------------------------------------------------------------------------


def rotated(items: list[Any], by: int) -> list[Any]:
    # Still A, B, C, A, B, C, ..., but each round starts one further on, so no driver always runs first after
    # the round's checkpoint or right after the same neighbour.
    k = by % len(items)
    return items[k:] + items[:k]


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


async def run(url: str, data: Data, meter: Meter, args: argparse.Namespace) -> None:
    sizes = [int(s) for s in args.batch.split(",")]

    writers: list[Writer] = [await PsycopgThreadWriter.open(url), await PsycopgAsyncWriter.open(url),
                             await AsyncpgWriter.open(url)]
    point_async = await psycopg.AsyncConnection.connect(url, autocommit=True)
    point_sync = psycopg.connect(url, autocommit=True)
    point_apg = await asyncpg.connect(url)
    readers: dict[str, Reader] = {"psycopg async": psycopg_async_reader(point_async),
                                  "asyncpg": asyncpg_reader(point_apg),
                                  "psycopg sync, on the loop": psycopg_sync_reader(point_sync)}
    ppool = psycopg_pool.AsyncConnectionPool(url, min_size=args.pool, max_size=args.pool,
                                             kwargs={"autocommit": True}, open=False)
    await ppool.open(wait=True)
    apool = await asyncpg.create_pool(url, min_size=args.pool, max_size=args.pool)

    async def no_reset(conn: asyncpg.Connection) -> None:
        pass

    # asyncpg's pool runs a reset query (advisory unlocks, CLOSE ALL, UNLISTEN *, RESET ALL) on every release,
    # one more round trip per checkout than psycopg_pool, which only looks at the transaction status; a pool whose
    # users set no session state can skip it, so both are measured.
    apool_bare = await asyncpg.create_pool(url, min_size=args.pool, max_size=args.pool, reset=no_reset)
    pools: dict[str, Reader] = {"psycopg_pool": psycopg_pool_reader(ppool), "asyncpg pool": asyncpg_pool_reader(apool),
                                "asyncpg pool, reset=no-op": asyncpg_pool_reader(apool_bare)}

    commits: dict[tuple[int, str], list[Sample]] = {(b, w.name): [] for b in sizes for w in writers}
    points: dict[str, list[Sample]] = {name: [] for name in readers}
    pooled: dict[str, list[Sample]] = {name: [] for name in pools}
    try:
        # Warm-up: connections used, statements prepared (psycopg prepares after 5 runs), caches filled.
        for b in sizes:
            for w in writers:
                await commit_sample(meter, w, data, b, 8)
        for read in readers.values():
            await meter.measure(lambda r=read: r(data.rng.choices(data.trajectory_ids, k=200)), 200)
        for read in pools.values():
            await concurrent_sample(meter, read, data, args.tasks, 20)

        started = time.perf_counter()
        busy0, own0, server0 = meter.machine_busy_seconds(), time.process_time(), meter.server_seconds()
        for round_ in range(args.rounds):
            # Every round starts from the same table and a clean checkpoint, so a checkpoint's writes (the run
            # inserts hundreds of MB) and a growing index land on no driver in particular.
            async with await psycopg.AsyncConnection.connect(url, autocommit=True) as admin:
                await admin.execute("TRUNCATE model_calls")
                await admin.execute("CHECKPOINT")
            waited = await meter.wait_until_quiet(args.quiet_threshold, args.quiet_wait)
            round_busy, round_own, round_server = (meter.machine_busy_seconds(), time.process_time(),
                                                   meter.server_seconds())
            round_started = time.perf_counter()
            for b in sizes:
                n = max(args.min_commits, args.rows // b)
                for w in rotated(writers, round_):
                    commits[(b, w.name)].append(await commit_sample(meter, w, data, b, n))
            for name, read in rotated(list(readers.items()), round_):
                ids = data.rng.choices(data.trajectory_ids, k=args.reads)
                points[name].append(await meter.measure(lambda r=read, i=ids: r(i), args.reads))
            for name, read in rotated(list(pools.items()), round_):
                pooled[name].append(await concurrent_sample(meter, read, data, args.tasks, args.per_task,
                                                            args.pool_runs))
            round_other = ((meter.machine_busy_seconds() - round_busy) - (time.process_time() - round_own)
                           - (meter.server_seconds() - round_server))
            console.print(f"[dim]round {round_ + 1}/{args.rounds} done, {time.perf_counter() - started:.1f} s"
                          f"{f' (waited {waited:.0f} s for quiet)' if waited >= 1 else ''}; other work during it: "
                          f"{max(round_other, 0) / (time.perf_counter() - round_started) * 100:.0f}% of a core[/]")
        elapsed = time.perf_counter() - started
        busy = meter.machine_busy_seconds() - busy0
        other = busy - (time.process_time() - own0) - (meter.server_seconds() - server0)
    finally:
        for w in writers:
            await w.close()
        await point_async.close()
        point_sync.close()
        await point_apg.close()
        await ppool.close()
        await apool.close()
        await apool_bare.close()

    report(args, sizes, commits, points, pooled)
    # Figures taken while something else ran are worth less; say how much else ran.
    console.print(f"Rounds: {elapsed:.1f} s. Other work on the machine meanwhile (its busy time less this process's "
                  f"and the server's): {max(other, 0):.1f} CPU s, {max(other, 0) / elapsed * 100:.0f}% of one core.")


def report(args: argparse.Namespace, sizes: list[int], commits: dict[tuple[int, str], list[Sample]],
           points: dict[str, list[Sample]], pooled: dict[str, list[Sample]]) -> None:
    table = Table("B", "driver", "commits/s", "rows/s", "ms/commit", "client CPU ms/commit",
                  "server CPU ms/commit", "spread", title=f"1. group commit (medians of {args.rounds})")
    for b in sizes:
        med = {name: (median(s, per_op_ms), median(s, cpu_ms), median(s, server_ms))
               for (bb, name), s in commits.items() if bb == b}
        for (bb, name), samples in commits.items():
            if bb == b:
                ms, cpu, srv = med[name]
                table.add_row(str(b), name, f"{1000 / ms:,.0f}", f"{1000 / ms * b:,.0f}", f"{ms:.3f}", f"{cpu:.3f}",
                              f"{srv:.3f}", spread(samples, per_op_ms))
        apg_ms, apg_cpu, apg_srv = med[AsyncpgWriter.name]
        for base in (PsycopgThreadWriter.name, PsycopgAsyncWriter.name):
            ms, cpu, srv = med[base]
            table.add_row(str(b), f"[bold]asyncpg / {base}[/]", ratio(ms, apg_ms), ratio(ms, apg_ms),
                          ratio(apg_ms, ms), ratio(apg_cpu, cpu), ratio(apg_srv, srv), "")
        table.add_section()
    console.print(table)

    def read_table(title: str, first: str, samples_by: dict[str, list[Sample]], scale: float, fmt: str,
                   bases: list[str]) -> None:
        # scale turns µs per query into the first column's unit (µs per query, or seconds per pool run).
        table = Table("driver", first, "queries/s", "client CPU µs/query", "server CPU µs/query", "spread",
                      title=title)
        med = {name: (median(s, per_op_us), median(s, cpu_us), median(s, server_us))
               for name, s in samples_by.items()}
        for name, samples in samples_by.items():
            us, cpu, srv = med[name]
            table.add_row(name, format(us * scale, fmt), f"{1e6 / us:,.0f}", f"{cpu:.1f}", f"{srv:.1f}",
                          spread(samples, per_op_us))
        table.add_section()
        for apg, base in [(a, b) for a in samples_by if a.startswith("asyncpg") for b in bases]:
            table.add_row(f"[bold]{apg} / {base}[/]", ratio(med[apg][0], med[base][0]),
                          ratio(med[base][0], med[apg][0]), ratio(med[apg][1], med[base][1]),
                          ratio(med[apg][2], med[base][2]), "")
        console.print(table)

    read_table(f"2. sequential point reads, {args.reads} per sample (medians of {args.rounds})", "µs/query", points,
               1.0, ".1f", ["psycopg async", "psycopg sync, on the loop"])
    read_table(f"3. {args.tasks} tasks x {args.per_task} point reads through a pool of {args.pool}, "
               f"{args.pool_runs} runs per sample (medians of {args.rounds})", "s per run", pooled,
               args.tasks * args.per_task / 1e6, ".3f", ["psycopg_pool"])
    console.print("Ratios are asyncpg's figure over psycopg's: above 1 in commits/s, rows/s and queries/s means "
                  "asyncpg is faster; below 1 in time and CPU means asyncpg takes less. Spread: (max - min) / median "
                  "of the time per operation over the rounds.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds; medians are reported")
    parser.add_argument("--batch", default="1,16,64", help="group commit sizes B (comma-separated)")
    parser.add_argument("--rows", type=int, default=2048, help="model_calls rows per commit measurement")
    parser.add_argument("--min-commits", type=int, default=128, help="commits per measurement at least")
    parser.add_argument("--reads", type=int, default=10_000, help="sequential point reads per measurement")
    parser.add_argument("--tasks", type=int, default=32)
    parser.add_argument("--per-task", type=int, default=200)
    parser.add_argument("--pool", type=int, default=8, help="connections in each pool")
    parser.add_argument("--pool-runs", type=int, default=3, help="runs of --tasks x --per-task per measurement")
    parser.add_argument("--trajectories", type=int, default=20_000, help="rows seeded into trajectories")
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    parser.add_argument("--quiet-threshold", type=float, default=15.0,
                        help="before each round, wait until other work uses under this %% of one core (0: don't)")
    parser.add_argument("--quiet-wait", type=float, default=5.0, help="wait at most this many seconds per round")
    args = parser.parse_args()

    bin_dir = _bin_dir()
    if bin_dir is None:
        sys.exit("PostgreSQL's server binaries are not installed (Debian: apt-get install -y postgresql); "
                 "this benchmark starts a throwaway server with them.")
    server = PostgresServer(bin_dir)
    try:
        server.start()
        url = server.database()
        data = Data(args.trajectories)
        seed(url, data)
        meter = Meter(server.data)
        with psycopg.connect(url) as conn:
            version = conn.execute("SHOW server_version").fetchone()[0]
        console.print(f"PostgreSQL {version} ({bin_dir}), Python {platform.python_version()}, psycopg "
                      f"{psycopg.__version__} ({psycopg.pq.__impl__}, libpq {psycopg.pq.version()}), psycopg_pool "
                      f"{psycopg_pool.__version__}, asyncpg {asyncpg.__version__}, loop {args.loop}, "
                      f"{os.cpu_count()} CPUs")
        if args.loop == "uvloop":
            import uvloop

            uvloop.run(run(url, data, meter, args))
        else:
            asyncio.run(run(url, data, meter, args))
    finally:
        server.stop()


if __name__ == "__main__":
    main()
