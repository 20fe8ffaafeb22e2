"""The store's schema as an ordered list of migrations, the same numbers on both databases.

Each migration is written for SQLite; PostgreSQL runs it with its types spelled its own way (``postgres_ddl``),
or runs a text of its own where the two differ more than that (``POSTGRES``). SQLite counts the migrations that
ran in ``PRAGMA user_version``, PostgreSQL in the ``schema_version`` table; there, each runs under an advisory
lock, so replicas starting together migrate once.
"""

from __future__ import annotations

import re
import sqlite3
from typing import Any

from replay import search_text

MIGRATIONS: list[str] = [
    # 1: trajectories, content-addressed bodies, model calls, API keys.
    """
    CREATE TABLE trajectories (
        id TEXT PRIMARY KEY,
        source TEXT NOT NULL,
        tenant TEXT,
        key_id TEXT,
        session_key TEXT,
        requested_model TEXT,
        base_model TEXT,
        adapter TEXT,
        adapter_version TEXT,
        task_id TEXT,
        group_id TEXT,
        parent_id TEXT,
        status TEXT NOT NULL,
        termination_reason TEXT,
        head_hash TEXT,
        message_count INTEGER NOT NULL DEFAULT 0,
        n_calls INTEGER NOT NULL DEFAULT 0,
        prompt_tokens INTEGER NOT NULL DEFAULT 0,
        completion_tokens INTEGER NOT NULL DEFAULT 0,
        latency_ms REAL NOT NULL DEFAULT 0,
        final_reward REAL,
        metadata TEXT,
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL
    );
    CREATE INDEX trajectories_session ON trajectories(session_key, tenant, updated_at);
    CREATE INDEX trajectories_head ON trajectories(head_hash, tenant, updated_at);
    CREATE INDEX trajectories_created ON trajectories(created_at);
    CREATE INDEX trajectories_tenant ON trajectories(tenant, created_at);
    CREATE INDEX trajectories_group ON trajectories(group_id);

    CREATE TABLE blobs (
        hash TEXT PRIMARY KEY,
        body BLOB NOT NULL
    ) WITHOUT ROWID;

    CREATE TABLE model_calls (
        id TEXT PRIMARY KEY,
        trajectory_id TEXT NOT NULL REFERENCES trajectories(id) ON DELETE CASCADE,
        seq INTEGER NOT NULL,
        created_at REAL NOT NULL,
        backend TEXT,
        model TEXT,
        adapter TEXT,
        stream INTEGER NOT NULL DEFAULT 0,
        request_messages TEXT NOT NULL,
        tools_hash TEXT,
        params TEXT,
        response TEXT,
        response_messages TEXT,
        status TEXT NOT NULL,
        error TEXT,
        prompt_tokens INTEGER,
        completion_tokens INTEGER,
        latency_ms REAL,
        ttft_ms REAL,
        prompt_token_ids BLOB,
        completion_token_ids BLOB,
        completion_logprobs BLOB
    );
    CREATE INDEX model_calls_trajectory ON model_calls(trajectory_id, seq);

    CREATE TABLE api_keys (
        id TEXT PRIMARY KEY,
        hash TEXT NOT NULL UNIQUE,
        tenant TEXT NOT NULL,
        name TEXT,
        capture INTEGER NOT NULL DEFAULT 1,
        created_at REAL NOT NULL,
        revoked_at REAL
    );
    """,
    # 2: the agent loop's tool calls, state-machine events and resumable run state.
    """
    CREATE TABLE tool_calls (
        id TEXT PRIMARY KEY,
        trajectory_id TEXT NOT NULL REFERENCES trajectories(id) ON DELETE CASCADE,
        step INTEGER NOT NULL,
        call_id TEXT,
        name TEXT,
        raw_arguments TEXT,
        parsed INTEGER NOT NULL,
        repaired INTEGER NOT NULL,
        valid INTEGER NOT NULL,
        validation_error TEXT,
        status TEXT NOT NULL,
        result TEXT,
        duration_ms REAL,
        created_at REAL NOT NULL
    );
    CREATE INDEX tool_calls_trajectory ON tool_calls(trajectory_id, step);

    CREATE TABLE events (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        trajectory_id TEXT NOT NULL REFERENCES trajectories(id) ON DELETE CASCADE,
        step INTEGER NOT NULL,
        state TEXT NOT NULL,
        data TEXT,
        created_at REAL NOT NULL
    );
    CREATE INDEX events_trajectory ON events(trajectory_id, id);

    CREATE TABLE agent_runs (
        id TEXT PRIMARY KEY REFERENCES trajectories(id) ON DELETE CASCADE,
        profile TEXT NOT NULL,
        status TEXT NOT NULL,
        termination_reason TEXT,
        steps INTEGER NOT NULL DEFAULT 0,
        state TEXT,
        result TEXT,
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL
    );
    CREATE INDEX agent_runs_status ON agent_runs(status);
    """,
    # 3: Responses API objects kept with store=true, to fetch them or continue with previous_response_id.
    """
    CREATE TABLE responses (
        id TEXT PRIMARY KEY,
        trajectory_id TEXT REFERENCES trajectories(id) ON DELETE CASCADE,
        tenant TEXT,
        body TEXT NOT NULL,
        messages TEXT NOT NULL,
        created_at REAL NOT NULL
    );
    CREATE INDEX responses_trajectory ON responses(trajectory_id);
    """,
    # 4: rewards and labels from users, verifiers and the reward engine; model_call_seq names the step
    # (the model call's seq) a row belongs to, for per-step credit, and is NULL for the whole trajectory.
    """
    CREATE TABLE feedback (
        id TEXT PRIMARY KEY,
        trajectory_id TEXT NOT NULL REFERENCES trajectories(id) ON DELETE CASCADE,
        model_call_seq INTEGER,
        source TEXT NOT NULL,
        name TEXT NOT NULL,
        value REAL,
        label TEXT,
        comment TEXT,
        created_at REAL NOT NULL
    );
    CREATE INDEX feedback_trajectory ON feedback(trajectory_id, source, name);
    """,
    # 5: the LoRA adapter registry, and per-key routing: a default model and whether a header may override it.
    # ``published`` versions are kept loaded in every backend serving their base; ``activated_at`` orders the
    # versions that were active, so rollback can find the previous one.
    """
    CREATE TABLE adapters (
        name TEXT NOT NULL,
        version INTEGER NOT NULL,
        base_model TEXT NOT NULL,
        path TEXT NOT NULL,
        status TEXT NOT NULL CHECK (status IN ('candidate', 'active', 'retired')),
        published INTEGER NOT NULL DEFAULT 0,
        metrics TEXT,
        parent_version INTEGER,
        uploaded INTEGER NOT NULL DEFAULT 0,
        created_at REAL NOT NULL,
        activated_at REAL,
        updated_at REAL NOT NULL,
        PRIMARY KEY (name, version)
    );
    CREATE UNIQUE INDEX adapters_one_active ON adapters(name) WHERE status = 'active';

    ALTER TABLE api_keys ADD COLUMN default_model TEXT;
    ALTER TABLE api_keys ADD COLUMN allow_model_override INTEGER NOT NULL DEFAULT 0;
    """,
    # 6: nonces of signed bot requests already seen, so a replay is refused even after a restart.
    """
    CREATE TABLE bot_nonces (
        nonce TEXT PRIMARY KEY,
        seen_at REAL NOT NULL
    ) WITHOUT ROWID;
    CREATE INDEX bot_nonces_seen ON bot_nonces(seen_at);
    """,
    # 7: tool calls held for a person's approval; chat-bot conversations (one growing trajectory each) and the
    # messages they were sent, kept until their reply is delivered.
    """
    CREATE TABLE approvals (
        id TEXT PRIMARY KEY,
        trajectory_id TEXT NOT NULL REFERENCES trajectories(id) ON DELETE CASCADE,
        step INTEGER NOT NULL,
        call_id TEXT NOT NULL,
        tool TEXT NOT NULL,
        arguments TEXT NOT NULL,
        status TEXT NOT NULL,
        reason TEXT,
        decided_by TEXT,
        created_at REAL NOT NULL,
        expires_at REAL NOT NULL,
        decided_at REAL
    );
    CREATE INDEX approvals_status ON approvals(status, expires_at);
    CREATE INDEX approvals_trajectory ON approvals(trajectory_id);

    CREATE TABLE bot_conversations (
        platform TEXT NOT NULL,
        conversation_id TEXT NOT NULL,
        trajectory_id TEXT NOT NULL,
        user_id TEXT,
        created_at REAL NOT NULL,
        PRIMARY KEY (platform, conversation_id)
    ) WITHOUT ROWID;

    CREATE TABLE bot_messages (
        id TEXT PRIMARY KEY,
        platform TEXT NOT NULL,
        external_id TEXT,
        conversation_id TEXT NOT NULL,
        user_id TEXT NOT NULL,
        text TEXT NOT NULL,
        callback_url TEXT,
        trajectory_id TEXT,
        status TEXT NOT NULL,
        reply TEXT,
        model_call_seq INTEGER,
        harness TEXT,
        attempts INTEGER NOT NULL DEFAULT 0,
        error TEXT,
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL
    );
    CREATE UNIQUE INDEX bot_messages_external ON bot_messages(platform, external_id) WHERE external_id IS NOT NULL;
    CREATE INDEX bot_messages_status ON bot_messages(status, created_at);
    CREATE INDEX bot_messages_trajectory ON bot_messages(trajectory_id);
    """,
    # 8: facts about the store that must never be forgotten; 'keys_created' is set with the first API key and
    # never cleared, so revoking every key never reopens a gateway.
    """
    CREATE TABLE store_facts (
        name TEXT PRIMARY KEY,
        value TEXT NOT NULL,
        set_at REAL NOT NULL
    ) WITHOUT ROWID;
    INSERT INTO store_facts(name, value, set_at)
        SELECT 'keys_created', '1', MIN(created_at) FROM api_keys HAVING COUNT(*) > 0;
    """,
    # 9: each completion token's log-probability under the distribution it was sampled from (temperature, top-p,
    # penalties, grammar mask), beside ``completion_logprobs``, which is under the model itself.
    """
    ALTER TABLE model_calls ADD COLUMN completion_sampled_logprobs BLOB;
    """,
    # 10: what replicas sharing one store need. ``next_seq`` is claimed by compare-and-swap on the head when a
    # request extends a trajectory; a run's lease says which process carries it on, and until when; a body's
    # ``stored_at`` lets a writer trust its cache of stored bodies for a while, and the collector of unreferenced
    # bodies leave alone those that young. ``trajectory_text`` holds each call's new messages for full-text search.
    """
    ALTER TABLE trajectories ADD COLUMN next_seq INTEGER NOT NULL DEFAULT 0;
    UPDATE trajectories SET next_seq = (SELECT COALESCE(MAX(seq) + 1, 0) FROM model_calls
                                        WHERE model_calls.trajectory_id = trajectories.id);
    ALTER TABLE agent_runs ADD COLUMN lease_owner TEXT;
    ALTER TABLE agent_runs ADD COLUMN lease_expires_at REAL;
    CREATE INDEX agent_runs_lease ON agent_runs(status, lease_expires_at);
    ALTER TABLE blobs ADD COLUMN stored_at REAL NOT NULL DEFAULT 0;
    CREATE VIRTUAL TABLE trajectory_text USING fts5(body, trajectory_id UNINDEXED, tokenize = 'unicode61');
    """,
    # 11: a call that came through another API than chat completions (the Anthropic Messages API) keeps its exchange
    # as it came, beside the chat messages every reader takes: ``native_api`` names the API, ``native_bodies`` holds
    # the blob keys of its request and (when there was one) its answer.
    """
    ALTER TABLE model_calls ADD COLUMN native_api TEXT;
    ALTER TABLE model_calls ADD COLUMN native_bodies TEXT;
    """,
    # 12: what operators count: each call's cost (US dollars, at the gateway's price table when it was made), and a
    # key's own limits (JSON, over the configured defaults). The usage index serves reports over a period.
    """
    ALTER TABLE model_calls ADD COLUMN cost_usd REAL;
    ALTER TABLE api_keys ADD COLUMN limits TEXT;
    CREATE INDEX model_calls_created ON model_calls(created_at);
    """,
    # 13: the web console's sign-in sessions (``id`` is the hash of the cookie's token; ``key_hash`` the hash of the
    # key signed in with, so a changed admin key ends its sessions as a revoked API key ends its own), and each
    # replay-train run's stages, curves and before/after table, written as it goes so any replica can show it.
    """
    CREATE TABLE console_sessions (
        id TEXT PRIMARY KEY,
        key_id TEXT,
        key_hash TEXT,
        tenant TEXT,
        admin INTEGER NOT NULL DEFAULT 0,
        csrf TEXT NOT NULL,
        created_at REAL NOT NULL,
        expires_at REAL NOT NULL
    ) WITHOUT ROWID;
    CREATE INDEX console_sessions_expires ON console_sessions(expires_at);

    CREATE TABLE training_runs (
        id TEXT PRIMARY KEY,
        name TEXT NOT NULL,
        mode TEXT NOT NULL,
        status TEXT NOT NULL,
        host TEXT,
        run_dir TEXT,
        stages TEXT,
        metrics TEXT,
        error TEXT,
        adapter_version INTEGER,
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL
    );
    CREATE INDEX training_runs_created ON training_runs(created_at);
    CREATE INDEX trajectories_parent ON trajectories(parent_id);
    CREATE INDEX trajectories_status ON trajectories(status, id);
    """,
    # 14: while a process sends a bot reply, until when no other may (it renews the claim each attempt); a reply
    # answered but never claimed, or whose claim ran out, is sent by whichever process finds it.
    """
    ALTER TABLE bot_messages ADD COLUMN delivery_claimed_until REAL;
    """,
]

# Where PostgreSQL's text differs by more than its types: migration number -> what it runs instead.
POSTGRES: dict[int, str] = {
    10: """
    ALTER TABLE trajectories ADD COLUMN next_seq BIGINT NOT NULL DEFAULT 0;
    UPDATE trajectories SET next_seq = (SELECT COALESCE(MAX(seq) + 1, 0) FROM model_calls
                                        WHERE model_calls.trajectory_id = trajectories.id);
    ALTER TABLE agent_runs ADD COLUMN lease_owner TEXT;
    ALTER TABLE agent_runs ADD COLUMN lease_expires_at DOUBLE PRECISION;
    CREATE INDEX agent_runs_lease ON agent_runs(status, lease_expires_at);
    ALTER TABLE blobs ADD COLUMN stored_at DOUBLE PRECISION NOT NULL DEFAULT 0;
    CREATE TABLE trajectory_text (
        trajectory_id TEXT NOT NULL REFERENCES trajectories(id) ON DELETE CASCADE,
        body TEXT NOT NULL,
        document tsvector GENERATED ALWAYS AS (to_tsvector('simple', body)) STORED
    );
    CREATE INDEX trajectory_text_document ON trajectory_text USING GIN (document);
    CREATE INDEX trajectory_text_trajectory ON trajectory_text(trajectory_id);
    """,
}

SCHEMA_VERSION = len(MIGRATIONS)


_TYPES = [
    (re.compile(r"\bINTEGER PRIMARY KEY AUTOINCREMENT\b"), "BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY"),
    (re.compile(r"\bINTEGER\b"), "BIGINT"),
    (re.compile(r"\bREAL\b"), "DOUBLE PRECISION"),
    (re.compile(r"\bBLOB\b"), "BYTEA"),
    (re.compile(r"\)\s*WITHOUT ROWID"), ")"),
]


def postgres_ddl(sql: str) -> str:
    """A migration's SQLite text with PostgreSQL's names for its types."""
    for pattern, replacement in _TYPES:
        sql = pattern.sub(replacement, sql)
    return sql


# tool_calls gets SQLite's implicit rowid as a column, so both read a step's calls in the order they came.
POSTGRES[2] = (postgres_ddl(MIGRATIONS[1])
               + "ALTER TABLE tool_calls ADD COLUMN rowid BIGINT GENERATED ALWAYS AS IDENTITY;\n")


def postgres_migration(version: int) -> str:
    """What PostgreSQL runs as migration ``version`` (counted from 1)."""
    return POSTGRES.get(version) or postgres_ddl(MIGRATIONS[version - 1])


# Any fixed number: the key of the advisory lock migrations run under.
_MIGRATION_LOCK = 0x68_61_72_6E


def migrate_postgres(conn: Any) -> int:
    """Bring a PostgreSQL database (a psycopg connection in autocommit mode) to the newest schema; returns the
    version it started at. Each migration commits with its new version number, under an advisory lock."""
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
        # Under the lock: two processes creating it at once (workers starting on a fresh database) would collide,
        # IF NOT EXISTS notwithstanding.
        conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
        row = conn.execute("SELECT version FROM schema_version").fetchone()
        if row is None:
            conn.execute("INSERT INTO schema_version(version) VALUES (0)")
    start = row[0] if row else 0
    if start > SCHEMA_VERSION:
        raise RuntimeError(
            f"database schema version {start} is newer than this program knows ({SCHEMA_VERSION})"
        )
    while True:
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
            (version,) = conn.execute("SELECT version FROM schema_version").fetchone()
            if version >= SCHEMA_VERSION:
                return start
            conn.execute(postgres_migration(version + 1))
            conn.execute("UPDATE schema_version SET version = %s", (version + 1,))


def migrate(conn: sqlite3.Connection) -> int:
    """Bring a database to the newest schema; returns the version it started at."""
    start = conn.execute("PRAGMA user_version").fetchone()[0]
    if start > SCHEMA_VERSION:
        raise RuntimeError(
            f"database schema version {start} is newer than this program knows ({SCHEMA_VERSION})"
        )
    for version in range(start, SCHEMA_VERSION):
        conn.executescript("BEGIN;\n" + MIGRATIONS[version])
        try:
            if version + 1 == 10:  # the search index gets the calls stored before it
                search_text.backfill(conn)
            conn.execute(f"PRAGMA user_version = {version + 1}")
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
    return start
