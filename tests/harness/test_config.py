"""``harness config``: show (each value's source), check (one line per mistake), docs (the reference is current);
and a real ``harness serve`` run with a file, environment overrides and flags, as ``config show`` reports it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from harness.config_docs import DOCS_PATH, missing_sections, render_docs, sections
from harness.main import app
from tests.processes import ROOT, GatewayProcess, upstream_config
from tests.standin import free_port

runner = CliRunner()


def shown(output: str) -> dict[str, tuple[str, str]]:
    """``config show``'s lines as {dotted key: (value, source)}; a list of tables' entries get their index."""
    found: dict[str, tuple[str, str]] = {}
    table, counts = "", {}
    for line in output.splitlines():
        if header := re.fullmatch(r"\[\[(.+)\]\]", line):
            counts[header[1]] = counts.get(header[1], -1) + 1
            table = f"{header[1]}.{counts[header[1]]}"
        elif header := re.fullmatch(r"\[(.+)\]", line):
            table = header[1]
        elif pair := re.fullmatch(r"(\S+) = (.*)  # (.*)", line):
            found[f"{table}.{pair[1]}" if table else pair[1]] = (pair[2], pair[3])
    return found


def test_show_reports_each_source(tmp_path: Path) -> None:
    cfg = tmp_path / "h.toml"
    cfg.write_text("[server]\nport = 8100\nlog_level = 'warning'\n[store]\npath = 'x.db'\n[training]\nrank = 8\n")
    result = runner.invoke(app, ["config", "show", "--config", str(cfg), "--port", "8200"],
                           env={"HARNESS_STORE__PATH": "y.db", "HARNESS_ADMIN_KEY": "very-secret-admin-key",
                                "HARNESS_STORE__URL": "postgresql://harness:db-password@db:5432/harness"})
    assert result.exit_code == 0, result.output
    keys = shown(result.stdout)
    assert keys["server.port"] == ("8200", "flag")
    assert keys["store.path"] == ('"y.db"', "environment")
    assert keys["server.log_level"] == ('"warning"', "file") and keys["training.rank"] == ("8", "file")
    assert keys["server.max_headers"] == ("100", "default")
    assert keys["server.admin_key_env"] == ('"HARNESS_ADMIN_KEY"', "default; the secret: set, hidden")
    assert "very-secret-admin-key" not in result.output
    assert keys["store.url"] == ('"postgresql://harness:***@db:5432/harness"', "environment")
    assert "db-password" not in result.output
    assert f"# File: {cfg}" in result.stdout
    # what it prints is TOML a config file could hold
    import tomllib

    assert tomllib.loads(result.stdout)["training"]["rl"]["steps"] == 20


def test_check_names_every_mistake_on_a_line(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[server]\nport = 'eighty'\nbogus = 1\n[[backends]]\nname = 'a'\nbase_url = 'http://a/v1'\n"
                   "models = ['a']\nread_timeout = 0\n[training]\nrnak = 3\n[nosuch]\nkey = 1\n")
    result = runner.invoke(app, ["config", "check", str(cfg)])
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        f"{cfg}: server.port: Input should be a valid integer, unable to parse string as an integer",
        f"{cfg}: server.bogus: unknown key",
        f"{cfg}: backends.0.read_timeout: Input should be greater than 0",
        f"{cfg}: training.rnak: unknown key",
        f"{cfg}: nosuch: unknown key"]
    assert "Traceback" not in result.output


@pytest.mark.parametrize("text, line", [
    ("[server\n", "invalid TOML"),
    ("[[backends]]\nname = 'a'\nmodels = ['m']\n", "backends.0: backend 'a' of kind 'openai' needs base_url"),
    ("[bot]\nprofile = 'nobody'\n", "bot.profile names no configured profile"),
])
def test_check_reports_file_and_model_errors(tmp_path: Path, text: str, line: str) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text(text)
    result = runner.invoke(app, ["config", "check", str(cfg)])
    assert result.exit_code == 1 and len(result.stderr.splitlines()) == 1 and line in result.stderr
    assert "Traceback" not in result.output


def test_check_passes_a_good_file_and_ignores_the_environment(tmp_path: Path) -> None:
    cfg = tmp_path / "good.toml"
    cfg.write_text("[server]\nport = 8100\n[training.rl]\nsteps = 3\n")
    result = runner.invoke(app, ["config", "check", str(cfg)], env={"HARNESS_SERVER__PORT": "nope"})
    assert result.exit_code == 0 and result.stdout.strip() == f"{cfg}: ok"
    assert runner.invoke(app, ["config", "check", str(tmp_path / "missing.toml")]).exit_code == 1


def test_the_reference_is_current() -> None:
    current = DOCS_PATH.read_text()
    assert render_docs(current) == current, "docs/configuration.md is stale: run 'harness config docs'"
    assert not missing_sections(current), f"sections without a generated table: {missing_sections(current)}"
    undescribed = [f"{name}.{key}" for name, model, _ in sections() for key, field in model.model_fields.items()
                   if not field.exclude and not field.description]
    assert not undescribed, f"settings without a description (the reference would be empty): {undescribed}"


def test_the_generated_tables_follow_the_models(tmp_path: Path) -> None:
    stale = tmp_path / "configuration.md"
    stale.write_text("<!-- generated by harness config docs: training.gate -->\n| old |\n"
                     "<!-- end of generated table -->\n")
    assert runner.invoke(app, ["config", "docs", "--check", "--path", str(stale)]).exit_code == 1
    assert runner.invoke(app, ["config", "docs", "--path", str(stale)]).exit_code == 0
    text = stale.read_text()
    assert "| `tasks` | int | `100` | `HARNESS_TRAINING__GATE__TASKS` | Gate tasks drawn" in text
    assert runner.invoke(app, ["config", "docs", "--check", "--path", str(stale)]).exit_code == 0


@pytest.mark.integration
def test_serve_runs_with_file_environment_and_flags(standin, tmp_path: Path) -> None:
    flag_port = free_port()
    # The file sets a body limit the environment lowers; GatewayProcess puts a port in the environment, which
    # the --port flag overrides: the gateway answering on the flag's port is the flag winning.
    config = upstream_config(standin[1], extra="[server]\nmax_body_bytes = 100000\n[training]\nrank = 8\n")
    gw = GatewayProcess(config, tmp_path, env={"HARNESS_SERVER__MAX_BODY_BYTES": "3000",
                                               "HARNESS_ADMIN_KEY": "very-secret-admin-key"})
    env_port = gw.port
    code = ("import sys; from harness.main import main; "
            f"sys.argv = ['harness', *sys.argv[1:], '--port', '{flag_port}', '--host', '127.0.0.1']; main()")
    gw.command, gw.port = [sys.executable, "-c", code], flag_port
    gw.start()
    try:
        chat = {"model": "stand-in-model", "messages": [{"role": "user", "content": "hello"}]}
        assert httpx.post(gw.url + "/v1/chat/completions", json=chat, timeout=30).status_code == 200  # file
        big = {**chat, "messages": [{"role": "user", "content": "x" * 5000}]}
        assert httpx.post(gw.url + "/v1/chat/completions", json=big, timeout=30).status_code == 413  # environment
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{env_port}/healthz", timeout=1)
        shown_by = subprocess.run([sys.executable, "-m", "harness.main", "config", "show", "--config",
                                   str(gw.config), "--port", str(flag_port)], env=gw.env, cwd=ROOT,
                                  capture_output=True, text=True, timeout=60)
    finally:
        gw.stop()
    assert shown_by.returncode == 0, shown_by.stderr
    keys = shown(shown_by.stdout)
    assert keys["server.port"] == (str(flag_port), "flag")
    assert keys["server.max_body_bytes"] == ("3000", "environment")
    assert keys["backends.0.base_url"] == (f'"{standin[1]}/v1"', "file") and keys["training.rank"] == ("8", "file")
    assert keys["server.head_timeout"] == ("10.0", "default")
    assert keys["server.admin_key_env"][1] == "default; the secret: set, hidden"
    assert "very-secret-admin-key" not in shown_by.stdout + shown_by.stderr
