"""Model backends behind one protocol, built from the ``[[backends]]`` configuration."""

from __future__ import annotations

from extras import require_extra
from gateway.backends.base import Backend
from gateway.config import BackendSettings


def build_backend(settings: BackendSettings) -> Backend:
    if settings.kind == "local":
        # Imported only when configured: it pulls in torch and transformers (the [local] extra).
        require_extra("local", f"backend {settings.name!r} (kind \"local\", the embedded model)")
        from gateway.backends.local import LocalBackend

        return LocalBackend(settings)
    if settings.kind == "anthropic":
        from gateway.backends.anthropic import AnthropicBackend

        return AnthropicBackend(settings)
    if settings.kind == "openai-responses":
        from gateway.backends.openai_responses import ResponsesBackend

        return ResponsesBackend(settings)
    from gateway.backends.lora_servers import SGLangBackend, VLLMBackend
    from gateway.backends.openai_compat import OpenAICompatBackend

    kinds = {"sglang": SGLangBackend, "vllm": VLLMBackend}
    return kinds.get(settings.kind, OpenAICompatBackend)(settings)
