"""Which checkpoints the user can pick: the embedded reference model and the models folders' entries.

Shared by the loader node and the resolutions route.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..sjd_core.models.reference.adapter import WEIGHTS_DIR
from . import comfy_bridge

REFERENCE = "reference (embedded)"
WEIGHT_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin", ".ckpt")


def available_models() -> dict[str, Path]:
    """Display name -> path of every checkpoint the user can pick, the embedded model first.

    A checkpoint is a folder (Hugging Face layout) or a single weights file directly inside one of
    the models folders; the first folder that holds a name wins.
    """
    found: dict[str, Path] = {REFERENCE: WEIGHTS_DIR}
    for folder in comfy_bridge.models_folders():
        if not os.path.isdir(folder):
            continue
        for entry in sorted(os.scandir(folder), key=lambda e: e.name.lower()):
            if entry.name.startswith("."):
                continue
            if entry.is_dir() or entry.name.lower().endswith(WEIGHT_SUFFIXES):
                found.setdefault(entry.name, Path(entry.path))
    return found


def missing_model_message(name: str) -> str:
    """What to do when ``name`` is not in any models folder (e.g. a workflow from another machine)."""
    folders = comfy_bridge.models_folders()
    checked = ", ".join(f"{f}{'' if os.path.isdir(f) else ' (missing)'}" for f in folders) \
        or "none registered (outside ComfyUI set SJD_MODELS_DIR)"
    choices = ", ".join(repr(n) for n in available_models())
    return (f"SJD Model Loader: model={name!r} was not found in the SJD models folders "
            f"[{checked}]. Put the checkpoint folder there under that name (the README's "
            f"'models' section says where each family's weights come from), or add a folder with "
            f"an 'sjd:' entry in extra_model_paths.yaml, or pick one of: {choices}.")
