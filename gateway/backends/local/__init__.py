"""The embedded model: ``backend`` (the asyncio facade), ``request`` (the parameters it honours), ``engine``
(batching on its own thread), ``prefix_cache`` (keys and values reused across requests), ``grammar``
(constrained decoding), ``sampling``, ``text`` (incremental detokenization and stops), ``replies`` (OpenAI
completions and chunks), ``adapters`` and ``loading`` (the weights: found, loaded and cached)."""

from gateway.backends.local.backend import LocalBackend
from gateway.backends.local.replies import LocalChunkStream

__all__ = ["LocalBackend", "LocalChunkStream"]
