"""The web console's settings: ``[console]`` (whether it is served at all is ``[server] console``)."""

from __future__ import annotations

from pydantic import Field

from tools.settings import Section


class ConsoleSettings(Section):
    session_hours: float = Field(12.0, gt=0, le=24 * 30, description="How long a console sign-in lasts; signing "
                                 "out, or revoking the key signed in with, ends it sooner.")
    approvers: list[str] = Field(default_factory=list, description="Ids of API keys (harness keys list) whose "
                                 "console sessions may approve or deny held tool calls of their own tenant; the "
                                 "admin key may decide any.")
    page_size: int = Field(50, ge=1, le=500, description="Trajectories on one page of the console's list.")
