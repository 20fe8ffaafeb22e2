"""The ``harness trajectories`` commands over a store filled through a real gateway."""

from pathlib import Path

import httpx
import orjson
import pytest
from typer.testing import CliRunner

from harness.main import app
from tests.processes import GatewayProcess

pytestmark = pytest.mark.integration

runner = CliRunner()


def _invoke(gw: GatewayProcess, *args: str):
    result = runner.invoke(app, [*args, "--config", str(gw.config)], catch_exceptions=False)
    return result


def test_list_show_delete(gateway: GatewayProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(gateway.workdir)
    r = httpx.post(gateway.url + "/v1/chat/completions", json={
        "model": "stand-in-model", "messages": [{"role": "system", "content": "sys"},
                                                {"role": "user", "content": "show me"}]})
    tid = r.headers["x-harness-trajectory-id"]
    listed = _invoke(gateway, "trajectories", "list", "--json")
    assert listed.exit_code == 0
    assert tid in [t["id"] for t in orjson.loads(listed.stdout)]
    shown = _invoke(gateway, "trajectories", "show", tid)
    assert shown.exit_code == 0
    assert "show me" in shown.stdout and "echo: show me" in shown.stdout and "call 0" in shown.stdout
    as_json = orjson.loads(_invoke(gateway, "trajectories", "show", tid, "--json").stdout)
    assert as_json["calls"][0]["request"]["messages"][1] == {"role": "user", "content": "show me"}
    assert _invoke(gateway, "trajectories", "show", "nope").exit_code == 1
    assert _invoke(gateway, "trajectories", "delete", tid).exit_code == 0
    assert _invoke(gateway, "trajectories", "show", tid).exit_code == 1
    bad = _invoke(gateway, "trajectories", "delete", "--before", "not-a-date")
    assert bad.exit_code == 2 and "ISO 8601" in bad.stderr
    assert _invoke(gateway, "trajectories", "delete", "--before", "2999-01-01").exit_code == 0
    assert orjson.loads(_invoke(gateway, "trajectories", "list", "--json").stdout) == []


def test_bad_config_is_a_clear_cli_error(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[server]\nport = 'eighty'\n")
    result = runner.invoke(app, ["trajectories", "list", "--config", str(cfg)])
    assert result.exit_code == 2 and "server.port" in result.stderr


def test_run_prints_the_agent_and_records_it(standin, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sqlite3

    from tests.processes import upstream_config

    monkeypatch.chdir(tmp_path)
    cfg = tmp_path / "h.toml"
    cfg.write_text(upstream_config(standin[1], extra='[[profiles]]\nname = "echo"\nmodel = "stand-in-model"\n'
                                                  'tools = ["calculator"]\n'))
    result = runner.invoke(app, ["run", "echo", "hello agent", "--config", str(cfg)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "echo: hello agent" in result.stdout and "completed · 1 steps" in result.stdout
    db = sqlite3.connect(tmp_path / "harness.db")
    assert db.execute("SELECT profile, status, steps FROM agent_runs").fetchall() == [("echo", "completed", 1)]
    unknown = runner.invoke(app, ["run", "nope", "x", "--config", str(cfg)])
    assert unknown.exit_code == 2 and "No agent profile 'nope'" in unknown.stderr


def test_profile_with_an_unknown_tool_is_a_clear_error(tmp_path: Path) -> None:
    cfg = tmp_path / "h.toml"
    cfg.write_text('[store]\npath = "h.db"\n[[backends]]\nname = "u"\nkind = "openai"\nbase_url = "http://127.0.0.1:9/v1"\n'
                   'models = ["m"]\n[[profiles]]\nname = "p"\nmodel = "m"\ntools = ["teleport"]\n')
    result = runner.invoke(app, ["run", "p", "x", "--config", str(cfg)])
    assert result.exit_code == 2 and "unknown tools: teleport" in result.stderr
