"""The chat bot's settings: ``[bot]`` and ``[bot.wecom]``."""

from __future__ import annotations

from pydantic import Field

from gateway.quotas.settings import CounterStorage
from tools.settings import AllowHosts, Networks, Section


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
    rate_limit_storage: CounterStorage = Field("memory://", description="Where the rate limit counts messages: "
                                               "memory:// (each process alone) or a redis://host:port/db URL that "
                                               "replicas share.")
    callback_allow_hosts: AllowHosts = Field(default_factory=list, description="Callback hosts allowed even at "
                                            "private addresses.")
    callback_allow_networks: Networks = Field(default_factory=list, description="CIDR ranges callbacks may "
                                               "reach even when private.")
    callback_attempts: int = Field(6, gt=0, description="Tries to deliver one callback.")
    callback_backoff_seconds: float = Field(1.0, gt=0, description="Wait before the second try; doubles each "
                                            "time.")
    callback_timeout_seconds: float = Field(10.0, gt=0, description="Seconds one callback request may take.")
    wecom: WeComSettings = Field(default_factory=WeComSettings, description="[bot.wecom]: the WeCom adapter, "
                                 "below.")
    # Filled from secret_env at load time.
    secret: str | None = Field(None, exclude=True)
