"""The all-in-one sampler of the pack's first release, kept so that saved workflows load and run.

New workflows use SJD Sampler with the SJD option nodes; this node is hidden from the node
library (``DEPRECATED``) and takes every setting as a widget, declared as SJD Sampler and the
option nodes declare it. Its widgets and their order must not change: saved workflows store
widget values by position.
"""

from __future__ import annotations

from ..sjd_core.messages import quote
from ..sjd_core.decoding.settings import AccelerationSettings, SamplingSettings
from .generation import Prompting, check_resolution, prompting_inputs, run_sampler
from .handles import (CODES_TYPE, CUSTOM, FAMILY_RECIPE, TRACE_TYPE, LoadedModel,
                      SamplingChoice)
from .widgets import OPTION_GROUPS, field_widget, option_widgets, setting_value

NODE = "SJD Sampler (all options, old)"
MODES = {"PAC+VP": "pac+vp", "PAC": "pac", "SJD": "sjd", "AR": "ar", "custom": None}
DEFAULT_MODE = "PAC+VP"
SAMPLING_CHOICES = (FAMILY_RECIPE, CUSTOM)
SWITCHES = ("adaptive_continuation", "proactive_drafting", "verification_prediction")
PROMPTING = ("prompt", "negative_prompt", "resolution", "batch_size", "seed")
CUSTOM_SAMPLING = ("guidance", "temperature", "top_k", "top_p")


def _noted(spec: tuple, note: str) -> tuple:
    """A widget spec whose tooltip starts with ``note`` in brackets."""
    kind, options = spec
    return (kind, options | {"tooltip": f"({note}) {options['tooltip']}"})


def acceleration_settings(mode: str, widgets: dict) -> AccelerationSettings:
    """The engine's settings for a mode preset (or ``custom``) and the node's widget values.

    A preset fixes which of AC / PD / VP are on (and ``AR`` fixes window=1); ``custom`` takes the
    switches as they are. Every other setting applies in every mode.
    """
    if mode not in MODES:
        raise ValueError(f"{NODE}: mode={quote(mode)} is not allowed: pick one of {list(MODES)}.")
    names = {f for f in AccelerationSettings.__dataclass_fields__} - set(SWITCHES) - {"window"}
    shared = {name: setting_value(AccelerationSettings, name, widgets[name])
              for name in names if name in widgets}
    try:
        if MODES[mode] is None:
            switches = {name: widgets[name] for name in SWITCHES}
            return AccelerationSettings(window=widgets["window"], **switches, **shared)
        if MODES[mode] != "ar":
            shared["window"] = widgets["window"]
        return AccelerationSettings.preset(MODES[mode], **shared)
    except ValueError as error:
        hint = (" (mode AR decodes one slot per step: relaxed acceptance and drafting options "
                "need SJD, PAC, PAC+VP or custom with window > 1)" if MODES[mode] == "ar" else "")
        raise ValueError(f"{NODE}: mode={mode}: {error}{hint}") from error


def sampling_settings(model: LoadedModel, widgets: dict) -> SamplingSettings:
    """The family's recipe, or the four custom widgets when ``sampling`` is 'custom'."""
    choice = widgets["sampling"]
    if choice not in SAMPLING_CHOICES:
        raise ValueError(f"{NODE}: sampling={quote(choice)} is not allowed: pick one of "
                         f"{list(SAMPLING_CHOICES)}.")
    if choice == FAMILY_RECIPE:
        return SamplingChoice().settings(model)
    try:
        return SamplingSettings(**{name: widgets[name] for name in CUSTOM_SAMPLING})
    except ValueError as error:
        raise ValueError(f"{NODE}: {error}") from error


class SJDSamplerLegacy:
    """The first release's sampler: every setting as a widget (hidden; for saved workflows)."""

    DEPRECATED = True
    DESCRIPTION = ("The first release's all-in-one sampler, kept so that saved workflows run; new "
                   "workflows use SJD Sampler with the SJD option nodes and SJD Sampling "
                   "Options. Draws images as code grids with speculative Jacobi decoding "
                   "(every setting is a widget here).")
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
        sampling = {name: _noted(field_widget(SamplingSettings, name), "custom sampling only")
                    for name in CUSTOM_SAMPLING}
        options = option_widgets(OPTION_GROUPS["SJDDraftingOptions"]
                                 + OPTION_GROUPS["SJDLossyAcceptance"])
        for name in SWITCHES:  # on / off, and only in mode 'custom'
            options[name] = _noted(field_widget(AccelerationSettings, name), "custom mode only")
        return {
            "required": prompting_inputs() | {
                "sampling": (list(SAMPLING_CHOICES), {
                    "default": FAMILY_RECIPE,
                    "tooltip": "'family recipe' uses the model's official guidance, temperature, "
                               "top-k and top-p (see the Loader's info); 'custom' uses the four "
                               "inputs below."}),
            } | sampling | {
                "mode": (list(MODES), {
                    "default": DEFAULT_MODE,
                    "tooltip": "AR: plain autoregression, one code per forward pass. SJD: "
                               "speculative Jacobi decoding. PAC: SJD with adaptive continuation "
                               "and proactive drafting. PAC+VP: PAC with verification "
                               "prediction. All four are lossless. custom: use the AC / PD / VP "
                               "toggles below."}),
                "window": field_widget(AccelerationSettings, "window"),
            } | options,
            "hidden": {"unique_id": "UNIQUE_ID"},
        }

    @classmethod
    def VALIDATE_INPUTS(cls, resolution: str | None = None) -> bool | str:
        # Runs instead of ComfyUI's own list check, so a size no model draws gets a message
        # that says what to pick.
        return check_resolution(resolution, NODE)

    def sample(self, model: LoadedModel, unique_id: str | None = None, **widgets: object) -> dict:
        """Turn the widgets into settings objects, then run like SJD Sampler does."""
        acceleration = acceleration_settings(widgets["mode"], widgets)
        sampling = sampling_settings(model, widgets)
        asked = Prompting(**{name: widgets[name] for name in PROMPTING})
        return run_sampler(model, asked, acceleration, sampling, NODE, unique_id)
