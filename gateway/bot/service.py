"""The chat bot's core, shared by every platform: conversations as growing agent runs, per-user rate limits,
reply delivery with retries, user reactions as feedback, and recovery after a restart.

A conversation is one agent run (one trajectory): each new message is appended to it as the next user turn and
the loop runs again, its profile's summarization keeping the context inside its budget. Turns of one conversation
take their turn; a run waiting for a person's approval answers new messages with a note instead of running.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from typing import Any

import structlog
from limits import RateLimitItemPerSecond
from limits.aio.storage import MemoryStorage, RedisStorage, Storage
from limits.aio.strategies import MovingWindowRateLimiter
from limits.errors import StorageError
from redis.asyncio import ConnectionPool
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential

from gateway.agent.loop import USER_TURN, RunState, StepEvent, StepRecord
from gateway.agent.recording import StoreRecorder
from gateway.agent.service import AgentService
from gateway.auth import Principal
from gateway.bot.platform import DeliveryError, Incoming, Platform
from gateway.bot.settings import BotSettings
from gateway.errors import APIError
from gateway.keyed_lock import KeyedLock
from replay import bot_messages, feedback
from replay.records import Statement
from replay.store import TrajectoryStore
from replay.vocabulary import BOT

log = structlog.get_logger()

# Marks a turn's row whose message another process took: that one answers and delivers it.
ANSWERED_ELSEWHERE = "answered_elsewhere"
# How long a message's turn waits for its conversation's run while another process carries it on.
LEASE_WAIT_SECONDS = 600.0
SORRY = "Sorry, something went wrong on my side and I could not answer. Please try again later."
WAITING = ("I am waiting for a person to approve {calls} before I can go on. Send your message again once it is "
           "decided.")
STOPPED = "I had to stop before I could finish ({reason})."
MAX_BACKOFF_SECONDS = 300.0  # the longest wait between two tries of a callback

Spawn = Callable[..., asyncio.Task[Any]]

# How long a message may wait on Redis for its rate limit (connecting, then answering) before it goes through
# unlimited: a Redis that hangs must not hang the bot.
REDIS_TIMEOUT_SECONDS = 0.5


class BotService:
    def __init__(self, settings: BotSettings, agents: AgentService, store: TrajectoryStore, spawn: Spawn) -> None:
        self.settings = settings
        self.agents = agents
        self.store = store
        self.spawn = spawn
        self.platforms: dict[str, Platform] = {}
        self.principal = Principal(key_id=None, tenant=settings.tenant)
        self.conversations = KeyedLock()
        self._limit: tuple[MovingWindowRateLimiter, RateLimitItemPerSecond] | None = None
        self._redis: ConnectionPool | None = None
        self._limit_down = False  # Redis failed the last message: logged once per outage, not once per message
        if settings.rate_limit_messages:
            self._limit = (MovingWindowRateLimiter(self._limit_storage(settings.rate_limit_storage)),
                           RateLimitItemPerSecond(settings.rate_limit_messages,
                                                  max(1, math.ceil(settings.rate_limit_window_seconds))))
        agents.on_finish.append(self._resumed)

    def _limit_storage(self, url: str) -> Storage:
        """limits' asyncio storage: this process's memory, or a Redis every replica counts in."""
        if url == "memory://":
            return MemoryStorage()
        # Our own pool, to close at shutdown. One immediate retry reconnects after a Redis restart; redis-py's
        # default backoff would hold a message for seconds.
        self._redis = ConnectionPool.from_url(url, socket_connect_timeout=REDIS_TIMEOUT_SECONDS,
                                              socket_timeout=REDIS_TIMEOUT_SECONDS, retry=Retry(NoBackoff(), 1))
        return RedisStorage("async+" + url, implementation="redispy", connection_pool=self._redis,
                            wrap_exceptions=True)

    def add(self, platform: Platform) -> None:
        self.platforms[platform.name] = platform

    async def aclose(self) -> None:
        for platform in self.platforms.values():
            await platform.aclose()
        if self._redis is not None:
            await self._redis.disconnect()

    # -- taking messages in -----------------------------------------------------------------------

    async def rate_limited(self, platform: str, user_id: str) -> tuple[str, int] | None:
        """The reply to a user past the limit and the seconds until they may send again, or None."""
        if self._limit is None:
            return None
        limiter, limit = self._limit
        try:
            if await limiter.hit(limit, platform, user_id):
                reset = None
            else:
                reset = (await limiter.get_window_stats(limit, platform, user_id)).reset_time
        except StorageError as exc:
            # Fail open: the limit guards a fair share of the model, not access (every request is signed, its
            # nonce claimed in the store). Refusing everyone while Redis is down would turn its outage into the
            # bot's; letting messages through costs at most the unlimited traffic of the outage.
            if not self._limit_down:
                self._limit_down = True
                log.warning("bot.rate_limit_unavailable", error=repr(exc.storage_error))
            return None
        if self._limit_down:
            self._limit_down = False
            log.info("bot.rate_limit_restored")
        if reset is None:
            return None
        wait = max(1, math.ceil(reset - time.time()))
        return (f"You are sending messages too fast: at most {self.settings.rate_limit_messages} every "
                f"{self.settings.rate_limit_window_seconds:g} s. Try again in {wait} s.", wait)

    async def accept(self, incoming: Incoming) -> dict[str, Any] | None:
        """Store a message before anything else happens to it; None for a platform's retry of one already stored."""
        return await bot_messages.add(
            self.store, platform=incoming.platform, external_id=incoming.external_id,
            conversation_id=incoming.conversation_id, user_id=incoming.user_id, text=incoming.text,
            callback_url=incoming.callback_url)

    def answer(self, message: dict[str, Any]) -> asyncio.Task[dict[str, Any]]:
        """Run the message's turn in the background; the task ends with the message row, answered or waiting for
        an approval. A shutdown interrupts it, and the next start carries it on."""
        return self.spawn(self._turn(message), cancel_on_stop=True)

    def reply_later(self, turn: asyncio.Task[dict[str, Any]]) -> None:
        """Deliver the turn's reply once it is there. A shutdown stops the wait (the reply stays answered, and the
        next start sends it), so stopping never waits out a receiver's retries."""
        self.spawn(self._deliver_when_done(turn), cancel_on_stop=True)

    async def _deliver_when_done(self, turn: asyncio.Task[dict[str, Any]]) -> None:
        row = await turn
        if not row.get(ANSWERED_ELSEWHERE):  # the process that answered it delivers it
            await self.deliver(row)

    async def _turn(self, message: dict[str, Any]) -> dict[str, Any]:
        platform = self.platforms[message["platform"]]
        try:
            async with self.conversations.hold(f"{message['platform']}\x00{message['conversation_id']}"):
                run_id = await bot_messages.conversation_run(self.store, message["platform"],
                                                             message["conversation_id"])
                if run_id is None:
                    return await self._first_turn(message, platform.profile)
                # The conversation's run may be going on in another process that shares the store (resumed after an
                # approval, or a turn of a message that reached another replica): its turn waits for the lease.
                deadline = time.monotonic() + LEASE_WAIT_SECONDS
                while True:
                    async with self.agents.leased(run_id) as mine:
                        if mine:
                            return await self._next_turn(message, run_id, platform.profile)
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"run {run_id} stayed leased elsewhere for {LEASE_WAIT_SECONDS} s")
                    await asyncio.sleep(0.2)
        except Exception:
            log.exception("bot.turn_failed", message_id=message["id"])
            return await bot_messages.set_outcome(self.store, message["id"], status=bot_messages.ANSWERED, reply=SORRY)

    async def _next_turn(self, message: dict[str, Any], run_id: str, profile: str) -> dict[str, Any]:
        """A message's turn in its conversation's run, the run's lease held."""
        current = await bot_messages.get(self.store, message["id"])
        if current is None or current["status"] != bot_messages.QUEUED:
            # Another process that shares the store took it meanwhile (its recovery, at a start): it answers and
            # delivers it.
            return {**(current or message), ANSWERED_ELSEWHERE: True}
        loaded = await self.agents.load(run_id)
        if loaded is None:  # its profile was removed: the conversation starts afresh with today's
            return await self._first_turn(message, profile)
        loop, recorder = loaded
        if loop.state.status == "pending_approval":
            calls = ", ".join(held["name"] for held in loop.state.pending)
            return await bot_messages.set_outcome(self.store, message["id"], status=bot_messages.ANSWERED,
                                                  reply=WAITING.format(calls=calls), harness=loop.state.harness())
        loop.state.add_user_turn(message["text"])
        await self._record_turn(recorder, loop.state, message)
        return await self._answered_here(message, await loop.run())

    async def _first_turn(self, message: dict[str, Any], profile: str) -> dict[str, Any]:
        """A new conversation: a new run, and the conversation pointing at it, committed with the first turn."""
        loop, recorder = self.agents.prepare(
            profile, [{"role": "user", "content": message["text"]}], self.principal, hold_for_approval=True,
            source=BOT, metadata={"bot": {k: message[k] for k in ("platform", "conversation_id", "user_id")}})
        loop.cancelled_as = ("interrupted", None)
        run_id = loop.state.run_id
        async with self.agents.runs.hold(run_id):
            await recorder.start(loop.state)
            await self._record_turn(recorder, loop.state, message,
                                    also=[bot_messages.conversation_statement(message, run_id)])
            return await self._answered_here(message, await loop.run())

    @staticmethod
    async def _record_turn(recorder: StoreRecorder, state: RunState, message: dict[str, Any],
                           also: list[Statement] | None = None) -> None:
        """The user turn joins the run and the message becomes ``running`` in one commit: after a crash the
        message is either still queued (and runs again) or already in the run (which resumes)."""
        step = state.budget.steps
        record = StepRecord(step=step, events=[StepEvent(step, USER_TURN, {"message_id": message["id"]})])
        await recorder.step(state, record, also=[bot_messages.running_statement(message["id"], state.run_id),
                                                 *(also or [])])

    async def _answered(self, message_id: str, state: RunState) -> dict[str, Any] | None:
        """The message answered from its run's state, if it still waited for it: None when another process that
        found the same run ended answered it first (that one delivers the reply)."""
        waiting = (bot_messages.RUNNING, bot_messages.PENDING_APPROVAL)
        if state.status == "pending_approval":
            return await bot_messages.set_outcome(self.store, message_id, status=bot_messages.PENDING_APPROVAL,
                                                  harness=state.harness(), only_from=waiting)
        reply = state.final or (STOPPED.format(reason=state.termination_reason) if state.termination_reason else SORRY)
        return await bot_messages.set_outcome(self.store, message_id, status=bot_messages.ANSWERED, reply=reply,
                                              harness=state.harness(), model_call_seq=max(0, state.model_calls - 1),
                                              only_from=waiting)

    async def _answered_here(self, message: dict[str, Any], state: RunState) -> dict[str, Any]:
        row = await self._answered(message["id"], state)
        return row if row is not None else {**message, ANSWERED_ELSEWHERE: True}

    async def _deliver_answered(self, message_id: str, state: RunState) -> None:
        row = await self._answered(message_id, state)
        if row is not None:
            await self.deliver(row)

    async def _resumed(self, state: RunState) -> None:
        """A run went on after approval (or after a restart): its waiting messages get their replies."""
        for row in await bot_messages.of_run(self.store, state.run_id,
                                             (bot_messages.RUNNING, bot_messages.PENDING_APPROVAL)):
            await self._deliver_answered(row["id"], state)

    # -- replies out --------------------------------------------------------------------------------

    async def deliver(self, row: dict[str, Any]) -> None:
        """Send an answered message's reply through its platform, retrying with backoff; then mark it delivered
        (or failed, with the last error). A reply with nowhere to go stays answered, to be polled."""
        platform = self.platforms.get(row["platform"])
        if row["status"] != bot_messages.ANSWERED or platform is None or not platform.enabled:
            return
        # As it is now: the reply may have gone back meanwhile another way (in a response, to a poll), maybe
        # through another process that shares the store.
        current = await bot_messages.get(self.store, row["id"])
        if current is None or current["status"] != bot_messages.ANSWERED:
            return
        # Another replica may be sending it (found answered by a recovery while its answerer delivers): wait out
        # that one's claim, and send it only if it is still undelivered then (its sender stopped mid-way).
        while not await bot_messages.claim_delivery(self.store, row["id"], now=time.time(),
                                                    until=time.time() + self._claim_seconds):
            current = await bot_messages.get(self.store, row["id"])
            if current is None or current["status"] != bot_messages.ANSWERED:
                return
            await asyncio.sleep(max(0.05, (current["delivery_claimed_until"] or 0) - time.time()))
        attempts = 0
        retrying = AsyncRetrying(stop=stop_after_attempt(self.settings.callback_attempts),
                                 wait=wait_exponential(multiplier=self.settings.callback_backoff_seconds,
                                                       max=MAX_BACKOFF_SECONDS),
                                 retry=retry_if_exception(lambda e: isinstance(e, DeliveryError) and e.retryable),
                                 reraise=True)
        try:
            async for attempt in retrying:
                with attempt:
                    attempts += 1
                    if attempts > 1:
                        await bot_messages.renew_delivery(self.store, row["id"],
                                                          until=time.time() + self._claim_seconds)
                    sent = await platform.deliver(row)
        except DeliveryError as exc:
            log.warning("bot.delivery_failed", message_id=row["id"], platform=row["platform"], attempts=attempts,
                        error=str(exc))
            await bot_messages.set_delivery(self.store, row["id"], delivered=False, attempts=attempts, error=str(exc))
            return
        if sent:
            log.info("bot.delivered", message_id=row["id"], platform=row["platform"], attempts=attempts)
            await bot_messages.set_delivery(self.store, row["id"], delivered=True, attempts=attempts, error=None)

    @property
    def _claim_seconds(self) -> float:
        """How long a claim to send a reply holds: one attempt and the longest wait before the next."""
        return self.settings.callback_timeout_seconds + MAX_BACKOFF_SECONDS + 30.0

    async def mark_delivered(self, row: dict[str, Any]) -> dict[str, Any]:
        """The reply went back another way: in the response to the request itself, or to a poll."""
        return await bot_messages.set_delivery(self.store, row["id"], delivered=True, attempts=1, error=None)

    # -- feedback ------------------------------------------------------------------------------------

    async def react(self, message_id: str, row: dict[str, Any]) -> dict[str, Any]:
        """A user's reaction to a reply, as feedback on the conversation's trajectory at the reply's model call."""
        message = await bot_messages.get(self.store, message_id)
        if message is None or message["trajectory_id"] is None or message["model_call_seq"] is None:
            raise APIError(404, f"No answered bot message '{message_id}'.", code="not_found")
        row = {**row, "model_call_seq": message["model_call_seq"]}
        await feedback.add(self.store, message["trajectory_id"], source="user", **row)
        return {"object": "trajectory.feedback", "trajectory_id": message["trajectory_id"], "source": "user",
                "message_id": message_id, **row}

    # -- after a restart -----------------------------------------------------------------------------

    async def recover(self) -> None:
        """Carry on what a stop cut short: queued messages run, interrupted turns resume, undelivered replies go."""
        rows = await bot_messages.with_status(self.store, (bot_messages.QUEUED, bot_messages.RUNNING,
                                                           bot_messages.PENDING_APPROVAL, bot_messages.ANSWERED))
        for row in rows:
            platform = self.platforms.get(row["platform"])
            if platform is None or not platform.enabled:
                continue
            if row["status"] == bot_messages.QUEUED:
                self.reply_later(self.answer(row))
            elif row["status"] in (bot_messages.RUNNING, bot_messages.PENDING_APPROVAL):
                # Also a paused turn: the stop may have cut short the run it was resumed into after approval.
                self.spawn(self._recover_running(row), cancel_on_stop=True)
            else:
                self.spawn(self.deliver(row), cancel_on_stop=True)
        if rows:
            log.info("bot.recovering", messages=len(rows))

    async def _recover_running(self, row: dict[str, Any]) -> None:
        if await self.agents.resume(row["trajectory_id"]) is not None:
            return  # _resumed answered and delivered it
        loaded = await self.agents.load(row["trajectory_id"])
        # "running": another process carries it on, or will take it over when its dead owner's lease expires; the
        # one that finishes it delivers the reply.
        if loaded is not None and loaded[0].state.status not in ("interrupted", "pending_approval", "running"):
            # The run had ended before the stop; only its message was not updated.
            await self._deliver_answered(row["id"], loaded[0].state)

