"""The sampler's finer settings as objects: option nodes grouped by what an artist decides.

SJD Drafting Options (how guesses are made), SJD Lossy Acceptance (relaxed rules that change the
image's distribution) and SJD Speed Options (AUTO's shape choice, compiling) each set a part of
``AccelerationSettings``; they chain through their ``acceleration`` input or go to the sampler's
inputs of their own. SJD Sampling Options picks the recipe. Widgets are made from the settings'
fields (``widgets.py``), so a new setting needs only a place in ``widgets.OPTION_GROUPS``.
"""

from __future__ import annotations

from ..sjd_core.decoding.settings import AccelerationSettings, SamplingSettings
from ..sjd_core.models.registry import offered_recipes
from .handles import (ACCELERATION_TYPE, CUSTOM, FAMILY_RECIPE, SAMPLING_TYPE,
                      AccelerationOptions, SamplingChoice)
from .widgets import (AS_MODE, OPTION_GROUPS, SWITCH_VALUES, acceleration_option_fields,
                      field_widget, option_widgets, sampling_fields, setting_value, switches)

SAMPLING_NODE = "SJD Sampling Options"
CHAIN_TOOLTIP = ("Optional: settings from another SJD option node, to which this node's are "
                 "added (a setting both nodes give must have the same value).")


def chosen_options(widgets: dict[str, object]) -> AccelerationOptions:
    """The settings these widget values choose; a switch left 'as mode' is left out, for the
    sampler's mode to decide."""
    switch_names = switches()
    return AccelerationOptions({
        name: SWITCH_VALUES.get(value, value) if name in switch_names
        else setting_value(AccelerationSettings, name, value)
        for name, value in widgets.items() if value != AS_MODE})


def chained(node: str, acceleration: AccelerationOptions | None,
            own: AccelerationOptions) -> tuple[AccelerationOptions]:
    """``own`` added to the settings arriving on the ``acceleration`` input, if any."""
    if acceleration is None:
        return (own,)
    try:
        return (acceleration.merged(own),)
    except ValueError as error:
        raise ValueError(f"{node}: acceleration: {error}") from None


class _OptionGroup:
    """One group of acceleration settings (``OPTION_GROUPS``) as a node that can chain."""

    KEY = ""
    NODE = ""
    CATEGORY = "sampling/SJD"
    FUNCTION = "options"
    RETURN_TYPES = (ACCELERATION_TYPE,)
    RETURN_NAMES = ("acceleration",)
    OUTPUT_TOOLTIPS = ("Connect to an input of an SJD Sampler (or to the 'acceleration' input "
                       "of another SJD option node).",)

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        return {"required": option_widgets(OPTION_GROUPS[cls.KEY]),
                "optional": {"acceleration": (ACCELERATION_TYPE, {"tooltip": CHAIN_TOOLTIP})}}

    def options(self, acceleration: AccelerationOptions | None = None,
                **widgets: object) -> tuple[AccelerationOptions]:
        """This node's settings, added to those of the chain before it."""
        return chained(self.NODE, acceleration, chosen_options(widgets))


class SJDDraftingOptions(_OptionGroup):
    """How guesses are made: initial guesses, AC, the PD tree and verification prediction."""

    KEY = "SJDDraftingOptions"
    NODE = "SJD Drafting Options"
    DESCRIPTION = ("How an SJD Sampler guesses codes, all lossless: how guesses start (init), "
                   "adaptive continuation (AC), proactive drafting (PD: K candidates, depth D) "
                   "and verification prediction (VP: N rises, top-k, decay). Switches left "
                   "'as mode' follow the sampler's mode.")


class SJDLossyAcceptance(_OptionGroup):
    """LOSSY: relaxed acceptance rules (LANTERN, GSD) and their tolerances."""

    KEY = "SJDLossyAcceptance"
    NODE = "SJD Lossy Acceptance"
    DESCRIPTION = ("LOSSY: accept guesses that are close to, but not exactly, what the model "
                   "would draw (LANTERN: codebook neighbours; GSD: near the top of the "
                   "ranking). Faster, but the image no longer follows the model's exact "
                   "distribution. relaxed 'none' keeps decoding exact.")


class SJDSpeedOptions(_OptionGroup):
    """How the work is scheduled: AUTO's cost-aware shape choice and compiling the network."""

    KEY = "SJDSpeedOptions"
    NODE = "SJD Speed Options"
    DESCRIPTION = ("How an SJD Sampler spends its time, all lossless: AUTO's cost-aware choice "
                   "of window and draft tree (adaptive_shape, adaptive_tree, shape_cost) and "
                   "whether the network runs compiled (compile). Switches left 'as mode' "
                   "follow the sampler's mode.")


def compile_check(compile: object) -> bool | str:
    """compile: its combo's values, or True / False, which workflows saved while it was an
    on/off toggle hold."""
    choices = field_widget(AccelerationSettings, "compile")[0]
    if compile is None or isinstance(compile, bool) or compile in choices:
        return True
    return (f"compile={compile!r} is not allowed: compile must be one of {choices} ("
            f"'{choices[0]}': compiled on CUDA only).")


class SJDAccelerationOptions:
    """Every acceleration setting in one node, as saved workflows hold it (hidden; new workflows
    use the option nodes of ``OPTION_GROUPS``, whose widgets it shows in the same order)."""

    DEPRECATED = True
    NODE = "SJD Acceleration Options (old)"
    DESCRIPTION = ("Every acceleration setting in one node, kept so that saved workflows run; "
                   "new workflows use SJD Drafting Options, SJD Lossy Acceptance and SJD "
                   "Speed Options, which hold the same settings grouped by what they decide.")
    CATEGORY = "sampling/SJD"
    FUNCTION = "options"
    RETURN_TYPES = (ACCELERATION_TYPE,)
    RETURN_NAMES = ("acceleration",)
    OUTPUT_TOOLTIPS = ("Connect to the 'acceleration' input of an SJD Sampler.",)
    # settings added after workflows were saved: optional inputs, so those workflows still validate
    ADDED_LATER = ("compile",)

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        widgets = option_widgets(tuple(acceleration_option_fields()))
        later = {name: widgets.pop(name) for name in cls.ADDED_LATER}
        return {"required": widgets, "optional": later}

    @classmethod
    def VALIDATE_INPUTS(cls, compile: object = None) -> bool | str:
        return compile_check(compile)

    def options(self, **widgets: object) -> tuple[AccelerationOptions]:
        """Every setting as saved; a switch left 'as mode' is left to the sampler's mode."""
        return (chosen_options(widgets),)


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
