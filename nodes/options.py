"""SJD Acceleration Options and SJD Sampling Options: the sampler's finer settings, as objects.

Their widgets are made from the fields of ``AccelerationSettings`` and ``SamplingSettings``
(``widgets.py``), so a new setting appears here without new node code.
"""

from __future__ import annotations

from ..sjd_core.decoding.settings import AccelerationSettings, SamplingSettings
from ..sjd_core.models.registry import offered_recipes
from .handles import (ACCELERATION_TYPE, CUSTOM, FAMILY_RECIPE, SAMPLING_TYPE,
                      AccelerationOptions, SamplingChoice)
from .widgets import (AS_MODE, SWITCH_VALUES, acceleration_option_fields, field_widget,
                      sampling_fields, setting_value, switches)

ACCELERATION_NODE = "SJD Acceleration Options"
SAMPLING_NODE = "SJD Sampling Options"
# settings added after workflows were saved: optional inputs, so those workflows still validate
OPTIONAL_ACCELERATION = ("compile",)


class SJDAccelerationOptions:
    """Every acceleration setting but the window, for the sampler's ``acceleration`` input."""

    DESCRIPTION = ("The finer settings of speculative decoding for an SJD Sampler: how guesses "
                   "start, adaptive continuation (AC), proactive drafting (PD: K candidates, "
                   "depth D), verification prediction (VP: N rises, top-k, decay), the LOSSY "
                   "relaxed acceptance rules LANTERN and GSD with their knobs, and the "
                   "cost-aware shape choice of AUTO (adaptive_shape), and whether the network "
                   "runs compiled (compile). Switches left 'as mode' follow the sampler's mode.")
    CATEGORY = "sampling/SJD"
    FUNCTION = "options"
    RETURN_TYPES = (ACCELERATION_TYPE,)
    RETURN_NAMES = ("acceleration",)
    OUTPUT_TOOLTIPS = ("Connect to the 'acceleration' input of an SJD Sampler.",)

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        names = acceleration_option_fields()
        return {"required": {name: field_widget(AccelerationSettings, name, switch=True)
                             for name in names if name not in OPTIONAL_ACCELERATION},
                "optional": {name: field_widget(AccelerationSettings, name)
                             for name in OPTIONAL_ACCELERATION}}

    @classmethod
    def VALIDATE_INPUTS(cls, compile: object = None) -> bool | str:
        """compile: its combo's values, or True / False, which workflows saved while it was an
        on/off toggle hold."""
        choices = field_widget(AccelerationSettings, "compile")[0]
        if compile is None or isinstance(compile, bool) or compile in choices:
            return True
        return (f"compile={compile!r} is not allowed: compile must be one of {choices} ("
                f"'{choices[0]}': compiled on CUDA only).")

    def options(self, **widgets: object) -> tuple[AccelerationOptions]:
        """Keep every setting; a switch left 'as mode' is left out for the preset to decide."""
        switch_names = switches()
        overrides = {name: SWITCH_VALUES.get(value, value) if name in switch_names
                     else setting_value(AccelerationSettings, name, value)
                     for name, value in widgets.items() if value != AS_MODE}
        return (AccelerationOptions(overrides),)


def recipe_choices() -> list[str]:
    """The recipe combo: the family's first recipe, every named official recipe, custom."""
    return [FAMILY_RECIPE, *offered_recipes(), CUSTOM]


class SJDSamplingOptions:
    """Another official recipe of the loaded model by name, or custom guidance, temperature,
    top-k, top-p and guidance schedule, in place of the family's first recipe."""

    DESCRIPTION = ("Sampling settings for an SJD Sampler instead of the model family's first "
                   "official recipe: another official recipe by name (the Loader's info lists "
                   "the model's recipes and their sources), or your own classifier-free "
                   "guidance, temperature, top-k, top-p and guidance schedule. They define the "
                   "distribution every mode draws from; acceleration never changes it.")
    CATEGORY = "sampling/SJD"
    FUNCTION = "options"
    RETURN_TYPES = (SAMPLING_TYPE,)
    RETURN_NAMES = ("sampling",)
    OUTPUT_TOOLTIPS = ("Connect to the 'sampling' input of an SJD Sampler.",)

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        recipe = (recipe_choices(), {
            "default": CUSTOM,
            "tooltip": f"'{CUSTOM}': the settings below. '{FAMILY_RECIPE}': the loaded "
                       "model's first official recipe (Lumina-mGPT 2.0's with its official "
                       "guidance schedule). A name: that official recipe of the loaded model "
                       "(the Loader's info lists the model's recipes and where each comes "
                       "from); a name the model does not have stops with its list."})
        widgets = {name: field_widget(SamplingSettings, name) for name in sampling_fields()}
        # Optional, so prompts saved before the schedule existed still validate (as constant).
        schedule = {"guidance_schedule": widgets.pop("guidance_schedule")}
        return {"required": {"recipe": recipe} | widgets, "optional": schedule}

    def options(self, recipe: str = CUSTOM, **widgets: object) -> tuple[SamplingChoice]:
        """Custom numbers are validated here, so a bad value is reported on this node; a recipe
        name is looked up in the loaded model by the sampler."""
        if recipe != CUSTOM:
            return (SamplingChoice(recipe),)
        try:
            return (SamplingChoice(CUSTOM, SamplingSettings(**widgets)),)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{SAMPLING_NODE}: {error}") from error
