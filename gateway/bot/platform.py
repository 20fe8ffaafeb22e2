"""What a chat platform adapter is: one module that turns the platform's callbacks into ``Incoming`` messages
for ``BotService`` and delivers the replies back. The generic signed webhook (``webhook.py``) and WeCom
(``wecom.py``) are the two there are; another platform is one more module like them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from starlette.routing import BaseRoute


@dataclass(frozen=True)
class Incoming:
    """A user's message as a platform hands it over."""

    platform: str
    conversation_id: str
    user_id: str
    text: str
    external_id: str | None = None  # the platform's own message id: a retry carrying it again is dropped
    callback_url: str | None = None


class DeliveryError(Exception):
    """A reply did not reach the platform; ``retryable`` when trying again later may help."""

    def __init__(self, message: str, *, retryable: bool = True) -> None:
        super().__init__(message)
        self.retryable = retryable


class Platform(Protocol):
    name: str
    profile: str  # the agent profile that answers this platform's users

    @property
    def enabled(self) -> bool:
        """Whether it is configured; the routes of one that is not answer 404 saying what to set."""
        ...

    def routes(self) -> list[BaseRoute]:
        """The HTTP routes the platform calls."""
        ...

    async def deliver(self, message: dict[str, Any]) -> bool:
        """Send a stored message's ``reply`` to its user; False when there is nowhere to send it (it waits to be
        polled). Raises ``DeliveryError``."""
        ...

    async def aclose(self) -> None: ...
