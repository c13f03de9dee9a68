"""SJD Decode: code grids -> images."""

from __future__ import annotations

import torch

from ..sjd_core.messages import quote
from . import comfy_bridge
from .handles import CODES_TYPE, SamplerCodes

UPSCALES = ("1", "2", "4", "8")


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
        return {"required": {
            "codes": (CODES_TYPE, {"tooltip": "The 'codes' output of an SJD Sampler."}),
            "upscale": (list(UPSCALES), {
                "default": "1",
                "tooltip": "Enlarge the images this many times, nearest neighbour (every pixel "
                           "becomes a sharp square): for small models such as the 32x32 "
                           "reference model, whose images are otherwise a speck."}),
        }}

    def decode(self, codes: SamplerCodes, upscale: str = "1") -> tuple[torch.Tensor]:
        """Decode on the model's device; the result is float32 on the CPU, as ComfyUI wants."""
        if upscale not in UPSCALES:
            raise ValueError(f"SJD Decode: upscale={quote(upscale)} is not allowed: pick one of "
                             f"{list(UPSCALES)}.")
        adapter = codes.loaded.model
        comfy_bridge.load_to_device(codes.loaded.patcher)
        with torch.inference_mode():
            images = adapter.decode(codes.codes.to(adapter.device))
        factor = int(upscale)
        images = images.repeat_interleave(factor, dim=1).repeat_interleave(factor, dim=2)
        return (images.float().clamp(0, 1).cpu(),)
