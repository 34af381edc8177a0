"""LoRA adapters as served models (vLLM's surface): `--lora-modules name=path` adapters are models a request names
(`"model": "<adapter name>"`); `/v1/models` lists each with `"parent"` = the base model's id; with
`VLSERVE_ALLOW_RUNTIME_LORA_UPDATING=1`, `POST /v1/load_lora_adapter {"lora_name", "lora_path"}` and
`POST /v1/unload_lora_adapter {"lora_name"}` add and drop adapters at runtime (without it those routes are 404s).

Every adapter is loaded into the engine(s) when it is registered (`AsyncLLM.add_lora`: a control call that reaches
an engine process too), so a bad directory is the loader's 400, never a failed step. Adapter ids are handed out
here, increasing, never reused: the KV prefix cache keys blocks by them.
"""

from __future__ import annotations

import os

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from vlserve.api.errors import APIError
from vlserve.api.serving_base import ServedModels
from vlserve.lora.request import LoRARequest
from vlserve.shorten import shorten

RUNTIME_LORA_ENV = "VLSERVE_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_lora_updating_allowed() -> bool:
    """Whether the load / unload routes are on ($VLSERVE_ALLOW_RUNTIME_LORA_UPDATING is 1 or true)."""
    return os.environ.get(RUNTIME_LORA_ENV, "").strip().lower() in ("1", "true")


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


async def load_adapter(engine, models: ServedModels, name: str, path: str) -> LoRARequest:
    """Register adapter `name` at `path` and load it into the engine; APIError 400 when the name is taken (by the
    base model or another adapter), LoRA is off, or the directory is not a usable adapter."""
    if not name or not path:
        raise APIError("both lora_name and lora_path must be non-empty", 400)
    if name in models.names or name in models.loras:
        raise APIError(f"The lora adapter {shorten(name)} has already been loaded.", 400, "lora_name")
    request = LoRARequest(name, models.next_lora_id(), os.path.expanduser(path))
    models.loras[name] = request  # reserved now: a concurrent load of the same name is refused
    try:
        await engine.add_lora(request)
    except ValueError as e:
        del models.loras[name]
        raise APIError(f"cannot load LoRA adapter {shorten(name)}: {e}", 400, "lora_path") from None
    return request


async def unload_adapter(engine, models: ServedModels, name: str) -> None:
    """Drop adapter `name` (404 when no adapter has that name); requests still running with it finish with it."""
    request = models.loras.pop(name, None)
    if request is None:
        raise APIError(f"The lora adapter {shorten(name)} cannot be found.", 404, "lora_name")
    await engine.remove_lora(request.lora_int_id)


def install_lora_routes(app: FastAPI, engine, models: ServedModels) -> None:
    """The runtime load / unload routes (call only when `runtime_lora_updating_allowed()`)."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        await load_adapter(engine, models, body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        await unload_adapter(engine, models, body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
