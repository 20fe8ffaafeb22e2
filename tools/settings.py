"""The ``[tools]`` settings section, and the validators of network allow-lists (the bot's callbacks use them too).

``Section`` is the one base of every package's settings sections (``replay/settings.py``, ``gateway/config.py``,
``training/settings.py``); it lives here, at the bottom layer, so that each of them can import it.
``gateway/config.py`` composes the sections and is the only module that reads the environment.
"""

from __future__ import annotations

import ipaddress
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator


class ConfigError(ValueError):
    """The configuration cannot be used; the message says which key and why, ``problems`` one line per mistake."""

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems = problems or [message]


class Section(BaseModel):
    """A settings section: unknown keys are errors, so a misspelt key never passes silently."""

    model_config = ConfigDict(extra="forbid")

    @classmethod
    def default_of(cls, name: str) -> Any:
        """The section's default for ``name``: what code that is handed no section takes, so that the default is
        declared here alone."""
        return cls.model_fields[name].get_default(call_default_factory=True)


def _check_networks(value: list[str]) -> list[str]:
    for entry in value:
        try:
            ipaddress.ip_network(entry, strict=False)
        except ValueError as exc:
            raise ValueError(str(exc)) from None
    return value


Networks = Annotated[list[str], AfterValidator(_check_networks)]


def _check_allow_hosts(value: list[str]) -> list[str]:
    from tools.ssrf import parse_allow_host  # here, not above: the tools package imports this module first

    for entry in value:
        parse_allow_host(entry)
    return value


AllowHosts = Annotated[list[str], AfterValidator(_check_allow_hosts)]


class ToolsSettings(Section):
    workspace: str = Field("workspace", description="Folder write_file writes into (created when missing).")
    write_requires_approval: bool = Field(True, description="write_file waits for approval before running.")
    require_approval: list[str] = Field(default_factory=list, description="More tools (by name) whose calls wait "
                                        "for a person's approval.")
    approval_expiry_seconds: float = Field(86_400.0, gt=0, description="A call nobody approved or denied within "
                                           "this long is given up, and the run goes on without it.")
    approval_poll_seconds: float = Field(5.0, gt=0, description="How often the gateway looks for decisions made "
                                         "from the command line and for expired approvals.")
    run_lease_seconds: float = Field(30.0, gt=0, description="How long a gateway process's hold on an agent run "
                                     "lasts unrenewed (it renews every third of it): a run whose process died is "
                                     "taken over by another this long after its last renewal.")
    write_max_bytes: int = Field(1_000_000, gt=0, description="Largest file write_file writes.")
    sql_database: str | None = Field(None, description="SQLite file sql_query reads; none disables it.")
    sql_timeout: float = Field(5.0, gt=0, description="Seconds one query may run.")
    sql_max_rows: int = Field(200, gt=0, description="Most rows one query returns.")
    sql_max_bytes: int = Field(262_144, ge=1000, le=100_000_000, description="Largest value a query may make, "
                               "and most bytes of rows fetched (past it the rows are truncated).")
    sql_max_memory_mb: int = Field(128, ge=16, le=65_536, description="MiB of memory SQLite may allocate for one "
                                   "query, in the worker process it runs in; past it the query fails.")
    sql_workers: int = Field(2, ge=1, le=64, description="Worker processes sql_query keeps: the most queries that run "
                             "at once.")
    allow_hosts: AllowHosts = Field(
        default_factory=list, description="Hosts network tools may reach even at private addresses: 'host' (ports "
        "80 and 443) or 'host:port'.")
    allow_networks: Networks = Field(
        default_factory=list, description="CIDR ranges network tools may reach even when private.")
    http_timeout: float = Field(20.0, gt=0, description="Seconds one http_get call may take.")
    http_max_redirects: int = Field(5, ge=0, description="Most redirects http_get follows.")
    http_max_bytes: int = Field(2_000_000, gt=0, description="Most bytes read from one response.")
    user_agent: str = Field("agent-harness-tools/0.1", description="User-Agent of network tools.")
    browser_executable: str = Field("/usr/bin/chromium", description="Chromium binary browse drives.")
    browser_timeout: float = Field(30.0, gt=0, description="Seconds one browse call may take.")
    browser_max_pages: int = Field(4, gt=0, description="Most pages open at once.")
    output_cap: int = Field(20_000, gt=0, description="Most characters of a built-in tool's result.")

    @model_validator(mode="after")
    def _check_sql_memory(self) -> ToolsSettings:
        # A value of sql_max_bytes is built from its inputs (hex() doubles a blob) next to SQLite's own caches:
        # a heap smaller than that would refuse queries the value limit allows.
        needed = (4 * self.sql_max_bytes >> 20) + 16
        if self.sql_max_memory_mb < needed:
            raise ValueError(f"sql_max_memory_mb = {self.sql_max_memory_mb} is too small for sql_max_bytes = "
                             f"{self.sql_max_bytes}: give it at least {needed} (4 x sql_max_bytes + 16 MiB)")
        return self
