"""A bot message answered and delivered once, however many processes that share the store find it: on SQLite and
on PostgreSQL."""

from replay import bot_messages
from replay.records import WriteOp
from replay.store import TrajectoryStore


async def _running(store: TrajectoryStore) -> dict:
    message = await bot_messages.add(store, platform="webhook", external_id=None, conversation_id="c", user_id="u",
                                     text="hi", callback_url="https://example.invalid/cb")
    assert message is not None
    await store.write(WriteOp(statements=[bot_messages.running_statement(message["id"], "run-1")]))
    return message


async def test_only_the_first_answer_of_a_waiting_message_counts(store: TrajectoryStore) -> None:
    message = await _running(store)
    waiting = (bot_messages.RUNNING, bot_messages.PENDING_APPROVAL)
    first = await bot_messages.set_outcome(store, message["id"], status=bot_messages.ANSWERED, reply="one",
                                           only_from=waiting)
    assert first is not None and first["reply"] == "one"
    # A second process that found the same run ended: nothing changes, and it leaves the delivery to the first.
    assert await bot_messages.set_outcome(store, message["id"], status=bot_messages.ANSWERED, reply="two",
                                          only_from=waiting) is None
    await bot_messages.set_delivery(store, message["id"], delivered=True, attempts=1, error=None)
    again = await bot_messages.set_outcome(store, message["id"], status=bot_messages.ANSWERED, reply="three")
    assert again is not None and (again["status"], again["reply"]) == (bot_messages.DELIVERED, "one")


async def test_one_process_at_a_time_claims_an_answered_reply_to_send(store: TrajectoryStore) -> None:
    message = await _running(store)
    await bot_messages.set_outcome(store, message["id"], status=bot_messages.ANSWERED, reply="one")
    assert await bot_messages.claim_delivery(store, message["id"], now=100.0, until=200.0)
    # Another process finds it answered while the first sends it: not before the first one's claim runs out.
    assert not await bot_messages.claim_delivery(store, message["id"], now=150.0, until=250.0)
    await bot_messages.renew_delivery(store, message["id"], until=300.0)
    assert not await bot_messages.claim_delivery(store, message["id"], now=250.0, until=350.0)
    # The first stopped mid-way: the message is still answered, and once its claim ran out another sends it.
    assert await bot_messages.claim_delivery(store, message["id"], now=300.0, until=400.0)
    await bot_messages.set_delivery(store, message["id"], delivered=True, attempts=1, error=None)
    assert not await bot_messages.claim_delivery(store, message["id"], now=1000.0, until=1100.0)
