"""The sequential gate against the fixed-size rule, by simulation: false accepts, power and the tasks each runs.

    python -m bench.gate_sequential [--runs 400] [--looks 40 70] [--resamples 1000] [--workers 2]

Synthetic models on the gate's own 100 tasks (drawn as replay-train draws them, with their faults and the solver's
steps): on each task a model succeeds with its success rate, independently, in the solver's steps and without an
invalid call. Each run draws both models' outcomes afresh and decides them with the fixed-size rule (one look at all
tasks) and with the sequential gate (looks after ``--looks`` tasks, then all), by the real ``training/gate.py``.

Scenarios: the candidate as good as the reference (any accept is a false one: the rate must stay at most 5%), and
gains from clear to small (the accept rate is the power). Printed: each rule's accept rate with its 95% interval,
and the mean number of tasks the sequential gate ran before it stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import random
import statistics
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

from training.gate import baselines, decide, decide_in_looks, solver_steps, spending
from training.metrics import Episode, Loss
from training.settings import GateSettings
from training.stats import rate_bounds
from training.tasks.tools_suite import ToolsSuite

SCENARIOS = [  # (name, candidate's success rate, reference's)
    ("no gain (30% both)", 0.30, 0.30),
    ("no gain (0% both)", 0.0, 0.0),
    ("clear gain (37% over 0%, the README's)", 0.37, 0.0),
    ("gain of 15 points (45% over 30%)", 0.45, 0.30),
    ("gain of 8 points (45% over 37%)", 0.45, 0.37),
]


@dataclass
class Side:
    episodes: list[Episode]
    general_losses: list[Loss] = field(default_factory=list)


def _episodes(tasks: list, steps: dict[str, int], rate: float, rng: random.Random) -> list[Episode]:
    return [Episode(task_id=t.id, family=t.family, success=rng.random() < rate, steps=steps[t.id],
                    tool_calls=max(steps[t.id] - 1, 0), invalid_calls=0, needs_tools=t.family != "cannot",
                    faulted=t.fault is not None, status="completed", termination_reason=None, final="", run_id="")
            for t in tasks]


def _one(args: tuple[int, float, float, list[int], int]) -> tuple[bool, bool, int]:
    seed, p_candidate, p_reference, looks, resamples = args
    suite, tasks, steps, trivial = _world()
    rng = random.Random(seed)
    candidate, reference = _episodes(tasks, steps, p_candidate, rng), _episodes(tasks, steps, p_reference, rng)
    fixed = GateSettings(resamples=resamples, seed=seed)
    fixed_passed = decide(Side(candidate), Side(reference), baselines=trivial, solver_steps=steps, gate=fixed).passed
    decision = decide_in_looks(candidate, reference, suite=suite, tasks=tasks, solver_steps=steps,
                               gate=GateSettings(resamples=resamples, seed=seed, looks=looks))
    return fixed_passed, decision.passed, decision.tasks


@functools.cache
def _world() -> tuple[ToolsSuite, list, dict[str, int], dict[str, float]]:
    """The gate's tasks, the solver's steps on them and the trivial policies' rates: once per worker process."""
    suite = ToolsSuite(tempfile.mkdtemp(prefix="gate-sim-"))
    gate = GateSettings()
    tasks = suite.draw("test", gate.tasks, seed=gate.seed, min_faulted=gate.min_faulted, min_direct=gate.min_direct)
    return suite, tasks, asyncio.run(solver_steps(suite, tasks)), baselines(suite, tasks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=400)
    parser.add_argument("--looks", type=int, nargs="+", default=[40, 70])
    parser.add_argument("--resamples", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    print(f"{args.runs} runs a scenario; sequential looks after {args.looks} and 100 tasks "
          f"(confidences {', '.join(f'{c:.2%}' for c in spending([*args.looks, 100], 0.95))}); "
          f"{args.resamples} bootstrap resamples")
    print("| scenario | fixed rule: accepted | sequential: accepted | sequential: mean tasks |")
    print("|---|---|---|---|")
    with ProcessPoolExecutor(args.workers) as pool:
        for name, p_candidate, p_reference in SCENARIOS:
            jobs = [(seed, p_candidate, p_reference, args.looks, args.resamples) for seed in range(args.runs)]
            results = list(pool.map(_one, jobs, chunksize=8))
            cells = []
            for i in (0, 1):
                accepted = sum(r[i] for r in results)
                low, high = rate_bounds(accepted, args.runs, 0.975)
                cells.append(f"{accepted / args.runs:.1%} ({low:.1%}–{high:.1%})")
            print(f"| {name} | {cells[0]} | {cells[1]} | {statistics.mean(r[2] for r in results):.0f} |")


if __name__ == "__main__":
    main()
