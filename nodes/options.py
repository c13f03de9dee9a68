"""SJD Acceleration Options and SJD Sampling Options: the sampler's finer settings, as objects.

Their widgets are made from the fields of ``AccelerationSettings`` and ``SamplingSettings``
(``widgets.py``), so a new setting appears here without new node code.
"""

from __future__ import annotations

from ..sjd_core.decoding.settings import AccelerationSettings, SamplingSettings
from .handles import ACCELERATION_TYPE, SAMPLING_TYPE, AccelerationOptions
from .widgets import (AS_MODE, SWITCH_VALUES, acceleration_option_fields, field_widget,
                      sampling_fields, switches)

ACCELERATION_NODE = "SJD Acceleration Options"
SAMPLING_NODE = "SJD Sampling Options"


class SJDAccelerationOptions:
    """Every acceleration setting but the window, for the sampler's ``acceleration`` input."""

    DESCRIPTION = ("The finer settings of speculative decoding for an SJD Sampler: how guesses "
                   "start, adaptive continuation (AC), proactive drafting (PD: K candidates, "
                   "depth D), verification prediction (VP: N rises, top-k, decay) and the LOSSY "
                   "relaxed acceptance rules LANTERN and GSD with their knobs. AC, PD and VP "
                   "left 'as mode' follow the sampler's mode.")
    CATEGORY = "sampling/SJD"
    FUNCTION = "options"
    RETURN_TYPES = (ACCELERATION_TYPE,)
    RETURN_NAMES = ("acceleration",)
    OUTPUT_TOOLTIPS = ("Connect to the 'acceleration' input of an SJD Sampler.",)

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        return {"required": {name: field_widget(AccelerationSettings, name, switch=True)
                             for name in acceleration_option_fields()}}

    def options(self, **widgets: object) -> tuple[AccelerationOptions]:
        """Keep every setting; a switch left 'as mode' is left out for the preset to decide."""
        switch_names = switches()
        overrides = {name: SWITCH_VALUES.get(value, value) if name in switch_names else value
                     for name, value in widgets.items() if value != AS_MODE}
        return (AccelerationOptions(overrides),)


class SJDSamplingOptions:
    """Guidance, temperature, top-k and top-p, replacing the model family's recipe."""

    DESCRIPTION = ("Sampling settings for an SJD Sampler instead of the model family's official "
                   "recipe: classifier-free guidance, temperature, top-k and top-p. They define "
                   "the distribution every mode draws from; acceleration never changes it.")
    CATEGORY = "sampling/SJD"
    FUNCTION = "options"
    RETURN_TYPES = (SAMPLING_TYPE,)
    RETURN_NAMES = ("sampling",)
    OUTPUT_TOOLTIPS = ("Connect to the 'sampling' input of an SJD Sampler.",)

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        return {"required": {name: field_widget(SamplingSettings, name)
                             for name in sampling_fields()}}

    def options(self, **widgets: object) -> tuple[SamplingSettings]:
        """Validated here, so a bad value is reported on this node."""
        try:
            return (SamplingSettings(**widgets),)
        except (TypeError, ValueError) as error:
            raise ValueError(f"{SAMPLING_NODE}: {error}") from error
