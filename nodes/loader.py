"""SJD Model Loader: a checkpoint from the pack's models folder (or the embedded reference model)."""

from __future__ import annotations

import torch

from ..sjd_core.messages import quote
from ..sjd_core.models.registry import load_model
from ..sjd_core.models.weights import FLOAT_FORMATS, QUANTIZED_FORMATS
from . import comfy_bridge
from .handles import MODEL_TYPE, LoadedModel
from .model_files import REFERENCE, available_models, missing_model_message

# The `weights` widget took the place (and the values) of the former `dtype` widget, so workflows
# saved with `dtype` load their choice into it.
WEIGHTS = ("auto", "bf16", "fp16", "fp32", "int8", "int4")
MANAGED = "ComfyUI managed"
SPLIT = "split GPU/CPU (device_map auto)"
PLACEMENTS = (MANAGED, SPLIT)


class SJDModelLoader:
    """Loads an autoregressive image model for the SJD sampler."""

    DESCRIPTION = ("Loads an autoregressive text-to-image model (Lumina-mGPT 1 and 2, Anole, Emu3, "
                   "Janus-Pro, LlamaGen, or the small embedded reference model) from the 'sjd' "
                   "models folder. "
                   "ComfyUI's memory manager offloads and unloads it like its own models.")
    CATEGORY = "sampling/SJD"
    FUNCTION = "load"
    RETURN_TYPES = (MODEL_TYPE, "STRING")
    RETURN_NAMES = ("model", "info")
    OUTPUT_TOOLTIPS = ("The loaded model, for the SJD Sampler.",
                       "Family, weights, device, the resolutions this model can draw and its "
                       "official sampling recipes.")

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        return {"required": {
            "model": (list(available_models()), {
                "tooltip": "A checkpoint folder (or file) in ComfyUI/models/sjd or another "
                           "folder named 'sjd:' in extra_model_paths.yaml. 'reference "
                           "(embedded)' is a small Fashion-MNIST model shipped with the pack "
                           "that runs anywhere."}),
            "weights": (list(WEIGHTS), {
                "default": "auto",
                "tooltip": "How the weights are stored. auto follows ComfyUI (bf16 on GPUs that "
                           "run it well, else fp16, fp32 on the CPU). int8 / int4: weight-only "
                           "quantisation (about 1/2 and 1/4 of the bf16 weight memory, for 8-12 GB "
                           "GPUs; needs torchao). Decoding stays exact with respect to the "
                           "quantised model's own distribution, which differs a little from the "
                           "original's. Quantised models stay where they are loaded."}),
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

    def load(self, model: str, weights: str = "auto", placement: str = MANAGED,
             dtype: str | None = None) -> tuple[LoadedModel, str]:
        """Load ``model`` on ComfyUI's device and wrap it for ComfyUI's memory manager.

        ``dtype`` is the former name of ``weights`` (prompts saved in the API format name it).
        """
        weights = dtype if dtype is not None else weights
        path = available_models().get(model)
        if path is None:
            raise FileNotFoundError(missing_model_message(model))
        if weights not in WEIGHTS:
            raise ValueError(f"SJD Model Loader: weights={quote(weights)} is not allowed: pick one of "
                             f"{list(WEIGHTS)}.")
        if placement not in PLACEMENTS:
            raise ValueError(f"SJD Model Loader: placement={quote(placement)} is not allowed: pick "
                             f"one of {list(PLACEMENTS)}.")
        device = comfy_bridge.torch_device()
        quantized = weights in QUANTIZED_FORMATS
        torch_dtype = FLOAT_FORMATS.get(weights) or comfy_bridge.auto_dtype(device)
        if quantized and device.type == "cuda" and weights == "int4":
            torch_dtype = torch.bfloat16  # torchao's CUDA int4 kernels compute in bfloat16
        split = placement == SPLIT and device.type != "cpu"
        try:
            adapter = load_model(path, device=device, dtype=torch_dtype,
                                 device_map="auto" if split else None,
                                 weights=weights if quantized else None)
        except (FileNotFoundError, ValueError, ImportError) as error:
            # The types themselves: subclasses (json's JSONDecodeError, ...) take other arguments.
            kind = next(k for k in (FileNotFoundError, ImportError, ValueError) if isinstance(error, k))
            raise kind(f"SJD Model Loader: model={quote(model)} ({path}): {error}") from error
        # quantised tensors are not moved between devices by ComfyUI: they stay where loaded
        patcher = None if split or quantized else \
            comfy_bridge.wrap_for_memory_manager(_torch_modules(adapter), device)
        loaded = LoadedModel(adapter, patcher, model, torch_dtype)
        return loaded, info_text(model, adapter, weights, torch_dtype,
                                 "split over GPU/CPU/disk" if split else str(device))


def info_text(model: str, adapter, weights: str, dtype: torch.dtype, where: str) -> str:
    """The loader's ``info`` output: family, storage, device, resolutions, recipes with sources."""
    compute = str(dtype).removeprefix("torch.")
    storage = f"{weights} weights computing in {compute}" if weights in QUANTIZED_FORMATS else compute
    resolutions = ", ".join(f"{w}x{h}" for w, h in adapter.supported_resolutions())
    recipes = "; ".join(
        f"{name}{' (default)' if i == 0 else ''}: guidance {r.guidance}"
        f"{'' if r.guidance_schedule == 'constant' else f' ({r.guidance_schedule} schedule)'}, "
        f"temperature {r.temperature}, top-k {r.top_k}, top-p {r.top_p} [{r.source}]"
        for i, (name, r) in enumerate(adapter.recipes.items()))
    return (f"{model}: family {adapter.family}, {storage} on {where}; resolutions {resolutions} "
            f"(first = default); official recipes: {recipes}")


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

