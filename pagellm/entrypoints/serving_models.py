"""The served model names: the base model and its LoRA adapters."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from pagellm.engine.protocol import EngineClient
from pagellm.entrypoints.openai_protocol import APIError
from pagellm.lora_request import LoRAInUse, LoRARequest


class OpenAIServingModels:
    """The names this server answers to (vLLM's ``OpenAIServingModels``): the base model and its LoRA
    adapters, picked by a request's ``model``. The engine holds the truth; this front end's view is
    refreshed from it on a miss (another front end may have loaded an adapter)."""

    def __init__(self, engine: EngineClient, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.max_model_len = engine.max_model_len
        self.loras: dict[str, LoRARequest] = {r.lora_name: r for r in engine.lora("list") or []}

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The adapter ``model`` names (``None``: the base model); 404 for an unknown name."""
        if model is None or model == self.model_name:
            return None
        lora = self.loras.get(model)
        if lora is None:
            registered = self.engine.lora("list")  # another front end may have loaded it (None: no LoRA)
            if registered is not None:
                self.loras = {r.lora_name: r for r in registered}
                lora = self.loras.get(model)
        if lora is None:
            raise APIError(f"The model `{model}` does not exist.", 404, "NotFoundError", "model", "model_not_found")
        return lora

    async def load_lora(self, name: str, path: str) -> dict[str, Any]:
        """Register an adapter under ``name`` (the next free id); ``APIError`` 400 if it cannot be served."""
        registered = await asyncio.to_thread(self.engine.lora, "list")  # None: the engine runs without LoRA
        if registered is None:
            raise APIError("this server runs without LoRA: start it with --enable-lora", 400, param="lora_name")
        if name == self.model_name or name in {r.lora_name for r in registered}:
            raise APIError(f"the name {name!r} is already in use", 400, param="lora_name")
        request = LoRARequest(name, max([r.lora_int_id for r in registered], default=0) + 1, path)
        try:
            await asyncio.to_thread(self.engine.lora, "add", request)
        except ValueError as e:
            raise APIError(str(e), 400, param="lora_path") from e
        self.loras[name] = request
        return {"status": "ok", "lora_name": name, "lora_int_id": request.lora_int_id}

    async def unload_lora(self, name: str) -> dict[str, Any]:
        """Unregister an adapter; 409 while requests using it run (they are never cut short)."""
        lora = self.check_model(name)  # 404 for an unknown name
        if lora is None:  # the base model's name
            raise APIError(f"{name!r} is not a LoRA adapter", 404, "NotFoundError", "lora_name")
        try:
            await asyncio.to_thread(self.engine.lora, "remove", lora.lora_int_id)
        except LoRAInUse as e:
            raise APIError(str(e), 409, "ConflictError", "lora_name") from e
        self.loras.pop(lora.lora_name, None)
        return {"status": "ok", "lora_name": lora.lora_name}

    async def list_models(self) -> dict[str, Any]:
        now = int(time.time())
        loras = await asyncio.to_thread(self.engine.lora, "list") or []
        return {"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": now, "owned_by": "pagellm",
             "root": self.model_name, "parent": None, "max_model_len": self.max_model_len},
            *({"id": r.lora_name, "object": "model", "created": now, "owned_by": "pagellm", "root": r.lora_path,
               "parent": self.model_name, "max_model_len": self.max_model_len} for r in loras)]}
