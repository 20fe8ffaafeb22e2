"""Writes ``tests/training/fixtures/failed_episodes.json``: failed episodes of a real adapter, for the teacher's test.

    python -m bench.make_failed_episodes STORE [--per-family 3]

``STORE``: an SQLite store holding a correction round's rollouts (``replay-train`` with
``HARNESS_TRAINING__CORRECTION__ROUNDS=1`` records them with ``metadata.correction_round`` and the verifier's
``task_success``). Takes up to ``--per-family`` failed episodes of each task family, their whole conversations as
the agent loop kept them (``agent_runs.state``), so the test can continue each from every state it reached.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "training" / "fixtures" / "failed_episodes.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("store", type=Path)
    parser.add_argument("--per-family", type=int, default=3)
    args = parser.parse_args()
    with sqlite3.connect(args.store) as db:
        rows = db.execute(
            "SELECT t.task_id, json_extract(t.metadata, '$.family'), t.adapter, r.state FROM trajectories t "
            "JOIN agent_runs r ON r.id = t.id JOIN feedback f ON f.trajectory_id = t.id "
            "WHERE t.source = 'rollout' AND json_extract(t.metadata, '$.correction_round') IS NOT NULL "
            "AND f.name = 'task_success' AND f.value = 0 ORDER BY t.id").fetchall()
    taken: dict[str, int] = {}
    episodes = []
    for task_id, family, adapter, state in rows:
        messages = json.loads(state)["messages"]
        if taken.get(family, 0) >= args.per_family or not any(m["role"] == "assistant" for m in messages):
            continue
        taken[family] = taken.get(family, 0) + 1
        episodes.append({"task_id": task_id, "family": family, "adapter": adapter, "messages": messages})
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"made_by": "python -m bench.make_failed_episodes STORE", "episodes": episodes},
                              indent=1, ensure_ascii=False) + "\n")
    print(f"{len(episodes)} failed episodes ({', '.join(f'{f} {n}' for f, n in sorted(taken.items()))}) -> {OUT}")


if __name__ == "__main__":
    main()
