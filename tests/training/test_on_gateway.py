"""``replay-train --gateway``: rollouts through a real gateway whose model is served by two SGLang stand-in replicas
(and one vLLM stand-in): each step's adapter is a new version every replica has loaded before the step's first
call, the recorded tokens and log-probabilities are the sampling replica's, and the gateway does not record the
trainer's calls a second time."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.extras import skip_without

skip_without("train")

from gateway.app import build_app
from gateway.config import Settings
from replay.store import TrajectoryStore
from tests.standin import ServerThread
from tests.standins.common import LoRAServerStandIn
from tests.standins.sglang import SGLangStandIn
from tests.standins.vllm import VLLMStandIn
from training.on_gateway import GatewayEvaluator, GatewayRefused
from training.rollouts import Rollouts
from training.settings import HarnessSettings
from training.tasks import get_suite

pytestmark = pytest.mark.integration

ADMIN = "admin-secret"
BASE = "qwen-test"
RUN = "test"
NAME = f"rollouts-{RUN}"


def write_adapter(folder: Path, rank: int) -> Path:
    """An adapter folder as the trainer leaves one (the stand-ins read its config; the weights are never run)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj", "v_proj"]}))
    (folder / "adapter_model.safetensors").write_bytes(b"weights %d" % rank)
    return folder


@dataclass
class Setup:
    url: str
    replicas: dict[str, LoRAServerStandIn]
    settings: HarnessSettings
    tmp: Path

    def evaluator(self, **training: Any) -> GatewayEvaluator:
        settings = self.settings.training.model_copy(update=training)
        return GatewayEvaluator(settings, self.url, ADMIN, run=RUN)

    def registry(self) -> dict[int, dict[str, Any]]:
        cards = httpx.get(f"{self.url}/admin/adapters", headers={"Authorization": f"Bearer {ADMIN}"}).json()["data"]
        return {c["version"]: c for c in cards if c["name"] == NAME}


@contextmanager
def gateway(tmp: Path, replicas: dict[str, tuple[str, LoRAServerStandIn]]) -> Iterator[Setup]:
    with ExitStack() as stack:
        backends = [{"name": name, "kind": kind, "base_url": f"{stack.enter_context(ServerThread(s.app)).url}/v1",
                     "models": [BASE], "max_retries": 0} for name, (kind, s) in replicas.items()]
        settings = Settings.model_validate({
            "store": {"path": str(tmp / "gateway.db")}, "backends": backends,
            "routing": {"adapters_dir": str(tmp / "adapters"), "refresh_seconds": 3600, "health_check_seconds": 0}})
        settings.server.admin_key = ADMIN
        server = stack.enter_context(ServerThread(build_app(settings), lifespan="on"))
        trainer = HarnessSettings.model_validate({
            "store": {"path": str(tmp / "trainer.db")},
            "training": {"base_model": BASE, "output_dir": str(tmp / "runs"), "eval_concurrency": 4,
                         "constrain_tool_calls": False,
                         "rl": {"tasks_per_step": 2, "group_size": 2, "temperature": 1.0, "fault_rate": 0.0}}})
        yield Setup(server.url, {name: s for name, (_, s) in replicas.items()}, trainer, tmp)


def _first(calls: list[tuple[str, Any]], route: str, test: Any) -> int:
    return next(i for i, (path, body) in enumerate(calls) if path.endswith(route) and test(body))


def test_every_replica_loads_the_steps_version_first_and_the_logprobs_are_the_samplers(tmp_path: Path) -> None:
    replicas = {"replica-a": ("sglang", SGLangStandIn(served_model_name=BASE)),
                "replica-b": ("sglang", SGLangStandIn(served_model_name=BASE))}
    with gateway(tmp_path, replicas) as setup:
        policy = tmp_path / "policy"

        async def run() -> list[list[Any]]:
            store = TrajectoryStore(setup.settings.store.path)
            await store.start()
            try:
                async with setup.evaluator() as evaluator:
                    rollouts = Rollouts(setup.settings, evaluator, store, run=RUN)
                    steps = []
                    for step in (1, 2):
                        write_adapter(policy, rank=4 * step)  # the trainer rewrites its policy folder each step
                        steps.append(await rollouts.collect(step, policy))
                        # Released: retired, so every replica has unloaded it before the folder is rewritten.
                        assert all(f"{NAME}@{step}" not in s.loaded for s in setup.replicas.values())
                    return steps
            finally:
                await store.close()

        steps = asyncio.run(run())
        registry = setup.registry()

    assert [len(groups) for groups in steps] == [2, 2]
    assert {v: c["status"] for v, c in registry.items()} == {1: "retired", 2: "retired"}
    for name, standin in setup.replicas.items():
        for step in (1, 2):
            version = f"{NAME}@{step}"
            loaded = _first(standin.calls, "/load_lora_adapter", lambda b, v=version: b["lora_name"] == v)
            assert standin.calls[loaded][1]["lora_path"] == registry[step]["path"]
            chats = [i for i, (path, body) in enumerate(standin.calls)
                     if path.endswith("/chat/completions") and body["model"] == f"{BASE}:{version}"]
            assert chats and loaded < chats[0], f"{name} answered for {version} before loading it"
        # No name is ever loaded twice: a version's name stands for one set of weights.
        names = [body["lora_name"] for path, body in standin.calls if path.endswith("/load_lora_adapter")]
        assert names == [f"{NAME}@1", f"{NAME}@2"]

    # Every recorded call carries the ids and log-probabilities the replica that sampled it sent, and names it.
    sampled = {tuple(s["token_ids"]): (name, s["logprobs"]) for name, standin in setup.replicas.items()
               for s in standin.sampled}

    async def recorded() -> list[Any]:
        store = TrajectoryStore(setup.settings.store.path)
        await store.start()
        try:
            ids = [t.id for groups in steps for g in groups for t in g.trajectories]
            return [c for tid in ids for c in (await store.get_trajectory(tid)).calls]
        finally:
            await store.close()

    calls = asyncio.run(recorded())
    assert len(calls) == 8 and {c.backend for c in calls} == set(setup.replicas)  # both replicas sampled
    for call in calls:
        (ids,) = call.completion_token_ids
        assert sampled[tuple(ids)] == (call.backend, call.completion_sampled_logprobs[0])
    # The groups RL trains on hold those tokens, with the temperature they were sampled at.
    samples = [s for groups in steps for g in groups for s in g.samples()]
    assert len(samples) == 8 and all(sampled[tuple(s.completion_ids)][1] == s.logprobs for s in samples)
    # The gateway recorded none of it: the trainer recorded its rollouts itself.
    with sqlite3.connect(tmp_path / "gateway.db") as conn:
        assert conn.execute("SELECT COUNT(*) FROM model_calls").fetchone()[0] == 0


def test_versions_are_never_served_from_a_stale_prefix_cache(tmp_path: Path) -> None:
    """vLLM keeps its prefix cache per adapter name, and an in-place reload does not clear it: a same-name
    reload would serve the old weights. Each version's answers here come from that version's own weights."""
    vllm = VLLMStandIn(served_model_name=BASE)
    with gateway(tmp_path, {"vllm": ("vllm", vllm)}) as setup:
        suite = get_suite("tools")
        tasks = suite.tasks("train")[:2]

        async def run() -> None:
            async with setup.evaluator() as evaluator:
                for rank in (4, 8):
                    folder = write_adapter(tmp_path / "policy", rank)
                    await evaluator.episodes(suite, tasks, folder)
                    await evaluator.release(folder)

        asyncio.run(run())
        registry = setup.registry()
    served = {(s["served"], s["weights"]) for s in vllm.sampled}
    assert served == {(f"{NAME}@1", registry[1]["path"]), (f"{NAME}@2", registry[2]["path"])}

    # The stand-in does keep a stale cache for a name reloaded in place, so the check above could fail.
    (tmp_path / "old").mkdir(), (tmp_path / "new").mkdir()
    old, new = write_adapter(tmp_path / "old", 4), write_adapter(tmp_path / "new", 8)
    with ServerThread(vllm.app) as direct, httpx.Client(base_url=direct.url) as client:
        ask = {"model": "inplace", "messages": [{"role": "user", "content": "hi"}]}
        client.post("/v1/load_lora_adapter", json={"lora_name": "inplace", "lora_path": str(old)}).raise_for_status()
        client.post("/v1/chat/completions", json=ask).raise_for_status()
        client.post("/v1/load_lora_adapter", json={"lora_name": "inplace", "lora_path": str(new),
                                                   "load_inplace": True}).raise_for_status()
        client.post("/v1/chat/completions", json=ask).raise_for_status()
    assert [s["weights"] for s in vllm.sampled[-2:]] == [str(old), str(old)]


def test_a_parameter_the_replicas_refuse_stops_the_run_with_the_reason(tmp_path: Path) -> None:
    with gateway(tmp_path, {"replica-a": ("sglang", SGLangStandIn(served_model_name=BASE))}) as setup:
        suite = get_suite("tools")

        async def run() -> None:
            async with setup.evaluator(constrain_tool_calls=True) as evaluator:
                await evaluator.episodes(suite, suite.tasks("train")[:1])

        with pytest.raises(GatewayRefused, match="constrain_tool_calls"):
            asyncio.run(run())
    with pytest.raises(GatewayRefused, match="admin key"):
        GatewayEvaluator(setup.settings.training, setup.url, None, run=RUN)
