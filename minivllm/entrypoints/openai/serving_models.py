"""Which names a request's `model` may take: the base model's and the LoRA adapters'.

vLLM's `vllm/entrypoints/openai/serving_models.py` (0.6's `serving_engine.py` held the same):

    minivllm serve --enable-lora --lora-modules sql=/adapters/sql chat=/adapters/chat

serves the base model under its name and each adapter under its own; a request with
`"model": "sql"` runs through that adapter. `/v1/models` lists them all (an adapter's
`parent` is the base model). With LoRA on and, as in vLLM, the environment variable
VLLM_ALLOW_RUNTIME_LORA_UPDATING set (e.g. to 1), adapters come and go at run time:

    POST /v1/load_lora_adapter    {"lora_name": "sql", "lora_path": "/adapters/sql"}
    POST /v1/unload_lora_adapter  {"lora_name": "sql"}

(these read folders on the server, so with --api-key they need the key like every route).
Errors as in vLLM: 400 for a missing field, a bad name, a name already loaded, or an adapter
the engine refuses (the message says why; every path without a readable adapter config gets
the same one); 404 for unloading a name that is not loaded, or a request for an unknown
model. Every adapter gets a fresh `lora_int_id`: ids are never reused, so a re-loaded
adapter never meets a stale copy in the workers' caches.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Mapping
from dataclasses import dataclass

from minivllm.engine.protocol import EngineClient
from minivllm.entrypoints.openai.protocol import ModelCard, ModelList
from minivllm.entrypoints.openai.serving_engine import OpenAIError
from minivllm.lora.request import LoRARequest

RUNTIME_LORA_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
# A served name travels in every /v1/models answer and in log lines: short, printable text.
MAX_LORA_NAME_CHARS = 128


def runtime_lora_updating_allowed(environ: Mapping[str, str]) -> bool:
    """vLLM's switch for the run-time adapter routes: off unless set to 1/true/yes."""
    return environ.get(RUNTIME_LORA_UPDATING_ENV, "").strip().lower() in ("1", "true", "yes")


def check_lora_name(lora_name: str) -> None:
    """A name `/v1/models` can always list: 1-128 printable characters, valid UTF-8."""
    try:
        lora_name.encode("utf-8")
    except UnicodeEncodeError:
        raise OpenAIError("lora_name must be valid UTF-8 text.", param="lora_name") from None
    if not 0 < len(lora_name) <= MAX_LORA_NAME_CHARS or not lora_name.isprintable() or lora_name != lora_name.strip():
        raise OpenAIError(f"lora_name must be 1 to {MAX_LORA_NAME_CHARS} printable characters without "
                          "surrounding spaces.", param="lora_name")


@dataclass
class LoRAModulePath:
    name: str
    path: str


class OpenAIServingModels:
    """The served names: the base model's (`base_model_names`) and the adapters'."""

    def __init__(self, engine: EngineClient, base_model_names: list[str],
                 lora_modules: list[LoRAModulePath] | None = None) -> None:
        self.engine = engine
        self.base_model_names = base_model_names
        self.lora_requests: dict[str, LoRARequest] = {}
        self._next_id = itertools.count(1)
        if lora_modules and engine.engine_config.lora_config is None:
            raise ValueError("--lora-modules needs --enable-lora.")
        for module in lora_modules or []:
            request = self._new_request(module.name, module.path)  # a bad one stops the start-up
            self._add_to_engine(request)
            self.lora_requests[module.name] = request

    @property
    def lora_enabled(self) -> bool:
        return self.engine.engine_config.lora_config is not None

    def lora_request_for(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names; None for the base model; 404 if unknown."""
        if model is None or model in self.base_model_names:
            return None
        if model in self.lora_requests:
            return self.lora_requests[model]
        raise OpenAIError(f"The model `{model}` does not exist.", 404, param="model", code="model_not_found")

    def show_available_models(self, max_model_len: int) -> ModelList:
        # `root` is a served name, never a path on this machine.
        root = self.base_model_names[0]
        cards = [ModelCard(id=name, root=root, max_model_len=max_model_len) for name in self.base_model_names]
        cards += [ModelCard(id=name, root=name, parent=root, max_model_len=max_model_len)
                  for name in self.lora_requests]
        return ModelList(data=cards)

    async def load_lora_adapter(self, lora_name: str | None, lora_path: str | None) -> str:
        request = self._new_request(lora_name, lora_path)
        # Reading and checking the adapter's files takes a while (and the engine may be busy):
        # in a thread, the event loop keeps serving everybody else meanwhile.
        await asyncio.to_thread(self._add_to_engine, request)
        if lora_name in self.lora_requests:  # another call loaded the same name meanwhile
            await asyncio.to_thread(self.engine.remove_lora, request.lora_int_id)
            raise self._already_loaded(lora_name)
        self.lora_requests[lora_name] = request
        return f"Success: LoRA adapter '{lora_name}' added successfully."

    def _new_request(self, lora_name: str | None, lora_path: str | None) -> LoRARequest:
        """The adapter's request, its name checked; nothing is registered yet."""
        if not lora_name or not lora_path:
            raise OpenAIError("Both 'lora_name' and 'lora_path' must be provided.", param="lora_name")
        check_lora_name(lora_name)
        if lora_name in self.lora_requests or lora_name in self.base_model_names:
            raise self._already_loaded(lora_name)
        return LoRARequest(lora_name, next(self._next_id), lora_path)

    def _add_to_engine(self, request: LoRARequest) -> None:
        try:
            self.engine.add_lora(request)  # reads and checks the adapter's files
        except ValueError as error:
            raise OpenAIError(str(error), param="lora_path") from error

    @staticmethod
    def _already_loaded(lora_name: str) -> OpenAIError:
        return OpenAIError(f"The lora adapter '{lora_name}' has already been loaded.", param="lora_name")

    async def unload_lora_adapter(self, lora_name: str | None) -> str:
        if not lora_name:
            raise OpenAIError("'lora_name' must be provided.", param="lora_name")
        request = self.lora_requests.pop(lora_name, None)
        if request is None:
            raise OpenAIError(f"The lora adapter '{lora_name}' cannot be found.", 404, param="lora_name",
                              code="model_not_found")
        await asyncio.to_thread(self.engine.remove_lora, request.lora_int_id)
        return f"Success: LoRA adapter '{lora_name}' removed successfully."
