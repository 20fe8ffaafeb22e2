"""Which backend, base model and adapter version a request goes to: the routing pipeline, without I/O.

The pipeline, in order:

1. alias: a configured alias stands for another model name (``support`` = ``qwen:sql``); an alias with ``*``, ``?``
   or ``[`` is a shell-style pattern (``claude-*haiku*`` = ``small``), tried in the configured order after every
   exact alias: clients such as Claude Code name a new model with each release;
2. default: a request that names no model gets its API key's default, else its tenant's, else the
   configured ``default_model``;
3. override: the override header (``X-Harness-Model``) replaces the name, for keys allowed to use it
   (the admin key, keys created with ``--allow-model-override``, and an open gateway);
4. canary: a configured share of a model's traffic goes to a target (usually a candidate version),
   decided by a hash of the session, so a session stays on one version for its whole life;
5. target: a configured base name, matched exactly first (names may contain ``:``); otherwise
   ``base:adapter[@version]`` split at a ``:`` whose left side is a base. Without ``@version`` the
   adapter's active version is used.

Names that stand for agent profiles (``agent:<profile>``) leave the pipeline after step 3.
"""

from __future__ import annotations

import fnmatch
import hashlib
import random
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

from gateway.config import RoutingSettings
from gateway.errors import APIError, model_not_found
from replay.adapters import AdapterVersion

B = TypeVar("B")


class Snapshot:
    """The registry as routing reads it: every version, and each name's active one."""

    def __init__(self, versions: Iterable[AdapterVersion] = ()) -> None:
        self.versions: dict[tuple[str, int], AdapterVersion] = {}
        self.active: dict[str, AdapterVersion] = {}
        self.bases: dict[str, str] = {}  # adapter name -> its base model
        for v in versions:
            self.versions[(v.name, v.version)] = v
            self.bases[v.name] = v.base_model
            if v.status == "active":
                self.active[v.name] = v

    def find(self, name: str, version: int | None) -> AdapterVersion | None:
        return self.active.get(name) if version is None else self.versions.get((name, version))


@dataclass(frozen=True)
class Caller:
    """What routing needs to know about who is asking."""

    tenant: str | None = None
    default_model: str | None = None
    may_override: bool = False


@dataclass(frozen=True)
class Target(Generic[B]):
    model: str  # the name after the pipeline, e.g. "qwen:sql@4"
    base: str
    backend: B
    adapter: AdapterVersion | None = None
    canary: bool = False


def is_pattern(alias: str) -> bool:
    return any(c in alias for c in "*?[")


def bucket(key: str) -> float:
    """A number in [0, 1) fixed by ``key``: the same session always falls on the same side of a share."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


class Router(Generic[B]):
    def __init__(self, settings: RoutingSettings, bases: dict[str, B],
                 snapshot: Callable[[], Snapshot] = Snapshot,
                 lease: Callable[[Target[B]], B] | None = None) -> None:
        """``lease`` gives the backend an adapter target's requests go through (one that holds the version while
        a request runs); without it the base's backend is used as it is."""
        self.settings = settings
        self.bases = bases
        self._snapshot = snapshot  # the registry changes under a running router
        self._lease = lease
        self._patterns = [(re.compile(fnmatch.translate(alias)), target) for alias, target in settings.aliases.items()
                          if is_pattern(alias)]
        # Keyed by what the model stands for, so a canary on an alias splits whatever reaches its target.
        self._canaries = {self._alias(c.model): c for c in settings.canaries}

    def _alias(self, name: str) -> str:
        exact = self.settings.aliases.get(name)
        if exact is not None:
            return exact
        return next((target for pattern, target in self._patterns if pattern.match(name)), name)

    def backend_for(self, name: str) -> B:
        """The backend a model name (after ``name_for``) is served by, canaries aside."""
        return self._lookup(name).backend

    def name_for(self, requested: str | None, caller: Caller, header: str | None = None) -> str:
        """Steps 1-3: the model name this request stands for (may be an agent profile)."""
        name = self._alias(requested) if requested else None
        if not name:
            default = (caller.default_model or self.settings.tenant_defaults.get(caller.tenant or "")
                       or self.settings.default_model)
            if not default:
                raise APIError(400, "you must provide a model parameter", param="model", code="missing_model")
            name = self._alias(default)
        if header and caller.may_override:
            name = self._alias(header)
        return name

    def target_for(self, name: str, sticky: str | None = None) -> Target[B]:
        """Steps 4-5: the canary split, then the backend and adapter version."""
        canary = self._canaries.get(name)
        if canary is not None and canary.share > 0:
            draw = bucket(f"{canary.model}|{sticky}") if sticky else random.random()
            if draw < canary.share:
                return self._lookup(self._alias(canary.target), canary=True)
        return self._lookup(name)

    def route(self, name: str, sticky: str | None = None) -> Target[B]:
        """Steps 4-5, with an adapter target's backend leased: where a request with this model name goes."""
        target = self.target_for(name, sticky)
        if target.adapter is None or self._lease is None:
            return target
        return Target(target.model, target.base, self._lease(target), target.adapter, target.canary)

    def canary_versions(self) -> list[AdapterVersion]:
        """The adapter versions canaries send traffic to (kept loaded, so a canary's first request is fast)."""
        out = []
        for canary in self.settings.canaries:
            try:
                target = self._lookup(self._alias(canary.target))
            except APIError:
                continue  # not registered yet; requests for it fail with a clear 404 meanwhile
            if target.adapter is not None:
                out.append(target.adapter)
        return out

    def _lookup(self, name: str, *, canary: bool = False) -> Target[B]:
        backend = self.bases.get(name)
        if backend is not None:
            return Target(name, name, backend, canary=canary)
        for i, char in enumerate(name):
            if char != ":":
                continue
            base = name[:i]
            backend = self.bases.get(base)
            if backend is not None:
                return Target(name, base, backend, self._adapter(base, name[i + 1:], name), canary)
        raise model_not_found(f"The model '{name}' does not exist or you do not have access to it.")

    def _adapter(self, base: str, ref: str, model: str) -> AdapterVersion:
        adapter, sep, number = ref.partition("@")
        if sep and not number.isdigit():
            raise model_not_found(f"The model '{model}' does not exist: the version after '@' must be a number.")
        snapshot = self._snapshot()
        found = snapshot.find(adapter, int(number) if sep else None)
        if found is None or found.base_model != base:
            if not sep and snapshot.bases.get(adapter) == base:
                raise model_not_found(f"The adapter '{adapter}' on '{base}' has no active version; promote one.")
            raise model_not_found(f"The model '{model}' does not exist or you do not have access to it.")
        if found.status == "retired":
            raise model_not_found(f"The model '{model}' is retired.")
        return found
