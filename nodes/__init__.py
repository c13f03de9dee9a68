"""ComfyUI nodes of the pack: thin glue between widgets and ``sjd_core``."""

from . import comfy_bridge, resolutions_route
from .decode import SJDDecode
from .diagnostics import SJDDiagnostics
from .loader import SJDModelLoader
from .node_messages import shorten_messages
from .options import (SJDAccelerationOptions, SJDDraftingOptions, SJDLossyAcceptance,
                      SJDSamplingOptions, SJDSpeedOptions)
from .sampler import SJDSampler
from .sampler_legacy import SJDSamplerLegacy

comfy_bridge.register_models_folder()
if comfy_bridge.running_server() is not None:
    resolutions_route.register(comfy_bridge.running_server())

NODE_CLASS_MAPPINGS = {
    "SJDModelLoader": SJDModelLoader,
    "SJDSamplerV2": SJDSampler,
    "SJDDraftingOptions": SJDDraftingOptions,
    "SJDSpeedOptions": SJDSpeedOptions,
    "SJDLossyAcceptance": SJDLossyAcceptance,
    "SJDSamplingOptions": SJDSamplingOptions,
    "SJDDecode": SJDDecode,
    "SJDDiagnostics": SJDDiagnostics,
    # Kept under their saved names so that older workflows load (hidden): the first release's
    # sampler and the options node that held every acceleration setting.
    "SJDSampler": SJDSamplerLegacy,
    "SJDAccelerationOptions": SJDAccelerationOptions,
}

NODE_DISPLAY_NAME_MAPPINGS = {
    "SJDModelLoader": "SJD Model Loader",
    "SJDSamplerV2": "SJD Sampler",
    "SJDDraftingOptions": "SJD Drafting Options",
    "SJDSpeedOptions": "SJD Speed Options",
    "SJDLossyAcceptance": "SJD Lossy Acceptance",
    "SJDSamplingOptions": "SJD Sampling Options",
    "SJDDecode": "SJD Decode",
    "SJDDiagnostics": "SJD Diagnostics",
    "SJDSampler": "SJD Sampler (all options, old)",
    "SJDAccelerationOptions": "SJD Acceleration Options (old)",
}

# What a node raises shows as one plain line (the whole message goes to the console log).
for node_class in NODE_CLASS_MAPPINGS.values():
    shorten_messages(node_class)
