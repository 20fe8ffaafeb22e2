"""deploy/smoke_check.sh end to end, with the SGLang stand-in in place of SGLang and a real gateway process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.standin import free_port

ROOT = Path(__file__).resolve().parents[2]


def _fake_adapter(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "base_model_name_or_path": "stand-in/qwen", "r": 8, "lora_alpha": 16,
        "target_modules": ["q_proj", "v_proj"]}))
    (folder / "adapter_model.safetensors").write_bytes(b"")
    return folder


def _refused(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


@pytest.mark.integration
def test_smoke_check_against_the_sglang_standin(tmp_path: Path) -> None:
    sglang_port, gateway_port = free_port(), free_port()
    config = tmp_path / "gateway.toml"
    config.write_text(f"""
[server]
port = {gateway_port}

[store]
path = "{tmp_path / 'harness.db'}"

[[backends]]
name = "sglang"
kind = "sglang"
base_url = "http://127.0.0.1:{sglang_port}/v1"
models = ["qwen-test"]
read_timeout = 20.0

[routing]
adapters_dir = "{tmp_path / 'adapters'}"
default_model = "qwen-test"
""")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HARNESS_")}
    env.update({
        "PYTHONPATH": str(ROOT),
        "HARNESS_ADMIN_KEY": "smoke-admin-key",
        "SGLANG_LAUNCH": (f"{sys.executable} -m tests.standins.sglang --port {sglang_port} --model-path stand-in/qwen "
                          "--served-model-name qwen-test --enable-lora --max-lora-rank 64 --lora-target-modules all "
                          "--max-loras-per-batch 8 --max-loaded-loras 8 --tool-call-parser qwen25"),
        "SGLANG_URL": f"http://127.0.0.1:{sglang_port}",
        "SGLANG_WAIT": "60",
        "GATEWAY_CONFIG": str(config),
        "GATEWAY_PORT": str(gateway_port),
        "GATEWAY_WAIT": "120",
        "HARNESS_BIN": f"{sys.executable} -m harness.main",
        "ADAPTER_PATH": str(_fake_adapter(tmp_path / "adapter")),
        "ADAPTER_NAME": "sql",
        "LOG_DIR": str(tmp_path / "logs"),
    })
    result = subprocess.run([str(ROOT / "deploy" / "smoke_check.sh")], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=240)
    logs = "".join(f"\n--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((tmp_path / "logs").glob("*.log")))
    assert result.returncode == 0, result.stdout + result.stderr + logs

    lines = result.stdout.splitlines()
    steps = {line.split()[1]: line for line in lines if line.startswith("ok ")}
    assert not [line for line in lines if line.startswith("FAIL")]
    for step in ("sglang-start", "sglang-health", "gateway-start", "gateway-health", "register", "publish",
                 "sglang-lists-adapter", "promote", "chat-base", "chat-adapter"):
        assert step in steps, result.stdout
    assert "sql@1 base qwen-test" in steps["register"]
    assert "sql@1 parent qwen-test" in steps["sglang-lists-adapter"]
    assert steps["chat-base"].endswith("qwen-test: served by base")
    assert steps["chat-adapter"].endswith("qwen-test:sql: served by sql@1")
    # what the script started is gone
    assert _refused(sglang_port) and _refused(gateway_port)
