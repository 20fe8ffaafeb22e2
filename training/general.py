"""The general-ability check: perplexity on the held-out part of the general data, with an adapter or without.

The general data is the base model's own answers to the prompts shipped with the project (or the file
``[training] general_data`` names); a fixed quarter is held out and never trained on. An adapter that made the
model worse at ordinary conversation shows here as a higher perplexity than the base's.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from gateway.backends.local.heap import release_free_memory
from gateway.backends.local.loading import load_model
from training import batches, data, general_data
from training.settings import TrainingSettings


class GeneralCheck:
    """Loads the base weights once (on first use) and measures any number of adapters against them."""

    def __init__(self, settings: TrainingSettings) -> None:
        self.settings = settings
        self._model: Any = None
        self._tokenizer: Any = None
        self._held_out: list[data.Example] | None = None
        self._train: list[list[dict[str, Any]]] | None = None
        self._train_rows: list[data.Example] | None = None
        self._lock = threading.Lock()

    def _load(self) -> None:
        if self._model is not None:
            return
        loaded = load_model(self.settings.model_path)
        self._model, self._tokenizer = loaded.model, loaded.tokenizer
        if self._train is not None:  # loaded again after release: the data is still here
            return
        conversations = (general_data.load_conversations(self.settings.general_data) if self.settings.general_data
                         else general_data.general_conversations(self._model, self._tokenizer))
        train, held_out = general_data.split_general(conversations, seed=self.settings.seed)
        self._train = train
        self._held_out = general_data.general_examples(self._tokenizer, held_out, self.settings.max_seq_len)

    def release(self) -> None:
        """Drop the base weights until the next use (the data stays): training has the memory meanwhile."""
        with self._lock:
            self._model = None
        release_free_memory()

    def training_rows(self) -> list[data.Example]:
        """The general rows training may mix in (never the held-out ones), built once for SFT and every
        expert-iteration round."""
        with self._lock:
            self._load()
            assert self._train is not None
            if self._train_rows is None:
                self._train_rows = general_data.general_examples(self._tokenizer, self._train,
                                                                 self.settings.max_seq_len)
            return self._train_rows

    def losses(self, adapter: str | Path | None = None) -> list[tuple[float, int]]:
        """Each held-out text's summed negative log-likelihood and tokens, for the base (``adapter=None``) or the
        base with the adapter folder applied (``metrics.perplexity_of`` makes them one perplexity)."""
        with self._lock:
            self._load()
            assert self._held_out is not None
            if adapter is None:
                return batches.example_losses(self._model, self._tokenizer, self._held_out)
            from peft import PeftModel

            wrapped = PeftModel.from_pretrained(self._model, str(adapter), is_trainable=False)
            try:
                return batches.example_losses(wrapped, self._tokenizer, self._held_out)
            finally:
                self._model = wrapped.unload()  # the plain base again, for the next adapter
