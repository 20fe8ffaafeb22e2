from pathlib import Path

import pytest

from gateway.config import DEFAULT_MODEL_NAME, ConfigError, load_settings


def test_no_config_serves_the_embedded_model() -> None:
    s = load_settings(None, environ={})
    assert s.server.host == "127.0.0.1" and s.server.port == 8000
    assert s.store.path == "harness.db"
    assert [(b.name, b.kind, b.models) for b in s.backends] == [("local", "local", [DEFAULT_MODEL_NAME])]


def test_toml_file_and_environment_overrides(tmp_path: Path) -> None:
    cfg = tmp_path / "h.toml"
    cfg.write_text("""
[server]
port = 8100
[store]
path = "x.db"
[[backends]]
name = "upstream"
kind = "openai"
base_url = "http://127.0.0.1:9000/v1"
api_key_env = "UPSTREAM_API_KEY"
models = ["some-model"]
[[profiles]]
name = "support"
model = "some-model"
[bot]
profile = "support"
""")
    env = {"HARNESS_SERVER__PORT": "9000", "HARNESS_STORE__SYNCHRONOUS": "FULL",
           "HARNESS_BACKENDS__0__READ_TIMEOUT": "3.5", "UPSTREAM_API_KEY": "sekrit", "HARNESS_ADMIN_KEY": "adm",
           "HARNESS_BOT_SECRET": "shh", "HARNESS_BOT__WECOM__CORP_ID": "corp", "HARNESS_BOT__WECOM__AGENT_ID": "7",
           "HARNESS_WECOM_TOKEN": "tok"}
    s = load_settings(cfg, environ=env)
    assert s.server.port == 9000
    assert s.store.synchronous == "FULL" and s.store.path == "x.db"
    assert s.backends[0].read_timeout == 3.5 and s.backends[0].api_key == "sekrit"
    assert s.server.admin_key == "adm"
    assert (s.bot.profile, s.bot.secret, s.bot.wecom.corp_id, s.bot.wecom.agent_id) == ("support", "shh", "corp", 7)
    assert (s.bot.wecom.token, s.bot.wecom.aes_key) == ("tok", None)
    assert "shh" not in s.model_dump_json()  # secrets are never echoed back
    # a config serves exactly the backends it lists
    assert [b.name for b in s.backends] == ["upstream"]


def test_bot_settings_name_a_configured_profile(tmp_path: Path) -> None:
    for env, message in (({"HARNESS_BOT__PROFILE": "nobody"}, "bot.profile names no configured profile"),
                         ({"HARNESS_BOT__WECOM__CORP_ID": "corp"}, "bot.wecom.agent_id is needed"),
                         ({"HARNESS_BOT__WECOM__CORP_ID": "corp", "HARNESS_BOT__WECOM__AGENT_ID": "1"},
                          "bot.wecom needs a profile"),
                         ({"HARNESS_BOT__CALLBACK_ALLOW_NETWORKS": '["nope"]'}, "bot.callback_allow_networks"),
                         ({"HARNESS_TOOLS__APPROVAL_EXPIRY_SECONDS": "0"}, "tools.approval_expiry_seconds")):
        with pytest.raises(ConfigError, match=message):
            load_settings(environ=env)


def test_config_path_from_environment(tmp_path: Path) -> None:
    cfg = tmp_path / "h.toml"
    cfg.write_text("[server]\nport = 8123\n")
    assert load_settings(None, environ={"HARNESS_CONFIG": str(cfg)}).server.port == 8123


@pytest.mark.parametrize("text, needle", [
    ("[server]\nport = 'x'\n", "server.port"),
    ("[server]\nbogus = 1\n", "server.bogus"),
    ("[[backends]]\nname = 'a'\nkind = 'openai'\nmodels = ['m']\n", "needs base_url"),
    ("[[backends]]\nname = 'a'\nkind = 'carrier-pigeon'\nbase_url='http://x'\nmodels=['m']\n", "backends.0.kind"),
    ("[server\n", "invalid TOML"),
    ("[[backends]]\nname = 'a'\nbase_url = 'http://x'\nmodels = ['agent:x']\n", "prefix names agent profiles"),
])
def test_bad_config_names_the_problem(tmp_path: Path, text: str, needle: str) -> None:
    cfg = tmp_path / "h.toml"
    cfg.write_text(text)
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        load_settings(cfg, environ={})


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_settings(tmp_path / "nope.toml", environ={})


def test_every_setting_is_documented() -> None:
    from gateway.config import (
        BackendSettings,
        BotSettings,
        GateSettings,
        ProfileSettings,
        RewardSettings,
        RLSettings,
        RoutingSettings,
        ServerSettings,
        StoreSettings,
        ToolsSettings,
        TrainingSettings,
        WeComSettings,
    )

    doc = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    for model in (ServerSettings, StoreSettings, BackendSettings, ToolsSettings, ProfileSettings, RewardSettings,
                  RoutingSettings, TrainingSettings, GateSettings, RLSettings, BotSettings, WeComSettings):
        for name, field in model.model_fields.items():
            if not field.exclude:
                assert f"| `{name}` |" in doc, f"{model.__name__}.{name} is missing from docs/configuration.md"
