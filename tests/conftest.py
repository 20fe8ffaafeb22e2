from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from replay.store import TrajectoryStore
from tests import leftovers, markers
from tests.extras import skip_without
from tests.postgres import PostgresServer, require_postgres
from tests.processes import GatewayProcess, upstream_config
from tests.redis import RedisServer, require_redis
from tests.standin import ServerThread, StandIn

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    markers.mark_collected(items)


def pytest_runtest_setup(item: pytest.Item) -> None:
    markers.entering(item)
    for mark in item.iter_markers("extra"):
        skip_without(mark.args[0])


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.config.stash[_STATUS] = int(exitstatus)


def pytest_unconfigure(config: pytest.Config) -> None:
    # After the summary: a thread a test left behind would otherwise hang the run here, silently.
    leftovers.exit_if_any_left(config.stash.get(_STATUS, 0))


_STATUS = pytest.StashKey[int]()


@pytest.fixture(scope="session")
def smol_tokenizer() -> PreTrainedTokenizerBase:
    """The embedded model's tokenizer: instant from the model cache, else read from the GGUF (~7 s)."""
    from gateway.backends.local.loading import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, smol_tokenizer: PreTrainedTokenizerBase) -> Path:
    """A 2-layer Llama with random weights and the SmolLM2 tokenizer (``tests/models.py``)."""
    from tests.models import tiny_llama

    return tiny_llama(tmp_path_factory.mktemp("tiny-llama"), smol_tokenizer)


@pytest.fixture(scope="session")
def standin() -> Iterator[tuple[StandIn, str]]:
    """One stand-in upstream for the session: (app, base URL)."""
    app = StandIn()
    with ServerThread(app.app) as server:
        yield app, server.url


@pytest.fixture
def gateway(standin: tuple[StandIn, str], tmp_path: Path) -> Iterator[GatewayProcess]:
    """A real gateway process in front of the stand-in upstream, with its own SQLite file."""
    proc = GatewayProcess(upstream_config(standin[1]), tmp_path).start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def shared_gateway(standin: tuple[StandIn, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """``gateway``, one for a whole module: for tests that read only what their own requests recorded."""
    proc = GatewayProcess(upstream_config(standin[1]), tmp_path_factory.mktemp("shared-gateway")).start()
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """One throwaway PostgreSQL server for the session (``tests/postgres.py``); each user takes a fresh database."""
    server = PostgresServer(require_postgres()).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """One throwaway Redis server for the session (``tests/redis.py``): its URL. Tests share it, so each counts
    under keys of its own (its own user ids)."""
    server = RedisServer(require_redis()).start()
    yield server.url
    server.remove()


@pytest.fixture(params=["sqlite", "postgresql"])
def store_location(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Where a test's store is: a fresh SQLite file, then a fresh PostgreSQL database (the same test runs on both).
    A test about one database alone marks itself ``@pytest.mark.sqlite_only``."""
    if request.param == "postgresql":
        if request.node.get_closest_marker("sqlite_only"):
            pytest.skip("about SQLite alone")
        return request.getfixturevalue("postgres").database()
    return str(tmp_path / "store.db")


@pytest.fixture
async def store(store_location: str) -> AsyncIterator[TrajectoryStore]:
    """A real trajectory store, started and closed around the test: on SQLite, and on PostgreSQL."""
    s = TrajectoryStore(store_location)
    await s.start()
    yield s
    await s.close()
