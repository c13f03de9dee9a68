"""Which checkpoints the user can pick: the embedded reference model and the models folders' entries.

Shared by the loader node and the resolutions route.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..sjd_core.files import list_folder
from ..sjd_core.messages import quote
from ..sjd_core.models.reference.adapter import WEIGHTS_DIR
from . import comfy_bridge
from .node_messages import one_line

REFERENCE = "reference (embedded)"
WEIGHT_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin", ".ckpt")


def model_listing() -> tuple[dict[str, Path], list[str]]:
    """(display name -> path of every checkpoint the user can pick, the embedded model first;
    one sentence per entry of the models folders left out).

    A checkpoint is a folder (Hugging Face layout) or a single weights file directly inside one of
    the models folders; the first folder that holds a name wins. An entry that is a symbolic-link
    loop, a link to nothing, a FIFO or unreadable is left out and named, never fatal.
    """
    found: dict[str, Path] = {REFERENCE: WEIGHTS_DIR}
    skipped: list[str] = []
    for folder in comfy_bridge.models_folders():
        if not os.path.isdir(folder):
            continue
        entries, problems = list_folder(folder)
        skipped += [f"in {folder}: {problem}" for problem in problems]
        for entry in entries:
            if entry.name.startswith("."):
                continue
            if entry.is_folder or entry.name.lower().endswith(WEIGHT_SUFFIXES):
                found.setdefault(entry.name, entry.path)
    return found, skipped


def available_models() -> dict[str, Path]:
    """Display name -> path of every checkpoint the user can pick (see :func:`model_listing`)."""
    return model_listing()[0]


def missing_model_message(name: str) -> str:
    """What to do when ``name`` is not in any models folder (e.g. a workflow from another machine)."""
    folders = comfy_bridge.models_folders()
    checked = ", ".join(f"{f}{'' if os.path.isdir(f) else ' (missing)'}" for f in folders) \
        or "none registered (outside ComfyUI set SJD_MODELS_DIR)"
    found, skipped = model_listing()
    choices = ", ".join(quote(n) for n in found)
    left_out = f" Left out of the listing: {'; '.join(skipped)}." if skipped else ""
    return one_line(
        f"SJD Model Loader: model={quote(name)} was not found in the SJD models folders: put "
        "its checkpoint folder there under that name, or add a folder with an 'sjd:' entry in "
        "extra_model_paths.yaml (the README's 'Supported checkpoints' table says where each "
        f"family's weights come from); or pick one of: {choices}. Folders looked in: "
        f"{checked}.{left_out}")
