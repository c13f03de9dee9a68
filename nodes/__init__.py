"""ComfyUI nodes of the pack: thin glue between widgets and ``sjd_core``."""

from . import comfy_bridge, resolutions_route
from .decode import SJDDecode
from .diagnostics import SJDDiagnostics
from .loader import SJDModelLoader
from .sampler import SJDSampler

comfy_bridge.register_models_folder()
if comfy_bridge.running_server() is not None:
    resolutions_route.register(comfy_bridge.running_server())

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
