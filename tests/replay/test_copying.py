"""``replay.copying``: a whole store to PostgreSQL and back, unchanged; a killed copy resumes where it stopped and
reads nothing twice; a DST that differs is caught by the check."""

from __future__ import annotations

import sqlite3
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest

from replay import runs
from replay.copying import CopyError, Migration, migrate_store, tables
from replay.records import WriteOp
from replay.schema import MIGRATIONS, SCHEMA_VERSION
from replay.store import TrajectoryStore
from tests.postgres import PostgresServer
from tests.replay.builders import digest, side_files
from tests.replay.whole_store import NONCES, Built, build, counts
from tests.stores import rows


class Interrupted(Exception):
    pass


async def _dicts(location: str, ids: list[str]) -> dict[str, Any]:
    store = TrajectoryStore(location)
    await store.start()
    try:
        return {tid: (await store.get_trajectory(tid, all_tenants=True)).to_dict() for tid in ids}  # type: ignore[union-attr]
    finally:
        await store.close()


async def _found(location: str, word: str) -> list[str]:
    store = TrajectoryStore(location)
    await store.start()
    try:
        return [t.id for t in await store.search(word, all_tenants=True)]
    finally:
        await store.close()


def _icu_database(postgres: PostgresServer) -> str:
    """A database whose text order is English's ("alpha" < "Beta" < "Zulu"), not the bytes'."""
    name = "icu_" + uuid.uuid4().hex[:12]
    with psycopg.connect(postgres.admin_url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE \"{name}\" TEMPLATE template0 LOCALE_PROVIDER icu ICU_LOCALE 'en-US' "
                     "LOCALE 'C.UTF-8'")
    return postgres.admin_url.rsplit("/", 1)[0] + "/" + name


def _hashes(result: Migration, side: str) -> dict[str, str]:
    return {c.table: getattr(c, f"{side}_hash") for c in result.checks}


@pytest.fixture
async def built(tmp_path: Path) -> tuple[Path, Built]:
    path = tmp_path / "src.db"
    return path, await build(path)


# -- the round trip --------------------------------------------------------------------------------------------


async def test_a_store_goes_to_postgresql_and_back_unchanged(built: tuple[Path, Built], tmp_path: Path,
                                                             postgres: PostgresServer) -> None:
    src, facts = built
    before = digest(src)
    url = postgres.database()

    there = migrate_store(str(src), url)
    assert there.ok, [c for c in there.checks if not c.ok]
    counts = {c.table: c.source_rows for c in there.checks}
    assert all(counts.values()), f"the store to copy leaves a table empty: {counts}"  # every table is exercised
    assert {c.table: c.inserted for c in there.copies} == counts

    back = tmp_path / "back.db"
    again = migrate_store(url, str(back))
    assert again.ok
    # the same content hash on all three: SQLite and PostgreSQL hash alike
    assert _hashes(there, "source") == _hashes(there, "destination") == _hashes(again, "destination")

    assert digest(src) == before and side_files(src) == []  # SRC only read
    expected = await _dicts(str(src), facts.trajectories)
    assert await _dicts(url, facts.trajectories) == expected
    assert await _dicts(str(back), facts.trajectories) == expected
    for word, tid in facts.searchable.items():
        found = await _found(str(src), word)
        assert tid in found
        assert await _found(url, word) == found
        assert await _found(str(back), word) == found


async def test_events_ids_go_on_past_every_id_src_gave_out(built: tuple[Path, Built], tmp_path: Path,
                                                           postgres: PostgresServer) -> None:
    src, facts = built
    url = postgres.database()
    assert migrate_store(str(src), url).ok
    back = tmp_path / "back.db"
    assert migrate_store(url, str(back)).ok
    for location in (url, str(back)):
        store = TrajectoryStore(location)
        await store.start()
        try:
            [(largest,)] = await rows(store, "SELECT MAX(id) FROM events")
            assert largest < facts.events_high_water  # the deleted run's events were the last ones
            await store.write(WriteOp(statements=[runs.event_statement(facts.trajectories[0], step=9, state="x",
                                                                        data={}, at=1.0)]))
            [(new,)] = await rows(store, "SELECT MAX(id) FROM events")
            assert new == facts.events_high_water + 1
        finally:
            await store.close()


async def test_sqlite_to_sqlite_copies_too(built: tuple[Path, Built], tmp_path: Path) -> None:
    src, facts = built
    result = migrate_store(str(src), str(tmp_path / "copy.db"), chunk_rows=3)
    assert result.ok
    assert await _dicts(str(tmp_path / "copy.db"), facts.trajectories) == await _dicts(str(src), facts.trajectories)


# -- resuming --------------------------------------------------------------------------------------------------


def _stop_after(table: str, chunks: int) -> Any:
    seen = []

    def progress(phase: str, name: str, done: int, total: int) -> None:
        if phase == "copy" and name == table:
            seen.append(done)
            if len(seen) > chunks:  # the first call is the table's start
                raise Interrupted

    return progress


@pytest.mark.parametrize(("direction", "table"), [
    ("to_postgres", "model_calls"), ("to_postgres", "tool_calls"), ("to_postgres", "trajectory_text"),
    ("to_postgres", "bot_nonces"), ("to_sqlite", "tool_calls"), ("to_sqlite", "bot_nonces"),
    ("to_sqlite", "trajectory_text")])
async def test_an_interrupted_copy_resumes_where_it_stopped(built: tuple[Path, Built], tmp_path: Path,
                                                            postgres: PostgresServer, direction: str,
                                                            table: str) -> None:
    src, _ = built
    if direction == "to_postgres":
        source, destination = str(src), _icu_database(postgres)
    else:  # from a PostgreSQL store whose text order is not the bytes'
        source, destination = _icu_database(postgres), str(tmp_path / "dst.db")
        assert migrate_store(str(src), source).ok

    with pytest.raises(Interrupted):
        migrate_store(source, destination, chunk_rows=2, on_progress=_stop_after(table, chunks=2))
    held = counts(destination)
    total = counts(source)
    assert 0 < held[table] < total[table]

    result = migrate_store(source, destination, chunk_rows=2)
    assert result.ok, [c for c in result.checks if not c.ok]
    for copy in result.copies:
        # nothing committed before is read again, and everything else is
        assert copy.read == total[copy.table] - held[copy.table], copy
        assert copy.inserted == copy.read, copy
    assert counts(destination) == total


async def test_a_complete_copy_run_again_reads_nothing(built: tuple[Path, Built], postgres: PostgresServer) -> None:
    src, _ = built
    url = postgres.database()
    assert migrate_store(str(src), url).ok
    again = migrate_store(str(src), url)
    assert again.ok and all(c.read == 0 and c.inserted == 0 for c in again.copies)


# -- the check -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dst_kind", ["sqlite", "postgresql"])
async def test_a_dst_that_differs_is_reported(built: tuple[Path, Built], tmp_path: Path, postgres: PostgresServer,
                                              dst_kind: str) -> None:
    src, facts = built
    destination = postgres.database() if dst_kind == "postgresql" else str(tmp_path / "dst.db")
    assert migrate_store(str(src), destination).ok
    changed = facts.trajectories[2]
    store = TrajectoryStore(destination)
    await store.start()
    try:  # the same keys with other data, and a row SRC does not have
        await store._change([("UPDATE trajectories SET status = 'tampered' WHERE id = ?", (changed,)),
                             ("UPDATE blobs SET stored_at = stored_at + 1", ()),
                             ("INSERT INTO bot_nonces(nonce, seen_at) VALUES ('extra', 1.0)", ())])
    finally:
        await store.close()

    for result in (migrate_store(str(src), destination, verify_only=True), migrate_store(str(src), destination)):
        wrong = {c.table: c for c in result.checks if not c.ok}
        assert set(wrong) == {"trajectories", "blobs", "bot_nonces"}
        assert wrong["trajectories"].first_difference == ({"id": changed}, {"id": changed})
        assert wrong["trajectories"].source_rows == wrong["trajectories"].destination_rows
        assert wrong["trajectories"].source_hash != wrong["trajectories"].destination_hash
        nonces = wrong["bot_nonces"]
        assert (nonces.source_rows, nonces.destination_rows) == (len(NONCES), len(NONCES) + 1)
        # in byte order "extra" comes after "alpha" and before "yak"
        assert nonces.first_difference == ({"nonce": "yak"}, {"nonce": "extra"})
        assert "SRC has nonce='yak' where DST has nonce='extra'" in nonces.describe()


async def test_verify_only_changes_nothing(built: tuple[Path, Built], tmp_path: Path) -> None:
    src, _ = built
    dst = tmp_path / "dst.db"
    assert migrate_store(str(src), str(dst)).ok
    digests = digest(src), digest(dst)
    result = migrate_store(str(src), str(dst), verify_only=True)
    assert result.ok and not result.copies
    assert (digest(src), digest(dst)) == digests and side_files(dst) == []


# -- what is refused -------------------------------------------------------------------------------------------


async def test_src_and_dst_must_differ(built: tuple[Path, Built], postgres: PostgresServer, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    src, _ = built
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CopyError, match="same store"):
        migrate_store(str(src), "./src.db")
    url = postgres.database()
    with pytest.raises(CopyError, match="same store"):
        migrate_store(url, url + "?connect_timeout=5")


def test_an_older_src_is_refused_with_how_to_upgrade_it(tmp_path: Path, postgres: PostgresServer) -> None:
    old = tmp_path / "old.db"
    conn = sqlite3.connect(old)
    for version, text in enumerate(MIGRATIONS[:-1]):
        conn.executescript(f"BEGIN; {text}; PRAGMA user_version = {version + 1}; COMMIT;")
    conn.close()
    before = digest(old)
    with pytest.raises(CopyError, match=rf"schema version {SCHEMA_VERSION - 1}, older .*HARNESS_STORE__PATH="):
        migrate_store(str(old), postgres.database())
    assert digest(old) == before


def test_a_missing_or_foreign_src_is_named(tmp_path: Path) -> None:
    with pytest.raises(CopyError, match="no store at"):
        migrate_store(str(tmp_path / "none.db"), str(tmp_path / "dst.db"))
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(CopyError, match="not an SQLite database"):
        migrate_store(str(tmp_path / "notes.txt"), str(tmp_path / "dst.db"))


async def test_a_value_postgresql_cannot_hold_stops_the_copy_by_name(built: tuple[Path, Built],
                                                                      postgres: PostgresServer) -> None:
    src, facts = built
    conn = sqlite3.connect(src)
    with conn:  # SQLite's loose typing lets text into an INTEGER column
        conn.execute("UPDATE trajectories SET message_count = 'many' WHERE id = ?", (facts.trajectories[1],))
    conn.close()
    with pytest.raises(CopyError, match=rf"trajectories \(id='{facts.trajectories[1]}'\): column message_count "
                                        r"holds str 'many'"):
        migrate_store(str(src), postgres.database())


# -- the schema as the copy reads it ---------------------------------------------------------------------------


def test_every_table_is_copied_after_those_it_refers_to(postgres: PostgresServer, tmp_path: Path) -> None:
    from replay.schema import migrate, migrate_postgres

    order = [t.name for t in tables()]
    url = postgres.database()
    with psycopg.connect(url, autocommit=True) as conn:
        migrate_postgres(conn)
        found = {r[0] for r in conn.execute("SELECT table_name FROM information_schema.tables "
                                            "WHERE table_schema = 'public'")}
        references = conn.execute("""
            SELECT child.relname, parent.relname FROM pg_constraint c
            JOIN pg_class child ON child.oid = c.conrelid JOIN pg_class parent ON parent.oid = c.confrelid
            WHERE c.contype = 'f'""").fetchall()
        with_rowid = {r[0] for r in conn.execute("SELECT table_name FROM information_schema.columns "
                                                 "WHERE table_schema = 'public' AND column_name = 'rowid'")}
    assert set(order) == found - {"schema_version"}
    assert references and all(order.index(parent) < order.index(child) for child, parent in references)
    assert {t.name for t in tables() if t.order == ("rowid",)} == with_rowid == {"tool_calls"}

    conn = sqlite3.connect(tmp_path / "s.db")
    migrate(conn)
    sqlite_references = [(t.name, r[2]) for t in tables()
                         for r in conn.execute(f"PRAGMA foreign_key_list({t.name})").fetchall()]
    conn.close()
    assert sqlite_references and all(order.index(p) < order.index(c) for c, p in sqlite_references)
