"""SJD Sampler: draws code grids with plain or speculative Jacobi decoding, with live progress.

Shaped like ComfyUI's custom sampler: the node holds what to draw, the mode and the window; the
rest of the acceleration settings and the sampling settings come, when wanted, from the SJD
option nodes (chained, or one per input) and SJD Sampling Options as objects.
"""

from __future__ import annotations

from ..sjd_core.decoding.settings import AccelerationSettings
from .generation import Prompting, check_resolution, prompting_inputs, run_sampler
from .handles import (ACCELERATION_TYPE, CODES_TYPE, SAMPLING_TYPE, TRACE_TYPE,
                      AccelerationOptions, LoadedModel, SamplingChoice)
from .widgets import (chosen_window, default_mode, mode_choices, preset_of,
                      window_widget)

NODE = "SJD Sampler"
MODE_TOOLTIP = (
    "AUTO: cost-aware: each step picks the window or draft tree expected to commit the most codes "
    "per second on this machine (with adaptive continuation and drafts from the code above). AR: "
    "plain autoregression, one code per forward pass. SJD: speculative Jacobi decoding. PAC: SJD "
    "with adaptive continuation and proactive drafting. PAC+VP: PAC with verification "
    "prediction. All of these are lossless; the SJD option nodes can change any part of the "
    "mode.")
# the sampler's inputs for one option node each, besides 'acceleration' (any node or a chain)
OPTION_INPUTS = {
    "drafting": "Settings from SJD Drafting Options: initial guesses, AC, PD, VP (lossless).",
    "lossy": "Settings from SJD Lossy Acceptance: LOSSY relaxed acceptance (LANTERN, GSD).",
    "speed": "Settings from SJD Speed Options: AUTO's shape choice and compiling (lossless).",
}


def combined_options(parts: dict[str, AccelerationOptions | None]) -> AccelerationOptions | None:
    """The settings of every connected option input together (None when none is connected);
    ValueError naming the input that sets a setting another input set otherwise."""
    combined = None
    for name, part in parts.items():
        if part is None:
            continue
        try:
            combined = part if combined is None else combined.merged(part)
        except ValueError as error:
            raise ValueError(f"{NODE}: {name}: {error}") from None
    return combined


def acceleration_settings(mode: str, window: int | None,
                          options: AccelerationOptions | None) -> AccelerationSettings:
    """The mode's preset with the sampler's window (None: the mode's own) and the options node's
    settings on top."""
    try:
        preset = preset_of(mode)
    except ValueError as error:
        raise ValueError(f"{NODE}: {error}") from None
    try:
        return (options or AccelerationOptions()).settings(preset, window)
    except ValueError as error:
        single = AccelerationSettings.preset(preset).window == 1
        hint = (f" (mode {mode} decodes one code per step: relaxed acceptance and the AC / PD / "
                "VP / adaptive_shape switches need a speculative mode such as AUTO, SJD, PAC or "
                "PAC+VP)" if single else "")
        raise ValueError(f"{NODE}: mode={mode}: {error}{hint}") from error


class SJDSampler:
    """Generates code grids for a prompt with exact (or, if asked, relaxed) speculative decoding."""

    DESCRIPTION = ("Draws images as code grids with speculative Jacobi decoding: each step guesses "
                   "a window of codes and keeps those that pass an exact acceptance test, so the "
                   "result follows the model's own distribution while taking far fewer forward "
                   "passes than plain autoregression (AR). Connect SJD Drafting Options, SJD Speed "
                   "Options, SJD Lossy Acceptance or SJD Sampling Options for the finer "
                   "settings. The progress bar counts committed "
                   "codes; the chart on the node shows codes accepted per step.")
    CATEGORY = "sampling/SJD"
    FUNCTION = "sample"
    RETURN_TYPES = (CODES_TYPE, TRACE_TYPE, "STRING")
    RETURN_NAMES = ("codes", "trace", "summary")
    OUTPUT_TOOLTIPS = (
        "The code grids; connect to SJD Decode for the images.",
        "What happened at every step and slot; connect to SJD Diagnostics.",
        "One line: mode, forward passes (NFE), step compression and time.",
    )

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        return {
            "required": prompting_inputs() | {
                "mode": (mode_choices(), {"default": default_mode(), "tooltip": MODE_TOOLTIP}),
                "window": window_widget(),
            },
            "optional": {
                "acceleration": (ACCELERATION_TYPE, {
                    "tooltip": "Finer acceleration settings from any SJD option node, or from "
                               "a chain of them. Without any: the mode's own settings."}),
                "sampling": (SAMPLING_TYPE, {
                    "tooltip": "Guidance, temperature, top-k, top-p and guidance schedule "
                               "from SJD Sampling Options: another of the model's official "
                               "recipes, or your own. "
                               "Without it: the model family's first official recipe (see the "
                               "Loader's info)."}),
            } | {name: (ACCELERATION_TYPE, {"tooltip": tooltip})
                 for name, tooltip in OPTION_INPUTS.items()},
            "hidden": {"unique_id": "UNIQUE_ID"},
        }

    @classmethod
    def VALIDATE_INPUTS(cls, resolution: str | None = None) -> bool | str:
        # Runs instead of ComfyUI's own list check, so a size no model draws gets a message
        # that says what to pick.
        return check_resolution(resolution, NODE)

    def sample(self, model: LoadedModel, prompt: str, negative_prompt: str, resolution: str,
               batch_size: int, seed: int, mode: str, window: int,
               acceleration: AccelerationOptions | None = None,
               sampling: SamplingChoice | None = None, unique_id: str | None = None,
               drafting: AccelerationOptions | None = None,
               lossy: AccelerationOptions | None = None,
               speed: AccelerationOptions | None = None) -> dict:
        """Build the settings objects, then run the engine with progress, previews and Cancel."""
        options = combined_options({"acceleration": acceleration, "drafting": drafting,
                                    "lossy": lossy, "speed": speed})
        settings = acceleration_settings(mode, chosen_window(window), options)
        try:
            recipe = (sampling or SamplingChoice()).settings(model)
        except ValueError as error:
            raise ValueError(f"{NODE}: {error}") from None
        asked = Prompting(prompt, negative_prompt, resolution, batch_size, seed)
        return run_sampler(model, asked, settings, recipe, NODE, unique_id)
