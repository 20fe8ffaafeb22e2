"""The reward engine over a real store: runs of the real agent loop with a scripted model, and
agent-like or proxy trajectories written through the store's own write path (CallRecord with tool calls)."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from gateway.agent.limits import Limits
from gateway.agent.loop import Profile
from gateway.config import ConfigError, RewardSettings, load_settings
from harness.replay import with_filters
from harness.rewards import rewards as rewards_command
from replay import feedback, hashing, vocabulary
from replay.filters import Filters
from replay.model import Feedback
from replay.records import CallRecord, TrajectoryRef, WriteOp, new_id
from replay.rewards import (
    ENGINE,
    SUCCESS_UNKNOWN,
    RewardError,
    combine,
    load_view,
    recompute,
    score,
    signal_weights,
)
from replay.signals import (
    PENALISED_TERMINATIONS,
    SIGNALS,
    TrajectoryView,
    evidence,
    feedback_outcome,
    register_signal,
    unregister_signal,
    used_in,
)
from replay.signals import Target as _Target
from replay.store import TrajectoryStore
from tests.gateway.agent.conftest import WEATHER, Box, run_agent
from tests.scripted import call

SYSTEM = {"role": "system", "content": "You are a test agent."}
TEMPS = {"Paris": 21, "London": 14, "Berlin": 9}
DEFAULT = RewardSettings()
FULL = 1.0 + 0.3 + 1.0 + 0.1  # the absolute sum of the default weights


async def feedback_rows(store: TrajectoryStore, trajectory_id: str, source: str | None = None) -> list[dict[str, Any]]:
    t = await store.get_trajectory(trajectory_id, all_tenants=True)
    return [f.to_dict() for f in (t.feedback if t else []) if source is None or f.source == source]


async def city_weather(args: dict[str, Any]) -> dict[str, Any]:
    return {"city": args["city"], "temp_c": TEMPS.get(args["city"], 0)}


def box() -> Box:
    return Box({"get_weather": (WEATHER, city_weather),
                "broken": ({"type": "object"}, _broken)})


async def _broken(args: dict[str, Any]) -> Any:
    raise RuntimeError("disk on fire")


def calls(*pairs: tuple[str, dict[str, Any]]) -> dict[str, Any]:
    """One assistant message calling several tools at once."""
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{i}_{new_id()}", "type": "function",
         "function": {"name": name, "arguments": json.dumps(args)}} for i, (name, args) in enumerate(pairs)]}


def weather(city: str) -> dict[str, Any]:
    return call("get_weather", {"city": city})


async def agent(store: TrajectoryStore, script: list, **kw: Any) -> str:
    state, _, _ = await run_agent(store, script, box=box(), **kw)
    return state.run_id


async def scored(store: TrajectoryStore, tid: str, settings: RewardSettings = DEFAULT, **kw: Any):
    view = await load_view(store, tid, **kw)
    assert view is not None
    return score(view, settings)


class Traj:
    """An agent-like (or proxy) trajectory written through the real write path, one model call at a time."""

    def __init__(self, store: TrajectoryStore, task: str = "What is the weather in Paris?",
                 source: str = "agent") -> None:
        self.store = store
        self.id = new_id()
        self.seq = 0
        self.source = source
        self.messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": task}]

    async def _record(self, message: dict[str, Any], rows: list[dict[str, Any]] | None = None,
                      purpose: str = "step", request: list[dict[str, Any]] | None = None) -> int:
        request = list(self.messages) if request is None else request
        seq = self.seq
        await self.store.record(CallRecord(
            trajectory=TrajectoryRef(id=self.id, seq=seq, is_new=seq == 0), request_messages=request,
            request_prefix=hashing.prefix_hashes(request), status="ok", source=self.source,
            response={"id": "x", "object": "chat.completion", "model": "m", "choices": [
                {"index": 0, "message": message, "finish_reason": "stop"}]},
            params={"purpose": purpose} if self.source == "agent" else {}, tool_calls=rows or [],
            prompt_tokens=10, completion_tokens=5))
        self.seq += 1
        return seq

    async def tools(self, *made: dict[str, Any]) -> int:
        """Each: name, args, and result, status (ok), valid (True); proxy calls are ``returned``."""
        message = {"role": "assistant", "content": None, "tool_calls": [
            {"id": f"c{self.seq}_{i}", "type": "function",
             "function": {"name": m["name"], "arguments": json.dumps(m["args"])}} for i, m in enumerate(made)]}
        proxy = self.source == "proxy"
        rows = [{"call_id": f"c{self.seq}_{i}", "name": m["name"], "raw_arguments": json.dumps(m["args"]),
                 "parsed": True, "repaired": False, "valid": m.get("valid", True), "validation_error": None,
                 "status": m.get("status", "returned" if proxy else "ok"),
                 "result": None if proxy else json.dumps(m.get("result")), "duration_ms": 1.0}
                for i, m in enumerate(made)]
        seq = await self._record(message, rows)
        self.messages.append(message)
        for i, m in enumerate(made):
            self.messages.append({"role": "tool", "tool_call_id": f"c{seq}_{i}",
                                  "content": json.dumps(m.get("result"))})
        return seq

    async def summary(self) -> int:
        return await self._record({"role": "assistant", "content": "They asked about Paris."}, purpose="summary",
                                  request=[{"role": "user", "content": "Summarize."}])

    async def answer(self, text: str) -> int:
        message = {"role": "assistant", "content": text}
        seq = await self._record(message)
        self.messages.append(message)
        return seq

    async def finish(self, status: str = "completed", reason: str | None = None) -> str:
        await self.store.write(WriteOp(statements=[(
            "UPDATE trajectories SET status = ?, termination_reason = ? WHERE id = ?", (status, reason, self.id))]))
        return self.id


def view(**kw: Any) -> TrajectoryView:
    base: dict[str, Any] = dict(id="t", source="agent", status="completed", termination_reason=None, messages=[],
                                tool_calls=[], final_answer="", steps=1, step_seqs=[0], step_limit=10, feedback=[])
    return TrajectoryView(**{**base, **kw})


# -- task success --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "value", "label", "expected"), [
    ("thumbs", None, "up", 1.0), ("thumbs", None, "down", 0.0), ("thumbs", 1.0, None, 1.0),
    ("thumbs", -1.0, None, 0.0), ("score", 0.7, None, 0.7), ("outcome", None, "success", 1.0),
    ("outcome", None, "Failure", 0.0), ("score", 4.0, None, None), ("note", None, "nice prose", None),
])
def test_feedback_outcomes(name: str, value: float | None, label: str | None, expected: float | None) -> None:
    assert feedback_outcome(Feedback("user", name, value, label)) == expected


async def test_verifier_beats_user_and_user_beats_unknown(store: TrajectoryStore) -> None:
    tid = await agent(store, [weather("Paris"), "It is 21 °C in Paris."])
    assert (await scored(store, tid)).signals["task_success"] is None
    await feedback.add(store, tid, source="user", name="thumbs", label="up")
    assert (await scored(store, tid)).signals["task_success"] == 1.0
    await feedback.add(store, tid, source="user", name="score", value=0.25)  # the newer user verdict wins
    assert (await scored(store, tid)).signals["task_success"] == 0.25
    await feedback.add(store, tid, source="verifier", name="tests", label="failure")
    result = await scored(store, tid)
    assert result.signals["task_success"] == 0.0 and not result.success_unknown


async def test_unknown_success_renormalises_and_flags(store: TrajectoryStore) -> None:
    tid = await agent(store, [weather("Paris"), "It is 21 °C in Paris."])
    summary = await recompute(store, Filters(), DEFAULT)
    assert summary.count == 1 and summary.unknown_success == 1
    assert summary.signal_unknown["task_success"] == 1 and summary.signal_means["task_success"] is None
    # validity 1, no penalty, efficiency 1 - 1/10: the known weights (0.3, -1, 0.1) scaled to the full 2.4
    expected = (0.3 * 1.0 + 0.1 * 0.9) * FULL / (0.3 + 1.0 + 0.1)
    row = await store.get_trajectory(tid, all_tenants=True)
    assert row.final_reward == pytest.approx(expected)
    flags = {r["name"]: r for r in await feedback_rows(store, tid, source=ENGINE) if r["model_call_seq"] is None}
    assert flags[SUCCESS_UNKNOWN]["value"] == 1.0
    assert flags["task_success"]["value"] is None and flags["task_success"]["label"] == "unknown"
    await feedback.add(store, tid, source="verifier", name="tests", value=1.0)
    await recompute(store, Filters(), DEFAULT)
    row = await store.get_trajectory(tid, all_tenants=True)
    assert row.final_reward == pytest.approx(1.0 + 0.3 + 0.1 * 0.9)
    flags = {r["name"]: r["value"] for r in await feedback_rows(store, tid, source=ENGINE)
             if r["model_call_seq"] is None}
    assert flags[SUCCESS_UNKNOWN] == 0.0 and flags["task_success"] == 1.0


def test_renormalisation_keeps_each_known_share_whatever_the_sign() -> None:
    weights = {"a": 1.0, "b": -1.0, "c": 0.5}
    assert combine({"a": None, "b": 1.0, "c": 0.5}, weights) == pytest.approx((-1.0 + 0.25) * 2.5 / 1.5)
    assert combine({"a": 1.0, "b": 0.0, "c": 1.0}, weights) == pytest.approx(1.5)  # all known: plain sum
    assert combine({"a": None, "b": None, "c": None}, weights) is None
    assert combine({"a": None, "b": 1.0}, {"a": 1.0, "b": 0.0}) == 0.0


# -- process validity -----------------------------------------------------------------------------------


async def test_ignored_result_scores_lower_process_validity(store: TrajectoryStore) -> None:
    honest = await agent(store, [weather("Paris"), "It is 21 °C in Paris."])
    ignored = await agent(store, [weather("Paris"), "It is probably sunny and mild."])
    assert (await scored(store, honest)).signals["process_validity"] == 1.0
    assert (await scored(store, ignored)).signals["process_validity"] == 0.0


@pytest.mark.parametrize("padding", ["extra steps", "same step"])
async def test_padding_never_out_scores_the_honest_run(store: TrajectoryStore, padding: str) -> None:
    honest = await agent(store, [weather("Paris"), "It is 21 °C in Paris."])
    script = ([weather("London"), weather("Berlin"), weather("Paris")] if padding == "extra steps" else
              [calls(("get_weather", {"city": "London"}), ("get_weather", {"city": "Berlin"}),
                     ("get_weather", {"city": "Paris"}))])
    padded = await agent(store, [*script, "It is 21 °C in Paris."])
    for tid in (honest, padded):  # the same outcome
        await feedback.add(store, tid, source="verifier", name="tests", value=1.0)
    h, p = await scored(store, honest), await scored(store, padded)
    assert p.signals["process_validity"] == pytest.approx(1 / 3)  # three valid calls, one result used
    assert h.signals["process_validity"] == 1.0
    assert p.total < h.total
    assert p.signals["efficiency"] < h.signals["efficiency"]  # side by side in one step or one after another


async def test_repeating_a_good_call_is_padding(store: TrajectoryStore) -> None:
    honest = await agent(store, [weather("Paris"), "It is 21 °C in Paris."])
    repeated = await agent(store, [calls(("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Paris"})),
                                   "It is 21 °C in Paris."])
    h, r = await scored(store, honest), await scored(store, repeated)
    assert h.signals["process_validity"] == 1.0
    assert r.signals["process_validity"] == pytest.approx(1 / 2)  # the repeat learnt nothing


async def test_result_used_in_a_later_calls_arguments(store: TrajectoryStore) -> None:
    t = Traj(store, "Where is order 7?")
    await t.tools({"name": "find_order", "args": {"n": 7}, "result": {"tracking": "ZX-99887766-DE"}})
    await t.tools({"name": "track", "args": {"code": "ZX-99887766-DE"}, "result": {"where": "Lyon depot"}})
    await t.answer("It is at the Lyon depot.")
    tid = await t.finish()
    # first result used in the second call's arguments; the second's "Lyon depot" (10 characters) in the answer
    assert (await scored(store, tid)).signals["process_validity"] == 1.0


async def test_proxy_results_come_from_the_clients_tool_messages(store: TrajectoryStore) -> None:
    used, ignored = Traj(store, source="proxy"), Traj(store, source="proxy")
    for t, text in ((used, "It is 21 °C."), (ignored, "No idea.")):
        await t.tools({"name": "get_weather", "args": {"city": "Paris"}, "result": {"temp_c": 21}})
        await t.answer(text)
    assert (await scored(store, used.id)).signals["process_validity"] == 1.0
    assert (await scored(store, ignored.id)).signals["process_validity"] == 0.0


async def test_no_tool_calls_earns_no_validity_and_neither_do_failed_calls(store: TrajectoryStore) -> None:
    chat = await agent(store, ["Bonjour."])
    assert (await scored(store, chat)).signals["process_validity"] == 0.0  # not acting is not credited
    failed = await agent(store, [call("broken", {}), "It broke."])
    assert (await scored(store, failed)).signals["process_validity"] == 0.0


def test_evidence_numbers_and_long_strings() -> None:
    ev = evidence(json.dumps({"temperature_c": 21.456, "station": "Montparnasse", "ok": True, "n": 3}))
    assert ev.numbers == {"21.456", "3"} and "montparnasse" in ev.strings
    assert "temperature_c" not in ev.strings  # keys are not evidence
    assert used_in(ev, [_Target.of("About 21.5 degrees")]) and used_in(ev, [_Target.of("about 21 °C")])
    assert not used_in(ev, [_Target.of("about 22 °C, 210 m")])
    assert used_in(ev, [_Target.of("near MONTPARNASSE")])
    assert used_in(evidence("total: 1234567 people"), [_Target.of("1,234,567")])
    assert evidence(json.dumps({"city": "Rome"})).empty  # short strings are no evidence


# -- illegal actions and efficiency ------------------------------------------------------------------------


async def test_invalid_call_penalty_and_per_step_rows(store: TrajectoryStore) -> None:
    tid = await agent(store, [call("get_weather", {"town": "Paris"}), weather("Paris"), "It is 21 °C."])
    result = await scored(store, tid)
    assert result.signals["illegal_action_penalty"] == pytest.approx(1 / 3)  # one bad step of three
    assert result.signals["process_validity"] == pytest.approx(0.5)
    await recompute(store, Filters(), DEFAULT)
    rows = await feedback_rows(store, tid, source=ENGINE)
    per_step = {(r["name"], r["model_call_seq"]): r["value"] for r in rows if r["model_call_seq"] is not None}
    assert per_step == {("process_validity", 0): 0.0, ("process_validity", 1): 1.0,
                        ("illegal_action_penalty", 0): 1.0, ("illegal_action_penalty", 1): 0.0}
    steps = {c.step for c in (await store.get_trajectory(tid, all_tenants=True)).tool_calls}
    assert steps == {0, 1}


async def test_per_step_rows_name_the_model_call_seq_past_a_summary(store: TrajectoryStore) -> None:
    t = Traj(store)
    await t.tools({"name": "get_weather", "args": {"city": "Lyon"}, "result": {"temp_c": 17}})
    await t.summary()  # seq 1: not a step
    ignored = await t.tools({"name": "get_weather", "args": {"city": "Nice"}, "result": {"temp_c": 25}})
    bad = await t.tools({"name": "get_weather", "args": {"town": "Paris"}, "valid": False, "status": "invalid",
                         "result": "Invalid call"})
    last = await t.answer("Lyon is at 17 °C.")
    tid = await t.finish()
    assert (ignored, bad, last) == (2, 3, 4)
    await recompute(store, Filters(), DEFAULT)
    rows = await feedback_rows(store, tid, source=ENGINE)
    validity = {r["model_call_seq"]: r["value"] for r in rows if r["name"] == "process_validity"}
    illegal = {r["model_call_seq"]: r["value"] for r in rows if r["name"] == "illegal_action_penalty"}
    assert validity == {None: pytest.approx(2 / 3 * 1 / 2), 0: 1.0, 2: 0.0, 3: 0.0}
    assert illegal == {None: pytest.approx(1 / 4), 0: 0.0, 2: 0.0, 3: 1.0}  # four steps: the summary is none
    eff = next(r["value"] for r in rows if r["name"] == "efficiency")
    assert eff == pytest.approx(1 - 3 / 10)


async def test_loop_and_budget_terminations_cost_the_whole_penalty(store: TrajectoryStore) -> None:
    looped = await agent(store, [weather("Paris")] * 3 + ["best I can do: 21 °C"])
    capped = await agent(store, [weather(c) for c in ("Paris", "London", "Berlin", "Rome")],
                         profile=Profile(name="t", model="scripted-model", tools=["get_weather"],
                                         limits=Limits(max_steps=3)))
    tokens = await agent(store, [weather(c) for c in "ABCDEF"],
                         profile=Profile(name="t", model="scripted-model", tools=["get_weather"],
                                         limits=Limits(max_total_tokens=40)))
    failing = await agent(store, [call("broken", {"n": i}) for i in range(10)],
                          profile=Profile(name="t", model="scripted-model", tools=["broken"],
                                          limits=Limits(max_consecutive_tool_failures=2)))
    for tid, reason in ((looped, "loop_detected"), (capped, "max_steps"), (tokens, "max_total_tokens"),
                        (failing, "tool_failures")):
        result = await scored(store, tid)
        assert (await load_view(store, tid)).termination_reason == reason
        assert result.signals["illegal_action_penalty"] == 1.0, reason
    # stopped by max_steps: the limit it hit is the scale, three steps of three
    assert (await scored(store, capped)).signals["efficiency"] == pytest.approx(1 - 2 / 3)


def test_every_loop_or_budget_reason_is_penalised() -> None:
    assert PENALISED_TERMINATIONS == {vocabulary.LOOP_DETECTED, vocabulary.MAX_STEPS, vocabulary.MAX_TOTAL_TOKENS,
                                      vocabulary.DEADLINE, vocabulary.TOOL_FAILURES}
    penalty = SIGNALS["illegal_action_penalty"]
    for reason in PENALISED_TERMINATIONS:
        assert penalty(view(termination_reason=reason)) == 1.0
    assert penalty(view(termination_reason=vocabulary.CLIENT_DISCONNECTED)) == 0.0


async def test_efficiency_scales_by_the_profiles_step_limit(store: TrajectoryStore) -> None:
    tid = await agent(store, [weather("Paris"), "It is 21 °C in Paris."])
    assert (await scored(store, tid)).signals["efficiency"] == pytest.approx(0.9)  # default limit 10
    assert (await scored(store, tid, step_limits={"t": 4})).signals["efficiency"] == pytest.approx(0.75)
    efficiency = SIGNALS["efficiency"]
    assert efficiency(view(steps=1)) == 1.0 and efficiency(view(steps=40)) == 0.0
    assert efficiency(view(steps=0)) is None


# -- recomputing, storing, plugins -----------------------------------------------------------------------------


async def _engine_rows(store: TrajectoryStore, tid: str) -> list[tuple]:
    return sorted((r["name"], r["model_call_seq"] if r["model_call_seq"] is not None else -1, r["value"],
                   r["label"], r["comment"]) for r in await feedback_rows(store, tid, source=ENGINE))


async def test_recompute_is_idempotent_and_deterministic(store: TrajectoryStore) -> None:
    a = await agent(store, [weather("London"), weather("Paris"), "It is 21 °C in Paris."])
    b = await agent(store, [call("get_weather", {"town": "Paris"}), "No idea."])
    await feedback.add(store, a, source="user", name="thumbs", label="up")
    first = await recompute(store, Filters(), DEFAULT)
    rows = {t: await _engine_rows(store, t) for t in (a, b)}
    rewards = {t: (await store.get_trajectory(t, all_tenants=True)).final_reward for t in (a, b)}
    second = await recompute(store, Filters(), DEFAULT)
    assert second == first
    assert {t: await _engine_rows(store, t) for t in (a, b)} == rows  # replaced, not added to
    assert {t: (await store.get_trajectory(t, all_tenants=True)).final_reward for t in (a, b)} == rewards
    assert [r["label"] for r in await feedback_rows(store, a, source="user")] == ["up"]  # others' rows stay
    assert first.count == 2 and first.unknown_success == 1
    assert first.mean_reward == pytest.approx(sum(rewards.values()) / 2)


async def test_filters_select_and_in_flight_runs_are_skipped(store: TrajectoryStore) -> None:
    done = await agent(store, [weather("Paris"), "It is 21 °C in Paris."])
    t = Traj(store, source="proxy")
    await t.answer("Hello.")
    running = Traj(store)
    await running.tools({"name": "get_weather", "args": {"city": "Paris"}, "result": {"temp_c": 21}})
    await running.finish("running")
    summary = await recompute(store, Filters(source="proxy"), DEFAULT)
    assert summary.count == 1
    assert (await store.get_trajectory(done, all_tenants=True)).final_reward is None
    summary = await recompute(store, Filters(), DEFAULT)
    assert (summary.count, summary.skipped) == (2, 1)
    assert await feedback_rows(store, running.id) == []
    assert (await recompute(store, Filters(source="nobody"), DEFAULT)).count == 0


async def test_custom_signal_is_picked_up_with_its_weight(store: TrajectoryStore) -> None:
    tid = await agent(store, [weather("Paris"), "It is 21 °C in Paris."])
    await feedback.add(store, tid, source="verifier", name="tests", value=1.0)

    @register_signal("names_the_city")
    class NamesTheCity:
        def __call__(self, v: TrajectoryView) -> float | None:
            return 1.0 if "Paris" in (v.final_answer or "") else 0.0

    try:
        settings = RewardSettings.model_validate({"names_the_city": 0.5})
        assert signal_weights(settings)["names_the_city"] == 0.5
        await recompute(store, Filters(), settings)
        row = await store.get_trajectory(tid, all_tenants=True)
        assert row.final_reward == pytest.approx(1.0 + 0.3 + 0.1 * 0.9 + 0.5)
        stored = {r["name"]: r for r in await feedback_rows(store, tid, source=ENGINE)}
        assert stored["names_the_city"]["value"] == 1.0 and stored["names_the_city"]["comment"] == "weight 0.5"
        # registered but not weighted: stored, not summed
        await recompute(store, Filters(), DEFAULT)
        assert (await store.get_trajectory(tid, all_tenants=True)).final_reward == pytest.approx(1.39)
        assert {r["name"] for r in await feedback_rows(store, tid, source=ENGINE)} >= {"names_the_city"}
    finally:
        unregister_signal("names_the_city")
    with pytest.raises(RewardError, match="not registered: names_the_city"):
        await recompute(store, Filters(), settings)


async def test_misbehaving_signal_is_a_clear_error(store: TrajectoryStore) -> None:
    tid = await agent(store, ["Hi."])
    register_signal("too_big")(lambda v: 2.0)
    try:
        with pytest.raises(RewardError, match="'too_big' gave 2.0"):
            await scored(store, tid)
    finally:
        unregister_signal("too_big")
    with pytest.raises(ValueError, match="already registered"):
        register_signal("efficiency")(lambda v: 1.0)


def test_reward_settings_shape() -> None:
    s = load_settings(None, environ={"HARNESS_REWARDS__EFFICIENCY": "0.2", "HARNESS_REWARDS__CITES": "0.4"})
    assert s.rewards.weights() == {"task_success": 1.0, "process_validity": 0.3, "illegal_action_penalty": -1.0,
                                   "efficiency": 0.2, "cites": 0.4}
    with pytest.raises(ConfigError, match="must be a finite number"):
        load_settings(None, environ={"HARNESS_REWARDS__CITES": "lots"})
    with pytest.raises(ConfigError, match="rewards.task_success"):
        load_settings(None, environ={"HARNESS_REWARDS__TASK_SUCCESS": "nan"})


# -- the command ----------------------------------------------------------------------------------------------


def _cli() -> typer.Typer:
    app = typer.Typer()

    @app.callback()
    def replay() -> None:
        pass

    app.command("rewards")(with_filters(rewards_command))  # as replay/cli.py registers it
    return app


def _config(tmp_path: Path, db: Path, extra: str = "") -> str:
    path = tmp_path / "harness.toml"
    path.write_text(f'[store]\npath = "{db}"\n\n[rewards]\nefficiency = 0.2\n{extra}')
    return str(path)


def test_cli_scores_and_summarises(tmp_path: Path) -> None:
    db = tmp_path / "cli.db"

    async def build() -> None:
        s = TrajectoryStore(str(db))
        await s.start()
        try:
            await agent(s, [weather("Paris"), "It is 21 °C in Paris."])
            t = Traj(s, source="proxy")
            await t.answer("Hello.")
            await feedback.add(s, t.id, source="user", name="thumbs", label="down")
        finally:
            await s.close()

    asyncio.run(build())
    runner = CliRunner()
    out = runner.invoke(_cli(), ["rewards", "--config", _config(tmp_path, db), "--json"])
    assert out.exit_code == 0, out.output
    summary = json.loads(out.stdout)
    assert summary["count"] == 2 and summary["unknown_success"] == 1
    assert summary["weights"]["efficiency"] == 0.2 and summary["signal_means"]["task_success"] == 0.0
    out = runner.invoke(_cli(), ["rewards", "--store", str(db), "--source", "proxy"])
    assert out.exit_code == 0, out.output
    assert "scored 1 trajectories" in out.stdout and "mean reward" in out.stdout and "efficiency" in out.stdout
    out = runner.invoke(_cli(), ["rewards", "--store", str(db), "--source", "bot"])
    assert out.exit_code == 0 and "no trajectories match the filters" in out.output
    out = runner.invoke(_cli(), ["rewards", "--store", str(db), "--since", "last tuesday"])
    assert out.exit_code == 2 and "not an ISO 8601 time" in out.output
    out = runner.invoke(_cli(), ["rewards", "--config", _config(tmp_path, db, "mystery = 1.0\n")])
    assert out.exit_code == 2 and "not registered: mystery" in out.output


def test_cli_refuses_a_bad_store(tmp_path: Path) -> None:
    runner = CliRunner()
    missing = runner.invoke(_cli(), ["rewards", "--store", str(tmp_path / "none.db")])
    assert missing.exit_code == 1 and "no store at" in missing.output
    assert not (tmp_path / "none.db").exists()
    corrupt = tmp_path / "corrupt.db"
    corrupt.write_bytes(b"this is not a database at all" * 100)
    out = runner.invoke(_cli(), ["rewards", "--store", str(corrupt)])
    assert out.exit_code == 1 and "not an SQLite database" in out.output
    newer = tmp_path / "newer.db"
    with sqlite3.connect(newer) as db:
        db.execute("CREATE TABLE t(x)")
        db.execute("PRAGMA user_version = 999")
    out = runner.invoke(_cli(), ["rewards", "--store", str(newer)])
    assert out.exit_code == 1 and "newer than this program knows" in out.output


async def test_calls_without_a_conversation_are_left_unscored(store: TrajectoryStore) -> None:
    """A prompt completed or texts embedded hold no conversation: nothing for the signals to judge."""
    chat = CallRecord(trajectory=TrajectoryRef(new_id(), 0, True), request_prefix=[], status="ok",
                      request_messages=[{"role": "user", "content": "hi"}],
                      response={"choices": [{"index": 0, "message": {"role": "assistant", "content": "hello"},
                                             "finish_reason": "stop"}]})
    native = [CallRecord(trajectory=TrajectoryRef(new_id(), 0, True), request_messages=[], request_prefix=[],
                         status="ok", response={"object": kind, "usage": {"prompt_tokens": 2}}, prompt_tokens=2,
                         native={"api": api, "request": {"model": "m"}, "response": {"object": kind}})
              for api, kind in (("completions", "text_completion"), ("embeddings", "list"))]
    await store.write(WriteOp(records=[chat, *native]))
    summary = await recompute(store, Filters(), RewardSettings())
    assert (summary.count, summary.skipped) == (1, 2)
    for rec in native:
        t = await store.get_trajectory(rec.trajectory.id, all_tenants=True)
        assert t is not None and t.format == rec.native["api"] and t.final_reward is None
    assert (await store.get_trajectory(chat.trajectory.id, all_tenants=True)).final_reward is not None
