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

MODELS_FOLDER = "sjd"  # the name users write in extra_model_paths.yaml
# The least time between two progress bar updates sent to the browser: at most 2 a second, as
# often as a live preview, which travels with one. Each update is a "progress" and a
# "progress_state" message, and the newest frontend's Vue-nodes mode spends about a tenth of a
# second of CPU on each; at 10 a second an AR run of the reference model queued from the page took
# 1.3-1.4 times as long as over the API on two busy cores.
UPDATE_SECONDS = 0.5


def _comfy(module: str) -> ModuleType | None:
    """``module`` from ComfyUI, or None when this Python is not running inside ComfyUI."""
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


def in_comfyui() -> bool:
    """True when ComfyUI's model management is importable (the pack runs inside ComfyUI)."""
    return _comfy("comfy.model_management") is not None


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


class Progress:
    """ComfyUI's progress bar (with previews) when running inside ComfyUI; silent outside.

    Updates reach the bar at most once every ``interval`` seconds, and the final one
    (``done == total``) always, so the browser's bar ends full.
    """

    def __init__(self, total: int, interval: float = UPDATE_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        utils = _comfy("comfy.utils")
        self._bar = utils.ProgressBar(total) if utils is not None else None
        self.total = total
        self.throttle = Throttle(interval, clock)

    def update(self, done: int, preview: Callable[[], Any] | None = None) -> bool:
        """Set the bar to ``done`` unless the last update was too recent; ``preview`` is called
        (only for an update that goes out) for a PIL image shown on the node, or None. Returns
        whether the update went out."""
        if not self.throttle.ready(final=done >= self.total):
            return False
        image = preview() if preview is not None else None
        if self._bar is not None:
            self._bar.update_absolute(done, self.total,
                                      ("JPEG", image, 512) if image is not None else None)
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
