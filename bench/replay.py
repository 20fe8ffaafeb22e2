"""Replay throughput and memory: export (chat JSONL, HF datasets), stats and reward computation.

    python bench/replay.py [--trajectories 100000] [--db PATH] [--keep] [--skip hf] [--skip rewards]

1. Builds a store of N agent-like trajectories through the store's own write path (TrajectoryStore.write,
   one WriteOp per 500 trajectories): three model calls each (system + user → tool call → tool result →
   tool call → tool result → answer), the tool specs, exact prompt/completion token ids, and 1% of the
   users' messages carrying an e-mail address, so redaction has real work. Reused with --db if it exists.
2. Runs each measurement in a fresh child process (so one's memory cannot hide in another's) and reports
   wall time, trajectories/s, rows/s, bytes written and the child's peak RSS (VmHWM, which an exec resets,
   unlike ru_maxrss), once over the first 10% of the store and once over all of it: equal peaks mean memory
   stays flat as the store grows. chat-jsonl runs in one process (--jobs 1) and with worker processes
   (--jobs 0: one per CPU); the workers' own memory is listed separately.
3. If ``replay.rewards`` exists: ``recompute`` over the first --reward-trajectories of a copy of the store.

Target: export at 20,000 trajectories/s or more (chat JSONL, default options, redaction on).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rich.console import Console  # noqa: E402
from rich.progress import Progress  # noqa: E402
from rich.table import Table  # noqa: E402

console = Console(width=None if sys.stdout.isatty() else 160)
START = 1_700_000_000.0  # trajectory i is created at START + i seconds, so --until selects a prefix
SYSTEM = {"role": "system", "content": "You are a meticulous research agent. Use the tools to look things up, "
                                       "check every figure twice, and answer in one short paragraph. " * 2}
TOOLS = [{"type": "function", "function": {
    "name": name, "description": f"{name}: a tool the agent may call.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
                   "required": ["query"]}}} for name in ("search", "fetch_page", "calculator")]


def _trajectory(i: int) -> list[tuple[list[dict[str, Any]], dict[str, Any]]]:
    who = f" Reply to user{i}@example.com." if i % 100 == 0 else ""
    user = {"role": "user", "content": f"Question {i}: what was the population of city {i % 977} in {1900 + i % 120}, "
                                       f"and how did it change over the following decade?{who}"}
    calls = []
    history = [SYSTEM, user]
    for step, tool in enumerate(("search", "fetch_page")):
        call_id = f"call_{i}_{step}"
        reply = {"role": "assistant", "content": None, "tool_calls": [{
            "id": call_id, "type": "function",
            "function": {"name": tool, "arguments": json.dumps({"query": f"city {i % 977} population", "limit": 5})}}]}
        calls.append((list(history), reply))
        history += [reply, {"role": "tool", "tool_call_id": call_id,
                            "content": f"Result {step} for trajectory {i}: " + "census figures, sources, notes. " * 8}]
    calls.append((list(history), {"role": "assistant", "content": f"City {i % 977} grew by {i % 37}% that decade."}))
    return calls


async def build(path: Path, n: int) -> None:
    from replay.records import CallRecord, TrajectoryRef, WriteOp, new_id
    from replay.store import TrajectoryStore

    store = TrajectoryStore(str(path), max_batch=8)
    await store.start()
    per_op = 500
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task(f"building {n:,} trajectories", total=n)

        def op_for(lo: int, hi: int) -> WriteOp:
            records = []
            for i in range(lo, hi):
                tid = new_id()
                for seq, (request, reply) in enumerate(_trajectory(i)):
                    prompt_len = 60 * len(request)
                    records.append(CallRecord(
                        trajectory=TrajectoryRef(id=tid, seq=seq, is_new=seq == 0, group_id=f"task-{i // 4}"),
                        request_messages=request, request_prefix=[], status="ok", source="agent",
                        tenant=("acme", "beta")[i % 2], requested_model="agent:research", base_model="base-model",
                        adapter="lora-a" if i % 3 == 0 else None, tools=TOOLS, params={"temperature": 0.7},
                        response={"object": "chat.completion", "choices": [
                            {"index": 0, "message": reply, "finish_reason": "stop"}]},
                        prompt_tokens=prompt_len, completion_tokens=24, latency_ms=120.0,
                        prompt_token_ids=[(i + k) % 50_000 for k in range(prompt_len)],
                        completion_token_ids=[[(i * 7 + k) % 50_000 for k in range(24)]],
                        tool_calls=[{"call_id": c["id"], "name": c["function"]["name"],
                                     "raw_arguments": c["function"]["arguments"], "parsed": True, "repaired": False,
                                     "valid": i % 10 != 0, "validation_error": None, "status": "ok",
                                     "result": "ok", "duration_ms": 3.0} for c in reply.get("tool_calls") or []],
                        created_at=START + i))
            return WriteOp(records=records)

        pending: set[asyncio.Task[None]] = set()
        for lo in range(0, n, per_op):
            hi = min(n, lo + per_op)
            pending.add(asyncio.create_task(store.write(op_for(lo, hi))))
            if len(pending) >= 4:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for d in done:
                    d.result()
                    progress.advance(task, per_op)
            await asyncio.sleep(0)
        for d in asyncio.as_completed(pending):
            await d
            progress.advance(task, per_op)
    await store.close()


def child(args: argparse.Namespace) -> None:
    """One measurement, in its own process; prints a JSON line."""
    from gateway.logging import configure_logging
    from replay.export import ExportOptions, export
    from replay.filters import Filters
    from replay.readonly import open_readonly
    from replay.redact import Redactor

    configure_logging("console", "warning")
    filters = Filters(until=args.until) if args.until else Filters()
    baseline = _hwm_kib()
    anon = _AnonPeak()
    started = time.perf_counter()
    out: dict[str, Any] = {}
    if args.child == "export":
        if args.format == "hf":
            import datasets  # noqa: F401 - its import is not the export's memory
            baseline = _hwm_kib()
        with open_readonly(args.db) as conn:
            result = export(conn, filters, args.output, fmt=args.format,
                            options=ExportOptions(window=args.window, jobs=args.jobs), redactor=Redactor(),
                            overwrite=True)
        size = _size(Path(args.output))
        out = {"trajectories": result.trajectories, "rows": result.rows, "redacted": result.redacted_rows,
               "bytes": size}
    elif args.child == "stats":
        from replay.stats import compute

        with open_readonly(args.db) as conn:
            s = compute(conn, filters)
        out = {"trajectories": s["trajectories"], "rows": 0, "bytes": 0}
    elif args.child == "rewards":
        from gateway.config import RewardSettings
        from replay.rewards import recompute
        from replay.store import TrajectoryStore

        async def run() -> Any:
            store = TrajectoryStore(args.db)
            await store.start()
            try:
                return await recompute(store, filters, RewardSettings())
            finally:
                await store.close()

        summary = asyncio.run(run())
        out = {"trajectories": summary.count, "rows": 0, "bytes": 0}
    out["seconds"] = time.perf_counter() - started
    out["peak_anon_mb"] = anon.stop() / 1024
    out["peak_rss_mb"] = _hwm_kib() / 1024
    out["baseline_rss_mb"] = baseline / 1024
    # Worker processes (--jobs) have ended by now; the largest one's peak, as the kernel kept it.
    out["worker_peak_rss_mb"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print(json.dumps(out))


class _AnonPeak:
    """Samples RssAnon (heap and other private memory, not file pages mapped in) every 20 ms: the peak
    RSS also counts pages of memory-mapped files (Arrow's), which the kernel can drop at any time."""

    def __init__(self) -> None:
        import threading

        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, _status_kib("RssAnon:"))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, _status_kib("RssAnon:"))


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith(field))


def _hwm_kib() -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:"))


def _size(path: Path) -> int:
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return path.stat().st_size if path.exists() else 0


def measure(db: Path, what: str, *, until: float | None = None, fmt: str = "chat-jsonl", window: int = 1,
            jobs: int = 1, output: Path | None = None) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", what, "--db", str(db), "--format", fmt, "--window", str(window),
           "--jobs", str(jobs)]
    if until is not None:
        cmd += ["--until", str(until)]
    if output is not None:
        cmd += ["--output", str(output)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"{what} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trajectories", type=int, default=100_000)
    parser.add_argument("--db", type=Path, help="Use (or build) this store instead of a temporary one.")
    parser.add_argument("--keep", action="store_true", help="Keep the temporary directory.")
    parser.add_argument("--skip", action="append", default=[], choices=["hf", "window", "stats", "rewards", "small"])
    parser.add_argument("--reward-trajectories", type=int, default=10_000)
    parser.add_argument("--json", type=Path, help="Also write the figures here.")
    # internal: one measurement in a child process
    parser.add_argument("--child", choices=["export", "stats", "rewards"], help=argparse.SUPPRESS)
    parser.add_argument("--format", default="chat-jsonl", help=argparse.SUPPRESS)
    parser.add_argument("--window", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--jobs", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--until", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return

    from gateway.logging import configure_logging

    configure_logging("console", "warning")
    n = args.trajectories
    tmp = Path(tempfile.mkdtemp(prefix="replay-bench-"))
    db = args.db or tmp / "bench.db"
    try:
        if not db.exists():
            started = time.perf_counter()
            asyncio.run(build(db, n))
            built = time.perf_counter() - started
            console.print(f"built {n:,} trajectories ({3 * n:,} model calls) in {built:.1f} s "
                          f"({n / built:,.0f}/s), store {db.stat().st_size / 2**20:,.0f} MiB")
        small = START + max(1, n // 10)
        runs: list[tuple[str, str, dict[str, Any]]] = []
        plan: list[tuple[str, str, dict[str, Any]]] = []
        for scope, until in ((f"{n // 10:,}", small), (f"{n:,}", None)):
            if scope != f"{n:,}" and "small" in args.skip:
                continue
            plan.append(("export chat-jsonl", scope, {"until": until, "fmt": "chat-jsonl",
                                                      "output": tmp / "rows.jsonl"}))
            plan.append(("export chat-jsonl --jobs 0", scope, {"until": until, "fmt": "chat-jsonl", "jobs": 0,
                                                               "output": tmp / "rows.jsonl"}))
            if "window" not in args.skip:
                plan.append(("export chat-jsonl --window 0", scope, {"until": until, "fmt": "chat-jsonl", "window": 0,
                                                                     "output": tmp / "rows-w.jsonl"}))
            if "hf" not in args.skip:
                plan.append(("export hf", scope, {"until": until, "fmt": "hf", "output": tmp / "ds"}))
            if "stats" not in args.skip:
                plan.append(("stats", scope, {"until": until}))
        for name, scope, kw in plan:
            console.print(f"[dim]{name} over {scope} trajectories…[/dim]")
            what = "stats" if name == "stats" else "export"
            runs.append((name, scope, measure(db, what, **kw)))
        if "rewards" not in args.skip:
            if importlib.util.find_spec("replay.rewards") is None:
                console.print("[yellow]replay.rewards does not exist yet: reward throughput not measured[/yellow]")
            else:
                copy = tmp / "rewards.db"
                shutil.copyfile(db, copy)
                limit = min(n, args.reward_trajectories)
                console.print(f"[dim]rewards over {limit:,} trajectories…[/dim]")
                runs.append(("rewards recompute", f"{limit:,}", measure(copy, "rewards", until=START + limit)))
        table = Table("what", "trajectories", "rows", "seconds", "traj/s", "rows/s", "MiB out", "peak RSS",
                      "peak anon", "RSS at start", "workers' peak",
                      title=f"replay bench ({os.cpu_count()} CPUs; memory in MiB)")
        for name, _scope, r in runs:
            table.add_row(name, f"{r['trajectories']:,}", f"{r['rows']:,}", f"{r['seconds']:.2f}",
                          f"{r['trajectories'] / r['seconds']:,.0f}",
                          f"{r['rows'] / r['seconds']:,.0f}" if r["rows"] else "-",
                          f"{r['bytes'] / 2**20:,.0f}" if r["bytes"] else "-",
                          f"{r['peak_rss_mb']:,.0f}", f"{r['peak_anon_mb']:,.0f}", f"{r['baseline_rss_mb']:,.0f}",
                          f"{r['worker_peak_rss_mb']:,.0f}" if r["worker_peak_rss_mb"] else "-")
        console.print(table)
        for name in ("export chat-jsonl", "export chat-jsonl --jobs 0"):
            r = next(r for what, scope, r in runs if what == name and scope == f"{n:,}")
            rate = r["trajectories"] / r["seconds"]
            console.print(f"{name}: {rate:,.0f} trajectories/s (target 20,000): {'PASS' if rate >= 20_000 else 'FAIL'}")
        if args.json:
            args.json.write_text(json.dumps([{"what": a, "scope": s, **r} for a, s, r in runs], indent=2))
    finally:
        if args.keep:
            console.print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
