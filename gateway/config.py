"""One settings object: a TOML file plus ``HARNESS_<SECTION>__<KEY>`` environment overrides.

This is the only module that reads the environment. Everything else receives a ``Settings``.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from gateway.prompting import DEFAULT_RENDERING, Rendering
from replay.settings import RewardSettings, StoreSettings
from tools.settings import AllowHosts, ConfigError, Networks, Section, ToolsSettings

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
    # Filled from admin_key_env at load time.
    admin_key: str | None = Field(None, exclude=True)


class BackendSettings(Section):
    name: str
    kind: Literal["openai", "sglang", "vllm", "local"] = "openai"
    base_url: str | None = None
    api_key_env: str | None = None
    models: list[str] = Field(default_factory=list, description="Base model names this backend serves.")
    connect_timeout: float = Field(5.0, gt=0)
    read_timeout: float = Field(120.0, gt=0)
    max_retries: int = Field(2, ge=0, description="Retries on connection errors, 429 and 5xx.")
    max_connections: int = Field(256, gt=0)
    max_response_bytes: int = Field(8 * 1024 * 1024, gt=0, description="Largest upstream response (a stream's "
                                    "events together); past it the exchange ends with a 502, recorded as an error.")
    # local kind
    model_path: str | None = Field(
        None, description="local: a GGUF file or a cached folder; default the embedded model.")
    cache_dir: str | None = Field(None, description="local: where dequantized weights are cached.")
    max_batch_size: int = Field(8, gt=0, description="local: most sequences in one forward pass.")
    batch_wait_ms: float = Field(5.0, ge=0, description="local: how long to gather a batch.")
    prefix_cache_mb: int = Field(256, ge=0, description="local: memory for keys and values kept across requests, "
                                 "so a prompt that starts like an earlier one prefills only the rest (0: off).")
    threads: int | None = Field(None, gt=0, description="local: torch threads (default: all cores).")
    map_large_allocations: bool = Field(True, description="local: have glibc map every allocation of 1 MiB or more, "
                                        "so freed activations go back to the system at once (a lower, steadier "
                                        "RSS for a long-lived server, for page faults: about a tenth more time "
                                        "per episode on CPU). Process-wide once an engine sets it.")
    tool_rendering: Rendering = Field(DEFAULT_RENDERING, description="local: how tool specs are written into the "
                                      "base model's prompt: 'hermes' (a line of JSON per tool) or 'compact' (a "
                                      "signature per tool); an adapter gets the rendering it was trained with.")
    api_key: str | None = Field(None, exclude=True)

    @model_validator(mode="after")
    def _check_kind(self) -> BackendSettings:
        if self.kind != "local" and not self.base_url:
            raise ValueError(f"backend {self.name!r} of kind {self.kind!r} needs base_url")
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

    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]+$")
    model: str = Field(description="The base model (or base:adapter) the agent thinks with.")
    system_prompt: str = ""
    tools: list[str] = Field(default_factory=list, description="Tool names this agent may call.")
    max_steps: int = Field(10, ge=0, description="Model calls per run (0: no limit).")
    max_total_tokens: int = Field(0, ge=0, description="Prompt plus completion tokens per run (0: no limit).")
    deadline_seconds: float = Field(0.0, ge=0, description="Wall-clock limit per run (0: none).")
    max_consecutive_tool_failures: int = Field(3, ge=0, description="Failures of one tool before a nudge; "
                                               "as many more end the run.")
    max_repeats: int = Field(3, ge=0, description="Identical calls (not back to back) allowed per run.")
    context_budget_tokens: int = Field(0, ge=0, description="Summarize older turns past this many tokens (0: never).")
    keep_last_turns: int = Field(2, ge=0, description="Turns kept verbatim when summarizing.")
    temperature: float | None = Field(None, ge=0, le=2)
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

    @model_validator(mode="after")
    def _check_names(self) -> RoutingSettings:
        for alias in self.aliases:
            if alias.startswith("agent:"):
                raise ValueError(f"alias {alias!r}: the 'agent:' prefix names agent profiles")
        return self


class GateSettings(Section):
    """Whether a candidate replaces the reference (the active adapter, else the base): both are evaluated on the
    same gate tasks, drawn with a fixed seed from the suite's test templates, and compared by one-sided bounds."""

    tasks: int = Field(100, gt=0, description="Gate tasks drawn from the test templates (at least 100, or at "
                       "least 40 with 3 samples each).")
    samples: int = Field(1, gt=0, description="Episodes per gate task and model (above 1: sampled at "
                         "``temperature``; a task's success is then the share of its samples that succeeded).")
    temperature: float = Field(0.7, gt=0, le=2, description="Sampling temperature when ``samples`` is above 1 "
                               "(one sample is greedy).")
    seed: int = Field(0, description="Seed of the gate tasks' draw and of the bootstrap.")
    confidence: float = Field(0.95, gt=0.5, lt=1, description="Confidence of each one-sided bound.")
    resamples: int = Field(10_000, ge=1000, description="Bootstrap resamples of the paired tasks.")
    min_faulted: int = Field(20, gt=0, description="Gate tasks with an injected tool fault the draw includes at "
                             "least; recovery is judged on them pooled.")
    invalid_call_rate: float = Field(0.05, ge=0, description="Largest rise in the invalid tool-call rate the "
                                     "upper bound may show.")
    general_perplexity: float = Field(0.05, ge=0, description="Largest relative rise in perplexity on held-out "
                                      "general data the upper bound may show (0.05 = 5%).")
    recovery_rate: float = Field(0.1, ge=0, description="Largest drop in success after a tool fault the lower "
                                 "bound may show.")
    mean_steps: float = Field(1.0, ge=0, description="Largest rise in steps beyond the solver's, on tasks both "
                              "solved, the upper bound may show.")

    @model_validator(mode="after")
    def _enough_tasks(self) -> GateSettings:
        if self.tasks < 100 and not (self.tasks >= 40 and self.samples >= 3):
            raise ValueError(f"the gate needs at least 100 tasks, or at least 40 tasks with 3 samples each "
                             f"(got {self.tasks} tasks x {self.samples} samples): fewer cannot tell a real "
                             "improvement from noise")
        return self


class ExpertSettings(Section):
    """Expert iteration after SFT (``replay-train --mode sft|sft+rl``): the model's own verified, clean episodes on
    the train tasks it fails greedily, trained on, round after round."""

    rounds: int = Field(0, ge=0, description="Rounds after SFT (0: none).")
    tasks: int = Field(64, gt=0, description="Train tasks each round screens with one greedy episode (in turn "
                       "through the split).")
    samples: int = Field(4, gt=0, description="Episodes per screened task the greedy episode failed, sampled at "
                         "``temperature``.")
    temperature: float = Field(0.7, gt=0, le=2, description="Sampling temperature of the episodes.")
    epochs: float = Field(2.0, gt=0, description="Passes over a round's rows: its kept episodes, the replayed "
                          "demonstrations and general rows at ``general_share``.")
    learning_rate: float = Field(2e-4, gt=0, description="Learning rate of a round's training, which starts from a "
                                 "trained adapter: SFT's own rate undid it.")
    replay: float = Field(3.0, ge=0, description="Rows of SFT's demonstrations mixed into a round per kept "
                          "episode's row, so a round adds to what SFT taught instead of training over it.")


class RLSettings(Section):
    """Group-relative RL on LoRA (``replay-train --mode rl|sft+rl``): rollouts, the update, validation."""

    algorithm: Literal["grpo", "rloo"] = Field("rloo", description="How a group's rewards become advantages: "
                                               "rloo (reward minus the mean of the others: unscaled) or grpo "
                                               "(scaled by the group's std, so a tiny spread among failures "
                                               "weighs as much as success against failure).")
    outcome: Literal["success", "total"] = Field("success", description="A trajectory's outcome reward: its "
                                                 "verified task success where known (else the reward total), or "
                                                 "the reward engine's total (validity and efficiency included).")
    steps: int = Field(20, ge=0, description="Online steps: each rolls out a batch of groups and updates on it "
                       "(0: only the captured groups the filters select).")
    tasks_per_step: int = Field(8, gt=0, description="Tasks (groups) per step, chosen of similar difficulty.")
    group_size: int = Field(8, ge=2, description="Rollouts per task in a group.")
    temperature: float = Field(1.0, gt=0, le=2, description="Sampling temperature of the rollouts.")
    fault_rate: float = Field(0.2, ge=0, le=1, description="Share of groups whose tools get an injected fault "
                              "(timeout, empty result or error) on their first call, so recovery is practised.")
    learning_rate: float = Field(5e-5, gt=0, description="Learning rate of the RL updates (constant).")
    batch_size: int = Field(4, gt=0, description="Model calls per micro-batch; a step's calls all make one update.")
    updates_per_batch: int = Field(1, gt=0, description="Optimizer steps on each batch of rollouts; beyond the "
                                   "first the clipped importance ratio keeps the policy near the rollouts'.")
    clip: float = Field(0.2, gt=0, lt=1, description="Importance ratios are clipped to [1 - clip, 1 + clip].")
    kl_coef: float = Field(0.04, ge=0, description="Weight of the KL penalty to the policy RL starts from (frozen; "
                           "the base when it starts from a fresh adapter).")
    process_coef: float = Field(0.0, ge=0, description="Weight of each step's own process reward (normalised "
                                "within the group) beside the trajectory's advantage; 0: validity guards (the "
                                "reward-hacking alarm), it is not a reward to farm.")
    eval_every: int = Field(5, gt=0, description="Steps between validations (each saves a checkpoint).")
    validation_tasks: int = Field(0, ge=0, description="Validation tasks per validation, spread over the split "
                                  "(0: all of it).")
    rollback_margin: float = Field(0.05, ge=0, description="A validation success or valid-call rate this far "
                                   "below the best checkpoint's rolls the adapter back to it.")
    max_rollbacks: int = Field(3, ge=0, description="Rollbacks before the run stops.")
    alarm_reward_rise: float = Field(0.05, ge=0, description="Reward-hacking alarm: a rise in mean training "
                                     "reward since the last validation of more than this ...")
    alarm_drop: float = Field(0.05, ge=0, description="... while validation valid-call rate or success fell "
                              "by more than this stops the run.")


class TrainingSettings(Section):
    base_model: str = Field(DEFAULT_MODEL_NAME, description="The served base model adapters are trained for.")
    model_path: str | None = Field(None, description="Weights to train on: a GGUF or checkpoint folder; default "
                                   "the embedded model.")
    output_dir: str = Field("runs", description="Where training runs write checkpoints, metrics and plots.")
    tasks_dir: str = Field("~/.cache/agent-harness/tasks", description="Where task suites keep the fixture "
                           "databases their tools read (made on first use).")
    rank: int = Field(16, gt=0, description="LoRA rank.")
    alpha: float = Field(32.0, gt=0, description="LoRA alpha (scale = alpha / rank).")
    dropout: float = Field(0.0, ge=0, lt=1, description="LoRA dropout.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description="Modules LoRA adapts.")
    learning_rate: float = Field(2e-3, gt=0, description="Peak learning rate (linear warm-up, then cosine decay).")
    epochs: float = Field(1.0, gt=0, description="Passes over the training rows.")
    batch_size: int = Field(4, gt=0, description="Rows per micro-batch.")
    grad_accum: int = Field(2, gt=0, description="Micro-batches per optimizer step.")
    gradient_checkpointing: bool = Field(False, description="Recompute each layer's activations during the backward "
                                         "pass instead of keeping them: a fraction of the memory for about a third "
                                         "more compute, and no prompt shared across a batch (SFT and RL).")
    max_seq_len: int = Field(1024, gt=0, description="Rows longer than this are cut from the left of the prompt.")
    map_large_allocations: bool = Field(False, description="Have glibc map every allocation of 1 MiB or more "
                                        "while training and evaluating ([[backends]] map_large_allocations): "
                                        "peak RSS falls (4 rows of 512 tokens: 7.7 GB to 4.6 GB) but a CPU "
                                        "training step takes about a third longer, from the page faults.")
    tool_rendering: Rendering = Field("compact", description="How tool specs are written into training "
                                      "prompts ('hermes' or 'compact', as [[backends]] tool_rendering); recorded "
                                      "in each adapter folder (rendering.json), which is served the same way.")
    checkpoints: int = Field(1, gt=0, description="Checkpoints saved per run, evenly spaced; validation picks one "
                             "when there are several.")
    seed: int = Field(0, description="Seed for shuffling, mixing and initialisation.")
    min_recovered_share: float = Field(0.2, ge=0, le=1, description="Least share of rows from trajectories that "
                                       "recovered after a failed tool call (repeated to reach it).")
    general_share: float = Field(0.1, ge=0, lt=1, description="Share of rows from general data, against forgetting.")
    general_data: str | None = Field(None, description="A JSONL file of chat conversations for the general rows "
                                     "and check; default the base model's own answers to prompts shipped "
                                     "with the project.")
    suite: str = Field("tools", description="The task suite replay-train evaluates and gates on.")
    eval_concurrency: int = Field(8, gt=0, description="Episodes run at once during evaluation.")
    eval_max_tokens: int = Field(160, gt=0, description="Most tokens the model may write per step in an evaluation "
                                 "episode.")
    episode_timeout_seconds: float = Field(600.0, ge=0, description="Wall-clock limit of one episode (evaluation, "
                                           "gate, capture's attempts, expert iteration, RL rollouts): past it the "
                                           "episode is cancelled and counts as a failure (0: none).")
    constrain_tool_calls: bool = Field(True, description="Hold every tool call the model opens in an episode "
                                       "(evaluation, gate, expert iteration, RL rollouts) to a call of an offered "
                                       "tool with valid arguments, as a [[profiles]] constrain_tool_calls does "
                                       "when serving.")
    gate: GateSettings = Field(default_factory=GateSettings)
    expert: ExpertSettings = Field(default_factory=ExpertSettings)
    rl: RLSettings = Field(default_factory=RLSettings)


class WeComSettings(Section):
    """A WeCom (企业微信) self-built application whose callback URL points at ``/bot/wecom/callback``."""

    corp_id: str | None = Field(None, description="The company's corp id (the receive id of its callback "
                                "messages); none disables the adapter.")
    agent_id: int | None = Field(None, description="The application's agent id, used to send replies.")
    token_env: str = Field("HARNESS_WECOM_TOKEN", description="Variable holding the callback token.")
    aes_key_env: str = Field("HARNESS_WECOM_AES_KEY", description="Variable holding the 43-character "
                             "EncodingAESKey.")
    corp_secret_env: str = Field("HARNESS_WECOM_SECRET", description="Variable holding the application secret "
                                 "the send API's access token is taken with.")
    api_base: str = Field("https://qyapi.weixin.qq.com", description="Base URL of WeCom's server API.")
    profile: str | None = Field(None, description="The agent profile answering WeCom users (default "
                                "[bot] profile).")
    ack_text: str = Field("", description="A passive reply sent at once while the agent works (empty: none).")
    # Filled from the *_env variables at load time.
    token: str | None = Field(None, exclude=True)
    aes_key: str | None = Field(None, exclude=True)
    corp_secret: str | None = Field(None, exclude=True)


class BotSettings(Section):
    """The chat-bot backend: the signed JSON webhook ``/bot/v1/...`` and platform adapters."""

    profile: str | None = Field(None, description="The agent profile that answers; the bot routes are off "
                                "without one.")
    secret_env: str = Field("HARNESS_BOT_SECRET", description="Variable holding the webhook's shared secret.")
    tenant: str = Field("bot", description="Tenant the bot's trajectories belong to.")
    sync_timeout_seconds: float = Field(20.0, ge=0, description="How long a webhook waits for the reply before "
                                        "answering 202 (then callback or polling).")
    signature_window_seconds: float = Field(300.0, gt=0, description="Largest distance between a request's "
                                            "timestamp and the gateway's clock.")
    rate_limit_messages: int = Field(20, ge=0, description="Messages one user may send per window (0: no limit).")
    rate_limit_window_seconds: float = Field(60.0, gt=0, description="The rate limit's window.")
    callback_allow_hosts: AllowHosts = Field(default_factory=list, description="Callback hosts allowed even at "
                                            "private addresses.")
    callback_allow_networks: Networks = Field(default_factory=list, description="CIDR ranges callbacks may "
                                               "reach even when private.")
    callback_attempts: int = Field(6, gt=0, description="Tries to deliver one callback.")
    callback_backoff_seconds: float = Field(1.0, gt=0, description="Wait before the second try; doubles each "
                                            "time.")
    callback_timeout_seconds: float = Field(10.0, gt=0, description="Seconds one callback request may take.")
    wecom: WeComSettings = Field(default_factory=WeComSettings)
    # Filled from secret_env at load time.
    secret: str | None = Field(None, exclude=True)


class Settings(Section):
    server: ServerSettings = Field(default_factory=ServerSettings)
    store: StoreSettings = Field(default_factory=StoreSettings)
    backends: list[BackendSettings] = Field(default_factory=list)
    tools: ToolsSettings = Field(default_factory=ToolsSettings)
    profiles: list[ProfileSettings] = Field(default_factory=list)
    rewards: RewardSettings = Field(default_factory=RewardSettings)
    routing: RoutingSettings = Field(default_factory=RoutingSettings)
    training: TrainingSettings = Field(default_factory=TrainingSettings)
    bot: BotSettings = Field(default_factory=BotSettings)

    @model_validator(mode="after")
    def _default_backend(self) -> Settings:
        if not self.backends:
            self.backends = [BackendSettings(name="local", kind="local")]
        for kind, names in (("backend", [b.name for b in self.backends]), ("profile", [p.name for p in self.profiles])):
            if len(set(names)) != len(names):
                raise ValueError(f"{kind} names must be unique, got {names}")
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


def _parse_env_value(raw: str) -> Any:
    """Read an override as a TOML value where it is one (numbers, booleans, arrays), else a string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _apply_override(data: dict[str, Any], path: list[str], value: Any) -> None:
    node: Any = data
    for i, part in enumerate(path):
        last = i == len(path) - 1
        if isinstance(node, list):
            if not part.isdigit():
                raise ConfigError(f"{'.'.join(path)}: {part!r} is not a list index")
            idx = int(part)
            while len(node) <= idx:
                node.append({})
            if last:
                node[idx] = value
            else:
                node = node[idx]
            continue
        if last:
            node[part] = value
        else:
            nxt = node.get(part)
            if nxt is None:
                nxt = [] if part in ("backends", "profiles", "canaries") else {}
                node[part] = nxt
            node = nxt


def load_settings(path: str | os.PathLike[str] | None = None, environ: Mapping[str, str] | None = None) -> Settings:
    """Load the TOML file (``path``, else ``HARNESS_CONFIG``, else none) and apply environment overrides."""
    env = os.environ if environ is None else environ
    path = path or env.get("HARNESS_CONFIG")
    data: dict[str, Any] = {}
    if path:
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {p}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{p}: invalid TOML: {exc}") from None
    for key, raw in env.items():
        if not key.startswith(ENV_PREFIX) or "__" not in key:
            continue
        parts = [p.lower() for p in key[len(ENV_PREFIX):].split("__")]
        _apply_override(data, parts, _parse_env_value(raw))
    try:
        settings = Settings.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(x) for x in err['loc']) or '(top)'}: {err['msg']}" for err in exc.errors()
        )
        raise ConfigError(f"invalid configuration: {problems}") from None
    settings.server.admin_key = env.get(settings.server.admin_key_env) or None
    settings.bot.secret = env.get(settings.bot.secret_env) or None
    wecom = settings.bot.wecom
    wecom.token, wecom.aes_key, wecom.corp_secret = (env.get(name) or None for name in (
        wecom.token_env, wecom.aes_key_env, wecom.corp_secret_env))
    for backend in settings.backends:
        if backend.api_key_env:
            backend.api_key = env.get(backend.api_key_env) or None
    return settings
