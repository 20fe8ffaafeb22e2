"""The routing pipeline, in memory: aliases, defaults, the override header, canaries and name resolution."""

from __future__ import annotations

import math

import pytest

from gateway.config import CanarySettings, RoutingSettings
from gateway.errors import APIError
from gateway.routing import Caller, Router, Snapshot
from replay.adapters import AdapterVersion


def version(name: str, number: int, status: str = "candidate", base: str = "qwen") -> AdapterVersion:
    return AdapterVersion(name=name, version=number, base_model=base, path=f"/a/{name}/{number}", status=status,
                          published=status == "active", metrics=None, parent_version=None, uploaded=False,
                          created_at=0.0, activated_at=None)


SNAPSHOT = Snapshot([version("sql", 1, "retired"), version("sql", 2, "active"), version("sql", 3),
                     version("draft", 1), version("chat", 1, "active", base="llama")])
BASES = {"qwen": "b1", "llama": "b2", "org:model:7b": "b3"}


def router(**settings: object) -> Router[str]:
    return Router(RoutingSettings.model_validate(settings), BASES, snapshot=lambda: SNAPSHOT)


def test_a_base_resolves_to_its_backend_without_an_adapter() -> None:
    target = router().target_for("qwen")
    assert (target.base, target.backend, target.adapter) == ("qwen", "b1", None)


def test_base_adapter_resolves_to_the_active_version_and_a_named_version_to_itself() -> None:
    r = router()
    assert r.target_for("qwen:sql").adapter.version == 2
    assert r.target_for("qwen:sql@3").adapter.version == 3
    assert r.target_for("qwen:sql@3").adapter.backend_name == "sql@3"
    assert r.target_for("llama:chat").backend == "b2"


def test_names_configured_exactly_match_before_any_splitting() -> None:
    target = router().target_for("org:model:7b")
    assert (target.base, target.adapter) == ("org:model:7b", None)


@pytest.mark.parametrize(("name", "fragment"), [
    ("qwen:nope", "does not exist"),
    ("qwen:draft", "no active version"),
    ("qwen:sql@1", "retired"),
    ("qwen:sql@9", "does not exist"),
    ("qwen:sql@x", "must be a number"),
    ("llama:sql", "does not exist"),  # sql belongs to qwen
    ("mystery", "does not exist"),
])
def test_unknown_or_unservable_names_are_404s_that_say_why(name: str, fragment: str) -> None:
    with pytest.raises(APIError) as caught:
        router().target_for(name)
    assert caught.value.status_code == 404 and caught.value.code == "model_not_found"
    assert fragment in caught.value.message


def test_an_alias_stands_for_its_target() -> None:
    r = router(aliases={"support": "qwen:sql"})
    name = r.name_for("support", Caller())
    assert name == "qwen:sql" and r.target_for(name).adapter.version == 2


def test_pattern_aliases_map_a_clients_changing_names_exact_aliases_first() -> None:
    r = router(aliases={"claude-*haiku*": "llama", "claude-*": "qwen:sql", "claude-special": "qwen"})
    caller = Caller()
    assert r.name_for("claude-haiku-4-5", caller) == "llama"
    assert r.name_for("claude-opus-5-5", caller) == "qwen:sql"
    assert r.name_for("claude-special", caller) == "qwen"  # exact beats a pattern listed before it
    assert r.name_for("gpt-4o", caller) == "gpt-4o"  # no pattern matches: the name as given
    assert r.backend_for(r.name_for("claude-opus-5-5", caller)) == "b1"
    # Patterns match the whole name, case-sensitively, like a shell's.
    assert r.name_for("my-claude-model", caller) == "my-claude-model"
    assert r.name_for("CLAUDE-OPUS", caller) == "CLAUDE-OPUS"


def test_defaults_apply_only_when_the_request_names_no_model_key_then_tenant_then_config() -> None:
    r = router(default_model="qwen", tenant_defaults={"acme": "llama"}, aliases={"support": "qwen:sql"})
    assert r.name_for(None, Caller(tenant="acme", default_model="support")) == "qwen:sql"
    assert r.name_for(None, Caller(tenant="acme")) == "llama"
    assert r.name_for(None, Caller(tenant="other")) == "qwen"
    assert r.name_for("llama:chat", Caller(tenant="acme", default_model="support")) == "llama:chat"


def test_no_model_and_no_default_is_a_400_naming_the_parameter() -> None:
    with pytest.raises(APIError) as caught:
        router().name_for("", Caller())
    assert caught.value.status_code == 400 and caught.value.param == "model"


def test_the_override_header_applies_only_for_callers_allowed_to_use_it() -> None:
    r = router(aliases={"support": "qwen:sql"})
    assert r.name_for("qwen", Caller(may_override=True), header="support") == "qwen:sql"
    assert r.name_for("qwen", Caller(may_override=False), header="support") == "qwen"


def test_canary_share_is_within_statistical_tolerance_over_many_sessions() -> None:
    share, sessions = 0.2, 4000
    r = router(aliases={"support": "qwen:sql"},
               canaries=[CanarySettings(model="qwen:sql", target="qwen:sql@3", share=share)])
    hits = sum(r.target_for("qwen:sql", sticky=f"session-{i}").canary for i in range(sessions))
    sigma = math.sqrt(sessions * share * (1 - share))
    assert abs(hits - sessions * share) < 4 * sigma, hits


def test_a_canary_is_sticky_per_session() -> None:
    r = router(canaries=[CanarySettings(model="qwen:sql", target="qwen:sql@3", share=0.5)])
    for i in range(50):
        first = r.target_for("qwen:sql", sticky=f"s{i}")
        assert all(r.target_for("qwen:sql", sticky=f"s{i}").adapter == first.adapter for _ in range(5))
    picked = {r.target_for("qwen:sql", sticky=f"s{i}").adapter.version for i in range(50)}
    assert picked == {2, 3}


def test_a_canary_on_an_alias_splits_the_alias_traffic_and_lists_its_target_as_wanted() -> None:
    r = router(aliases={"support": "qwen:sql"},
               canaries=[CanarySettings(model="support", target="qwen:sql@3", share=1.0)])
    assert r.target_for(r.name_for("support", Caller()), sticky="x").adapter.version == 3
    assert [v.backend_name for v in r.canary_versions()] == ["sql@3"]


def test_aliases_may_not_take_the_agent_prefix() -> None:
    with pytest.raises(ValueError, match="agent"):
        RoutingSettings.model_validate({"aliases": {"agent:x": "qwen"}})
