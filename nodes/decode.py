"""SJD Decode: code grids -> images."""

from __future__ import annotations

import torch

from . import comfy_bridge
from .handles import CODES_TYPE, SamplerCodes


class SJDDecode:
    """Turns the sampler's code grids into images with the model's own VQ decoder."""

    DESCRIPTION = ("Decodes the code grids of an SJD Sampler into images with the VQ decoder of "
                   "the model that drew them.")
    CATEGORY = "sampling/SJD"
    FUNCTION = "decode"
    RETURN_TYPES = ("IMAGE",)
    RETURN_NAMES = ("images",)
    OUTPUT_TOOLTIPS = ("The images (batch, height, width, RGB), ready for Save Image.",)

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        return {"required": {"codes": (CODES_TYPE, {
            "tooltip": "The 'codes' output of an SJD Sampler."})}}

    def decode(self, codes: SamplerCodes) -> tuple[torch.Tensor]:
        """Decode on the model's device; the result is float32 on the CPU, as ComfyUI wants."""
        adapter = codes.loaded.model
        comfy_bridge.load_to_device(codes.loaded.patcher)
        with torch.inference_mode():
            images = adapter.decode(codes.codes.to(adapter.device))
        return (images.float().clamp(0, 1).cpu(),)
