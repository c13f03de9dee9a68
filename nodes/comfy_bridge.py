"""Everything the nodes need from ComfyUI, in one place, imported lazily.

Inside ComfyUI these helpers use its model management, progress bar, interrupt flag, websocket
server and model folders. Outside it (node-level tests, scripts) they fall back to plain torch
behaviour: CPU or the first CUDA device, no progress bar, no messages, no interrupt flag, and only
the folders given in ``SJD_MODELS_DIR``. Nothing here imports ComfyUI at module import time.
"""

from __future__ import annotations

import importlib
import os
import time
import uuid
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from PIL import Image

MODELS_FOLDER = "sjd"  # the name users write in extra_model_paths.yaml
# The least time between two progress bar updates sent to the browser: at most 1 a second (and
# the last), with the live preview, which travels with one. Each update is a "progress" and a
# "progress_state" message, and the newest frontend's Vue-nodes mode spends about a tenth of a
# second of CPU on each, which a page on a machine of two cores takes from the run itself.
UPDATE_SECONDS = 1.0
PREVIEW_SIZE = 512  # ComfyUI's default largest side of a live preview, in pixels


def _comfy(module: str) -> ModuleType | None:
    """``module`` from ComfyUI, or None when this Python is not running inside ComfyUI."""
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


def register_models_folder() -> None:
    """Register ``models/sjd`` with ComfyUI so that extra_model_paths.yaml can add more folders."""
    folder_paths = _comfy("folder_paths")
    if folder_paths is None:
        return
    default = os.path.join(folder_paths.models_dir, MODELS_FOLDER)
    if default not in folder_paths.folder_names_and_paths.get(MODELS_FOLDER, ([], None))[0]:
        folder_paths.add_model_folder_path(MODELS_FOLDER, default)


def running_server() -> ModuleType | None:
    """ComfyUI's ``server`` module when it is importable and its ``PromptServer`` runs, else None."""
    server = _comfy("server")
    if server is None or getattr(getattr(server, "PromptServer", None), "instance", None) is None:
        return None
    return server


def models_folders() -> list[str]:
    """Every folder where users may put checkpoints, existing or not, in search order."""
    folders: list[str] = []
    folder_paths = _comfy("folder_paths")
    if folder_paths is not None:
        register_models_folder()
        folders += folder_paths.get_folder_paths(MODELS_FOLDER)
    folders += [p for p in os.environ.get("SJD_MODELS_DIR", "").split(os.pathsep) if p]
    return list(dict.fromkeys(folders))


def torch_device() -> torch.device:
    """ComfyUI's compute device (honours --cpu); outside ComfyUI, CUDA if present, else CPU."""
    mm = _comfy("comfy.model_management")
    if mm is not None:
        return mm.get_torch_device()
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def offload_device() -> torch.device:
    """Where ComfyUI parks models it is not running right now."""
    mm = _comfy("comfy.model_management")
    return mm.unet_offload_device() if mm is not None else torch.device("cpu")


def auto_dtype(device: torch.device) -> torch.dtype:
    """bf16 where the device runs it well, else fp16 where that works, else fp32 (ComfyUI's rule)."""
    mm = _comfy("comfy.model_management")
    if mm is not None:
        if mm.should_use_bf16(device):
            return torch.bfloat16
        if mm.should_use_fp16(device):
            return torch.float16
        return torch.float32
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def wrap_for_memory_manager(module: torch.nn.Module, device: torch.device) -> Any:
    """A ``ModelPatcher`` around ``module`` so ComfyUI can offload and unload it; None outside."""
    patcher = _comfy("comfy.model_patcher")
    if patcher is None:
        return None
    return patcher.ModelPatcher(module, load_device=device, offload_device=offload_device())


def load_to_device(patcher: Any) -> None:
    """Ask ComfyUI to put the model on its device, offloading others if memory is short."""
    mm = _comfy("comfy.model_management")
    if mm is not None and patcher is not None:
        mm.load_models_gpu([patcher])


def check_interrupted() -> None:
    """Raise ComfyUI's interrupt exception when the user pressed Cancel."""
    mm = _comfy("comfy.model_management")
    if mm is not None:
        mm.throw_exception_if_processing_interrupted()


class Throttle:
    """Lets an update through at most once every ``interval`` seconds of ``clock``; an update
    marked final always goes through."""

    def __init__(self, interval: float = UPDATE_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self.clock = clock
        self.last: float | None = None  # when the last update went through

    def ready(self, final: bool = False) -> bool:
        """True (and the update counts as sent) when it may go out now."""
        now = self.clock()
        if final or self.last is None or now - self.last >= self.interval:
            self.last = now
            return True
        return False


def preview_options() -> tuple[bool, int]:
    """(whether samplers show live previews, their largest side in pixels), read as ComfyUI's own
    samplers read them when a run starts: ``--preview-method`` (``none``: no previews; a newer
    ComfyUI sets it for the run from the frontend's "Live preview method") and ``--preview-size``
    (a ComfyUI without that option previews at 512). No previews outside ComfyUI."""
    cli = _comfy("comfy.cli_args")
    if cli is None:
        return False, PREVIEW_SIZE
    method = getattr(cli.args, "preview_method", "none")
    return getattr(method, "value", method) != "none", int(getattr(cli.args, "preview_size",
                                                                     PREVIEW_SIZE))


def fit_preview(image: Image.Image, size: int) -> Image.Image:
    """``image`` scaled to fit ``size`` x ``size`` as ComfyUI fits a preview, but an image smaller
    than that (pixel art, such as the reference model's 32 x 32) grows with nearest-neighbour
    scaling, so its pixels stay sharp instead of being smoothed by ComfyUI's scaling."""
    width, height = image.size
    if max(width, height) >= size:
        return image
    scale = size / max(width, height)
    return image.resize((max(1, round(width * scale)), max(1, round(height * scale))),
                        Image.NEAREST)


class Progress:
    """ComfyUI's progress bar (with previews) when running inside ComfyUI; silent outside.

    Updates reach the bar at most once every ``interval`` seconds, and the final one
    (``done == total``) always, so the browser's bar ends full. Previews go out at most
    ``preview_size`` pixels on a side (see :func:`fit_preview`).
    """

    def __init__(self, total: int, interval: float = UPDATE_SECONDS,
                 clock: Callable[[], float] = time.monotonic,
                 preview_size: int = PREVIEW_SIZE) -> None:
        utils = _comfy("comfy.utils")
        self._bar = utils.ProgressBar(total) if utils is not None else None
        self.total = total
        self.throttle = Throttle(interval, clock)
        self.preview_size = preview_size

    def update(self, done: int, preview: Callable[[], Any] | None = None) -> bool:
        """Set the bar to ``done`` unless the last update was too recent; ``preview`` is called
        (only for an update that goes out) for a PIL image shown on the node, or None. Returns
        whether the update went out."""
        if not self.throttle.ready(final=done >= self.total):
            return False
        image = preview() if preview is not None else None
        if self._bar is not None:
            shown = None if image is None else (
                "JPEG", fit_preview(image, self.preview_size), self.preview_size)
            self._bar.update_absolute(done, self.total, shown)
        return True


def send(event: str, payload: dict) -> None:
    """Send a websocket message to the browser that queued the running prompt
    (``api.addEventListener(event, ...)``), as ComfyUI sends its own progress: other pages and a
    prompt queued without a client id hear nothing."""
    server = _comfy("server")
    instance = getattr(getattr(server, "PromptServer", None), "instance", None)
    client = getattr(instance, "client_id", None)
    if instance is not None and client is not None:
        instance.send_sync(event, payload, client)


def save_previews(images: list[Any], prefix: str) -> list[dict]:
    """Write PIL images to ComfyUI's temp folder; returns the ``{"ui": {"images": ...}}`` entries.

    Outside ComfyUI there is nowhere to show them, so nothing is written.
    """
    folder_paths = _comfy("folder_paths")
    if folder_paths is None:
        return []
    folder = folder_paths.get_temp_directory()
    os.makedirs(folder, exist_ok=True)
    entries = []
    for image in images:
        name = f"{prefix}_{uuid.uuid4().hex[:12]}.png"
        image.save(os.path.join(folder, name), compress_level=1)
        entries.append({"filename": name, "subfolder": "", "type": "temp"})
    return entries
