"""Optional extras: which modules each brings, and the one-line error a feature gives when its extra is missing.

The core (gateway, proxy backends, store, replay, rewards) installs without torch; the embedded model,
training and the browser live in extras (``pyproject.toml``), so a proxy-only gateway stays small.
"""

from __future__ import annotations

import importlib.util

_LOCAL = ("torch", "transformers", "peft", "gguf", "safetensors", "llguidance")
EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    "local": _LOCAL,
    "train": (*_LOCAL, "tqdm", "matplotlib", "datasets"),  # [train] includes [local]
    "browse": ("playwright",),
}


class MissingExtra(ImportError):
    """A feature was asked for whose extra is not installed; the message says how to install it."""

    def __init__(self, feature: str, extra: str, module: str) -> None:
        super().__init__(f"{feature} needs the [{extra}] extra, which is not installed (no module {module!r}): "
                         f"pip install 'agent-harness[{extra}]' (scripts/install.sh installs every extra)")
        self.feature, self.extra, self.module = feature, extra, module


def require_extra(extra: str, feature: str) -> None:
    """Raises ``MissingExtra`` naming ``feature`` unless every module of ``extra`` can be imported."""
    for module in EXTRA_MODULES[extra]:
        if importlib.util.find_spec(module) is None:
            raise MissingExtra(feature, extra, module)
