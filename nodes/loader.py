"""SJD Model Loader: a checkpoint from the pack's models folder (or the embedded reference model)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..sjd_core.models.registry import load_model
from ..sjd_core.models.reference.adapter import WEIGHTS_DIR
from . import comfy_bridge
from .handles import MODEL_TYPE, LoadedModel

REFERENCE = "reference (embedded)"
WEIGHT_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin", ".ckpt")
DTYPES = {"auto": None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MANAGED = "ComfyUI managed"
SPLIT = "split GPU/CPU (device_map auto)"
PLACEMENTS = (MANAGED, SPLIT)


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


class SJDModelLoader:
    """Loads an autoregressive image model for the SJD sampler."""

    DESCRIPTION = ("Loads an autoregressive text-to-image model (Lumina-mGPT, Emu3, Janus-Pro, "
                   "LlamaGen, or the small embedded reference model) from the 'sjd' models folder. "
                   "ComfyUI's memory manager offloads and unloads it like its own models.")
    CATEGORY = "sampling/SJD"
    FUNCTION = "load"
    RETURN_TYPES = (MODEL_TYPE, "STRING")
    RETURN_NAMES = ("model", "info")
    OUTPUT_TOOLTIPS = ("The loaded model, for the SJD Sampler.",
                       "Family, dtype, device and the resolutions this model can draw.")

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        return {"required": {
            "model": (list(available_models()), {
                "tooltip": "A checkpoint folder (or file) in ComfyUI/models/sjd or another "
                           "folder named 'sjd:' in extra_model_paths.yaml. 'reference "
                           "(embedded)' is a small Fashion-MNIST model shipped with the pack "
                           "that runs anywhere."}),
            "dtype": (list(DTYPES), {
                "default": "auto",
                "tooltip": "Weight precision. auto follows ComfyUI (bf16 on GPUs that run it "
                           "well, else fp16 where that works, fp32 on the CPU)."}),
            "placement": (list(PLACEMENTS), {
                "default": MANAGED,
                "tooltip": "ComfyUI managed: the whole model on ComfyUI's device, offloaded and "
                           "unloaded by ComfyUI like its own models. split: for models larger "
                           "than the GPU, layers are spread over GPU, CPU and disk once at load "
                           "(exact, slower); ComfyUI then cannot move it, so unload other models "
                           "first. Has no effect with --cpu."}),
        }}

    @classmethod
    def VALIDATE_INPUTS(cls, model: str) -> bool | str:
        # Runs instead of ComfyUI's own list check, so a missing model gets a message that helps.
        return True if model in available_models() else missing_model_message(model)

    def load(self, model: str, dtype: str, placement: str = MANAGED) -> tuple[LoadedModel, str]:
        """Load ``model`` on ComfyUI's device and wrap it for ComfyUI's memory manager."""
        path = available_models().get(model)
        if path is None:
            raise FileNotFoundError(missing_model_message(model))
        if dtype not in DTYPES:
            raise ValueError(f"SJD Model Loader: dtype={dtype!r} is not allowed: pick one of "
                             f"{list(DTYPES)}.")
        if placement not in PLACEMENTS:
            raise ValueError(f"SJD Model Loader: placement={placement!r} is not allowed: pick "
                             f"one of {list(PLACEMENTS)}.")
        device = comfy_bridge.torch_device()
        torch_dtype = DTYPES[dtype] or comfy_bridge.auto_dtype(device)
        split = placement == SPLIT and device.type != "cpu"
        try:
            adapter = load_model(path, device=device, dtype=torch_dtype,
                                 device_map="auto" if split else None)
        except (FileNotFoundError, ValueError) as error:
            # The two types themselves: subclasses (json's JSONDecodeError, ...) take other arguments.
            kind = FileNotFoundError if isinstance(error, FileNotFoundError) else ValueError
            raise kind(f"SJD Model Loader: model={model!r} ({path}): {error}") from error
        patcher = None if split else \
            comfy_bridge.wrap_for_memory_manager(_torch_modules(adapter), device)
        loaded = LoadedModel(adapter, patcher, model, torch_dtype)
        resolutions = ", ".join(f"{w}x{h}" for w, h in adapter.supported_resolutions())
        where = "split over GPU/CPU/disk" if split else str(device)
        info = (f"{model}: family {adapter.family}, {str(torch_dtype).removeprefix('torch.')} on "
                f"{where}; resolutions {resolutions} (first = default); family recipe: "
                f"guidance {adapter.defaults.guidance}, temperature {adapter.defaults.temperature},"
                f" top-k {adapter.defaults.top_k}, top-p {adapter.defaults.top_p}")
        return loaded, info


def _torch_modules(adapter: object) -> torch.nn.Module:
    """The torch module(s) of an adapter, as one module ComfyUI can move and measure."""
    if isinstance(adapter, torch.nn.Module):
        return adapter
    modules = {name: value for name, value in vars(adapter).items()
               if isinstance(value, torch.nn.Module)}
    if not modules:
        raise TypeError(f"the {getattr(adapter, 'family', '?')} adapter holds no torch module "
                        "for ComfyUI's memory manager to manage.")
    return torch.nn.ModuleDict(modules)

