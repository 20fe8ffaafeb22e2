"""Every file under deploy/ goes through the loader that reads it in production, so a broken file fails here.

Files are found by globbing: a new file under deploy/ that no loader below covers fails
``test_every_deploy_file_is_checked``.
"""

from __future__ import annotations

import ast
import configparser
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path, PurePosixPath
from types import ModuleType
from typing import Any

import pytest
import yaml
from packaging.requirements import Requirement

from gateway.config import load_settings

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"

# Flags of `python -m sglang.launch_server` as of sglang 0.5.21 (the version deploy/sglang/requirements.txt pins),
# each one checked against the argument parser that `ServerArgs.add_cli_args` in sglang/srt/server_args.py builds
# (the fields live in sglang/srt/arg_groups/fields/*.py and become --kebab-case flags). A key of an SGLang launch
# config must be one of these; add a flag here only after finding it in that parser.
SGLANG_FLAGS = frozenset({
    "--model-path", "--served-model-name", "--host", "--port", "--tool-call-parser", "--reasoning-parser",
    "--enable-lora", "--max-lora-rank", "--lora-target-modules", "--max-loras-per-batch", "--max-loaded-loras",
    "--lora-paths", "--lora-backend", "--lora-eviction-policy", "--mem-fraction-static", "--context-length",
    "--api-key", "--trust-remote-code", "--dtype", "--tp-size", "--chat-template", "--log-level", "--enable-metrics",
})
# sglang 0.5.21's choices for --lora-target-modules (sglang/srt/utils/common.py SUPPORTED_LORA_TARGET_MODULES + "all").
LORA_TARGET_MODULES = frozenset({
    "q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "kv_b_proj", "wq_b", "wk",
    "weights_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj", "embed_tokens", "lm_head",
    "qkvr", "wo_ud", "all",
})

# What checks each kind of file; every file under deploy/ must match one of these globs.
GATEWAY_CONFIGS = "*.toml"
SGLANG_CONFIGS = "sglang/*.toml"
PYTHON = "**/*.py"
SHELL = "**/*.sh"
REQUIREMENTS = "**/requirements*.txt"
COMPOSE = "compose*.yaml"
DOCKERFILES = "Dockerfile*"
UNITS = "systemd/*.service"
ENV_EXAMPLES = "systemd/*.env.example"
READMES = "**/README.md"
CHECKED = (GATEWAY_CONFIGS, SGLANG_CONFIGS, PYTHON, SHELL, REQUIREMENTS, COMPOSE, DOCKERFILES, UNITS, ENV_EXAMPLES,
           READMES)


def files(pattern: str) -> list[Path]:
    return sorted(p for p in DEPLOY.glob(pattern) if p.is_file() and "__pycache__" not in p.parts)


def params(pattern: str) -> Any:
    found = files(pattern)
    return pytest.mark.parametrize("path", found, ids=[str(p.relative_to(DEPLOY)) for p in found])


def rel(path: Path) -> str:
    return path.relative_to(DEPLOY).as_posix()


@pytest.fixture(scope="module")
def launch() -> ModuleType:
    spec = importlib.util.spec_from_file_location("deploy_sglang_launch", DEPLOY / "sglang" / "launch.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sglang_config() -> dict[str, Any]:
    return tomllib.loads((DEPLOY / "sglang" / "sglang.toml").read_text())


def pinned_sglang() -> str:
    for line in (DEPLOY / "sglang" / "requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and Requirement(line).name == "sglang":
            return str(Requirement(line).specifier).removeprefix("==")
    raise AssertionError("deploy/sglang/requirements.txt does not pin sglang")


def test_every_deploy_file_is_checked() -> None:
    every = {p for p in DEPLOY.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    checked = {p for pattern in CHECKED for p in files(pattern)}
    assert sorted(rel(p) for p in every - checked) == [], "files under deploy/ that no loader in this test checks"


# -- gateway configs -----------------------------------------------------------------------------------------


@params(GATEWAY_CONFIGS)
def test_gateway_config_loads(path: Path) -> None:
    settings = load_settings(path, environ={})
    assert settings.backends
    for backend in settings.backends:
        if backend.kind in ("openai", "sglang", "vllm"):
            assert backend.base_url and backend.base_url.rstrip("/").endswith("/v1"), backend.name


def test_gpu_config_fronts_the_sglang_config() -> None:
    raw = tomllib.loads((DEPLOY / "gateway.gpu.toml").read_text())
    settings = load_settings(DEPLOY / "gateway.gpu.toml", environ={})
    sglang = sglang_config()
    assert set(raw["routing"]) <= {"adapters_dir", "aliases", "default_model"}
    (backend,) = [b for b in settings.backends if b.kind == "sglang"]
    assert backend.models == [sglang["served-model-name"]]
    assert backend.base_url == f"http://127.0.0.1:{sglang['port']}/v1"
    assert settings.routing.default_model in backend.models
    for target in settings.routing.aliases.values():
        assert target.split(":", 1)[0] in backend.models
    assert Path(settings.store.path).is_absolute() and Path(settings.routing.adapters_dir).is_absolute()
    assert settings.server.admin_key_env == "HARNESS_ADMIN_KEY"


# -- SGLang launch config and launcher -----------------------------------------------------------------------


@params(SGLANG_CONFIGS)
def test_sglang_config_is_sglang_flags(path: Path, launch: ModuleType) -> None:
    config = launch.load_config(path)
    argv = launch.build_argv(config)
    flags = [a for a in argv if a.startswith("--")]
    assert sorted(set(flags) - SGLANG_FLAGS) == [], "flags not in the list verified against SGLang's parser"
    assert len(flags) == len(set(flags)), "a flag given twice keeps only its last value"
    for needed in ("--model-path", "--served-model-name", "--port", "--enable-lora"):
        assert needed in flags
    targets = config.get("lora-target-modules", [])
    assert set([targets] if isinstance(targets, str) else targets) <= LORA_TARGET_MODULES
    if "max-loaded-loras" in config:
        assert config["max-loaded-loras"] >= config.get("max-loras-per-batch", 8)


def test_build_argv_forms(launch: ModuleType) -> None:
    argv = launch.build_argv({"model-path": "m", "port": 30000, "enable-lora": True, "disable-radix-cache": False,
                              "lora-target-modules": ["q_proj", "v_proj"], "lora-paths": [
                                  "a=/p", {"lora_name": "b", "lora_path": "/q", "pinned": True}],
                              "mem_fraction_static": 0.8, "empty": []})
    assert argv == ["--model-path", "m", "--port", "30000", "--enable-lora",
                    "--lora-target-modules", "q_proj", "v_proj",
                    "--lora-paths", "a=/p", '{"lora_name":"b","lora_path":"/q","pinned":true}',
                    "--mem-fraction-static", "0.8"]
    for bad in ({"section": {"a": 1}}, {"Bad Key": 1}, {"flags": [True]}):
        with pytest.raises(ValueError):
            launch.build_argv(bad)


def test_launch_sh_prints_the_command(tmp_path: Path) -> None:
    config = tmp_path / "s.toml"
    config.write_text('model-path = "m"\nport = 1\nenable-lora = true\n')
    env = {**os.environ, "SGLANG_PYTHON": sys.executable}
    out = subprocess.run([str(DEPLOY / "sglang" / "launch.sh"), "--dry-run", str(config), "--host", "0.0.0.0"],
                         env=env, capture_output=True, text=True, timeout=30, check=True).stdout
    assert shlex.split(out.removeprefix("+ ")) == [sys.executable, "-m", "sglang.launch_server", "--model-path", "m",
                                                   "--port", "1", "--enable-lora", "--host", "0.0.0.0"]
    bad = subprocess.run([str(DEPLOY / "sglang" / "launch.sh"), "--dry-run", str(tmp_path / "missing.toml")],
                         env=env, capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "missing.toml" in bad.stderr


@params(PYTHON)
def test_python_needs_only_the_standard_library_and_is_clean(path: Path) -> None:
    # These run where the gateway is not installed (SGLang's own environment): the standard library only.
    tree = ast.parse(path.read_text(), str(path))
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module and node.level == 0}
    assert imported, f"{rel(path)} imports nothing: is it Python?"
    assert imported <= sys.stdlib_module_names | {"__future__"}, \
        f"{rel(path)} imports {sorted(imported - sys.stdlib_module_names)}, which SGLang's environment lacks"
    # Undefined names, unused imports and the like: what pyflakes finds, through ruff's F rules.
    lint = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--select", "F,E9", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert lint.returncode == 0, lint.stdout + lint.stderr


@params(SHELL)
def test_shell_script_parses(path: Path) -> None:
    result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert os.access(path, os.X_OK), f"{rel(path)} is not executable"
    assert "set -euo pipefail" in path.read_text()


@params(REQUIREMENTS)
def test_requirements_are_pinned(path: Path) -> None:
    requirements = [Requirement(line.split("#", 1)[0].strip()) for line in path.read_text().splitlines()
                    if line.split("#", 1)[0].strip()]
    assert requirements
    for requirement in requirements:
        assert str(requirement.specifier).startswith("=="), f"{requirement} is not pinned"


# -- compose and the image -----------------------------------------------------------------------------------


def _mounts(service: dict[str, Any]) -> dict[str, str]:
    """target → source of a service's short-syntax volumes."""
    mounts = {}
    for entry in service.get("volumes", []):
        source, target = entry.split(":")[:2]
        mounts[target] = source
    return mounts


@params(COMPOSE)
def test_compose(path: Path) -> None:
    compose = yaml.safe_load(path.read_text())
    services = compose["services"]
    assert set(services) == {"gateway", "sglang"}
    gateway, sglang = services["gateway"], services["sglang"]

    assert re.fullmatch(r"lmsysorg/sglang:v\d+\.\d+\.\d+(-cu\d+)?", sglang["image"]), "pin a real release tag"
    assert sglang["image"].split(":v")[1].split("-")[0] == pinned_sglang()
    devices = sglang["deploy"]["resources"]["reservations"]["devices"]
    assert any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) for d in devices)

    named = set(compose["volumes"])
    assert {"store", "adapters"} <= named
    gw_mounts, sg_mounts = _mounts(gateway), _mounts(sglang)
    for mounts in (gw_mounts, sg_mounts):
        for source in mounts.values():
            assert source in named or (path.parent / source).exists(), f"{source} is neither a volume nor a file"
    adapters_at = {t for t, s in gw_mounts.items() if s == "adapters"}
    assert adapters_at and adapters_at == {t for t, s in sg_mounts.items() if s == "adapters"}, \
        "both services must see the adapters volume at the same path"

    command = gateway["command"]
    assert command[:2] == ["harness", "serve"] and "--config" in command
    config_target = command[command.index("--config") + 1]
    settings = load_settings(path.parent / gw_mounts[config_target], environ={})
    assert adapters_at == {settings.routing.adapters_dir}
    assert gw_mounts.get(str(Path(settings.store.path).parent)) == "store"
    env = gateway["environment"]
    assert env.get("HARNESS_CONFIG") == config_target
    assert settings.server.admin_key_env in env

    sglang_dir = next(t for t, s in sg_mounts.items() if (path.parent / s).resolve() == DEPLOY / "sglang")
    assert sglang["command"][1:3] == [f"{sglang_dir}/launch.py", f"{sglang_dir}/sglang.toml"]
    port = sglang_config()["port"]
    assert env["HARNESS_BACKENDS__0__BASE_URL"] == f"http://sglang:{port}/v1"
    assert f":{port}/health" in " ".join(sglang["healthcheck"]["test"])
    assert "/healthz" in " ".join(gateway["healthcheck"]["test"])
    assert gateway["depends_on"]["sglang"]["condition"] == "service_healthy"


def _dockerfile(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments), continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n", " ", "\n".join(line for line in path.read_text().splitlines()
                                            if not line.lstrip().startswith("#")))
    instructions = []
    for line in joined.splitlines():
        if line.strip():
            word, _, args = line.strip().partition(" ")
            instructions.append((word.upper(), args.strip()))
    return instructions


@params(DOCKERFILES)
def test_dockerfile(path: Path) -> None:
    instructions = _dockerfile(path)
    known = {"FROM", "ENV", "WORKDIR", "COPY", "RUN", "USER", "VOLUME", "EXPOSE", "HEALTHCHECK", "CMD", "ARG", "LABEL"}
    assert {word for word, _ in instructions} <= known
    assert instructions[0] == ("FROM", "python:3.11-slim")
    runs = " ".join(args for word, args in instructions if word == "RUN")
    # The core only, from the lock: a proxy-only gateway without torch (tests/deploy/test_core_install.py).
    assert "pip install -c requirements.lock ." in runs and "torch" not in runs
    for word, args in instructions:
        if word == "COPY":
            for source in args.split()[:-1]:
                assert (ROOT / source).exists(), f"COPY {source}: not in the build context (the repository root)"
    (cmd,) = [json.loads(args) for word, args in instructions if word == "CMD"]
    assert cmd[:2] == ["harness", "serve"] and "--config" in cmd


# -- systemd -------------------------------------------------------------------------------------------------


def _unit(path: Path) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None, strict=True)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(path.read_text(), source=str(path))
    return parser


@params(UNITS)
def test_systemd_unit(path: Path) -> None:
    unit = _unit(path)
    assert {"Unit", "Service", "Install"} <= set(unit.sections())
    assert unit["Unit"].get("Description")
    assert unit["Install"].get("WantedBy") == "multi-user.target"
    exec_start = shlex.split(unit["Service"]["ExecStart"])
    assert PurePosixPath(exec_start[0]).is_absolute()
    for env_file in unit["Service"].get("EnvironmentFile", "").split():
        example = DEPLOY / "systemd" / (PurePosixPath(env_file.lstrip("-")).name + ".example")
        assert example.is_file(), f"{rel(path)} reads {env_file}: add {rel(example)}"
    assert unit["Service"].get("User") and unit["Service"].get("Restart")


def test_gateway_unit_serves_the_gpu_config() -> None:
    service = _unit(DEPLOY / "systemd" / "harness-gateway.service")["Service"]
    exec_start = shlex.split(service["ExecStart"])
    assert exec_start[0].endswith("/harness") and exec_start[1:3] == ["serve", "--config"]
    assert "harness/store" in service["StateDirectory"].split()
    assert "harness/adapters" in service["StateDirectory"].split()


def test_sglang_unit_uses_the_launcher() -> None:
    service = _unit(DEPLOY / "systemd" / "sglang.service")["Service"]
    exec_start = shlex.split(service["ExecStart"])
    assert exec_start[0].endswith("deploy/sglang/launch.sh") and exec_start[1].endswith(".toml")
    assert "SGLANG_PYTHON=" in service["Environment"]


@params(ENV_EXAMPLES)
def test_env_example(path: Path) -> None:
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=\S*", line), f"{rel(path)}: {line!r}"


def test_gateway_env_example_sets_the_admin_key() -> None:
    text = (DEPLOY / "systemd" / "harness.env.example").read_text()
    key = load_settings(DEPLOY / "gateway.gpu.toml", environ={}).server.admin_key_env
    assert re.search(rf"^{key}=\S+", text, re.MULTILINE)


# -- documentation -------------------------------------------------------------------------------------------


@params(READMES)
def test_readme_names_every_file(path: Path) -> None:
    text = path.read_text()
    every = sorted(p for p in DEPLOY.rglob("*") if p.is_file() and "__pycache__" not in p.parts and p != path)
    missing = [rel(p) for p in every if rel(p) not in text]
    assert missing == [], f"{rel(path)} does not describe these files"
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" in text
