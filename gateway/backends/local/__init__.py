"""The embedded model: ``backend`` (the asyncio facade), ``engine`` (batching on its own thread), ``adapters``,
``sampling`` and ``text`` (incremental detokenization and stop strings)."""

from gateway.backends.local.backend import LocalBackend, LocalChunkStream

__all__ = ["LocalBackend", "LocalChunkStream"]
