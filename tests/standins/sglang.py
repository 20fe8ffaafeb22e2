"""A stand-in for an SGLang server started with ``--enable-lora`` (behaviour read from SGLang 0.5.21's source).

Routes, bodies and status codes as the real server answers them:

- ``POST /load_lora_adapter`` ``{"lora_name", "lora_path", "pinned"}`` and ``POST /unload_lora_adapter``
  ``{"lora_name"}`` (``entrypoints/http_server.py``) answer a ``LoRAUpdateOutput`` (``managers/io_struct.py``):
  ``{"rid": null, "http_worker_ipc": null, "success", "error_message", "loaded_adapters"}``, 200 on success
  (``error_message`` ``""``, ``loaded_adapters`` name → path of every adapter now loaded), else 400.
  Loading checks the folder first (``lora/lora_config.py``: a missing ``adapter_config.json`` fails with the
  ``FileNotFoundError`` text), then the name (``lora/lora_manager.py``: ``Failed to load LoRA adapter X because it
  is already loaded``). Unloading an unknown name fails with ``LoRA with name X does not exist. Loaded LoRAs:
  odict_keys([...])`` (``lora/lora_registry.py``) and ``loaded_adapters`` null. An unload first stops new requests
  from using the adapter, then waits for its running requests to finish (``wait_for_unload``) before answering.
- With ``--max-loaded-loras``, a load past the limit evicts the least recently used unpinned adapter
  (``managers/tokenizer_control_mixin.py``).
- ``POST /v1/chat/completions`` names the adapter as ``model: "base:adapter"`` (``openai/serving_base.py``
  ``_parse_model_parameter``; the base part is not checked) or with the ``lora_path`` field. An adapter that was
  loaded once since the start but is not loaded now (unloaded or evicted) is loaded again on the spot
  (``managers/tokenizer_manager.py`` ``_resolve_lora_path``, from ``lora_ref_cache``); one never loaded answers
  400 ``{"object": "error", "message": "Got LoRA adapter that has never been loaded: X\\nAll loaded adapters:
  dict_keys([...]).", "type": "BadRequestError", "param": null, "code": 400}`` (no ``{"error": ...}`` envelope),
  streamed or not. The answer's ``model`` is the request's.
- ``GET /v1/models`` lists the base (``id`` and ``root`` the served name) and, with LoRA enabled, one card per
  loaded adapter: ``{"id": name, "root": path, "parent": served name, "max_model_len": null}``.
- ``GET /get_model_info`` (deprecated alias of ``/model_info``), ``GET /health`` (200, empty body).

``restart()`` (or ``POST /_standin/restart``) forgets every runtime-loaded adapter, as a restarted server does;
adapters given at start (``lora_paths``) come back.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from tests.standins.common import BASE, LoRAServerStandIn, base_parser, json_response, run


def _odict_keys(names: Any) -> str:
    return repr(OrderedDict.fromkeys(names).keys())


def _update_output(success: bool, error_message: str, loaded_adapters: dict[str, str] | None) -> dict[str, Any]:
    return {"rid": None, "http_worker_ipc": None, "success": success, "error_message": error_message,
            "loaded_adapters": loaded_adapters}


def _openai_error(message: str, status: int = 400, err_type: str = "BadRequestError") -> Response:
    return json_response({"object": "error", "message": message, "type": err_type, "param": None,
                          "code": status}, status)


class SGLangStandIn(LoRAServerStandIn):
    def __init__(self, model_path: str = "stand-in/base-model", served_model_name: str | None = None, *,
                 enable_lora: bool = True, lora_paths: dict[str, str] | None = None,
                 max_loaded_loras: int | None = None, max_loras_per_batch: int = 8,
                 max_lora_rank: int | None = None, tool_call_parser: str | None = None,
                 context_length: int = 32768) -> None:
        self.enable_lora = enable_lora or bool(lora_paths)
        self.lora_paths = dict(lora_paths or {})
        self.max_loaded_loras = max_loaded_loras
        self.max_loras_per_batch = max_loras_per_batch
        self.max_lora_rank = max_lora_rank
        self.tool_call_parser = tool_call_parser
        self.pinned: set[str] = set()
        self.known: dict[str, tuple[str, bool]] = {}
        """Every adapter loaded since the start, name → (path, pinned): SGLang's ``lora_ref_cache``."""
        self.implicit_loads: list[str] = []
        self.evicted: list[str] = []
        self._update_lock = asyncio.Lock()
        super().__init__(model_path, served_model_name, context_length)
        self.restart()

    def routes(self) -> list[Route]:
        return [Route("/health", self.health, methods=["GET"]),
                Route("/health_generate", self.health, methods=["GET"]),
                Route("/get_model_info", self.model_info, methods=["GET"]),
                Route("/model_info", self.model_info, methods=["GET"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/models/{model:path}", self.model, methods=["GET"]),
                Route("/load_lora_adapter", self.load, methods=["POST"]),
                Route("/unload_lora_adapter", self.unload, methods=["POST"]),
                Route("/v1/chat/completions", self.chat, methods=["POST"])]

    def restart(self) -> None:
        for name, path in self.lora_paths.items():
            if problem := self._check_folder(path):
                raise ValueError(f"Failed to load LoRA adapter {name}: {problem}")
        self.loaded = dict(self.lora_paths)
        self.known = {name: (path, False) for name, path in self.lora_paths.items()}
        self.pinned.clear()

    # -- probes ----------------------------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        await self.read(request)
        return Response(status_code=200 if self.healthy else 503)

    async def model_info(self, request: Request) -> Response:
        await self.read(request)
        return json_response({
            "model_path": self.model_path, "served_model_name": self.served_model_name,
            "tokenizer_path": self.model_path, "is_generation": True, "preferred_sampling_params": None,
            "weight_version": "default", "load_format": "auto", "reasoning_parser": None,
            "tool_call_parser": self.tool_call_parser, "disaggregation_mode": "null",
            "has_image_understanding": False, "has_audio_understanding": False,
            "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]})

    def _card(self, id_: str, root: str, parent: str | None, max_model_len: int | None) -> dict[str, Any]:
        return {"id": id_, "object": "model", "created": int(time.time()), "owned_by": "sglang", "root": root,
                "parent": parent, "max_model_len": max_model_len}

    async def models(self, request: Request) -> Response:
        await self.read(request)
        cards = [self._card(self.served_model_name, self.served_model_name, None, self.context_length)]
        if self.enable_lora:
            cards += [self._card(name, path, self.served_model_name, None) for name, path in self.loaded.items()]
        return json_response({"object": "list", "data": cards})

    async def model(self, request: Request) -> Response:
        await self.read(request)
        model = request.path_params["model"]
        if model != self.served_model_name:
            return json_response({"error": {"message": f"The model '{model}' does not exist",
                                            "type": "invalid_request_error", "param": "model",
                                            "code": "model_not_found"}}, 404)
        return json_response(self._card(model, model, None, self.context_length))

    # -- loading and unloading -------------------------------------------------------------------------------

    @staticmethod
    def _check_folder(path: str) -> str | None:
        """What reading the adapter's config fails with (``LoRAConfig``), or None."""
        if not os.path.isdir(path):
            # SGLang takes a path that is not a folder for a Hugging Face repo id and tries to download it.
            return (f"Repo id must be in the form 'repo_name' or 'namespace/repo_name': '{path}'. "
                    "Use `repo_type` argument if needed.")
        config_file = os.path.join(path, "adapter_config.json")
        try:
            config = json.loads(Path(config_file).read_text())
        except FileNotFoundError:
            return f"[Errno 2] No such file or directory: '{config_file}'"
        except ValueError as exc:
            return str(exc)
        if not isinstance(config, dict):
            return "adapter_config.json does not hold a JSON object"
        for key in ("target_modules", "r", "lora_alpha"):
            if key not in config:
                return repr(key)
        return None

    def _check_new(self, name: str, path: str, pinned: bool) -> str | None:
        if problem := self._check_folder(path):
            return problem
        config = json.loads(Path(path, "adapter_config.json").read_text())
        if config.get("use_dora"):
            return f"Failed to load {name} because LoRA serving currently doesn't support DoRA adapters"
        if name in self.loaded:
            return f"Failed to load LoRA adapter {name} because it is already loaded"
        if self.max_lora_rank is not None and int(config["r"]) > self.max_lora_rank:
            return (f"LoRA adapter {name} with rank {config['r']} is incompatible with the current LoRA memory pool "
                    "configuration. Please ensure that the LoRA adapter's rank is within the configured "
                    "`--max-lora-rank` and that the target modules are included in `--lora-target-modules`.")
        if pinned and len(self.pinned) >= self.max_loras_per_batch - 1:
            return (f"Failed to load LoRA adapter {name} as a pinned adapter. It is not allowed to pin all slots "
                    "in the LoRA memory pool to avoid starvation for unpinned adapters and base models. Please "
                    "increase your `--max-loras-per-batch` or load it as unpinned LoRA adapters.")
        return None

    async def _load(self, name: str, path: str, pinned: bool) -> dict[str, Any]:
        if not self.enable_lora:
            return _update_output(False, "LoRA is not enabled. Please set `--enable-lora` to enable LoRA.", None)
        async with self._update_lock:
            if problem := self._check_new(name, path, pinned):
                return _update_output(False, problem, dict(self.loaded))
            self.loaded[name] = path
            self.known[name] = (path, pinned)
            if pinned:
                self.pinned.add(name)
            result = _update_output(True, "", dict(self.loaded))
            while self.max_loaded_loras is not None and len(self.loaded) > self.max_loaded_loras:
                lru = next((n for n in self.loaded if n not in self.pinned), None)
                if lru is None:
                    return _update_output(False, "Didn't find any LoRA adapters when trying to evict LRU LoRA "
                                          "adapter.", None)
                await self._drop(lru)
                self.evicted.append(lru)
                del result["loaded_adapters"][lru]
            return result

    async def _drop(self, name: str) -> None:
        """Stop new requests from using ``name``, wait until its running ones are done, then free it."""
        del self.loaded[name]
        self.pinned.discard(name)
        await self.wait_idle(name)

    async def load(self, request: Request) -> Response:
        body = await self.read(request)
        if problem := _missing(body, ("lora_name", "lora_path")):
            return problem
        result = await self._load(str(body["lora_name"]), str(body["lora_path"]), bool(body.get("pinned")))
        return json_response(result, 200 if result["success"] else 400)

    async def unload(self, request: Request) -> Response:
        body = await self.read(request)
        if problem := _missing(body, ("lora_name",)):
            return problem
        name = str(body["lora_name"])
        self.note_unload(name)
        if not self.enable_lora:
            result = _update_output(False, "LoRA is not enabled. Please set `--enable-lora` to enable LoRA.", None)
        else:
            async with self._update_lock:
                if name not in self.loaded:
                    result = _update_output(False, f"LoRA with name {name} does not exist. Loaded LoRAs: "
                                            f"{_odict_keys(self.loaded)}", None)
                else:
                    await self._drop(name)
                    result = _update_output(True, "", dict(self.loaded))
        return json_response(result, 200 if result["success"] else 400)

    # -- chat ------------------------------------------------------------------------------------------------

    def add_tokens(self, body: dict[str, Any], answer: dict[str, Any], ids: list[int], logprobs: list[float]) -> None:
        """``return_prompt_token_ids``: the choice's ``prompt_token_ids``; ``return_meta_info``: its ``meta_info``,
        whose ``output_token_logprobs`` are ``[logprob, id, None]`` (text only with ``return_text_in_logprobs``)."""
        choice = answer["choices"][0]
        if body.get("return_prompt_token_ids"):
            choice["prompt_token_ids"] = list(range(1, 11))
        if body.get("return_meta_info"):
            choice["meta_info"] = {"id": answer["id"], "prompt_tokens": 10, "completion_tokens": len(ids),
                                   "output_token_logprobs": [[lp, i, None] for lp, i in zip(logprobs, ids,
                                                                                             strict=True)]}

    def parse_model(self, model: str) -> tuple[str, str | None]:
        """``base:adapter`` → (base, adapter); the served name itself may contain colons."""
        if ":" not in model or model == self.served_model_name:
            return model, None
        if model.startswith(self.served_model_name + ":"):
            base, adapter = self.served_model_name, model[len(self.served_model_name) + 1:]
        else:
            base, adapter = model.split(":", 1)
        return base.strip(), adapter.strip() or None

    async def chat(self, request: Request) -> Response:
        body = await self.read(request)
        if not isinstance(body, dict) or not body.get("messages"):
            return _openai_error("Messages cannot be empty.")
        model = str(body.get("model") or "default")
        adapter = self.parse_model(model)[1] or body.get("lora_path")
        if adapter:
            adapter = str(adapter)
            if not self.enable_lora:
                return _openai_error(f"LoRA adapter '{adapter}' was requested, but LoRA is not enabled. Please launch "
                                     "the server with --enable-lora flag and preload adapters using --lora-paths or "
                                     "/load_lora_adapter endpoint.")
            if adapter not in self.loaded:
                if adapter not in self.known:
                    return _openai_error(f"Got LoRA adapter that has never been loaded: {adapter}\n"
                                         f"All loaded adapters: {dict.fromkeys(self.known).keys()}.")
                path, pinned = self.known[adapter]
                result = await self._load(adapter, path, pinned)
                if not result["success"] and "already loaded" not in result["error_message"]:
                    return _openai_error(f"Failed to implicitly load LoRA adapter {adapter}: "
                                         f"{result['error_message']}")
                self.implicit_loads.append(adapter)
            if adapter not in self.loaded:
                return _openai_error(f"The following requested LoRA adapters are not loaded: {adapter}\n"
                                     f"Loaded adapters: {_odict_keys(self.loaded)}.")
            self.loaded[adapter] = self.loaded.pop(adapter)  # most recently used goes last
        return await self.answer(body, adapter or BASE, model)


def _missing(body: Any, fields: tuple[str, ...]) -> Response | None:
    """SGLang answers a body that fails validation with 400 in its legacy error shape."""
    if not isinstance(body, dict):
        return _openai_error("Input should be a valid dictionary or instance of the request")
    for field in fields:
        if not isinstance(body.get(field), str):
            return _openai_error(f"1 validation error:\n  body.{field}: Field required")
    return None


def _lora_paths(values: list[str]) -> dict[str, str]:
    """``--lora-paths`` entries: ``PATH``, ``NAME=PATH`` or ``{"lora_name", "lora_path", "pinned"}``."""
    paths: dict[str, str] = {}
    for value in values:
        value = value.strip()
        if value.startswith("{"):
            entry = json.loads(value)
            paths[entry["lora_name"]] = entry["lora_path"]
        else:
            name, sep, path = value.partition("=")
            paths[name if sep else value] = path if sep else value
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = base_parser("python -m tests.standins.sglang")
    parser.add_argument("--model-path", "--model", dest="model_path", required=True)
    parser.add_argument("--served-model-name")
    parser.add_argument("--enable-lora", action="store_true")
    parser.add_argument("--lora-paths", nargs="*", default=[])
    parser.add_argument("--max-loaded-loras", type=int)
    parser.add_argument("--max-loras-per-batch", type=int, default=8)
    parser.add_argument("--max-lora-rank", type=int)
    parser.add_argument("--tool-call-parser")
    parser.add_argument("--context-length", type=int, default=32768)
    args, ignored = parser.parse_known_args(argv)
    standin = SGLangStandIn(args.model_path, args.served_model_name, enable_lora=args.enable_lora,
                            lora_paths=_lora_paths(args.lora_paths), max_loaded_loras=args.max_loaded_loras,
                            max_loras_per_batch=args.max_loras_per_batch, max_lora_rank=args.max_lora_rank,
                            tool_call_parser=args.tool_call_parser, context_length=args.context_length)
    run(standin.app, args.host, args.port, ignored)


if __name__ == "__main__":
    main(sys.argv[1:])
