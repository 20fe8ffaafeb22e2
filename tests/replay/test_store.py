import asyncio
import sqlite3
import time
from pathlib import Path

import pytest

import replay.store
from replay import hashing, keys
from replay.filters import Filters
from replay.records import CallRecord, WriteOp
from replay.schema import MIGRATIONS, SCHEMA_VERSION, migrate
from replay.settings import StoreSettings
from replay.store import TrajectoryStore
from replay.writer import RecordRejected
from tests.stores import rows

SYSTEM = {"role": "system", "content": "You are terse."}


async def _open(location: str | Path, **settings) -> TrajectoryStore:
    store = TrajectoryStore(str(location), StoreSettings(**settings))
    await store.start()
    return store


def _answer(text: str) -> dict:
    return {"id": "x", "object": "chat.completion", "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


async def _call(store: TrajectoryStore, messages: list[dict], answer: str, *, session: str | None = None,
                tenant: str | None = None, compacted: bool = False) -> str:
    prefix = hashing.prefix_hashes(messages)
    ref = await store.stitch(session_key=session, prefix=prefix, anchor=prefix[hashing.anchor_index(messages)],
                              tenant=tenant, compacted=compacted)
    await store.record(CallRecord(trajectory=ref, request_messages=messages, request_prefix=prefix, status="ok",
                                  tenant=tenant, response=_answer(answer), prompt_tokens=1, completion_tokens=1,
                                  prompt_token_ids=[1, 2, 3], completion_token_ids=[[4, 5]]))
    return ref.id


async def test_a_compacted_history_goes_on_in_its_session(store_location: str) -> None:
    """A history its client shortened (a compaction) extends the session's trajectory; any other history that does
    not extend it forks, as before."""
    store = await _open(store_location)
    t1 = await _call(store, [SYSTEM, {"role": "user", "content": "hi"}], "hello", session="s")
    shortened = [SYSTEM, {"role": "user", "content": "Summary: we said hello."}]
    assert await _call(store, shortened, "ok", session="s", compacted=True) == t1
    assert await _call(store, [SYSTEM, {"role": "user", "content": "something else"}], "no", session="s") != t1
    whole = await store.get_trajectory(t1, all_tenants=True)
    assert [c.seq for c in whole.calls] == [0, 1]
    await store.close()


async def test_resent_history_extends_and_edit_forks(store_location: str) -> None:
    store = await _open(store_location)
    history = [SYSTEM, {"role": "user", "content": "hi"}]
    t1 = await _call(store, history, "hello")
    history += [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "how are you"}]
    t2 = await _call(store, history, "fine")
    assert t2 == t1
    edited = [SYSTEM, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
              {"role": "user", "content": "something else"}]
    t3 = await _call(store, edited, "ok")
    # `something else` extends the first call's conversation too, but the trajectory has moved on: fork.
    assert t3 != t1
    row = await store.get_trajectory(t3, all_tenants=True)
    assert row.parent_id == t1
    whole = (await store.get_trajectory(t1, all_tenants=True)).to_dict()
    assert whole["n_calls"] == 2 and whole["status"] == "completed"
    assert [c["seq"] for c in whole["calls"]] == [0, 1]
    assert whole["calls"][1]["request"]["messages"] == history
    assert whole["calls"][1]["response"]["choices"][0]["message"] == {"role": "assistant", "content": "fine"}
    assert whole["calls"][0]["prompt_token_ids"] == [1, 2, 3]
    assert whole["calls"][0]["completion_token_ids"] == [[4, 5]]
    await store.close()


async def test_stitching_survives_a_restart(store_location: str) -> None:
    store = await _open(store_location)
    history = [SYSTEM, {"role": "user", "content": "hi"}]
    t1 = await _call(store, history, "hello")
    await store.close()
    store = await _open(store_location)
    t2 = await _call(store, history + [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}],
                     "sure")
    assert t2 == t1
    await store.close()


async def test_session_key_wins_and_forks_on_divergence(store_location: str) -> None:
    store = await _open(store_location)
    a = await _call(store, [{"role": "user", "content": "one"}], "1", session="s1")
    b = await _call(store, [{"role": "user", "content": "one"}, {"role": "assistant", "content": "1"},
                            {"role": "user", "content": "two"}], "2", session="s1")
    assert a == b
    # A compaction rewrote the history: same session, new trajectory that records its parent.
    c = await _call(store, [{"role": "user", "content": "summary of one and two"}], "ok", session="s1")
    assert c != a
    assert (await store.get_trajectory(c, all_tenants=True)).parent_id == a
    # Tenants never share trajectories.
    d = await _call(store, [{"role": "user", "content": "one"}], "1", session="s1", tenant="other")
    assert d not in (a, c)
    await store.close()


async def test_bodies_are_stored_once(store_location: str) -> None:
    store = await _open(store_location)
    history = [SYSTEM]
    turns = 30
    for i in range(turns):
        history.append({"role": "user", "content": f"question {i} " + "x" * 500})
        tid = await _call(store, list(history), f"answer {i}")
        history.append({"role": "assistant", "content": f"answer {i}"})
    [(blobs, size)] = await rows(store, "SELECT COUNT(*), SUM(LENGTH(body)) FROM blobs")
    # system + one user and one assistant message per turn: linear, not quadratic, in the turns
    assert blobs == 1 + 2 * turns
    assert size < 2 * turns * 600
    assert await rows(store, "SELECT COUNT(DISTINCT trajectory_id) FROM model_calls") == [(1,)]
    assert await rows(store, "SELECT n_calls FROM trajectories WHERE id = ?", tid) == [(turns,)]
    await store.close()


async def test_group_commit_under_backpressure(store_location: str) -> None:
    store = await _open(store_location, max_queue=4, max_batch=8)
    await asyncio.gather(*[_call(store, [{"role": "user", "content": f"q{i}"}], "a") for i in range(200)])
    assert await rows(store, "SELECT COUNT(*) FROM model_calls") == [(200,)]
    assert await store.integrity_check() == ["ok"]
    await store.close()


@pytest.mark.parametrize("fault", ["rows", "commit", "statement"])
async def test_a_write_the_store_cannot_take_fails_alone(store_location: str, fault: str) -> None:
    """One write in the middle of concurrent batches that cannot be stored: its rows cannot be built (a value
    JSON cannot hold), its row fails inside the transaction (an integer past the database's), or its statement does.
    Only its own caller hears of it; every other write of the batch is committed."""
    store = await _open(store_location, commit_delay_ms=5)
    poisoned = set(range(3, 200, 17))

    async def one(i: int) -> str:
        messages = [{"role": "user", "content": f"q{i}"}]
        prefix = hashing.prefix_hashes(messages)
        ref = await store.stitch(session_key=None, prefix=prefix, anchor=prefix[0], tenant=f"t{i % 3}")
        rec = CallRecord(trajectory=ref, request_messages=messages, request_prefix=prefix, status="ok",
                         tenant=f"t{i % 3}", response=_answer("a"), prompt_tokens=1, completion_tokens=1)
        statements = []
        if i in poisoned:
            if fault == "rows":
                rec.params = {"seed": {1, 2}}
            elif fault == "commit":
                rec.prompt_tokens = 2**64 - 1
            else:
                statements = [("UPDATE no_such_table SET x = 1", ())]
        await store.write(WriteOp(records=[rec], statements=statements))
        return ref.id

    results = await asyncio.gather(*[one(i) for i in range(200)], return_exceptions=True)
    refused = {i for i, r in enumerate(results) if isinstance(r, BaseException)}
    assert refused == poisoned
    assert all(isinstance(results[i], RecordRejected) for i in refused)
    stored = {row[0] for row in await rows(store, "SELECT trajectory_id FROM model_calls")}
    assert stored == {r for i, r in enumerate(results) if i not in poisoned}
    assert await store.integrity_check() == ["ok"]
    await store.close()


async def test_delete_by_id_and_age_collects_bodies(store_location: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # On a shared store bodies younger than twice the writers' trust are spared (another process may count on
    # them); with no trust at all they are collected at once, as a store only this process writes collects them.
    monkeypatch.setattr(replay.store, "SHARED_BLOB_TRUST_SECONDS", 0.0)
    store = await _open(store_location)
    old = await _call(store, [{"role": "user", "content": "old"}], "a")
    new = await _call(store, [{"role": "user", "content": "new"}], "b")
    assert await store.delete(ids=[old]) == 1
    assert await store.get_trajectory(old, all_tenants=True) is None
    assert await store.delete(before=time.time() + 1) == 1
    assert await store.get_trajectory(new, all_tenants=True) is None
    assert await rows(store, "SELECT COUNT(*) FROM blobs") == [(0,)]
    assert await rows(store, "SELECT COUNT(*) FROM model_calls") == [(0,)]
    assert await rows(store, "SELECT COUNT(*) FROM trajectory_text") == [(0,)]
    await store.close()


async def test_tenant_scoping(store_location: str) -> None:
    store = await _open(store_location)
    mine = await _call(store, [{"role": "user", "content": "x"}], "a", tenant="acme")
    assert await store.get_trajectory(mine, tenant="acme") is not None
    assert await store.get_trajectory(mine, tenant="globex") is None
    assert [t.id for t in await store.list_trajectories(tenant="acme")] == [mine]
    assert await store.list_trajectories(tenant="globex") == []
    await store.close()


@pytest.mark.sqlite_only
def test_migrations_are_versioned(tmp_path: Path) -> None:
    db = sqlite3.connect(tmp_path / "h.db")
    assert migrate(db) == 0
    assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert migrate(db) == SCHEMA_VERSION  # idempotent
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    with pytest.raises(RuntimeError, match="newer"):
        migrate(db)


async def test_a_store_that_ever_had_a_key_remembers_it(tmp_path: Path) -> None:
    # A store from before the fact was recorded (schema 7) with one key, revoked: the migration keeps it closed.
    old = sqlite3.connect(tmp_path / "old.db")
    for version, script in enumerate(MIGRATIONS[:7]):
        old.executescript(f"BEGIN;\n{script}\nPRAGMA user_version = {version + 1};\nCOMMIT;")
    old.execute("INSERT INTO api_keys(id, hash, tenant, capture, created_at, revoked_at) VALUES "
                "('k', 'h', 't', 1, 1.0, 2.0)")
    old.commit()
    old.close()
    for path, expected in ((tmp_path / "old.db", True), (tmp_path / "new.db", False)):
        store = await _open(path)
        assert await keys.ever_created(store) is expected
        if not expected:
            await keys.revoke(store, await keys.create(store, tenant="t", name=None, capture=True, secret_hash="x"))
            assert await keys.ever_created(store)
        await store.close()


async def test_n_choices_form_a_group_of_trajectories(store_location: str) -> None:
    store = await _open(store_location)
    messages = [{"role": "user", "content": "pick a number"}]
    prefix = hashing.prefix_hashes(messages)
    ref = await store.stitch(session_key=None, prefix=prefix, anchor=prefix[0], tenant=None)
    response = _answer("1")
    response["choices"] = [{"index": i, "message": {"role": "assistant", "content": str(i)}, "finish_reason": "stop"}
                           for i in range(3)]
    await store.record(CallRecord(trajectory=ref, request_messages=messages, request_prefix=prefix, status="ok",
                                  response=response, completion_token_ids=[[1], [2, 2], [3, 3, 3]]))
    rows = [t.summary() for t in await store.list_trajectories(all_tenants=True)]
    assert len(rows) == 3
    assert len({r["group_id"] for r in rows}) == 1 and rows[0]["group_id"]
    assert sorted(r["completion_tokens"] for r in rows) == [1, 2, 3]
    # continuing the third sample extends its own trajectory
    follow = messages + [{"role": "assistant", "content": "2"}, {"role": "user", "content": "why?"}]
    tid = await _call(store, follow, "because")
    third = (await store.get_trajectory(tid, all_tenants=True)).to_dict()
    assert third["n_calls"] == 2 and third["group_id"] == rows[0]["group_id"]
    assert third["calls"][0]["completion_token_ids"] == [[3, 3, 3]]
    assert tid != ref.id
    await store.close()


async def test_a_nonce_is_claimed_once_even_across_a_restart(store_location: str) -> None:
    path = store_location
    store = TrajectoryStore(path)
    await store.start()
    assert await keys.claim_nonce(store, "n1", now=1000.0, keep_seconds=600) is True
    assert await keys.claim_nonce(store, "n1", now=1001.0, keep_seconds=600) is False
    assert await keys.claim_nonce(store, "n2", now=1001.0, keep_seconds=600) is True
    await store.close()

    reopened = TrajectoryStore(path)
    await reopened.start()
    try:
        assert await keys.claim_nonce(reopened, "n1", now=1200.0, keep_seconds=600) is False  # still a replay
        # Past the keep window the nonce is forgotten: its timestamp could no longer pass the signature window.
        assert await keys.claim_nonce(reopened, "n1", now=1700.0, keep_seconds=600) is True
    finally:
        await reopened.close()


async def test_a_statement_cancelled_half_way_still_commits_and_never_locks_later_writes(store) -> None:
    from replay.records import WriteOp

    for _ in range(20):  # cancel at whichever await the statement happens to be in
        task = asyncio.create_task(store._change([("INSERT INTO bot_nonces(nonce, seen_at) VALUES (?, 1)",
                                                    (f"n{_}",))]))
        await asyncio.sleep(0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        # the batch writer (another connection) must get the write lock at once, not after the busy timeout
        await asyncio.wait_for(store.write(WriteOp(statements=[
            ("INSERT INTO bot_nonces(nonce, seen_at) VALUES (?, 2)", (f"b{_}",))])), 3)
    assert await rows(store, "SELECT COUNT(*) FROM bot_nonces WHERE seen_at = 2") == [(20,)]
    # The cancelled ones finish behind their callers' backs: on PostgreSQL nothing orders them before the writer's.
    for _ in range(100):
        if await rows(store, "SELECT COUNT(*) FROM bot_nonces WHERE seen_at = 1") == [(20,)]:
            break
        await asyncio.sleep(0.02)
    assert await rows(store, "SELECT COUNT(*) FROM bot_nonces WHERE seen_at = 1") == [(20,)]


async def test_integrity_check_says_ok_and_finds_damage(tmp_path: Path) -> None:
    store = await _open(tmp_path / "s.db")
    await _call(store, [{"role": "user", "content": "hi"}], "hello")
    assert await store.integrity_check() == ["ok"]
    await store.close()
    # an index that no longer matches its table: what a torn write or a bad disk leaves
    db = sqlite3.connect(tmp_path / "s.db")
    index = db.execute("SELECT name, tbl_name FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL").fetchone()
    db.execute("PRAGMA writable_schema = ON")
    root = db.execute("SELECT rootpage FROM sqlite_master WHERE name = ?", (index[0],)).fetchone()[0]
    db.close()
    with open(tmp_path / "s.db", "r+b") as f:  # zero the index's root page
        page = 4096
        f.seek((root - 1) * page)
        f.write(b"\0" * page)
    store = await _open(tmp_path / "s.db")
    try:
        assert await store.integrity_check() != ["ok"]
    finally:
        await store.close()


async def test_bounded_caches_still_stitch_what_they_evicted(tmp_path: Path) -> None:
    """SQLite's stitcher caches (PostgreSQL's has none: other processes write there too)."""
    store = await _open(tmp_path / "s.db", cache_entries=100)
    try:
        first = [SYSTEM, {"role": "user", "content": "conversation 0"}]
        tid = await _call(store, first, "answer 0")
        for i in range(1, 150):  # enough newer conversations to push the first out of every cache
            await _call(store, [SYSTEM, {"role": "user", "content": f"conversation {i}"}], f"answer {i}")
        assert len(store._stitcher._heads) == 100
        later = [*first, {"role": "assistant", "content": "answer 0"}, {"role": "user", "content": "and then?"}]
        assert await _call(store, later, "then this") == tid
    finally:
        await store.close()


async def test_what_was_committed_is_read_back_at_once_under_concurrent_reads(store_location: str) -> None:
    """Reads share one connection: a statement queued between another read's execute and its fetch joined that
    read's WAL snapshot, older than the caller's own commit (here 97 of 200 read back as missing before the fix;
    the soak saw agent runs 404 right after their 201)."""
    store = await _open(store_location)
    try:
        await _call(store, [SYSTEM, {"role": "user", "content": "first"}], "so that listings have rows")
        done = asyncio.Event()

        async def keep_listing() -> None:
            while not done.is_set():
                await store.list_trajectories(limit=5)

        readers = [asyncio.create_task(keep_listing()) for _ in range(4)]
        missing = 0
        for i in range(200):
            tid = await _call(store, [SYSTEM, {"role": "user", "content": f"question {i}"}], f"answer {i}")
            missing += await store.get_trajectory(tid) is None
        done.set()
        await asyncio.gather(*readers)
        assert missing == 0, f"{missing} of 200 writes were not read back"
    finally:
        await store.close()


async def test_search_finds_trajectories_by_the_words_of_their_messages(store_location: str) -> None:
    store = await _open(store_location)
    try:
        history = [SYSTEM, {"role": "user", "content": "Where is the Eiffel tower?"}]
        paris = await _call(store, history, "In Paris, France.", tenant="acme")
        history += [{"role": "assistant", "content": "In Paris, France."},
                    {"role": "user", "content": "And how tall is it?"}]
        assert await _call(store, history, "About 330 metres.", tenant="acme") == paris
        rome = await _call(store, [SYSTEM, {"role": "user", "content": "Where is the Colosseum?"}], "Rome.",
                           tenant="acme")
        other = await _call(store, [SYSTEM, {"role": "user", "content": "Eiffel tower height?"}], "330 m",
                            tenant="globex")

        async def found(text: str, **scope) -> list[str]:
            return [t.id for t in await store.search(text, **{"tenant": "acme", **scope})]

        assert await found("eiffel") == [paris]  # case folded; the other tenant's is not seen
        assert await found("TALL metres") == [paris]  # a later turn's question and answer; every word must match
        assert await found("where") == [rome, paris]  # newest first
        assert await found("eiffel rome") == []
        assert set(await found("eiffel", all_tenants=True)) == {paris, other}
        assert await found('"; DROP TABLE trajectories; --') == []  # words, never a query language
        assert await found("-- *") == []
        assert await found("where", before=rome) == [paris]
        assert await store.delete(ids=[paris]) == 1
        assert await found("eiffel") == []
    finally:
        await store.close()


async def test_listing_and_search_take_filters_and_pages_by_keyset(store_location: str) -> None:
    """What the console's list asks: filters, full-text search and keyset pages together, on both databases."""
    store = await _open(store_location)
    try:
        ids = [await _call(store, [SYSTEM, {"role": "user", "content": f"question {i} about {word}"}], "ok",
                           tenant="acme") for i, word in enumerate(["otters", "otters", "badgers", "otters"])]
        forked = await _call(store, [SYSTEM, {"role": "user", "content": "question 0 about otters"},
                                     {"role": "assistant", "content": "no"}, {"role": "user", "content": "again"}],
                             "ok", tenant="acme")
        await store._change([("UPDATE trajectories SET final_reward = ?, source = ? WHERE id = ?", (r, s, t))
                             for t, r, s in zip(ids, (0.9, 0.2, 0.8, 0.7), ("proxy", "agent", "proxy", "proxy"),
                                                strict=True)])
        await store._change([("UPDATE trajectories SET parent_id = ? WHERE id = ?", (ids[0], forked))])

        async def listed(text: str | None = None, **scope) -> list[str]:
            scope = {"tenant": "acme", **scope}
            found = await (store.search(text, **scope) if text else store.list_trajectories(**scope))
            return [t.id for t in found]

        good = Filters(min_reward=0.5, source="proxy")
        assert await listed(filters=good) == [ids[3], ids[2], ids[0]]
        assert await listed("otters", filters=good) == [ids[3], ids[0]]
        assert await listed("otters", filters=good, limit=1) == [ids[3]]
        assert await listed("otters", filters=good, limit=1, before=ids[3]) == [ids[0]]
        assert await listed("otters", filters=Filters(max_reward=0.5)) == [ids[1]]
        assert await listed(filters=Filters(parent=ids[0])) == [forked]
        assert await listed("otters", filters=good, tenant="globex") == []
    finally:
        await store.close()


@pytest.mark.sqlite_only
async def test_a_store_from_before_the_search_index_is_searchable_after_its_upgrade(tmp_path: Path) -> None:
    store = await _open(tmp_path / "old.db")
    history = [SYSTEM, {"role": "user", "content": "Where is the Eiffel tower?"}]
    tid = await _call(store, history, "In Paris.")
    await _call(store, [*history, {"role": "assistant", "content": "In Paris."},
                        {"role": "user", "content": "How tall?"}], "About 330 metres.")
    await store.close()
    with sqlite3.connect(tmp_path / "old.db") as db:  # back to schema 9, as such a store was written
        db.executescript("""DROP TABLE trajectory_text; DROP INDEX agent_runs_lease;
            ALTER TABLE trajectories DROP COLUMN next_seq; ALTER TABLE agent_runs DROP COLUMN lease_owner;
            ALTER TABLE agent_runs DROP COLUMN lease_expires_at; ALTER TABLE blobs DROP COLUMN stored_at;
            ALTER TABLE model_calls DROP COLUMN native_api; ALTER TABLE model_calls DROP COLUMN native_bodies;
            DROP INDEX model_calls_created; ALTER TABLE model_calls DROP COLUMN cost_usd;
            ALTER TABLE api_keys DROP COLUMN limits; DROP TABLE console_sessions; DROP TABLE training_runs;
            DROP INDEX trajectories_parent; DROP INDEX trajectories_status;
            ALTER TABLE bot_messages DROP COLUMN delivery_claimed_until; PRAGMA user_version = 9;""")
    store = await _open(tmp_path / "old.db")
    try:
        assert [t.id for t in await store.search("eiffel")] == [tid]
        assert [t.id for t in await store.search("metres tall")] == [tid]
        # and the upgraded trajectory goes on where it was
        assert await rows(store, "SELECT next_seq FROM trajectories WHERE id = ?", tid) == [(2,)]
    finally:
        await store.close()


async def test_an_exchange_kept_as_it_came_is_read_back_and_outlives_collection(
        store_location: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(replay.store, "SHARED_BLOB_TRUST_SECONDS", 0.0)
    store = await _open(store_location)
    messages = [{"role": "user", "content": "hi"}]
    native = {"api": "anthropic", "request": {"model": "claude-x", "max_tokens": 9, "messages": messages},
              "response": {"type": "message", "content": [{"type": "thinking", "thinking": "t", "signature": "S=="}]}}
    prefix = hashing.prefix_hashes(messages)
    ref = await store.stitch(session_key=None, prefix=prefix, anchor=prefix[0], tenant=None)
    await store.record(CallRecord(trajectory=ref, request_messages=messages, request_prefix=prefix, status="ok",
                                  response=_answer("hello"), native=native))
    other = await _call(store, [{"role": "user", "content": "other"}], "b")
    assert await store.delete(ids=[other]) == 1  # collects the bodies no call refers to
    kept = await store.get_trajectory(ref.id, all_tenants=True)
    assert kept is not None and kept.format == "anthropic"
    assert kept.calls[0].native == native
    assert kept.calls[0].messages == messages  # the chat messages every reader takes, as ever
    assert kept.to_dict()["calls"][0]["native"] == native
    plain = await _call(store, [{"role": "user", "content": "plain"}], "c")
    assert (await store.get_trajectory(plain, all_tenants=True)).format == "chat"
    await store.close()
