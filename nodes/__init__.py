"""ComfyUI nodes of the pack: thin glue between widgets and ``sjd_core``."""

from . import comfy_bridge
from .decode import SJDDecode
from .diagnostics import SJDDiagnostics
from .loader import SJDModelLoader
from .sampler import SJDSampler

comfy_bridge.register_models_folder()

NODE_CLASS_MAPPINGS = {
    "SJDModelLoader": SJDModelLoader,
    "SJDSampler": SJDSampler,
    "SJDDecode": SJDDecode,
    "SJDDiagnostics": SJDDiagnostics,
}

NODE_DISPLAY_NAME_MAPPINGS = {
    "SJDModelLoader": "SJD Model Loader",
    "SJDSampler": "SJD Sampler",
    "SJDDecode": "SJD Decode",
    "SJDDiagnostics": "SJD Diagnostics",
}
