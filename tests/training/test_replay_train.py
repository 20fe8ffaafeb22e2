"""replay-train end to end, the gate with real adapters, and the leak check, on a tiny random Llama:
demonstrations captured into a real store, trained, evaluated through the agent loop, gated, registered."""

from __future__ import annotations

import asyncio
import io
import json
import socket
import sqlite3
from pathlib import Path

import httpx
import openai
import orjson
import pytest

from tests.extras import skip_without

skip_without("train")

from rich.console import Console

from gateway.app import build_app
from gateway.backends.local.loading import load_tokenizer
from replay import training_runs
from replay.adapters import AdapterRegistry
from replay.filters import Filters
from replay.importer import Conversation, import_conversations
from replay.store import TrajectoryStore
from tests.models import random_lora
from tests.standin import ServerThread
from tests.training.capitals import CapitalsSuite
from training import data
from training.capture import capture
from training.evaluate import Evaluator
from training.gate import baselines, decide, solver_steps
from training.general import GeneralCheck
from training.replay_train import ReplayTrainError, replay_train
from training.settings import HarnessSettings
from training.tasks import SUITES, get_suite, leak_filter, test_only_markers
from training.tasks.tools_suite import SIZES

pytestmark = pytest.mark.integration
TRAIN, VALIDATION = sum(SIZES["train"].values()), sum(SIZES["validation"].values())

GENERAL = [
    [{"role": "user", "content": f"Tell me something about the number {i}."},
     {"role": "assistant", "content": f"The number {i} comes after {i - 1} and before {i + 1}."}]
    for i in range(1, 25)
]


@pytest.fixture
def settings(tmp_path: Path, tiny_model_dir: Path) -> HarnessSettings:
    general = tmp_path / "general.jsonl"
    general.write_text("".join(json.dumps({"messages": m}) + "\n" for m in GENERAL))
    return HarnessSettings.model_validate({
        "store": {"path": str(tmp_path / "harness.db")},
        "training": {"model_path": str(tiny_model_dir), "output_dir": str(tmp_path / "runs"), "rank": 4,
                     "alpha": 8, "epochs": 0.25, "batch_size": 8, "grad_accum": 1, "checkpoints": 2, "max_seq_len": 768,
                     "eval_concurrency": 16, "eval_max_tokens": 4, "general_data": str(general),
                     "general_share": 0.1, "min_recovered_share": 0.2},
    })


def test_replay_train_selects_trains_validates_gates_and_registers(settings: HarnessSettings) -> None:
    result = asyncio.run(capture(settings, "tools", "train", attempts=0))
    assert result.demonstrations == TRAIN
    outcome = asyncio.run(replay_train(settings, Filters(source="demo"), console=Console(quiet=True)))
    assert outcome.decision is not None and outcome.registered is not None
    version = outcome.registered
    assert version.name == "tools" and version.version == 1
    assert version.status == ("active" if outcome.decision.passed else "candidate")
    stored = AdapterRegistry(settings.store.path).get("tools", 1).metrics
    assert stored["gate"]["passed"] == outcome.decision.passed
    assert set(stored["test"]) >= {"success_rate", "valid_call_rate", "recovery_rate", "general_perplexity",
                                   "unseen_tool_success_rate", "direct_answer_rate"}
    assert stored["test"]["unseen_tool_success_rate"] is not None  # the test split's convert_units tasks
    assert stored["test"]["direct_answer_rate"] is not None  # the gate's questions no offered tool fits
    assert stored["reference"]["model"] == "base"
    run = outcome.run_dir
    for name in ("eval.json", "eval.png", "loss.png", "metrics.jsonl"):
        assert (run / name).stat().st_size > 0, name
    assert (Path(version.path) / "adapter_config.json").is_file()
    before, after = orjson.loads((run / "eval.json").read_bytes())
    assert before["split"] == after["split"] == "gate" and len(after["episodes"]) == settings.training.gate.tasks
    assert stored["gate"]["tasks"] == 100 and len(stored["gate"]["checks"]) == 8
    # Each stage's wall time and what it processed, with the version and (with register too) in the run folder.
    stages = stored["stages"]
    assert [s["stage"] for s in stages] == ["select", "reward", "build", "sft", "validate", "reference", "evaluate",
                                            "gate"]
    assert all(s["seconds"] >= 0 for s in stages)
    by_name = {s["stage"]: s for s in stages}
    assert by_name["build"]["rows"] > TRAIN and by_name["sft"]["tokens"] > 0
    assert by_name["validate"]["episodes"] == 2 * VALIDATION and by_name["evaluate"]["episodes"] == 100
    assert by_name["reference"]["episodes"] == 100  # evaluated: nothing cached yet
    assert [s["stage"] for s in orjson.loads((run / "stages.json").read_bytes())][-1] == "register"

    # The store's row of the run: what the console shows, from any host.
    (row,) = _training_runs(settings)
    assert row.id == outcome.run_id and row.status == "completed" and row.error is None
    assert (row.name, row.mode, row.host, row.run_dir) == ("tools", "sft", socket.gethostname(), str(run))
    assert row.stages == orjson.loads((run / "stages.json").read_bytes()) and row.adapter_version == 1
    curves = row.metrics["curves"]
    assert [step for step, _ in curves["loss"]] == list(range(1, len(curves["loss"]) + 1))
    assert curves["loss"] and all(loss > 0 for _, loss in curves["loss"]) and curves["reward"] == []
    checkpoints = sorted((path.name for path in run.glob("checkpoint-*")), key=lambda n: int(n.split("-")[1]))
    assert len(checkpoints) == 2 and [(v["stage"], v["label"]) for v in curves["validation"]] == [
        ("sft", c) for c in checkpoints]
    assert all(0 <= v["metrics"]["success_rate"] <= 1 for v in curves["validation"])
    reference, candidate = row.metrics["reports"]
    assert (reference["role"], reference["model"]) == ("reference", "base") and candidate["role"] == "candidate"
    assert {"model": "base", **reference["metrics"]} == stored["reference"] and candidate["metrics"] == stored["test"]
    assert candidate["episodes"] == 100 and row.metrics["gate"] == stored["gate"]
    assert row.metrics["registered"] == {"name": "tools", "version": 1, "status": version.status, "published": False}


def _training_runs(settings: HarnessSettings) -> list[training_runs.TrainingRun]:
    async def read() -> list[training_runs.TrainingRun]:
        store = TrajectoryStore(settings.store.location)
        await store.start()
        try:
            return await training_runs.list_runs(store)
        finally:
            await store.close()

    return asyncio.run(read())


def test_a_run_that_cannot_go_on_leaves_a_failed_row_with_why(settings: HarnessSettings) -> None:
    with pytest.raises(ReplayTrainError, match="no trajectories match the filters"):
        asyncio.run(replay_train(settings, Filters(source="demo"), console=Console(quiet=True)))
    (row,) = _training_runs(settings)
    assert row.status == "failed" and row.name == "tools" and row.mode == "sft"
    assert row.error.startswith("no trajectories match the filters") and row.stages == [] and row.metrics is None
    assert row.adapter_version is None and AdapterRegistry(settings.store.path).all() == []


def test_publish_registers_publishes_and_promotes_on_a_running_gateway(capitals: HarnessSettings, tmp_path: Path,
                                                                      tiny_model_dir: Path) -> None:
    settings = capitals
    gateway_settings = HarnessSettings.model_validate({
        "store": {"path": str(tmp_path / "gateway.db")},
        "backends": [{"name": "local", "kind": "local", "model_path": str(tiny_model_dir),
                      "models": [settings.training.base_model]}],
        "routing": {"adapters_dir": str(tmp_path / "adapters")},
    })
    gateway_settings.server.admin_key = settings.server.admin_key = "admin-secret"
    asyncio.run(capture(settings, "capitals", "train", attempts=0))
    with ServerThread(build_app(gateway_settings), lifespan="on") as server:
        outcome = asyncio.run(replay_train(settings, Filters(source="demo"), publish=server.url,
                                           console=Console(quiet=True)))
        assert outcome.decision.passed and outcome.published
        assert outcome.registered.status == "active" and outcome.registered.uploaded
        cards = httpx.get(f"{server.url}/admin/adapters", headers={"Authorization": "Bearer admin-secret"}).json()
        (card,) = cards["data"]
        assert card["metrics"]["gate"]["passed"] is True and card["status"] == "active"
        assert cards["loaded"] == {"local": ["capitals@1"]}
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
        reply = client.chat.completions.create(model=f"{settings.training.base_model}:capitals", max_tokens=4,
                                               messages=[{"role": "user", "content": "hi"}])
        assert reply.choices[0].message.content is not None
    assert AdapterRegistry(settings.store.path).all() == []  # registered on the gateway, not twice


def test_nothing_from_the_held_out_splits_reaches_the_training_rows(settings: HarnessSettings) -> None:
    suite = get_suite("tools")
    held_out = [suite.tasks("test")[0], suite.tasks("validation")[0]]
    tokenizer = load_tokenizer(settings.training.model_path)

    async def fill() -> None:
        await capture(settings, "tools", "train", attempts=0)
        store = TrajectoryStore(settings.store.path)
        await store.start()
        leaked = [Conversation(line=i + 1, messages=[{"role": "system", "content": suite.system_prompt},
                                                      *await suite.solve(task)],
                               tools=suite.toolbox(task).openai_tools()) for i, task in enumerate(held_out)]
        await import_conversations(store, leaked, source="demo")
        await store.close()

    asyncio.run(fill())
    rows, stats = data.examples_from_store(settings.store.path, Filters(source="demo"), tokenizer,
                                           max_seq_len=2048, exclude=leak_filter(suite))
    assert stats.excluded >= 2 and rows
    markers = test_only_markers(suite)
    validation = [t.prompt for t in suite.tasks("validation")]
    for row in rows:
        text = tokenizer.decode(row.input_ids)
        assert not any(p in text for p in markers["prompts"])
        assert not any(p in text for p in validation)
        assert not any(t in text for t in markers["tools"])


@pytest.fixture
def capitals(settings: HarnessSettings, monkeypatch: pytest.MonkeyPatch) -> HarnessSettings:
    """The settings on the capitals suite (``tests/training/capitals.py``), trained hard enough to learn it."""
    monkeypatch.setitem(SUITES, "capitals", CapitalsSuite)
    return settings.model_copy(update={"training": settings.training.model_copy(update={
        "suite": "capitals", "epochs": 10.0, "learning_rate": 5e-3, "checkpoints": 1, "max_seq_len": 256})})


def test_a_trained_adapter_passes_the_gate_is_promoted_and_becomes_the_next_runs_reference(
        capitals: HarnessSettings, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = capitals
    asyncio.run(capture(settings, "capitals", "train", attempts=0))
    registry = AdapterRegistry(settings.store.path)

    def run() -> tuple[object, str]:
        console = Console(record=True, width=200, file=io.StringIO())
        outcome = asyncio.run(replay_train(settings, Filters(source="demo"), console=console))
        return outcome, console.export_text()

    first, printed = run()
    assert first.decision.passed, first.decision.failures()
    assert first.registered.status == "active" and registry.active("capitals").version == 1
    stored = registry.get("capitals", 1).metrics
    assert stored["reference"]["model"] == "base" and stored["gate"]["passed"] is True
    gain = stored["gate"]["checks"][0]
    assert gain["name"] == "success gain" and gain["bound"] > 0.2 and gain["n"] == 100
    assert stored["test"]["success_rate"] > 0.3 and stored["reference"]["success_rate"] == 0.0
    assert "bounds: passed" in " ".join(printed.split()) and "from the cache" not in printed
    # One checkpoint and no expert iteration: nothing for validation to choose between, so it is not run.
    assert stored["validation"] == {} and "skipped: one checkpoint" in " ".join(printed.split())

    # The next run is judged against the promoted version; trained the same way it gains nothing on it.
    second, printed = run()
    stored = registry.get("capitals", 2).metrics
    assert stored["reference"]["model"] == "capitals@1" and "from the cache" not in printed  # a new reference
    assert not second.decision.passed and second.registered.status == "candidate"
    assert registry.active("capitals").version == 1
    # Its reference report is read back while nothing it depends on changed, and evaluated anew when it does.
    third, printed = run()
    assert "capitals@1: its gate report from the cache" in printed
    monkeypatch.setattr(CapitalsSuite, "version", "2")
    fourth, printed = run()
    assert "from the cache" not in printed
    assert registry.get("capitals", 4).metrics["reference"]["model"] == "capitals@1"


def test_a_sequential_gate_publishes_a_clear_gain_after_its_first_look(capitals: HarnessSettings) -> None:
    training = capitals.training
    settings = capitals.model_copy(update={"training": training.model_copy(update={
        "gate": training.gate.model_copy(update={"looks": [40, 70]})})})
    asyncio.run(capture(settings, "capitals", "train", attempts=0))
    console = Console(record=True, width=200, file=io.StringIO())
    outcome = asyncio.run(replay_train(settings, Filters(source="demo"), console=console))
    assert outcome.decision.passed and outcome.decision.tasks == 40
    gate = AdapterRegistry(settings.store.path).get("capitals", 1).metrics["gate"]
    assert gate["looks"] == [{"tasks": 40, "confidence": pytest.approx(0.992), "outcome": "passed"}]
    reports = orjson.loads((outcome.run_dir / "eval.json").read_bytes())
    assert [len(r["episodes"]) for r in reports] == [40, 40]  # the base and the candidate, on the first block
    assert "gate look 40 tasks" in " ".join(console.export_text().split())
    # A reference that ran part of the tasks is not cached: the next run's would stand for tasks it never ran.
    assert not list((Path(training.output_dir) / "references").glob("*.json"))


def test_expert_iteration_trains_on_the_candidates_own_clean_successes(capitals: HarnessSettings) -> None:
    settings = capitals.model_copy(update={"training": capitals.training.model_copy(update={
        "expert": capitals.training.expert.model_copy(update={"rounds": 2, "tasks": 8, "samples": 3,
                                                              "epochs": 3.0})})})
    asyncio.run(capture(settings, "capitals", "train", attempts=0))
    console = Console(record=True, width=200, file=io.StringIO())
    outcome = asyncio.run(replay_train(settings, Filters(source="demo"), console=console))
    rounds = AdapterRegistry(settings.store.path).get("capitals", outcome.registered.version).metrics["expert"]
    # Each round screens 8 tasks greedily and samples 3 episodes of each one the screen failed.
    assert [r["round"] for r in rounds] == [1, 2] and all(r["tasks"] == 8 for r in rounds)
    assert all(r["episodes"] == 3 * r["failed"] and 0 <= r["kept"] <= r["succeeded"] <= r["episodes"]
               for r in rounds)
    trained = [r for r in rounds if r["kept"]]
    assert trained, rounds  # an SFT candidate that solves some capitals some of the time leaves something to keep
    assert all(r["rows"] >= r["kept"] and r["action"] in ("kept", "rejected") for r in trained)
    assert "expert    round 1:" in console.export_text()
    # The episodes are in the store, recorded and labelled as rollouts of their round.
    with sqlite3.connect(settings.store.path) as conn:
        recorded = conn.execute("SELECT json_extract(metadata, '$.expert_round'), COUNT(*) FROM trajectories "
                                "WHERE source = 'rollout' GROUP BY 1 ORDER BY 1").fetchall()
    assert recorded == [(r["round"], r["episodes"]) for r in rounds if r["episodes"]]
    stages = [s["stage"] for s in orjson.loads((outcome.run_dir / "stages.json").read_bytes())]
    assert stages.count("expert") == 2 and stages.index("expert") > stages.index("validate")


def test_correction_rounds_train_on_the_states_the_candidate_reached_with_the_teachers_turns(
        capitals: HarnessSettings) -> None:
    settings = capitals.model_copy(update={"training": capitals.training.model_copy(update={
        "epochs": 1.0,  # an SFT candidate that still gets some capitals wrong, so there is something to correct
        "correction": capitals.training.correction.model_copy(update={"rounds": 2, "tasks": 6, "samples": 1})})})
    asyncio.run(capture(settings, "capitals", "train", attempts=0))
    console = Console(record=True, width=200, file=io.StringIO())
    outcome = asyncio.run(replay_train(settings, Filters(source="demo"), console=console))
    rounds = AdapterRegistry(settings.store.path).get("capitals", outcome.registered.version).metrics["correction"]
    # Each round: one greedy and one sampled episode of each of 6 tasks; every assistant turn is a state.
    assert [r["round"] for r in rounds] == [1, 2] and all(r["episodes"] == 12 for r in rounds)
    assert all(r["states"] >= r["episodes"] and r["teacher"] == "solver" and r["teacher_dropped"] == 0
               for r in rounds)
    assert all(sum(r["disagreements"].values()) + r["agreed"] == r["states"] for r in rounds)
    # A capital's answer is all a turn can be, so every disagreement is a wrong answer, and every one a new row
    # unless the same state came up twice; rows add up across rounds (DAgger).
    assert all(set(r["disagreements"]) <= {"wrong_answer"} for r in rounds)
    assert sum(sum(r["disagreements"].values()) for r in rounds) > 0, rounds
    assert rounds[1]["correction_rows"] == rounds[0]["correction_rows"] + rounds[1]["new_rows"]
    assert all(r["action"] in ("kept", "rejected") for r in rounds if r["new_rows"])
    assert "correction round 1:" in console.export_text()
    with sqlite3.connect(settings.store.path) as conn:
        recorded = conn.execute("SELECT json_extract(metadata, '$.correction_round'), COUNT(*) FROM trajectories "
                                "WHERE source = 'rollout' GROUP BY 1 ORDER BY 1").fetchall()
    assert recorded == [(1, 12), (2, 12)]
    stages = [s["stage"] for s in orjson.loads((outcome.run_dir / "stages.json").read_bytes())]
    assert stages.count("correction") == 2 and stages.index("correction") > stages.index("validate")


def test_a_noise_adapter_fails_the_gate(capitals: HarnessSettings, tmp_path: Path, tiny_model_dir: Path) -> None:
    training = capitals.training
    suite = get_suite("capitals")
    tasks = suite.draw("test", training.gate.tasks, seed=training.gate.seed)
    general = GeneralCheck(training)
    noise = random_lora(tiny_model_dir, tmp_path / "noise", seed=7, scale=2.0)  # loud noise

    async def reports() -> list:
        async with Evaluator(training) as evaluator:
            return [await evaluator.evaluate_tasks(suite, tasks, adapter, split="gate", samples=training.gate.samples,
                                                   temperature=training.gate.temperature, general=general.losses)
                    for adapter in (None, noise)]

    base, bad = asyncio.run(reports())
    decision = decide(bad, base, baselines=baselines(suite, tasks),
                      solver_steps=asyncio.run(solver_steps(suite, tasks)), gate=training.gate)
    assert not decision.passed
    assert {c.name for c in decision.failures()} >= {"success gain", "perplexity rise"}
    assert bad.metrics["general_perplexity"] > base.metrics["general_perplexity"]


def _rl_settings(settings: HarnessSettings, **rl: object) -> HarnessSettings:
    return settings.model_copy(update={"training": settings.training.model_copy(update={
        "rl": settings.training.rl.model_copy(update={"tasks_per_step": 2, "group_size": 2, "eval_every": 1,
                                                      "validation_tasks": 3, "batch_size": 4, **rl})})})


def test_rl_mode_rolls_out_trains_validates_gates_and_registers(settings: HarnessSettings) -> None:
    settings = _rl_settings(settings, steps=2)
    outcome = asyncio.run(replay_train(settings, Filters(source="rollout"), mode="rl", console=Console(quiet=True)))
    assert outcome.decision is not None and outcome.registered is not None
    stored = AdapterRegistry(settings.store.path).get("tools", 1).metrics
    rl = stored["rl"]
    assert stored["mode"] == "rl" and rl["steps"] == 2 and rl["captured_steps"] == 0 and rl["rollouts"] == 8
    assert [v["step"] for v in rl["validations"]] == [0, 1, 2]
    assert rl["groups"] == 4 and 0 <= rl["flat_groups"] <= 4
    run = outcome.run_dir
    for name in ("rl/rl.png", "rl/metrics.jsonl", "rl/checkpoint-0/adapter_config.json", "eval.json", "eval.png"):
        assert (run / name).stat().st_size > 0, name
    lines = [json.loads(line) for line in (run / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1, 2]
    assert all(line["samples"] > 0 and "kl" in line and "clip_fraction" in line for line in lines[1:])
    with sqlite3.connect(settings.store.path) as conn:
        groups = conn.execute("SELECT group_id, COUNT(*) FROM trajectories WHERE source = 'rollout' "
                              "GROUP BY group_id").fetchall()
    assert len(groups) == 4 and all(n == 2 for _, n in groups)

    # A second run with no online steps trains on those captured groups alone, from the first run's adapter.
    again = asyncio.run(replay_train(_rl_settings(settings, steps=0), Filters(source="rollout"), mode="rl",
                                     init=str(outcome.registered.path), name="again", console=Console(quiet=True)))
    assert again.registered is not None
    rl = AdapterRegistry(settings.store.path).get("again", 1).metrics["rl"]
    assert rl["captured_steps"] == 2 and rl["steps"] == 2 and rl["rollouts"] == 0 and rl["groups"] == 4


def test_sft_then_rl_starts_from_the_sft_candidate(settings: HarnessSettings) -> None:
    asyncio.run(capture(settings, "tools", "train", attempts=0))
    settings = _rl_settings(settings, steps=1)
    outcome = asyncio.run(replay_train(settings, Filters(source="demo"), mode="sft+rl", console=Console(quiet=True)))
    assert outcome.registered is not None
    stored = AdapterRegistry(settings.store.path).get("tools", 1).metrics
    assert stored["mode"] == "sft+rl" and stored["rl"]["steps"] == 1
    (row,) = _training_runs(settings)
    curves = row.metrics["curves"]
    assert curves["loss"] and [v["label"] for v in curves["validation"] if v["stage"] == "rl"] == ["RL step 0",
                                                                                                 "RL step 1"]
    assert [step for step, _ in curves["reward"]] == [1] and isinstance(curves["reward"][0][1], float)
    assert row.metrics["rl"]["steps"] == 1 and [s["stage"] for s in row.stages][-3:] == ["evaluate", "gate",
                                                                                         "register"]
    run = outcome.run_dir
    assert (run / "sft" / "loss.png").is_file() and (run / "rl" / "rl.png").is_file()
    reports = orjson.loads((run / "eval.json").read_bytes())
    if stored["rl"]["best_step"]:
        assert [r["model"] for r in reports] == ["base", "before RL", "tools (candidate)"]
        assert stored["before_rl"]["model"] == "before RL"
        assert [r["role"] for r in row.metrics["reports"]] == ["reference", "before RL", "candidate"]
    else:  # RL kept the SFT candidate: it is the candidate itself
        assert [r["model"] for r in reports] == ["base", "tools (candidate)"]
        assert stored["checkpoint"].startswith("sft/checkpoint-")
