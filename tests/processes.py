"""A real gateway process on a loopback port, for tests that need the whole thing."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.markers import require_integration
from tests.standin import free_port

ROOT = Path(__file__).resolve().parent.parent


class GatewayProcess:
    """``harness serve``: by default this checkout's, or ``harness`` (an installed ``harness`` command)."""

    def __init__(self, config_text: str, workdir: Path, env: dict[str, str] | None = None, *,
                 harness: str | None = None) -> None:
        self.workdir = workdir
        self.config = workdir / "harness.toml"
        self.port = free_port()
        self.config.write_text(config_text)
        self.command = [harness] if harness else [sys.executable, "-m", "harness.main"]
        source = {} if harness else {"PYTHONPATH": str(ROOT)}
        self.env = {**os.environ, **source, **(env or {}), "HARNESS_SERVER__PORT": str(self.port)}
        self.env.pop("HARNESS_CONFIG", None)
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = workdir / "gateway.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def db(self) -> Path:
        return self.workdir / "harness.db"

    def start(self, timeout: float = 120.0) -> GatewayProcess:
        require_integration("a gateway process")
        log = open(self.log, "ab")
        self.proc = subprocess.Popen([*self.command, "serve", "--config", str(self.config)],
                                     cwd=self.workdir, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"gateway did not become healthy:\n{self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()


def upstream_config(upstream_url: str, *, extra: str = "", store: str = "", backend: str = "",
                    kind: str = "openai") -> str:
    return f"""
[store]
path = "harness.db"
{store}

[[backends]]
name = "standin"
kind = "{kind}"
base_url = "{upstream_url}/v1"
models = ["stand-in-model"]
read_timeout = 2.0
connect_timeout = 1.0
max_retries = 2
{backend}
{extra}
"""


def harness_cli(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``harness ARGS --config CONFIG``, as an operator runs it beside the gateway (this checkout's code)."""
    return subprocess.run([sys.executable, "-m", "harness.main", *args, "--config", str(config)],
                          cwd=config.parent, capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


def create_key(config: Path, tenant: str, *extra: str) -> tuple[str, str]:
    """A key of ``tenant`` made with ``harness keys create``: (its id, its secret)."""
    out = harness_cli(config, "keys", "create", "--tenant", tenant, *extra)
    assert out.returncode == 0, out.stderr
    key_id, secret = re.search(r"id:\s+(\S+)", out.stdout), re.search(r"key:\s+(sk-harness-\S+)", out.stdout)
    assert key_id and secret, out.stdout
    return key_id.group(1), secret.group(1)
