"""``harness adapters``: on the store (a running gateway applies it at its next refresh) and through a
gateway's admin routes (``--gateway``)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import openai
import pytest
from typer.testing import CliRunner

from harness.main import app
from tests.gateway.adapters.test_lifecycle import BASE, adapter_folder, serve

pytestmark = pytest.mark.integration

runner = CliRunner()


def harness(*args: str, env: dict[str, str]) -> tuple[int, str]:
    result = runner.invoke(app, list(args), env=env)
    return result.exit_code, result.output


def test_store_commands_reach_a_running_gateway_at_its_next_refresh(tmp_path: Path) -> None:
    env = {"HARNESS_STORE__PATH": str(tmp_path / "harness.db"), "HARNESS_ROUTING__ADAPTERS_DIR": str(tmp_path / "a")}
    with serve("sglang", tmp_path, routing={"refresh_seconds": 0.1}) as s:
        code, out = harness("adapters", "register", str(adapter_folder(tmp_path / "lora")), "--name", "sql",
                            "--base", BASE, env=env)
        assert code == 0 and "registered sql@1" in out, out
        code, out = harness("adapters", "promote", "sql@1", env=env)
        assert code == 0 and "promoted sql@1" in out, out
        deadline = time.monotonic() + 5
        while "sql@1" not in s.standin.loaded:
            assert time.monotonic() < deadline, "the gateway did not load the promoted version"
            time.sleep(0.02)
        assert s.ask(f"{BASE}:sql") == "served by sql@1"
        code, out = harness("adapters", "list", "--json", env=env)
        assert code == 0
        assert [(r["backend_name"], r["status"]) for r in json.loads(out)] == [("sql@1", "active")]
        code, out = harness("adapters", "retire", "sql@1", env=env)
        assert code == 0
        deadline = time.monotonic() + 5
        while s.standin.loaded:
            assert time.monotonic() < deadline, "the gateway did not unload the retired version"
            time.sleep(0.02)
        with pytest.raises(openai.NotFoundError):
            s.ask(f"{BASE}:sql")


def test_gateway_commands_go_through_the_admin_routes(tmp_path: Path) -> None:
    with serve("vllm", tmp_path) as s:
        env = {"HARNESS_ADMIN_KEY": "admin-secret", "HARNESS_STORE__PATH": str(tmp_path / "elsewhere.db")}
        folder = adapter_folder(tmp_path / "lora")
        code, out = harness("adapters", "register", str(folder), "--name", "sql", "--base", BASE, "--upload",
                            "--gateway", s.url, env=env)
        assert code == 0 and "registered sql@1" in out, out
        code, out = harness("adapters", "publish", "sql", "--gateway", s.url, "--json", env=env)
        assert code == 0 and json.loads(out)["loaded"][0]["ok"] is True, out
        uploaded = s.standin.loaded["sql@1"]
        assert Path(uploaded).parent == (tmp_path / "adapters" / "sql").resolve()  # a copy the gateway keeps
        code, out = harness("adapters", "promote", "sql@1", "--gateway", s.url, env=env)
        assert code == 0 and s.ask(f"{BASE}:sql") == "served by sql@1"
        code, out = harness("adapters", "rollback", "sql", "--gateway", s.url, env=env)
        assert code == 1 and "no earlier active version" in out
        code, out = harness("adapters", "list", "--gateway", s.url, "--json", env=env)
        assert [r["status"] for r in json.loads(out)] == ["active"]
        assert not (tmp_path / "elsewhere.db").exists()  # nothing touched the local store
        code, out = harness("adapters", "list", "--gateway", s.url, env={**env, "HARNESS_ADMIN_KEY": "wrong"})
        assert code == 1 and "401" in out


def test_usage_errors_are_clear(tmp_path: Path) -> None:
    env = {"HARNESS_STORE__PATH": str(tmp_path / "harness.db")}
    assert harness("adapters", "promote", "sql", env=env) == (2, "error: name the version: sql@N\n")
    code, out = harness("adapters", "publish", "sql@x", env=env)
    assert code == 2 and "must be a number" in out
    code, out = harness("adapters", "promote", "sql@1", env=env)
    assert code == 1 and "no adapter 'sql@1'" in out
    code, out = harness("adapters", "register", str(tmp_path), "--name", "sql", "--base", BASE, "--upload", env=env)
    assert code == 2 and "adapter_config.json" in out
    code, out = harness("adapters", "list", "--gateway", "http://127.0.0.1:9", env={**env, "HARNESS_ADMIN_KEY": "k"})
    assert code == 1 and "cannot reach the gateway" in out
