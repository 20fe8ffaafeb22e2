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
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path, PurePosixPath
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from packaging.requirements import Requirement

from gateway.config import load_settings
from tests.markers import missing
from tests.standin import free_port

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
NGINX = "nginx/*.conf"
CHECKED = (GATEWAY_CONFIGS, SGLANG_CONFIGS, PYTHON, SHELL, REQUIREMENTS, COMPOSE, DOCKERFILES, UNITS, ENV_EXAMPLES,
           READMES, NGINX)


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


# -- compose -------------------------------------------------------------------------------------------------

DEPENDS_CONDITIONS = {"service_started", "service_healthy", "service_completed_successfully"}


def _mounts(service: dict[str, Any]) -> dict[str, str]:
    """target → source of a service's short-syntax volumes."""
    mounts = {}
    for entry in service.get("volumes", []):
        source, target = entry.split(":")[:2]
        mounts[target] = source
    return mounts


def _environment(service: dict[str, Any]) -> dict[str, str]:
    """A service's environment, from either of compose's forms (a table, or a list of NAME=VALUE)."""
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(entry.split("=", 1) if "=" in entry else (entry, "") for entry in env)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def _depends(service: dict[str, Any]) -> dict[str, str]:
    """name → condition of a service's depends_on, from either form (a list means service_started)."""
    depends = service.get("depends_on", {})
    if isinstance(depends, list):
        return dict.fromkeys(depends, "service_started")
    return {name: (spec or {}).get("condition", "service_started") for name, spec in depends.items()}


_VARIABLE = re.compile(r"\$\$|\$\{(\w+)(?:(:?[-?])([^}]*))?\}|\$(\w+)")


def _interpolate(text: str, environ: dict[str, str] | None = None) -> str:
    """What compose makes of ``text`` in ``environ`` (default empty): ``${X:-default}``, ``${X-default}``,
    ``${X:?error}``, ``${X?error}``, ``${X}``, ``$X``, ``$$``. A required variable that is unset stands as
    ``<X>``, so that the rest of the value can still be checked."""
    environ = environ or {}

    def one(match: re.Match[str]) -> str:
        if match[0] == "$$":
            return "$"
        name, op, arg = match[1] or match[4], match[2], match[3]
        value = environ.get(name)
        unset = value is None or (value == "" and op is not None and op.startswith(":"))
        if op in (":-", "-"):
            return arg if unset else str(value)
        if op in (":?", "?"):
            return f"<{name}>" if unset else str(value)
        return value or ""

    return _VARIABLE.sub(one, text)


def _compose(path: Path) -> dict[str, Any]:
    compose = yaml.safe_load(path.read_text())
    assert isinstance(compose, dict) and compose.get("services"), f"{rel(path)}: no services"
    return compose


def _gateways(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The services that run `harness serve`."""
    return {name: s for name, s in compose["services"].items() if s.get("command", [])[:2] == ["harness", "serve"]}


def _built_dockerfile(path: Path, service: dict[str, Any]) -> Path | None:
    build = service.get("build")
    if build is None:
        return None
    if isinstance(build, str):
        build = {"context": build}
    return (path.parent / build.get("context", ".")).resolve() / build.get("dockerfile", "Dockerfile")


def _healthcheck(path: Path, service: dict[str, Any]) -> list[str]:
    """The health check's command: the service's own, else its Dockerfile's HEALTHCHECK; [] without one."""
    if "healthcheck" in service:
        test = service["healthcheck"]["test"]
        assert isinstance(test, list) and test[0] in ("CMD", "CMD-SHELL"), f"health check {test!r}"
        return test
    dockerfile = _built_dockerfile(path, service)
    if dockerfile is not None:
        for word, args in _dockerfile(dockerfile):
            if word == "HEALTHCHECK":
                return ["CMD", *json.loads(args.split(" CMD ", 1)[1])]
    return []


def _gateway_settings(path: Path, service: dict[str, Any]) -> tuple[Any, dict[str, str]]:
    """A gateway service's settings, as its config file and its environment (interpolated) give them, and that
    environment. Loading fails on a variable that names no setting."""
    command = service["command"]
    assert "--config" in command, "harness serve without --config"
    target = command[command.index("--config") + 1]
    source = _mounts(service).get(target)
    assert source and (path.parent / source).is_file(), f"--config {target} is not a file mounted from deploy/"
    env = {name: _interpolate(value) for name, value in _environment(service).items()}
    return load_settings(path.parent / source, environ=env), env


@params(COMPOSE)
def test_compose(path: Path) -> None:
    """What holds for every compose file: images, builds, dependencies, volumes, and each gateway's settings."""
    compose = _compose(path)
    assert {k for k in compose if not k.startswith("x-")} <= {"name", "services", "volumes", "networks"}
    services = compose["services"]
    named = set(compose.get("volumes") or {})
    used = set()
    for name, service in services.items():
        dockerfile = _built_dockerfile(path, service)
        assert dockerfile is not None or "image" in service, f"{name}: neither build nor image"
        if dockerfile is not None:
            assert dockerfile.is_file(), f"{name} builds from {dockerfile}, which does not exist"
        else:
            assert re.fullmatch(r"[\w./-]+:[\w.-]+", service["image"]) and not service["image"].endswith(":latest"), \
                f"{name}: pin the image's tag ({service['image']})"
        for other, condition in _depends(service).items():
            assert other in services and other != name, f"{name} depends on {other}, which is not a service here"
            assert condition in DEPENDS_CONDITIONS, f"{name} → {other}: {condition}"
            if condition == "service_healthy":
                assert _healthcheck(path, services[other]), f"{name} waits for {other} to be healthy: it has no check"
        for source in _mounts(service).values():
            if source.startswith((".", "/")):
                assert (path.parent / source).exists(), f"{name} mounts {source}, which does not exist"
            else:
                assert source in named, f"{name} mounts volume {source}, which is not declared"
                used.add(source)
    assert named == used, f"declared volumes no service mounts: {sorted(named - used)}"

    gateways = _gateways(compose)
    assert gateways, f"{rel(path)} runs no gateway"
    assert len({s.get("image") for s in gateways.values()}) == 1, "every gateway service runs the same image"
    for name, gateway in gateways.items():
        settings, env = _gateway_settings(path, gateway)
        config_target = gateway["command"][gateway["command"].index("--config") + 1]
        assert env.get("HARNESS_CONFIG") == config_target, name
        assert settings.server.admin_key_env in env, name
        assert "/healthz" in " ".join(_healthcheck(path, gateway)), name
        mounts = _mounts(gateway)
        if "HARNESS_STORE__URL" in env:
            assert env["HARNESS_STORE__URL"].startswith("postgresql://"), name
            assert urlsplit(env["HARNESS_STORE__URL"]).hostname in services, f"{name}: the store's host is not here"
        else:  # the SQLite file, on a volume of its own
            assert mounts.get(str(PurePosixPath(settings.store.path).parent)) in named, \
                f"{name}: the store's folder is not on a named volume"
        if any(b.kind in ("sglang", "vllm") for b in settings.backends):
            # Adapters are read by path by the backend: the same volume at the same path in every service.
            assert mounts.get(settings.routing.adapters_dir) in named, f"{name}: adapters_dir is not on a volume"
            volume = mounts[settings.routing.adapters_dir]
            for other, service in services.items():
                at = {t for t, s in _mounts(service).items() if s == volume}
                assert at in (set(), {settings.routing.adapters_dir}), f"{other} mounts {volume} at {sorted(at)}"


def test_compose_gpu() -> None:
    """compose.yaml: one gateway in front of SGLang on one GPU."""
    path = DEPLOY / "compose.yaml"
    compose = _compose(path)
    services = compose["services"]
    assert set(services) == {"gateway", "sglang"}
    gateway, sglang = services["gateway"], services["sglang"]

    assert re.fullmatch(r"lmsysorg/sglang:v\d+\.\d+\.\d+(-cu\d+)?", sglang["image"]), "pin a real release tag"
    assert sglang["image"].split(":v")[1].split("-")[0] == pinned_sglang()
    devices = sglang["deploy"]["resources"]["reservations"]["devices"]
    assert any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", []) for d in devices)

    assert {"store", "adapters"} <= set(compose["volumes"])
    settings, env = _gateway_settings(path, gateway)
    gw_mounts, sg_mounts = _mounts(gateway), _mounts(sglang)
    adapters_at = {t for t, s in gw_mounts.items() if s == "adapters"}
    assert adapters_at == {settings.routing.adapters_dir} == {t for t, s in sg_mounts.items() if s == "adapters"}, \
        "both services must see the adapters volume at the same path"
    assert gw_mounts.get(str(Path(settings.store.path).parent)) == "store"

    sglang_dir = next(t for t, s in sg_mounts.items() if (path.parent / s).resolve() == DEPLOY / "sglang")
    assert sglang["command"][1:3] == [f"{sglang_dir}/launch.py", f"{sglang_dir}/sglang.toml"]
    port = sglang_config()["port"]
    assert env["HARNESS_BACKENDS__0__BASE_URL"] == f"http://sglang:{port}/v1"
    assert f":{port}/health" in " ".join(sglang["healthcheck"]["test"])
    assert _depends(gateway) == {"sglang": "service_healthy"}
    assert list(gateway["ports"]) == ["8000:8000"]


def _published(service: dict[str, Any]) -> list[int]:
    """The container ports a service publishes (short syntax: [HOST_IP:]HOST:CONTAINER[/PROTO])."""
    return [int(str(p).split("/")[0].rsplit(":", 1)[-1]) for p in service.get("ports", [])]


def _service_by_image(services: dict[str, Any], repository: str) -> tuple[str, dict[str, Any]]:
    (found,) = [(n, s) for n, s in services.items() if s.get("image", "").split(":")[0] == repository]
    return found


def test_compose_replicas() -> None:
    """compose.replicas.yaml: two proxying gateways on one PostgreSQL and one Redis, behind nginx."""
    path = DEPLOY / "compose.replicas.yaml"
    compose = _compose(path)
    services = compose["services"]
    gateways = _gateways(compose)
    pg_name, postgres = _service_by_image(services, "postgres")
    redis_name, redis = _service_by_image(services, "redis")
    lb_name, lb = _service_by_image(services, "nginx")
    assert set(services) == {*gateways, pg_name, redis_name, lb_name}

    # PostgreSQL 15, its data on a named volume, healthy only once it takes connections over TCP.
    assert postgres["image"] == "postgres:15"
    assert _mounts(postgres).get("/var/lib/postgresql/data") in compose["volumes"]
    pg_env = _environment(postgres)
    assert re.fullmatch(r"\$\{POSTGRES_PASSWORD:-[^}]+\}", pg_env["POSTGRES_PASSWORD"]), \
        "the password comes from POSTGRES_PASSWORD (its default is for a demo only)"
    check = postgres["healthcheck"]["test"]
    assert check[:2] == ["CMD", "pg_isready"]
    options = dict(zip(check[2::2], check[3::2], strict=True))
    assert options.get("-h") == "127.0.0.1", "over TCP: the image's initialising server answers on the socket"
    assert options.get("-U") == pg_env["POSTGRES_USER"] and options.get("-d") == pg_env["POSTGRES_DB"]

    # Redis 7 for rate-limit counters only: no persistence, nothing mounted.
    assert redis["image"] == "redis:7" and not redis.get("volumes")
    assert redis["command"][0] == "redis-server"
    assert " ".join(map(repr, redis["command"])).count("'--save' ''") == 1
    assert redis["command"][redis["command"].index("--appendonly") + 1] == "no"

    # Two replicas of one image, one config, the same store, rate limits and admin key.
    assert len(gateways) == 2
    assert len({json.dumps(s.get("build"), sort_keys=True) for s in gateways.values()}) == 1
    configs = {json.dumps(_gateway_settings(path, s)[0].model_dump(mode="json"), sort_keys=True)
               for s in gateways.values()}
    assert len(configs) == 1, "the replicas' settings differ"
    ports = set()
    for name, gateway in gateways.items():
        settings, env = _gateway_settings(path, gateway)
        assert all(b.kind != "local" for b in settings.backends), \
            f"{name}: the embedded model's engine lives in one process; replicas proxy"
        url = urlsplit(env["HARNESS_STORE__URL"])
        assert url.scheme == "postgresql" and url.hostname == pg_name and url.port == 5432, name
        assert (url.username, url.password, url.path) == (
            pg_env["POSTGRES_USER"], _interpolate(pg_env["POSTGRES_PASSWORD"]), "/" + pg_env["POSTGRES_DB"]), name
        assert _environment(gateway)["HARNESS_STORE__URL"].count("${POSTGRES_PASSWORD:-") == 1, \
            f"{name}: the store URL's password is POSTGRES_PASSWORD, as the database's"
        limits = urlsplit(env["HARNESS_BOT__RATE_LIMIT_STORAGE"])
        assert limits.scheme == "redis" and limits.hostname == redis_name, name
        assert _depends(gateway).get(pg_name) == "service_healthy", name
        assert not any(s in compose["volumes"] for s in _mounts(gateway).values()), \
            f"{name}: a replica keeps no state of its own"
        assert env["HARNESS_SERVER__HOST"] == "0.0.0.0", name
        ports.add(settings.server.port)
    (port,) = ports

    # Only the load balancer is published; it forwards to exactly the replicas.
    assert [n for n, s in services.items() if s.get("ports")] == [lb_name]
    assert set(_depends(lb)) == set(gateways)
    conf_source = next(s for t, s in _mounts(lb).items() if PurePosixPath(t).parent == PurePosixPath(
        "/etc/nginx/conf.d") and t.endswith(".conf"))
    conf = _nginx(path.parent / conf_source)
    (upstream,) = [d for d in conf if d.name == "upstream"]
    assert sorted(d.args[0] for d in upstream.children if d.name == "server") == sorted(
        f"{name}:{port}" for name in gateways)
    (server,) = [d for d in conf if d.name == "server"]
    assert {int(d.args[0].rsplit(":", 1)[-1].split()[0]) for d in server.children if d.name == "listen"} == set(
        _published(lb))

    settings = _gateway_settings(path, next(iter(gateways.values())))[0]
    (keepalive_timeout,) = [_seconds(d.args[0]) for d in upstream.children if d.name == "keepalive_timeout"]
    assert keepalive_timeout < settings.server.keep_alive_seconds, \
        "nginx must drop an idle upstream connection before the gateway does, or a request races the close"
    (body,) = [d.args[0] for d in server.children if d.name == "client_max_body_size"]
    assert _bytes(body) >= max(settings.server.max_body_bytes, settings.routing.max_upload_bytes)
    for location in (d for d in server.children if d.name == "location"):
        (read_timeout,) = [_seconds(d.args[0]) for d in location.children if d.name == "proxy_read_timeout"]
        assert read_timeout >= max(b.read_timeout for b in settings.backends)
    (per_client,) = [d.args for d in server.children if d.name == "limit_conn"]
    assert 0 < int(per_client[1]) <= settings.server.max_connections * len(gateways)


# -- nginx ---------------------------------------------------------------------------------------------------


class _Directive:
    def __init__(self, name: str, args: list[str], children: list[_Directive] | None) -> None:
        self.name, self.args, self.children = name, args, children or []
        self.block = children is not None


_NGINX_TOKEN = re.compile(r"""\s+|#[^\n]*|"((?:[^"\\]|\\.)*)"|'((?:[^'\\]|\\.)*)'|([{};])|([^\s{};"'#]+)""")


def _nginx(path: Path) -> list[_Directive]:
    """nginx's configuration syntax: directives with arguments, ending in ``;`` or a ``{ }`` block."""
    text, pos, tokens = path.read_text(), 0, []
    while pos < len(text):
        match = _NGINX_TOKEN.match(text, pos)
        assert match, f"{rel(path)}: cannot read from {text[pos:pos + 40]!r}"
        pos = match.end()
        if match[1] is not None or match[2] is not None:
            tokens.append(("word", match[1] if match[1] is not None else match[2]))
        elif match[3]:
            tokens.append(("punct", match[3]))
        elif match[4]:
            tokens.append(("word", match[4]))
    stack: list[list[_Directive]] = [[]]
    words: list[str] = []
    for kind, token in tokens:
        if kind == "word":
            words.append(token)
        elif token == ";":
            assert words, f"{rel(path)}: an empty directive"
            stack[-1].append(_Directive(words[0], words[1:], None))
            words = []
        elif token == "{":
            assert words, f"{rel(path)}: a block without a name"
            directive = _Directive(words[0], words[1:], [])
            stack[-1].append(directive)
            stack.append(directive.children)
            words = []
        else:
            assert not words and len(stack) > 1, f"{rel(path)}: unbalanced }}"
            stack.pop()
    assert not words and len(stack) == 1, f"{rel(path)}: unterminated directive or block"
    return stack[0]


def _seconds(value: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
    match = re.fullmatch(r"(\d+)(ms|s|m|h|d)?", value)
    assert match, f"not an nginx time: {value}"
    return int(match[1]) * units[match[2] or "s"]


def _bytes(value: str) -> int:
    match = re.fullmatch(r"(\d+)([kKmMgG])?", value)
    assert match, f"not an nginx size: {value}"
    return int(match[1]) * {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}[(match[2] or "").lower()]


@params(NGINX)
def test_nginx_config(path: Path) -> None:
    """A conf.d file (inside `http { }`): upstreams of servers, and proxying fit for server-sent events."""
    conf = _nginx(path)
    assert {d.name for d in conf} <= {"upstream", "server", "limit_conn_zone", "limit_req_zone", "map"}
    upstreams = {d.args[0]: d for d in conf if d.name == "upstream"}
    assert upstreams, f"{rel(path)} has no upstream"
    for name, upstream in upstreams.items():
        servers = [d.args[0] for d in upstream.children if d.name == "server"]
        assert servers and all(re.fullmatch(r"[\w.-]+:\d+", s) for s in servers), f"upstream {name}: {servers}"
    servers = [d for d in conf if d.name == "server" and d.block]
    assert servers
    for server in servers:
        assert any(d.name == "listen" for d in server.children)
        locations = [d for d in server.children if d.name == "location"]
        assert locations
        for location in locations:
            settings = {d.name: d.args for d in location.children if not d.block}
            headers = {d.args[0].lower(): d.args[1] for d in location.children if d.name == "proxy_set_header"}
            target = urlsplit(settings["proxy_pass"][0])
            assert target.scheme == "http" and target.hostname in upstreams, settings["proxy_pass"]
            assert settings.get("proxy_buffering") == ["off"], "server-sent events must not wait in nginx's buffer"
            assert settings.get("proxy_http_version") == ["1.1"]
            assert headers.get("host") == "$host"
            assert headers.get("x-forwarded-for") == "$proxy_add_x_forwarded_for"
            if any(d.name == "keepalive" for d in upstreams[target.hostname].children):
                assert headers.get("connection") == "", "keepalive to the upstream needs Connection cleared"
            assert _seconds(settings["proxy_read_timeout"][0]) >= 300, "streams stay quiet for minutes"


def _nginx_test_config(path: Path, tmp: Path) -> Path:
    """A main nginx.conf around ``path`` as the official image includes it (inside `http { }`), with every
    upstream host name made a loopback address (nginx resolves them when it reads the file), every `listen` a
    free loopback port (`nginx -t` binds them, and an unprivileged user cannot bind 80) and every path it writes
    under ``tmp``."""
    hosts: dict[str, str] = {}

    def loopback(match: re.Match[str]) -> str:
        host = hosts.setdefault(match[2], f"127.0.0.{len(hosts) + 1}")
        return f"{match[1]}{host}{match[3]}"

    conf = re.sub(r"(?m)^(\s*server\s+)([A-Za-z][\w.-]*)(:\d+)", loopback, path.read_text())
    conf = re.sub(r"(?m)^(\s*listen\s+)[^\s;]+", lambda m: f"{m[1]}127.0.0.1:{free_port()}", conf)
    (tmp / "conf.d").mkdir()
    (tmp / "conf.d" / path.name).write_text(conf)
    built = subprocess.run(["nginx", "-V"], capture_output=True, text=True, timeout=30).stderr
    temp_paths = "".join(f"    {kind.replace('-', '_')}_temp_path {tmp}/{kind};\n"
                         for kind in re.findall(r"--http-([\w-]+)-temp-path=", built)
                         if f"--without-http_{kind}_module" not in built)
    main = tmp / "nginx.conf"
    main.write_text(f"pid {tmp}/nginx.pid;\nerror_log {tmp}/error.log;\nevents {{}}\nhttp {{\n"
                    f"    access_log {tmp}/access.log;\n{temp_paths}    include {tmp}/conf.d/*.conf;\n}}\n")
    return main


@params(NGINX)
def test_nginx_accepts_the_config(path: Path, tmp_path: Path) -> None:
    """`nginx -t` on the file itself: every directive known, every argument valid."""
    if shutil.which("nginx") is None:
        missing("nginx (Debian's nginx-light or nginx package)", "HARNESS_REQUIRE_NGINX")
    main = _nginx_test_config(path, tmp_path)
    result = subprocess.run(["nginx", "-t", "-p", str(tmp_path), "-e", str(tmp_path / "error.log"), "-c", str(main)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


# -- the image -----------------------------------------------------------------------------------------------


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
