"""Where RL groups come from: task picking, fault injection, and rollouts through the agent loop into a real store,
read back with the exact log-probabilities the policy gave its tokens (tiny random Llama)."""

from __future__ import annotations

import asyncio
import random
import sqlite3
from pathlib import Path

import pytest

from tests.extras import skip_without

skip_without("train")

import torch

from gateway.backends.local.adapters import write_rendering
from gateway.backends.local.loading import load_model, load_tokenizer
from gateway.config import RewardSettings
from replay import feedback
from replay.filters import Filters
from replay.records import WriteOp
from replay.rewards import signal_weights
from replay.store import TrajectoryStore
from tests.models import random_lora
from tests.replay import builders
from tests.replay.builders import SYSTEM, TOOLS, answer, assistant_calls, tool_call, tool_result, tool_row
from training.data import examples_from_store
from training.evaluate import Evaluator
from training.metrics import Episode
from training.rl import collate, token_logprobs
from training.rollouts import Rollouts, TaskPicker, groups_from_store, with_fault
from training.settings import HarnessSettings
from training.tasks import get_suite
from training.tasks.base import FAULT_KINDS


def _episode(task_id: str, success: bool) -> Episode:
    return Episode(task_id=task_id, family="f", success=success, steps=1, tool_calls=0, invalid_calls=0,
                   needs_tools=True, faulted=False, status="completed", termination_reason=None, final="",
                   run_id="r")


def test_the_picker_chooses_tasks_of_similar_difficulty() -> None:
    tasks = get_suite("tools").tasks("train")[:40]
    picker = TaskPicker(tasks, seed=0)
    easy, hard = tasks[:20], tasks[20:]
    picker.observe([_episode(t.id, True) for t in easy for _ in range(4)])
    picker.observe([_episode(t.id, False) for t in hard for _ in range(4)])
    assert picker.difficulty(easy[0]) == pytest.approx(1 / 6) and picker.difficulty(hard[0]) == pytest.approx(5 / 6)
    kinds = set()
    for _ in range(20):
        chosen = picker.pick(8)
        assert len({t.id for t in chosen}) == 8
        ids = {t.id for t in chosen}
        assert ids <= {t.id for t in easy} or ids <= {t.id for t in hard}  # never a mix
        kinds.add(ids <= {t.id for t in easy})
    assert kinds == {True, False}  # both kinds get their turn


def test_faults_are_injected_at_the_configured_rate_into_tasks_with_tools() -> None:
    suite = get_suite("tools")
    tasks = [t for t in suite.tasks("train") if t.fault is None]
    rng = random.Random(0)
    drawn = [with_fault(t, rng, 0.25) for t in tasks * 10]
    faulted = [t for t in drawn if t.fault is not None]
    assert 0.2 < len(faulted) / len([t for t in drawn if t.tools]) < 0.3
    assert {t.fault.kind for t in faulted} == set(FAULT_KINDS)
    assert all(t.fault.tool in t.tools for t in faulted)
    assert all(with_fault(t, rng, 1.0).fault is None for t in tasks if not t.tools)
    assert all(with_fault(t, rng, 0.0) is t for t in tasks)


async def test_groups_from_the_store_count_what_they_cannot_use_and_credit_each_step(store: TrajectoryStore) -> None:
    question = [SYSTEM, {"role": "user", "content": "What is 2 + 2?"}]
    good = [(question, assistant_calls(tool_call("c1", "2+2"))),
            ([*question, assistant_calls(tool_call("c1", "2+2")), tool_result("c1", "4")], answer("4"))]
    bad = [(question, assistant_calls(tool_call("c1", "2+")))]
    write = builders.write
    solved = await write(store, good, group="g1", task="t1", status="completed", logprobs=True, tools=TOOLS,
                         tool_rows=[[tool_row("c1", True)], []])
    failed = await write(store, bad, group="g1", task="t1", status="completed", logprobs=True, tools=TOOLS,
                         tool_rows=[[tool_row("c1", False)]])
    other = await write(store, good, group="g1", model="another-model", logprobs=True)
    alone = await write(store, good, group="g2", logprobs=True)
    no_logprobs = await write(store, good, group="g3")
    partner = await write(store, good, group="g3", logprobs=True)
    await store.write(WriteOp(statements=[
        feedback.statement(solved, source="verifier", name="task_success", value=1.0),
        feedback.statement(failed, source="verifier", name="task_success", value=0.0)]))

    weights = signal_weights(RewardSettings())
    groups, stats = await groups_from_store(store, [solved, failed, other, alone, no_logprobs, partner], weights,
                                            base_model="base-m", outcome="success")
    assert (stats.trajectories, stats.groups, stats.other_model, stats.without_logprobs) == (6, 1, 1, 1)
    assert stats.without_siblings == 2  # alone, and partner whose sibling had no log-probabilities
    (group,) = groups
    assert group.key == "g1" and group.task_id == "t1" and not group.flat
    by_id = {t.id: t for t in group.trajectories}
    assert by_id[solved].success == 1.0 and by_id[failed].success == 0.0
    # The outcome is the verified success; the reward engine's total (validity, efficiency) only when asked for.
    assert (by_id[solved].reward, by_id[failed].reward) == (1.0, 0.0)
    (totals,), _ = await groups_from_store(store, [solved, failed], weights, base_model="base-m", outcome="total")
    by_total = {t.id: t.reward for t in totals.trajectories}
    assert by_total[solved] > 1.0 and by_total[failed] < 0.0
    assert [s.seq for s in by_id[solved].samples] == [0, 1]
    # the importance ratio's side: the log-probabilities the tokens were sampled with, at the call's temperature
    first = by_id[solved].samples[0]
    assert first.completion_ids == [100, 101] and first.logprobs == [-0.4, -0.2] and first.temperature == 0.5
    # The step with the valid call earns validity; the one with the invalid call pays the penalty.
    assert by_id[solved].step_rewards[0] > 0 > by_id[failed].step_rewards[0]
    assert 1 not in by_id[solved].step_rewards  # the answer called no tool: nothing to credit


@pytest.mark.integration
def test_rollouts_are_recorded_grouped_scored_and_carry_the_policys_own_logprobs(tmp_path: Path,
                                                                              tiny_model_dir: Path) -> None:
    settings = HarnessSettings.model_validate({
        "store": {"path": str(tmp_path / "harness.db")},
        # Unconstrained: under a grammar mask the captured log-probabilities are of the masked distribution.
        "training": {"model_path": str(tiny_model_dir), "eval_max_tokens": 6, "eval_concurrency": 8,
                     "constrain_tool_calls": False,
                     "rl": {"tasks_per_step": 3, "group_size": 3, "temperature": 1.0, "fault_rate": 1.0}},
    })
    policy = random_lora(tiny_model_dir, tmp_path / "policy", seed=5)
    write_rendering(policy, "compact")  # the policy was trained on compact tool specs: its rollouts are served so

    async def run() -> list:
        store = TrajectoryStore(settings.store.path)
        await store.start()
        try:
            async with Evaluator(settings.training) as evaluator:
                rollouts = Rollouts(settings, evaluator, store, run="test-run")
                groups = await rollouts.collect(1, policy)
                assert not await (await evaluator.started()).loaded_adapters()  # released for the trainer to rewrite
                return groups
        finally:
            await store.close()

    groups = asyncio.run(run())
    assert len(groups) == 3 and all(len(g.trajectories) == 3 for g in groups)
    with sqlite3.connect(settings.store.path) as conn:
        rows = conn.execute("SELECT source, group_id, task_id, final_reward, metadata FROM trajectories").fetchall()
        verdicts = conn.execute("SELECT COUNT(*) FROM feedback WHERE source = 'verifier' "
                                "AND name = 'task_success'").fetchone()[0]
    assert len(rows) == 9 and verdicts == 9
    assert {r[0] for r in rows} == {"rollout"}
    assert {r[1] for r in rows} == {g.key for g in groups}
    assert all(r[3] is not None for r in rows)
    assert all('"rl_run":"test-run"' in r[4] for r in rows)
    faulted = sum('"fault"' in r[4] for r in rows)
    assert faulted == 3 * sum(bool(get_suite("tools").task(g.task_id).tools) for g in groups)

    # The captured log-probabilities are the policy's own (temperature 1), token for token.
    from peft import PeftModel

    model = PeftModel.from_pretrained(load_model(str(tiny_model_dir)).model, str(policy))
    samples = [s for g in groups for s in g.samples()]
    assert samples and all(s.completion_ids for s in samples)
    batch = collate(samples, pad_id=0)
    with torch.no_grad():
        now = token_logprobs(model, batch)
    gap = ((now - batch.old_logprobs).abs() * batch.mask).max()
    assert float(gap) < 1e-3

    # Trained on again (SFT, expert iteration) in the policy's rendering, every call keeps the ids it was served.
    examples, stats = examples_from_store(settings.store.path, Filters(), load_tokenizer(str(tiny_model_dir)),
                                          max_seq_len=4096, rendering="compact")
    assert stats.calls == stats.captured == len(examples) > 0 and stats.mismatched == 0
    _, stats = examples_from_store(settings.store.path, Filters(), load_tokenizer(str(tiny_model_dir)),
                                   max_seq_len=4096, rendering="hermes")
    assert stats.captured == 0 and stats.mismatched == stats.calls


@pytest.mark.integration
@pytest.mark.slow
def test_on_the_embedded_model_the_captured_logprobs_are_what_training_computes(tmp_path: Path) -> None:
    """The real model: rollouts through the batched backend score each token as the trainer's forward pass does,
    so the first update's importance ratios are 1 and nothing is recomputed from text."""
    from training.sft import SFTConfig, load_base, wrap_lora

    loaded = load_base()
    model = wrap_lora(loaded.model, SFTConfig.from_settings())  # a fresh adapter: the policy is the base, through peft
    model.save_pretrained(str(tmp_path / "policy"), save_embedding_layers=False)
    settings = HarnessSettings.model_validate({
        "store": {"path": str(tmp_path / "harness.db")},
        "training": {"eval_max_tokens": 24, "eval_concurrency": 4, "constrain_tool_calls": False,
                     "rl": {"tasks_per_step": 2, "group_size": 2, "temperature": 1.0}}})

    async def run() -> list:
        store = TrajectoryStore(settings.store.path)
        await store.start()
        try:
            async with Evaluator(settings.training) as evaluator:
                return await Rollouts(settings, evaluator, store, run="real").collect(1, tmp_path / "policy")
        finally:
            await store.close()

    samples = [s for g in asyncio.run(run()) for s in g.samples()]
    assert len(samples) >= 4
    batch = collate(samples, pad_id=loaded.tokenizer.pad_token_id)
    with torch.no_grad():
        now = token_logprobs(model, batch)
    assert float(((now - batch.old_logprobs).abs() * batch.mask).max()) < 1e-3
