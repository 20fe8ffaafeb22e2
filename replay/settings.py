"""The ``[store]`` and ``[rewards]`` settings sections, which the store and the reward engine own.

``gateway/config.py`` composes them into the gateway's settings, ``training/settings.py`` adds its own on top; only
``gateway/config.py`` reads the environment.
"""

from __future__ import annotations

import math
import re
from typing import Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from tools.settings import Section


class StoreSettings(Section):
    path: str = Field("harness.db", description="SQLite file for trajectories (when no url is set).")
    url: str | None = Field(None, description="A PostgreSQL database (postgresql://user:password@host:port/name) "
                            "instead of the SQLite file: what several gateway replicas or workers share.")
    pool_size: int = Field(8, gt=0, description="PostgreSQL connections for reads and short transactions, per "
                           "process (the writer has one more of its own).")
    synchronous: Literal["NORMAL", "FULL"] = Field(
        "NORMAL", description="NORMAL survives a process crash; FULL also a power loss."
    )
    retention_days: float | None = Field(None, gt=0, description="Delete trajectories older than this.")
    max_batch: int = Field(256, gt=0, description="Most records committed in one transaction.")
    max_queue: int = Field(100_000, gt=0, description="Pending records before requests wait (backpressure).")
    commit_delay_ms: float = Field(0.0, ge=0, description="Injected delay before each commit (tests only).")
    cache_entries: int = Field(5_000, ge=100, description="Entries of each in-memory stitching cache (twice as "
                               "many for stored bodies): what bounds the store's memory; misses read the database.")
    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("postgresql://", "postgres://")):
            raise ValueError("must be a postgresql:// URL (leave it out for the SQLite file at path)")
        return value

    @property
    def location(self) -> str:
        """Where the store is: the PostgreSQL URL, else the SQLite file."""
        return self.url or self.path

    redact_defaults: bool = Field(True, description="Exports remove API keys, bearer tokens and e-mail addresses.")
    redact_patterns: list[str] = Field(default_factory=list,
                                       description="More regular expressions whose matches exports redact.")


class RewardSettings(Section):
    """Weights of the reward engine's signals (``replay/rewards.py``). Every signal is a number in [0, 1];
    a negative weight makes a signal a penalty. Any other key is the weight of a signal registered by name."""

    model_config = ConfigDict(extra="allow")

    task_success: float = Field(1.0, allow_inf_nan=False, description="Verifier verdict, else user feedback.")
    process_validity: float = Field(0.3, allow_inf_nan=False,
                                    description="Valid tool calls times successful results used later.")
    illegal_action_penalty: float = Field(-1.0, allow_inf_nan=False,
                                          description="Steps with invalid or refused calls; 1 on loop or "
                                          "budget terminations.")
    efficiency: float = Field(0.1, allow_inf_nan=False, description="Fewer steps, scaled by the step limit.")

    @model_validator(mode="after")
    def _check_extra_weights(self) -> RewardSettings:
        extra = self.__pydantic_extra__ or {}
        for name, value in list(extra.items()):
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.\-]*", name):
                raise ValueError(f"{name!r} is not a signal name")
            if isinstance(value, str):  # an environment override arrives as text
                try:
                    value = float(value)
                except ValueError:
                    pass
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"the weight of signal {name!r} must be a finite number, got {value!r}")
            extra[name] = float(value)
        return self

    def weights(self) -> dict[str, float]:
        """Every configured weight: the four built-in signals, then registered ones by name."""
        return {**{name: getattr(self, name) for name in type(self).model_fields},
                **(self.__pydantic_extra__ or {})}
