"""Server route ``GET /sjd/resolutions?model=NAME``: the sizes a loader choice supports.

The browser (``web/js/sjd_resolutions.js``) asks it when a sampler's model input is connected to a
loader, and narrows the sampler's resolution list to the answer. The sizes are read from the
checkpoint's config files (and, for a few families, its name); no weights are loaded.
"""

from __future__ import annotations

from ..sjd_core.models.registry import resolutions_on_disk
from .model_files import available_models, missing_model_message

ROUTE = "/sjd/resolutions"


def resolutions_for(model: str) -> tuple[int, dict]:
    """(HTTP status, JSON body) for the loader choice ``model``."""
    path = available_models().get(model)
    if path is None:
        return 404, {"model": model, "error": missing_model_message(model)}
    try:
        family, sizes = resolutions_on_disk(path)
    except (OSError, ValueError) as error:
        return 422, {"model": model, "error": f"{model!r} ({path}): {error}"}
    return 200, {"model": model, "family": family, "resolutions": [f"{w}x{h}" for w, h in sizes]}


def register(server_module) -> None:
    """Add the route to ComfyUI's running ``PromptServer``."""
    from aiohttp import web

    @server_module.PromptServer.instance.routes.get(ROUTE)
    async def resolutions(request: web.Request) -> web.Response:
        model = request.query.get("model", "")
        if not model:
            return web.json_response({"error": "query parameter 'model' is missing: ask "
                                      f"{ROUTE}?model=NAME with a name the SJD Model Loader lists."},
                                     status=400)
        status, body = resolutions_for(model)
        return web.json_response(body, status=status)
