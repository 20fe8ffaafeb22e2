"""A stand-in for a vLLM OpenAI server started with ``--enable-lora`` (behaviour read from vLLM 0.33.0's source).

Routes, bodies and status codes as the real server answers them:

- ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path", "load_inplace"}`` and ``POST /v1/unload_lora_adapter``
  ``{"lora_name"}`` exist only when the server runs with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``
  (``entrypoints/serve/lora/api_router.py``; otherwise 404). Success is 200 with a plain-text body,
  ``Success: LoRA adapter 'X' added successfully.`` / ``... removed successfully.``. Failures
  (``entrypoints/openai/models/serving.py``) use ``{"error": {"message", "type", "param", "code"}}``: a name
  already loaded → 400 ``InvalidUserInput`` ``The lora adapter 'X' has already been loaded. ...`` (unless
  ``load_inplace``); a folder without ``adapter_config.json`` → 404 ``NotFoundError`` ``Loading lora X failed: No
  adapter found for PATH`` (``lora/worker_manager.py``, ``exceptions.py``); unloading an unknown name → 404
  ``NotFoundError`` ``The lora adapter 'X' cannot be found.``. Unloading does not wait for running requests.
- ``POST /v1/chat/completions`` names an adapter by its own name as ``model``. An unknown model → 404
  ``{"error": {"message": "The model `X` does not exist. Valid aliases: BASE.", "type": "NotFoundError",
  "param": "model", "code": 404}}`` (``entrypoints/serve/engine/serving.py`` ``_check_model``). The answer's
  ``model`` is the adapter's name, or the first served name for the base.
- ``GET /v1/models`` (``owned_by: "vllm"``): the base (``root`` the model path) and one card per loaded adapter,
  ``{"id": name, "root": path, "parent": base served name, "max_model_len": null, "permission": [...]}``.
- ``GET /health``: 200, empty body.

``restart()`` (or ``POST /_standin/restart``) forgets every runtime-loaded adapter; ``--lora-modules`` come back.

Its prefix cache is kept per adapter name, and an in-place reload (``load_inplace``) does not clear it, as users of
vLLM report: the answers of a name reloaded in place still come from the weights it was first served with
(``weights_of``).
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from tests.standins.common import BASE, LoRAServerStandIn, base_parser, json_response, run


def _error(message: str, err_type: str, status: int, param: str | None = None) -> Response:
    return json_response({"error": {"message": message, "type": err_type, "param": param, "code": status}}, status)


def _permission() -> dict[str, Any]:
    return {"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission", "created": int(time.time()),
            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False, "organization": "*",
            "group": None, "is_blocking": False}


class VLLMStandIn(LoRAServerStandIn):
    def __init__(self, model_path: str = "stand-in/base-model", served_model_name: str | list[str] | None = None, *,
                 allow_runtime_lora_updating: bool = True, lora_modules: dict[str, str] | None = None,
                 max_model_len: int = 32768) -> None:
        names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or [])
        self.served_model_names = names or [model_path]
        self.allow_runtime_lora_updating = allow_runtime_lora_updating
        self.lora_modules = dict(lora_modules or {})
        super().__init__(model_path, self.served_model_names[0], max_model_len)
        self.restart()

    def routes(self) -> list[Route]:
        routes = [Route("/health", self.health, methods=["GET"]),
                  Route("/v1/models", self.models, methods=["GET"]),
                  Route("/v1/chat/completions", self.chat, methods=["POST"])]
        if self.allow_runtime_lora_updating:
            routes += [Route("/v1/load_lora_adapter", self.load, methods=["POST"]),
                       Route("/v1/unload_lora_adapter", self.unload, methods=["POST"])]
        return routes

    def restart(self) -> None:
        self.loaded = dict(self.lora_modules)
        self.prefix_cache: dict[str, str] = {}  # adapter name -> the weights its cached prefixes were computed with

    def weights_of(self, served: str) -> str | None:
        if served not in self.loaded:
            return None
        return self.prefix_cache.setdefault(served, self.loaded[served])

    def add_tokens(self, body: dict[str, Any], answer: dict[str, Any], ids: list[int], logprobs: list[float]) -> None:
        """``return_token_ids``: the response's ``prompt_token_ids`` and the choice's ``token_ids``."""
        if body.get("return_token_ids"):
            answer["prompt_token_ids"] = list(range(1, 11))
            answer["choices"][0]["token_ids"] = ids

    async def health(self, request: Request) -> Response:
        await self.read(request)
        return Response(status_code=200 if self.healthy else 503)

    def _card(self, id_: str, root: str, parent: str | None, max_model_len: int | None) -> dict[str, Any]:
        return {"id": id_, "object": "model", "created": int(time.time()), "owned_by": "vllm", "root": root,
                "parent": parent, "max_model_len": max_model_len, "permission": [_permission()]}

    async def models(self, request: Request) -> Response:
        await self.read(request)
        cards = [self._card(name, self.model_path, None, self.context_length) for name in self.served_model_names]
        cards += [self._card(name, path, self.served_model_name, None) for name, path in self.loaded.items()]
        return json_response({"object": "list", "data": cards})

    async def load(self, request: Request) -> Response:
        body = await self.read(request)
        if problem := _invalid(body, ("lora_name", "lora_path")):
            return problem
        name, path = body["lora_name"], body["lora_path"]
        if not name or not path:
            return _error("Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput", 400)
        if name in self.served_model_names:
            return _error(f"The lora adapter '{name}' conflicts with a served base model.", "InvalidUserInput", 400)
        if not body.get("load_inplace") and name in self.loaded:
            return _error(f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in "
                          "place, set 'load_inplace' to True.", "InvalidUserInput", 400)
        if not os.path.isfile(os.path.join(path, "adapter_config.json")):
            return _error(f"Loading lora {name} failed: No adapter found for {path}", "NotFoundError", 404)
        self.loaded[name] = path
        return Response(f"Success: LoRA adapter '{name}' added successfully.", status_code=200)

    async def unload(self, request: Request) -> Response:
        body = await self.read(request)
        if problem := _invalid(body, ("lora_name",)):
            return problem
        name = body["lora_name"]
        self.note_unload(name)
        if not name:
            return _error("'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput", 400)
        if name not in self.loaded:
            return _error(f"The lora adapter '{name}' cannot be found.", "NotFoundError", 404)
        del self.loaded[name]
        self.prefix_cache.pop(name, None)
        return Response(f"Success: LoRA adapter '{name}' removed successfully.", status_code=200)

    async def chat(self, request: Request) -> Response:
        body = await self.read(request)
        if problem := _invalid(body, ("messages",), kind=list):
            return problem
        model = body.get("model")
        if not model or model in self.served_model_names:
            return await self.answer(body, BASE, self.served_model_name)
        if model in self.loaded:
            return await self.answer(body, model, model)
        return _error(f"The model `{model}` does not exist. Valid aliases: {', '.join(self.served_model_names)}.",
                      "NotFoundError", 404, param="model")


def _invalid(body: Any, fields: tuple[str, ...], kind: type = str) -> Response | None:
    """vLLM answers a body that fails validation with 400, type ``Bad Request``, naming the field."""
    if not isinstance(body, dict):
        return _error("1 validation error:\n  body: Input should be a valid dictionary", "Bad Request", 400, "body")
    for field in fields:
        if not isinstance(body.get(field), kind):
            return _error(f"1 validation error:\n  body.{field}: Field required", "Bad Request", 400,
                          f"body.{field}")
    return None


def _lora_modules(values: list[str]) -> dict[str, str]:
    """``--lora-modules`` entries: ``NAME=PATH`` or ``{"name", "path", "base_model_name"}``."""
    modules: dict[str, str] = {}
    for value in values:
        if value.strip().startswith("{"):
            entry = json.loads(value)
            modules[entry["name"]] = entry["path"]
        else:
            name, _, path = value.partition("=")
            modules[name] = path
    return modules


def main(argv: list[str]) -> None:
    """``python -m tests.standins.vllm [MODEL] --port P [--model M] [--served-model-name N ...] ...``, as
    ``vllm serve``; the runtime LoRA routes exist only with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` set to 1 or true."""
    positional = argv[0] if argv and not argv[0].startswith("-") else None
    parser = base_parser("python -m tests.standins.vllm")
    parser.add_argument("--model", default=positional)
    parser.add_argument("--served-model-name", nargs="+")
    parser.add_argument("--lora-modules", nargs="+", default=[])
    parser.add_argument("--max-model-len", type=int, default=32768)
    args, ignored = parser.parse_known_args(argv[1:] if positional else argv)
    if not args.model:
        parser.error("give the model, as the first argument or --model")
    allow = os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0").strip().lower() in ("1", "true")
    standin = VLLMStandIn(args.model, args.served_model_name, allow_runtime_lora_updating=allow,
                          lora_modules=_lora_modules(args.lora_modules), max_model_len=args.max_model_len)
    run(standin.app, args.host, args.port, ignored)


if __name__ == "__main__":
    main(sys.argv[1:])
