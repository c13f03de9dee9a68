"""Server route ``GET /sjd/resolutions?model=NAME``: the sizes a loader choice supports.

The browser (``web/js/sjd_resolutions.js``) asks it when a sampler's model input is connected to a
loader, and narrows the sampler's resolution list to the answer. The sizes are read from the
checkpoint's config files (and, for a few families, its name); no weights are loaded.
"""

from __future__ import annotations

import asyncio

from ..sjd_core.messages import first_line, quote
from ..sjd_core.models.registry import resolutions_on_disk
from .model_files import available_models, missing_model_message

ROUTE = "/sjd/resolutions"
TIME_LIMIT = 10.0  # seconds the route waits for the file system before it answers 504


def resolutions_for(model: str) -> tuple[int, dict]:
    """(HTTP status, JSON body) for the loader choice ``model``. A checkpoint that is not
    installed (a family template opened before its download) is an answer, not a failed request:
    200 with ``resolutions`` null and the message, so the page logs no error for it."""
    path = available_models().get(model)
    if path is None:
        return 200, {"model": quote(model), "resolutions": None,
                     "error": missing_model_message(model)}
    try:
        family, sizes = resolutions_on_disk(path)
    except (OSError, ValueError) as error:
        return 422, {"model": model, "error": f"{quote(model)} ({quote(str(path))}): {first_line(error)}"}
    return 200, {"model": model, "family": family, "resolutions": [f"{w}x{h}" for w, h in sizes]}


async def resolutions_answer(model: str, time_limit: float = TIME_LIMIT) -> tuple[int, dict]:
    """:func:`resolutions_for` on a worker thread, so that a slow or stuck file system never holds
    up ComfyUI's event loop; 504 when it takes longer than ``time_limit`` seconds."""
    try:
        return await asyncio.wait_for(asyncio.to_thread(resolutions_for, model), time_limit)
    except asyncio.TimeoutError:
        return 504, {"model": quote(model), "error": f"reading the checkpoint {quote(model)} took "
                     f"longer than {time_limit:g} s; check that its folder is on a reachable disk."}


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
        status, body = await resolutions_answer(model)
        return web.json_response(body, status=status)
