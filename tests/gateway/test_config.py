from pathlib import Path

import pytest

from gateway.config import DEFAULT_MODEL_NAME, ConfigError, Settings, load_settings, load_with_sources, source_of


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


def test_the_bot_rate_limit_storage_is_memory_or_a_redis_url() -> None:
    for good in ("memory://", "redis://127.0.0.1:6379/0", "redis://:pw@cache.internal", "rediss://cache:6380/2"):
        assert load_settings(environ={"HARNESS_BOT__RATE_LIMIT_STORAGE": good}).bot.rate_limit_storage == good
    for bad, message in (("memory", "must be memory:// or a Redis URL"),
                         ("memcached://127.0.0.1:11211", "must be memory:// or a Redis URL"),
                         ("redis://", "must be memory:// or a Redis URL"),
                         ("redis://:secret@host:port/0", "port must be a number"),
                         ("redis://:secret@host:6379/cache", "must be a database number")):
        with pytest.raises(ConfigError, match="bot.rate_limit_storage: .*" + message) as caught:
            load_settings(environ={"HARNESS_BOT__RATE_LIMIT_STORAGE": bad})
        assert "secret" not in str(caught.value)


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
    ("[routing.fallbacks]\nm = ['agent:x']\n", "not to agent profiles"),
    ("[[backends]]\nname = 'a'\nbase_url = 'http://x'\nmodels = ['m']\nweight = 0\n", "backends.0.weight"),
])
def test_bad_config_names_the_problem(tmp_path: Path, text: str, needle: str) -> None:
    cfg = tmp_path / "h.toml"
    cfg.write_text(text)
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        load_settings(cfg, environ={})


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_settings(tmp_path / "nope.toml", environ={})


def test_precedence_runs_flag_environment_file_default(tmp_path: Path) -> None:
    cfg = tmp_path / "h.toml"
    cfg.write_text("[server]\nport = 8100\nhost = '127.0.0.2'\nlog_level = 'warning'\n")
    env = {"HARNESS_SERVER__PORT": "9000", "HARNESS_SERVER__HOST": "127.0.0.3"}
    s, layers = load_with_sources(cfg, environ=env, flags={"server": {"port": 9100}})
    assert (s.server.port, s.server.host, s.server.log_level, s.server.max_headers) == (9100, "127.0.0.3", "warning",
                                                                                        100)
    assert [source_of(layers, ("server", key)) for key in ("port", "host", "log_level", "max_headers")] == \
        ["flag", "environment", "file", "default"]


def test_lists_and_tables_in_the_environment_are_json(tmp_path: Path) -> None:
    env = {"HARNESS_BACKENDS": '[{"name": "a", "base_url": "http://x/v1", "models": ["m"]}]',
           "HARNESS_ROUTING__ALIASES": '{"support": "m"}', "HARNESS_TOOLS__ALLOW_HOSTS": '["intranet:8080"]',
           "HARNESS_TRAINING__RL__STEPS": "3"}
    s, layers = load_with_sources(None, environ={k: v for k, v in env.items() if "TRAINING" not in k})
    assert [(b.name, b.models) for b in s.backends] == [("a", ["m"])]
    assert s.routing.aliases == {"support": "m"} and s.tools.allow_hosts == ["intranet:8080"]
    assert source_of(layers, ("backends", 0, "name")) == "environment"
    # a list given whole replaces the file's: a key its entries leave out is a default, not the file's
    cfg = tmp_path / "h.toml"
    cfg.write_text("[[backends]]\nname = 'f'\nbase_url = 'http://f/v1'\nmodels = ['f']\nread_timeout = 3.0\n")
    s, layers = load_with_sources(cfg, environ={"HARNESS_BACKENDS": env["HARNESS_BACKENDS"]})
    assert s.backends[0].read_timeout == 120.0 and source_of(layers, ("backends", 0, "read_timeout")) == "default"
    # the gateway's own settings have no [training]: the variable names a section only the whole composition has
    with pytest.raises(ConfigError, match="HARNESS_TRAINING__RL__STEPS: no section 'training'"):
        load_settings(None, environ=env)


def test_a_list_entry_is_overridden_by_index(tmp_path: Path) -> None:
    cfg = tmp_path / "h.toml"
    cfg.write_text("[[backends]]\nname = 'a'\nbase_url = 'http://a/v1'\nmodels = ['a']\n"
                   "[[backends]]\nname = 'b'\nbase_url = 'http://b/v1'\nmodels = ['b']\n")
    s, layers = load_with_sources(cfg, environ={"HARNESS_BACKENDS__1__READ_TIMEOUT": "30"})
    assert [b.read_timeout for b in s.backends] == [120.0, 30.0]
    assert source_of(layers, ("backends", 1, "read_timeout")) == "environment"
    assert source_of(layers, ("backends", 1, "name")) == "file"
    assert source_of(layers, ("backends", 0, "read_timeout")) == "default"


def test_a_misspelt_section_in_the_environment_is_an_error() -> None:
    with pytest.raises(ConfigError, match="HARNESS_SERVR__PORT: no section 'servr'"):
        load_settings(None, environ={"HARNESS_SERVR__PORT": "1"})
    with pytest.raises(ConfigError, match=r"server\.prot: unknown key"):
        load_settings(None, environ={"HARNESS_SERVER__PROT": "1"})
    # variables without the nested delimiter are not settings: the config path, secrets
    assert load_settings(None, environ={"HARNESS_ADMIN_KEY": "k", "HARNESS_ANYTHING": "x"}).server.admin_key == "k"


def test_every_mistake_is_one_problem(tmp_path: Path) -> None:
    cfg = tmp_path / "h.toml"
    cfg.write_text("[server]\nport = 'x'\nbogus = 1\n[[backends]]\nname = 'a'\nbase_url = 'http://a/v1'\n"
                   "models = ['a']\nread_timeout = -1\n[nosuch]\nkey = 1\n")
    with pytest.raises(ConfigError) as caught:
        load_settings(cfg, environ={})
    assert caught.value.problems == ["server.port: Input should be a valid integer, unable to parse string as an "
                                     "integer", "server.bogus: unknown key",
                                     "backends.0.read_timeout: Input should be greater than 0", "nosuch: unknown key"]


def test_secrets_are_read_from_their_variables_and_never_dumped(tmp_path: Path) -> None:
    s = load_settings(None, environ={"HARNESS_ADMIN_KEY": "adm-secret", "HARNESS_BOT_SECRET": "bot-secret"})
    assert (s.server.admin_key, s.bot.secret) == ("adm-secret", "bot-secret")
    dumped = s.model_dump_json()
    assert "adm-secret" not in dumped and "bot-secret" not in dumped


def test_settings_built_in_code_read_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HARNESS_SERVER__PORT", "9999")
    assert Settings().server.port == 8000 and Settings(server={"port": 1}).server.port == 1


def test_json_in_list_entries_and_bad_json_name_the_variable() -> None:
    s = load_settings(None, environ={"HARNESS_BACKENDS__0__NAME": "a", "HARNESS_BACKENDS__0__BASE_URL": "http://a/v1",
                                     "HARNESS_BACKENDS__0__MODELS": '["m1", "m2"]'})
    assert [(b.name, b.models) for b in s.backends] == [("a", ["m1", "m2"])]
    for env, name in (({"HARNESS_TOOLS__ALLOW_HOSTS": "['a']", "HARNESS_TOOLS__WORKSPACE": "w"},
                       "HARNESS_TOOLS__ALLOW_HOSTS"),
                      ({"HARNESS_BACKENDS": "nope"}, "HARNESS_BACKENDS"),
                      ({"HARNESS_BACKENDS__0__MODELS": "nope"}, "HARNESS_BACKENDS__0__MODELS")):
        with pytest.raises(ConfigError) as caught:
            load_settings(None, environ=env)
        assert caught.value.problems == [f"{name}: not valid JSON (lists and tables in the environment are JSON)"]
