"""The playground page: `GET /` and `GET /playground` serve static/playground.html, `/playground/static/*` its script,
style and example media, and `GET /v1/playground/info` (behind --api-key like all of /v1) tells the page which
media the model takes and whether it is the embedded demo model. `--disable-playground` leaves all of it out.
"""

from __future__ import annotations

import os

from fastapi import FastAPI
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

from vlserve import demo
from vlserve.api.serving_base import ServedModels

STATIC_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
PAGE = os.path.join(STATIC_DIR, "playground.html")


def is_demo_model(model_path: str | None) -> bool:
    """True when `model_path` is the embedded demo checkpoint (the page then says what that model knows)."""
    return model_path is not None and os.path.realpath(model_path) == os.path.realpath(demo.MODEL_DIR)


def install_playground(app: FastAPI, models: ServedModels, modalities: tuple[str, ...]) -> None:
    """Add the page, its static files and its info endpoint to `app`."""
    info = {
        "models": list(models.names),
        "modalities": list(modalities),
        "demo": is_demo_model(models.root),
        "max_model_len": models.max_model_len,
    }

    async def page() -> FileResponse:
        """The playground page (no caching, so an upgraded server serves its own page)."""
        return FileResponse(PAGE, media_type="text/html", headers={"Cache-Control": "no-cache"})

    app.add_api_route("/", page, methods=["GET"], include_in_schema=False)
    app.add_api_route("/playground", page, methods=["GET"], include_in_schema=False)
    app.mount("/playground/static", StaticFiles(directory=STATIC_DIR), name="playground-static")

    @app.get("/v1/playground/info", include_in_schema=False)
    async def playground_info() -> JSONResponse:
        """What the page needs beyond /v1/models: the modalities the model takes and whether it is the demo."""
        return JSONResponse(info)
