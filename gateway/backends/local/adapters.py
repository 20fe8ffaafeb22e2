"""LoRA adapters on the embedded model: checking a folder, and the model wrapped in peft while any is loaded.

The model is wrapped in a ``PeftModel`` only while at least one adapter is loaded, so a gateway that never loads
one runs the plain model. One batch mixes rows for different adapters and for the base model: every forward
pass names each row's adapter (peft's ``adapter_names``, ``__base__`` for the base).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

from gateway.prompting import Rendering

if TYPE_CHECKING:  # peft is imported on the first load: it takes over a second, and most gateways never load one
    from peft import LoraConfig, PeftModel

_BASE = "__base__"  # peft's name, in ``adapter_names``, for a row that runs without an adapter
RENDERING_FILE = "rendering.json"  # in an adapter folder: the tool rendering it was trained with


@dataclass(frozen=True)
class Adapter:
    name: str  # as requests name it (``sql@3``)
    # peft's name for it: request names hold characters peft's module dicts refuse (``.``), and a name
    # reloaded while its previous weights still serve a request must not collide with them.
    internal: str
    path: str
    rendering: Rendering | None = None  # the tool rendering it was trained with; None: the backend's own


class AdapterLoadError(Exception):
    """An adapter folder that cannot be served; the message says why."""


def write_rendering(folder: Path, rendering: Rendering) -> None:
    """Record in an adapter folder the tool rendering its training data was written in, so it is served the same."""
    (folder / RENDERING_FILE).write_text(json.dumps({"rendering": rendering}) + "\n", encoding="utf-8")


def read_rendering(path: str | Path) -> Rendering | None:
    """The tool rendering the adapter folder ``path`` records; None when it records none (an adapter trained
    elsewhere). A record that names no known rendering cannot be served as trained, so it is refused."""
    file = Path(path) / RENDERING_FILE
    if not file.is_file():
        return None
    try:
        rendering = json.loads(file.read_text(encoding="utf-8")).get("rendering")
    except (OSError, ValueError, AttributeError) as exc:
        raise AdapterLoadError(f"cannot read {RENDERING_FILE}: {exc}") from exc
    if rendering not in get_args(Rendering):
        raise AdapterLoadError(f"{RENDERING_FILE} names an unknown tool rendering: {rendering!r}")
    return rendering


def lora_config(path: str) -> LoraConfig:
    """The LoRA config of the adapter folder ``path``, checked for what mixed-adapter batches support."""
    from peft import LoraConfig

    folder = Path(path)
    # peft takes a path that is not a local folder for a Hub repository id; never go looking there.
    if not folder.is_dir():
        raise AdapterLoadError("no such folder")
    if not (folder / "adapter_model.safetensors").is_file() and not (folder / "adapter_model.bin").is_file():
        raise AdapterLoadError("the folder holds no adapter_model.safetensors")
    try:
        raw = json.loads((folder / "adapter_config.json").read_text())
        peft_type = raw.get("peft_type") if isinstance(raw, dict) else None
        if peft_type != "LORA":
            raise AdapterLoadError(f"only LoRA adapters are served; this one is {peft_type or 'of no known type'}")
        config = LoraConfig.from_pretrained(str(folder))
    except (OSError, ValueError, TypeError) as exc:
        raise AdapterLoadError(f"cannot read adapter_config.json: {exc}") from exc
    # peft's mixed-adapter batches refuse both; better to say so now than fail a batch later.
    if config.use_dora:
        raise AdapterLoadError("DoRA adapters cannot share a batch with other adapters")
    if getattr(config, "target_parameters", None):
        raise AdapterLoadError("adapters on parameters (target_parameters) cannot share a batch")
    config.inference_mode = True
    return config


class LoraModel:
    """The base model and the adapters in it. Used on the engine thread only, never beside a forward pass.

    With ``merge_lone``, a batch whose rows all run one adapter runs it merged into the base weights (as fast as the
    base model), until a batch needs the base or another adapter: the weights are then unmerged first. One merge per
    evaluation of one adapter; for mixed traffic it would merge and unmerge at nearly every step, so it is off.
    """

    def __init__(self, base_model: Any, *, merge_lone: bool = False) -> None:
        self.base_model = base_model
        self.peft: PeftModel | None = None  # wraps base_model (in place) while any adapter is loaded
        self.adapters: set[str] = set()  # internal names of the adapters in the model
        self.merge_lone = merge_lone
        self.merged: str | None = None  # the adapter whose weights are in the base weights now
        self.merges = 0  # merges made, for tests and benchmarks

    def load(self, internal: str, path: str, config: LoraConfig) -> None:
        from peft import PeftModel

        first = self.peft is None
        self._unmerge()  # the LoRA layers change under a merge made before; the next batch of one adapter merges again
        try:
            if self.peft is None:
                self.peft = PeftModel(self.base_model, config, adapter_name=internal)
            # load_adapter skips creating an adapter the constructor already made, and returns the missing
            # tensors (which from_pretrained only warns about), so both paths share it.
            result = self.peft.load_adapter(path, adapter_name=internal, torch_device=str(self.base_model.device))
            if result.missing_keys:
                raise AdapterLoadError(f"its weights lack {len(result.missing_keys)} tensors its config asks for, "
                                       f"such as {result.missing_keys[0]}")
        except Exception:
            if first:
                self.unwrap()
            elif self.peft is not None and internal in self.peft.peft_config:
                self.peft.delete_adapter(internal)
            raise
        self.peft.eval()  # peft refuses adapter_names in training mode
        self.adapters.add(internal)

    def delete(self, internal: str) -> None:
        self.adapters.discard(internal)
        assert self.peft is not None
        if self.merged == internal:
            self._unmerge()
        if not self.adapters:
            self.unwrap()  # back to the plain model: as fast as before any adapter was loaded
            return
        if self.peft.active_adapter == internal:
            # peft warns when the active adapter is deleted; no forward pass relies on which one is active
            # (each names its rows' adapters), so hand the role to a survivor first.
            self.peft.set_adapter(next(iter(self.adapters)))
        self.peft.delete_adapter(internal)

    def unwrap(self) -> None:
        from peft.tuners.tuners_utils import BaseTunerLayer

        if self.peft is not None:
            self._unmerge()  # unload() drops the LoRA layers as they are: merged weights would stay in the base
            self.peft.unload()
        # A wrap that failed halfway leaves LoRA layers in the model with no PeftModel to unload them.
        for name, module in list(self.base_model.named_modules()):
            if isinstance(module, BaseTunerLayer):
                parent, _, child = name.rpartition(".")
                setattr(self.base_model.get_submodule(parent), child, module.get_base_layer())
        self.peft = None
        self.adapters.clear()

    def __call__(self, adapters: list[Adapter | None], **inputs: Any) -> Any:
        """One forward pass; ``adapters`` names each row's adapter (None: the base model)."""
        if self.peft is None:
            return self.base_model(**inputs)
        names = [_BASE if a is None else a.internal for a in adapters]
        lone = names[0] != _BASE and names.count(names[0]) == len(names)
        if lone and self.merge_lone:
            if self.merged != names[0]:
                self._merge(names[0])
            return self.peft(**inputs)
        self._unmerge()
        if lone:
            # Every row on one adapter (an evaluation's batches): peft's own path for its active adapter skips the
            # mixed path's per-module hooks and per-adapter gathers and scatters, a decoding step about 13% faster.
            if self.peft.active_adapter != names[0]:
                self.peft.set_adapter(names[0], inference_mode=True)
            return self.peft(**inputs)
        # Without adapter_names peft would apply its active adapter to every row, base rows included.
        return self.peft(**inputs, adapter_names=names)

    def _merge(self, internal: str) -> None:
        assert self.peft is not None
        self._unmerge()
        self.peft.set_adapter(internal, inference_mode=True)
        self.peft.merge_adapter([internal])
        self.merged = internal
        self.merges += 1

    def _unmerge(self) -> None:
        # Subtracting the delta again gives the float32 weights back to within a rounding of each, and holds no copy
        # of them (a copy of every adapted weight: 0.4 GB more at the peak of an evaluation).
        if self.merged is not None and self.peft is not None:
            self.peft.unmerge_adapter()
        self.merged = None
