"""The gateway's settings sections, and how settings are loaded: defaults, under a TOML file, under
``HARNESS_<SECTION>__<KEY>`` environment variables, under command-line flags (pydantic-settings' sources).

This is the only module that reads the environment. Everything else receives a ``Settings``.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

from pydantic import BaseModel, Field, ValidationError, model_validator
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    TomlConfigSettingsSource,
)

from gateway.bot.settings import BotSettings
from gateway.console.settings import ConsoleSettings
from gateway.prompting import DEFAULT_RENDERING, Rendering
from gateway.quotas.settings import LimitsSettings, Price, unpriced
from replay.settings import RewardSettings, StoreSettings
from tools.settings import ConfigError, Section, ToolsSettings

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
ENV_PREFIX = "HARNESS_"


class ServerSettings(Section):
    host: str = Field("127.0.0.1", description="Address to bind.")
    port: int = Field(8000, ge=0, le=65535, description="Port to bind (0 picks a free one).")
    max_body_bytes: int = Field(8 * 1024 * 1024, gt=0, description="Largest accepted request body.")
    max_head_bytes: int = Field(65_536, ge=1024, description="Largest request line and headers together; "
                                "larger heads get 431 before the rest is read.")
    max_headers: int = Field(100, gt=0, description="Most headers in one request; more get 431.")
    head_timeout: float = Field(10.0, gt=0, description="Seconds a connection may take to send a complete request "
                                "head (from connecting, or from the head's first byte on a kept-alive connection).")
    body_timeout: float = Field(60.0, gt=0, description="Seconds a request body may take to arrive in full once its "
                                "head is in; a slower one gets 408 and its connection is closed.")
    keep_alive_seconds: float = Field(5.0, gt=0, description="Seconds an idle kept-alive connection stays open.")
    max_connections: int = Field(2048, gt=0, description="Connections and requests in flight before new requests "
                                 "get 503.")
    max_connections_per_client: int | None = Field(
        None, gt=0, description="Connections one client address may hold open; more are answered 503 and closed "
        "at once, without taking one of max_connections. Default: half of max_connections. Behind a reverse proxy "
        "(every connection from one address) set it to max_connections.")
    workers: int = Field(1, gt=0, description="Gateway processes serving one socket; uvicorn's supervisor replaces "
                         "one that dies. More than 1 needs a PostgreSQL store ([store] url) and no local backend. "
                         "Each worker keeps its own limits and metrics: max_connections and "
                         "max_connections_per_client hold per worker, and /metrics counts the worker that answers.")
    admin_key_env: str = Field("HARNESS_ADMIN_KEY", description="Variable holding the admin key.")
    auth_cache_seconds: float = Field(5.0, ge=0, description="How long a key lookup is trusted: a key revoked "
                                      "from the CLI keeps working for at most this long.")
    metrics_auth: Literal["open", "key", "admin"] = Field(
        "open", description="Who may read /metrics: anyone, any API key (or the admin key), or the admin key.")
    guard_retries: int = Field(1, ge=0, description="Proxy mode: times an invalid tool call goes back to the model "
                               "before the client sees it.")
    log_format: Literal["auto", "json", "console"] = Field(
        "auto", description="auto: readable on a terminal, JSON otherwise."
    )
    log_level: str = Field("info", description="Lowest level written.")
    console: bool = Field(True, description="Serve the web console at /ui (trajectories, approvals, adapters, "
                          "training runs); [console] tunes it.")
    # Filled from admin_key_env at load time.
    admin_key: str | None = Field(None, exclude=True)


# A small CPU model that does not stop would otherwise hold the engine for minutes on one ceiling request.
LOCAL_MAX_OUTPUT_TOKENS = 1024
# OpenAI's APIs beside chat that a backend may serve; the embedded model embeds nothing, an Anthropic upstream speaks
# the Messages API alone.
Api = Literal["completions", "embeddings"]
# The kinds whose API is passed through, not translated: each serves its own surface alone.
PASSED_THROUGH = ("anthropic", "openai-responses")
DEFAULT_APIS: dict[str, tuple[Api, ...]] = {"openai": ("completions", "embeddings"),
                                            "sglang": ("completions", "embeddings"),
                                            "vllm": ("completions", "embeddings"), "local": ("completions",),
                                            "anthropic": (), "openai-responses": ()}


class BackendSettings(Section):
    name: str = Field(description="Unique name, shown in logs and owned_by.")
    kind: Literal["openai", "sglang", "vllm", "local", "anthropic", "openai-responses"] = Field(
        "openai", description="openai (any OpenAI-compatible upstream), sglang, vllm, local (the embedded "
        "model), anthropic (an Anthropic Messages API upstream, served on /v1/messages only and passed through "
        "byte for byte; base_url is its root as ANTHROPIC_BASE_URL takes it, e.g. https://api.anthropic.com), or "
        "openai-responses (a Responses API upstream, served on /v1/responses only and passed through byte for "
        "byte: reasoning items, custom tools, compaction; base_url as for openai, e.g. https://api.openai.com/v1); "
        "sglang, vllm and local load LoRA adapters at runtime.")
    base_url: str | None = Field(None, description="The upstream's OpenAI base URL, e.g. "
                                 "http://127.0.0.1:30000/v1; required unless local.")
    api_key_env: str | None = Field(None, description="Variable holding the upstream's API key.")
    models: list[str] = Field(default_factory=list, description="Base model names this backend serves (local: "
                              "default the embedded model's).")
    connect_timeout: float = Field(5.0, gt=0, description="Seconds to establish a connection.")
    read_timeout: float = Field(120.0, gt=0, description="Seconds to wait for the upstream's next bytes; past it "
                                "the client gets a 504 (or a stream's error event).")
    max_retries: int = Field(2, ge=0, description="Retries on connection errors, 429 and 5xx.")
    max_connections: int = Field(256, gt=0, description="Connection pool size.")
    max_response_bytes: int = Field(8 * 1024 * 1024, gt=0, description="Largest upstream response (a stream's "
                                    "events together); past it the exchange ends with a 502, recorded as an error.")
    max_output_tokens: int | None = Field(None, gt=0, description="Largest max_tokens a Messages API request "
                                          "(whose max_tokens is a ceiling: Claude Code asks for 128,000) sends to "
                                          "this backend; larger ones are lowered to it (default: none; local: "
                                          f"{LOCAL_MAX_OUTPUT_TOKENS}, and never more than the context leaves).")
    # local kind
    model_path: str | None = Field(
        None, description="local: a GGUF file or a cached folder; default the embedded model.")
    cache_dir: str | None = Field(None, description="local: where dequantized weights are cached.")
    max_batch_size: int = Field(8, gt=0, description="local: most sequences in one forward pass.")
    batch_wait_ms: float = Field(5.0, ge=0, description="local: how long to gather a batch.")
    prefix_cache_mb: int = Field(256, ge=0, description="local: memory for keys and values kept across requests, "
                                 "so a prompt that starts like an earlier one prefills only the rest (0: off).")
    batch_cache_mb: int = Field(0, ge=0, description="local: memory for the running batch's keys and values, "
                                "padding included (rows times the longest row: one long conversation makes every "
                                "row as long); a request that would take the batch past it waits for rows to "
                                "finish, and one alone always runs. Checked as a request joins (the batch then "
                                "grows a position a step). 0: no limit beyond max_batch_size.")
    threads: int | None = Field(None, gt=0, description="local: torch threads (default: all cores).")
    merge_lone_adapter: bool = Field(False, description="local: while every row of a batch runs one adapter, run "
                                     "it merged into the base weights (a step as fast as the base model's), "
                                     "unmerging when a batch needs another: for evaluations of one adapter at a "
                                     "time (replay-train sets it), not for mixed traffic.")
    map_large_allocations: bool = Field(True, description="local: have glibc map every allocation of 1 MiB or more, "
                                        "so freed activations go back to the system at once (a lower, steadier "
                                        "RSS for a long-lived server, for page faults: about a tenth more time "
                                        "per episode on CPU). Process-wide once an engine sets it.")
    tool_rendering: Rendering = Field(DEFAULT_RENDERING, description="local: how tool specs are written into the "
                                      "base model's prompt: 'hermes' (a line of JSON per tool) or 'compact' (a "
                                      "signature per tool); an adapter gets the rendering it was trained with.")
    weight: float = Field(1.0, gt=0, description="This backend's share of a model it serves with others: requests "
                          "go to the backend with the fewest in flight per unit of weight.")
    apis: list[Api] | None = Field(None, description="Which of OpenAI's APIs besides chat this backend serves: "
                                   "completions (/v1/completions) and embeddings (/v1/embeddings); a model whose "
                                   "backend does not list one gets a 404 unsupported_api there (default: both for "
                                   "openai, sglang and vllm, completions for local, neither for anthropic and "
                                   "openai-responses).")
    api_key: str | None = Field(None, exclude=True)

    @model_validator(mode="after")
    def _check_kind(self) -> BackendSettings:
        if self.kind != "local" and not self.base_url:
            raise ValueError(f"backend {self.name!r} of kind {self.kind!r} needs base_url")
        if self.apis is None:
            self.apis = list(DEFAULT_APIS[self.kind])
        refused = set(self.apis) - set(DEFAULT_APIS[self.kind]) if self.kind in PASSED_THROUGH + ("local",) else set()
        if refused:
            raise ValueError(f"backend {self.name!r} of kind {self.kind!r} cannot serve {', '.join(sorted(refused))}")
        if self.kind == "local" and not self.models:
            self.models = [DEFAULT_MODEL_NAME]
        if not self.models:
            raise ValueError(f"backend {self.name!r} lists no models")
        reserved = [m for m in self.models if m.startswith("agent:")]
        if reserved:
            raise ValueError(f"backend {self.name!r} lists {reserved[0]!r}: the 'agent:' prefix names agent profiles")
        return self


class ProfileSettings(Section):
    """An agent profile: ``model = "agent:<name>"`` runs this agent to completion on the server."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]+$", description="Unique name; clients ask for agent:<name>.")
    model: str = Field(description="The base model (or base:adapter) the agent thinks with.")
    system_prompt: str = Field("", description="The agent's system prompt.")
    tools: list[str] = Field(default_factory=list, description="Tool names this agent may call.")
    max_steps: int = Field(10, ge=0, description="Model calls per run (0: no limit).")
    max_total_tokens: int = Field(0, ge=0, description="Prompt plus completion tokens per run (0: no limit).")
    deadline_seconds: float = Field(0.0, ge=0, description="Wall-clock limit per run (0: none).")
    max_consecutive_tool_failures: int = Field(3, ge=0, description="Failures of one tool before a nudge; "
                                               "as many more end the run.")
    max_repeats: int = Field(3, ge=0, description="Identical calls (not back to back) allowed per run.")
    context_budget_tokens: int = Field(0, ge=0, description="Summarize older turns past this many tokens (0: never).")
    keep_last_turns: int = Field(2, ge=0, description="Turns kept verbatim when summarizing.")
    temperature: float | None = Field(None, ge=0, le=2, description="Sampling temperature of the agent's model "
                                      "calls (default the backend's).")
    max_tokens: int | None = Field(None, ge=1, description="Per model call.")
    constrain_tool_calls: bool = Field(False, description="Once the model opens a <tool_call>, hold it to a call of "
                                       "one of the offered tools with valid arguments (the embedded model only).")


class CanarySettings(Section):
    model: str = Field(description="The alias (or model name) whose traffic is split, as clients name it.")
    target: str = Field(description="Where the canary share goes, usually a candidate version: 'base:adapter@4'.")
    share: float = Field(ge=0.0, le=1.0, description="Fraction of sessions sent to the target.")


class RoutingSettings(Section):
    aliases: dict[str, str] = Field(default_factory=dict, description="Model names clients use, and what each "
                                    "stands for ('support' = 'qwen:sql').")
    default_model: str | None = Field(None, description="Model for requests that name none, after key and tenant "
                                      "defaults.")
    tenant_defaults: dict[str, str] = Field(default_factory=dict,
                                            description="Per-tenant model for requests that name none.")
    override_header: str = Field("X-Harness-Model", description="Header that replaces the requested model, for "
                                 "keys allowed to use it.")
    canaries: list[CanarySettings] = Field(default_factory=list, description="Shares of a model's traffic sent "
                                           "elsewhere, sticky per session.")
    adapters_dir: str = Field("adapters", description="Where uploaded adapters are unpacked.")
    max_upload_bytes: int = Field(512 * 1024 * 1024, gt=0, description="Largest adapter archive accepted.")
    refresh_seconds: float = Field(5.0, gt=0, description="How often the registry is re-read and backends are "
                                   "checked for lost adapters.")
    fallbacks: dict[str, list[str]] = Field(default_factory=dict, description="Models tried in order when a model's "
                                            "call fails before anything reached the client (a 5xx, a timeout, a "
                                            "prompt longer than its context): 'gpt-x' = ['other', 'third'].")
    health_check_seconds: float = Field(10.0, ge=0, description="How often each remote backend is probed (GET "
                                        "{base_url}/models; any answer but a 5xx is healthy); 0: never.")
    eject_after_failures: int = Field(3, gt=0, description="Consecutive failures (unreachable, timeouts, 429 and "
                                      "5xx; requests and probes alike) that eject a backend from its models' pools.")
    eject_seconds: float = Field(30.0, gt=0, description="How long an ejected backend rests before one probe or "
                                 "request decides whether it comes back.")
    member_retries: int = Field(0, ge=0, description="Retries a backend that shares a model with others makes "
                                "itself (at most its max_retries) before the request moves on to the next.")

    @model_validator(mode="after")
    def _check_names(self) -> RoutingSettings:
        for alias in self.aliases:
            if alias.startswith("agent:"):
                raise ValueError(f"alias {alias!r}: the 'agent:' prefix names agent profiles")
        for model, fallbacks in self.fallbacks.items():
            if any(name.startswith("agent:") for name in [model, *fallbacks]):
                raise ValueError(f"fallbacks of {model!r}: models fall back to models, not to agent profiles")
        return self


class Settings(BaseSettings):
    """The gateway's sections; ``training/settings.py`` adds ``[training]`` on top. Built in code it holds what it is
    given and reads nothing: ``load_settings`` gathers the file, the environment and flags, so that each value's
    source can be told (``harness config show``)."""

    model_config = SettingsConfigDict(extra="forbid", env_prefix=ENV_PREFIX, env_nested_delimiter="__")

    server: ServerSettings = Field(default_factory=ServerSettings)
    store: StoreSettings = Field(default_factory=StoreSettings)
    backends: list[BackendSettings] = Field(default_factory=list)
    tools: ToolsSettings = Field(default_factory=ToolsSettings)
    profiles: list[ProfileSettings] = Field(default_factory=list)
    rewards: RewardSettings = Field(default_factory=RewardSettings)
    routing: RoutingSettings = Field(default_factory=RoutingSettings)
    bot: BotSettings = Field(default_factory=BotSettings)
    limits: LimitsSettings = Field(default_factory=LimitsSettings)
    console: ConsoleSettings = Field(default_factory=ConsoleSettings)
    prices: dict[str, Price] = Field(default_factory=dict, description="[prices.MODEL]: what a base model's tokens "
                                     "cost; each call's cost is recorded, and money budgets count it.")

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   **_: PydanticBaseSettingsSource) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)

    @model_validator(mode="after")
    def _default_backend(self) -> Settings:
        if not self.backends:
            self.backends = [BackendSettings(name="local", kind="local")]
            # Claude Code names claude-* models; with nothing configured they mean the one model there is.
            self.routing.aliases.setdefault("claude-*", DEFAULT_MODEL_NAME)
        for kind, names in (("backend", [b.name for b in self.backends]), ("profile", [p.name for p in self.profiles])):
            if len(set(names)) != len(names):
                raise ValueError(f"{kind} names must be unique, got {names}")
        return self

    @model_validator(mode="after")
    def _check_workers(self) -> Settings:
        workers = self.server.workers
        if workers == 1:
            return self
        if self.store.url is None:
            raise ValueError(f"[server] workers = {workers} needs a PostgreSQL store ([store] url): an SQLite file "
                             "takes one writing process")
        local = next((b.name for b in self.backends if b.kind == "local"), None)
        if local is not None:
            raise ValueError(f"[server] workers = {workers} cannot serve the embedded model (backend {local!r}): each "
                             "worker would load its own copy of the model and its cache and split the batches, so "
                             "more workers give less throughput per GB, not more. Run one worker, or serve the model "
                             "with sglang or vllm and put the workers in front of it")
        return self

    @model_validator(mode="after")
    def _check_prices(self) -> Settings:
        missing = unpriced(self.backends, self.prices) if self.limits.in_money else []
        if missing:
            raise ValueError(f"[limits] sets a budget in money, but these models have no [prices] entry to count it "
                             f"with: {', '.join(missing)}")
        return self

    @model_validator(mode="after")
    def _check_bot(self) -> Settings:
        profiles = {p.name for p in self.profiles}
        for key, name in (("bot.profile", self.bot.profile), ("bot.wecom.profile", self.bot.wecom.profile)):
            if name is not None and name not in profiles:
                raise ValueError(f"{key} names no configured profile: {name!r} (profiles: "
                                 f"{', '.join(sorted(profiles)) or 'none'})")
        wecom = self.bot.wecom
        if wecom.corp_id and wecom.agent_id is None:
            raise ValueError("bot.wecom.agent_id is needed to send replies when corp_id is set")
        if wecom.corp_id and not (wecom.profile or self.bot.profile):
            raise ValueError("bot.wecom needs a profile: set bot.profile or bot.wecom.profile")
        return self


# Precedence, highest first; a key none of them sets keeps its default.
SOURCES = ("flag", "environment", "file")
DEFAULT = "default"
S = TypeVar("S", bound=Settings)


class _Environment(EnvSettingsSource):
    """The library's environment source (``HARNESS_SECTION__KEY``, JSON for lists and tables), over a mapping the
    caller passes instead of ``os.environ`` itself, so that tests and ``harness config check`` choose theirs."""

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str]) -> None:
        self._environ = environ
        super().__init__(settings_cls)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return {key.lower(): value for key, value in self._environ.items()}


def _merge(low: Any, high: Any) -> Any:
    """``high`` over ``low``, tables key by key. The environment source nests by name, so a list entry's override
    (``HARNESS_BACKENDS__0__READ_TIMEOUT``) arrives as a table keyed "0"; it is applied to that entry of the list
    below it. The library merges tables but not list entries, hence this much of our own."""
    if isinstance(low, list) and _indexed(high):
        merged = list(low)
        for key, value in sorted(high.items(), key=lambda kv: int(kv[0])):
            while len(merged) <= int(key):
                merged.append({})
            merged[int(key)] = _merge(merged[int(key)], value)
        return merged
    if isinstance(low, dict) and isinstance(high, dict):
        # An entry by index with no list below it starts one, as it would have in the file.
        return {**low, **{k: _merge(low.get(k, [] if _indexed(v) else {}), v) for k, v in high.items()}}
    return high


def _indexed(value: Any) -> bool:
    return isinstance(value, dict) and bool(value) and all(k.isdigit() for k in value)


def source_of(layers: Mapping[str, Any], path: tuple[str | int, ...]) -> str:
    """Which source set the value at ``path`` ("flag", "environment", "file" or "default"). A list a source gives
    whole replaces the lists below it, so a key its entries leave out is a default, not a lower source's."""
    for name in SOURCES:
        node, through_list = layers.get(name, {}), False
        for part in path:
            if isinstance(node, list) and isinstance(part, int) and part < len(node):
                node, through_list = node[part], True
            elif isinstance(node, dict) and str(part) in node:
                node = node[str(part)]
            else:
                node = None
                break
        else:
            return name
        if through_list:
            return DEFAULT
    return DEFAULT


def _problems(exc: ValidationError) -> list[str]:
    """One line per mistake, by its dotted path (``backends.0.read_timeout``); a check across sections has none,
    and names its keys in its message."""
    problems = []
    for err in exc.errors():
        message = "unknown key" if err["type"] == "extra_forbidden" else err["msg"].removeprefix("Value error, ")
        path = ".".join(str(x) for x in err["loc"])
        problems.append(f"{path}: {message}" if path else message)
    return problems


def read_sources(path: str | os.PathLike[str] | None = None, environ: Mapping[str, str] | None = None, *,
                 flags: Mapping[str, Any] | None = None, model: type[Settings] = Settings) -> dict[str, Any]:
    """Each source's own values, unvalidated: ``{"flag": ..., "environment": ..., "file": ...}``. The file is
    ``path``, else ``HARNESS_CONFIG``, else none."""
    env = os.environ if environ is None else environ
    path = path or env.get("HARNESS_CONFIG")
    file: dict[str, Any] = {}
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            file = TomlConfigSettingsSource(model, toml_file=p)()
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{p}: invalid TOML: {exc}") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{p}: cannot be read: {exc}") from None
    # The library skips variables that name no field; a misspelt section must not pass silently.
    unknown = sorted(f"{key}: no section {key[len(ENV_PREFIX):].split('__')[0].lower()!r}" for key in env
                     if key.upper().startswith(ENV_PREFIX) and "__" in key
                     and key[len(ENV_PREFIX):].split("__")[0].lower() not in model.model_fields)
    if unknown:
        raise ConfigError(f"invalid configuration: {'; '.join(unknown)}", unknown)
    try:
        environment = _Environment(model, env)()
    except SettingsError as exc:  # a list or table that is not JSON; the library names only its section
        section = re.search(r'field "(\w+)"', str(exc))
        prefix = ENV_PREFIX + (section[1].upper() if section else "")
        names = sorted(k for k in env if k.upper().startswith(prefix) and not _is_json(env[k])
                       and _is_structured(model, k[len(ENV_PREFIX):].lower().split("__"))) or [prefix]
        problems = [f"{name}: not valid JSON (lists and tables in the environment are JSON)" for name in names]
        raise ConfigError(f"invalid configuration: {'; '.join(problems)}", problems) from None
    return {"flag": dict(flags or {}), "environment": _decode_entries(model, environment), "file": file,
            "path": str(path) if path else None}


def _child(annotation: Any, part: str) -> Any:
    """The type of ``part`` below ``annotation``: a model's field or a list's entry; None when it has none."""
    if get_origin(annotation) is list and part.isdigit():
        return get_args(annotation)[0]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel) and part in annotation.model_fields:
        return annotation.model_fields[part].annotation
    return None


def _structured(annotation: Any) -> bool:
    return get_origin(annotation) in (list, dict) or (isinstance(annotation, type) and issubclass(annotation,
                                                                                                 BaseModel))


def _is_structured(model: type[BaseModel], parts: list[str]) -> bool:
    """Whether the key a variable names holds a list or a table (which the environment gives as JSON)."""
    annotation: Any = model
    for part in parts:
        annotation = _child(annotation, part)
    return _structured(annotation)


def _decode_entries(annotation: Any, value: Any, path: str = "") -> Any:
    """JSON-decode lists and tables inside list entries (``HARNESS_BACKENDS__0__MODELS='["m"]'``), which the
    library leaves as text: it decodes by the field a variable names, and an entry by index names none."""
    if isinstance(value, dict):
        return {k: _decode_entries(_child(annotation, k), v, f"{path}__{k.upper()}" if path else ENV_PREFIX + k.upper())
                for k, v in value.items()}
    if isinstance(value, str) and _structured(annotation):
        try:
            return json.loads(value)
        except ValueError:
            raise ConfigError(f"{path}: not valid JSON (lists and tables in the environment are JSON)") from None
    return value


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def load_with_sources(path: str | os.PathLike[str] | None = None, environ: Mapping[str, str] | None = None, *,
                      flags: Mapping[str, Any] | None = None,
                      model: type[S] = Settings) -> tuple[S, dict[str, Any]]:  # type: ignore[assignment]
    """The settings, and each source's own values (for ``source_of``); secrets filled from their variables."""
    env = os.environ if environ is None else environ
    layers = read_sources(path, env, flags=flags, model=model)
    data: Any = {}
    for name in reversed(SOURCES):
        data = _merge(data, layers[name])
    try:
        settings = model.model_validate(data)
    except ValidationError as exc:
        problems = _problems(exc)
        raise ConfigError(f"invalid configuration: {'; '.join(problems)}", problems) from None
    _fill_secrets(settings, env)
    return settings, layers


def load_settings(path: str | os.PathLike[str] | None = None, environ: Mapping[str, str] | None = None, *,
                  flags: Mapping[str, Any] | None = None, model: type[S] = Settings) -> S:  # type: ignore[assignment]
    """Defaults, under the TOML file (``path``, else ``HARNESS_CONFIG``, else none), under the environment
    (``HARNESS_SECTION__KEY``), under command-line ``flags`` (a table shaped like the file)."""
    return load_with_sources(path, environ, flags=flags, model=model)[0]


def _fill_secrets(settings: BaseModel, env: Mapping[str, str]) -> None:
    # Secrets never sit in the file or in a dump: each *_env key names the variable that holds one, and the field of
    # the same name without _env (excluded from dumps) gets its value, in every section and list entry, whichever
    # package's section it is (training's too).
    for name in type(settings).model_fields:
        value = getattr(settings, name)
        if name.endswith("_env") and name[:-4] in type(settings).model_fields:
            if isinstance(value, str) and value:
                setattr(settings, name[:-4], env.get(value) or None)
        elif isinstance(value, BaseModel):
            _fill_secrets(value, env)
        elif isinstance(value, list):
            for item in value:
                if isinstance(item, BaseModel):
                    _fill_secrets(item, env)
