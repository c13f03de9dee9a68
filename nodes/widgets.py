"""Node widgets built from the settings dataclasses, so a new setting or mode needs no new glue.

Each field of :class:`AccelerationSettings` and :class:`SamplingSettings` becomes one widget: a
``Literal`` field a combo of its values, a bool a BOOLEAN, an int an INT, a float a FLOAT, with the
field's default. ``FIELD_WIDGETS`` adds the tooltip and range users should see; a field it does
not know yet still gets a widget, a generic tooltip and open ranges (the dataclass validates it).

A number that may be None (``int | None``: the core picks the value itself) shows as a number
whose widget reaches below the field's range: any value below it stands for None
(``NONE_WIDGET_VALUES`` holds the value shown by default, ``setting_value`` turns it back).
"""

from __future__ import annotations

import types
import typing
from dataclasses import MISSING, Field, fields

from ..sjd_core.messages import quote
from ..sjd_core.decoding.settings import (DEFAULT_PRESET, PRESETS, RELAXED_RULES,
                                          AccelerationSettings, SamplingSettings)

LOSSY = ("LOSSY: with relaxed acceptance the image no longer follows the model's exact "
         "distribution. ")
BATCH_TOOLTIP = ("Images drawn together. Image b draws with its own random stream (seed + b), "
                 "from the same distribution as when made alone, and its codes equal seed + b made "
                 "alone wherever the batched and single forwards give equal logits. They can "
                 "differ by about 1e-5, so on a long image a draw may flip and the rest of that "
                 "image differ, in every mode.")
AS_MODE = "as mode"  # a switch left to the sampler's mode preset
SWITCH_VALUES = {"on": True, "off": False}
SWITCH_CHOICES = (AS_MODE, *SWITCH_VALUES)
INT_LIMIT = 2**31 - 1

# field -> (tooltip, min, max, step); None keeps the open default.
FIELD_WIDGETS: dict[str, tuple[str, float | None, float | None, float | None]] = {
    "window": ("Codes guessed and checked per forward pass (not used by AR); 1 is plain "
               "autoregression. AUTO takes it as the longest window it may use.", 1, 256, 1),
    "init": ("How codes entering the window are first guessed: uniform = random codes; left = "
             "repeat the code to the left; above = repeat the code above; above_target = draw "
             "from what the model predicted for the code above. All lossless.", None, None,
             None),
    "adaptive_continuation": ("AC: after a rejection, keep later guesses that still fit. "
                              "Lossless.", None, None, None),
    "proactive_drafting": ("PD: try K alternatives for the first D-1 window slots as a tree. "
                           "Lossless.", None, None, None),
    "pd_candidates": ("K: alternatives per slot in the proactive-drafting tree.", 1, 16, 1),
    "pd_depth": ("D: depth of the proactive-drafting tree, counting the root; at most the "
                 "window.", 1, 16, 1),
    "verification_prediction": ("VP: guess codes whose probability kept rising. Lossless.",
                                None, None, None),
    "vp_rises": ("N: rises in a row that make verification prediction prefer a code.", 1, 64, 1),
    "vp_top_k": ("Verification prediction considers only the k most likely codes.", 1, 100_000,
                 1),
    "vp_decay": ("Weight of the past in verification prediction's running average (0 = only "
                 "the latest step).", 0.0, 0.99, 0.01),
    "relaxed": ("none = exact acceptance (lossless). lantern accepts guesses close to the "
                "target in the codebook; gsd accepts guesses near the top of the target's "
                "ranking. Faster, slightly different images.", None, None, None),
    "lantern_neighbours": ("LANTERN k: codebook neighbours whose probability mass a guess may "
                           "borrow. 0 = scaled to the model's codebook (1000 for codebooks of "
                           "8192 codes or more, fewer for smaller ones).", 1, 1_000_000, 1),
    "lantern_delta": ("LANTERN delta: the most probability mass (total variation) a guess may "
                      "borrow. Negative = scaled to the model's codebook (0.1 for codebooks of "
                      "8192 codes or more, less for smaller ones).", 0.0, 1.0, 0.01),
    "gsd_rank_radius": ("GSD: a guess within this many ranks of the top may pass.", 0, 100_000,
                        1),
    "gsd_prob_tolerance": ("GSD: how much less likely than the target's choice a guess may be.",
                           0.0, 10.0, 0.01),
    "gsd_embedding_tolerance": ("GSD: how far (codebook embedding distance) a guess may lie.",
                                0.0, 100.0, 0.01),
    "adaptive_shape": ("AUTO, cost-aware: each step picks the window or draft tree expected to "
                       "commit the most codes per second on this machine, from the speed and "
                       "acceptance it measured, plain autoregression where no window pays "
                       "(learning costs at most 5% of a run); the sampler's window is then the "
                       "longest it may use. Lossless.", None, None, None),
    "adaptive_tree": ("AUTO with PD: try every tree up to K candidates and depth D, with fewer "
                      "candidates where guesses pass more often, and feed the one expected to "
                      "pay most; off: only the full K x D tree. Lossless.", None, None, None),
    "shape_cost": ("What AUTO saves: time = seconds on this machine (measured as it runs); "
                   "passes = forward passes, every shape of at most 'window' nodes counting as "
                   "one (for a GPU with room to spare: window and tree then share that node "
                   "budget). Lossless either way.", None, None, None),
    "compile": ("Run the network compiled. On CUDA it is recorded as CUDA graphs, one per "
                "shape fed, at most 8 per run (about a second each); elsewhere torch.compile's "
                "inductor compiles it (several seconds for the first shape and for the first of "
                "another length, whose graph serves every later length; once per ComfyUI "
                "session). 'on CUDA' (default): on for CUDA only. If compiling fails the "
                "run goes on uncompiled with a warning in the summary. Lossless: the logits "
                "differ from uncompiled ones only by float rounding, so a draw may flip on a long "
                "image and the rest of it differ, from the same distribution.", None, None, None),
    "guidance": ("Classifier-free guidance scale; 1.0 turns guidance off and skips the "
                 "unconditional pass.", 0.0, 30.0, 0.1),
    "temperature": ("Softmax temperature; lower is more conservative.", 0.01, 5.0, 0.01),
    "top_k": ("Keep the k most likely codes; 0 = off, 1 = greedy.", 0, 1_000_000, 1),
    "top_p": ("Nucleus sampling mass; 1.0 = off.", 0.01, 1.0, 0.01),
    "guidance_schedule": ("How the guidance scale varies along the image. constant = the "
                          "guidance above at every code. lumina-mgpt-2 = Lumina-mGPT 2.0's "
                          "official schedule (its recipe's): a guidance of 1.0 stays off, any "
                          "other below 4 becomes 4, one above 4 falls to 4 over the first codes. "
                          "Depends on the code's position only: lossless in every mode.",
                          None, None, None),
}
# Widget defaults that differ from the dataclass default (guidance 1.0 would switch CFG off).
WIDGET_DEFAULTS = {"guidance": 3.0}
# field that may be None -> the widget value that stands for None (below the field's range)
NONE_WIDGET_VALUES = {"lantern_neighbours": 0, "lantern_delta": -1.0}
OWN_WINDOW = 0  # the sampler's window value that keeps the mode's own window
# a setting True, False or None -> the combo label that stands for None (its default)
NONE_SWITCH_LABELS = {"compile": "on CUDA"}


def mode_label(preset: str) -> str:
    """The sampler's combo label of a preset name (``pac+vp`` -> ``PAC+VP``)."""
    return preset.upper()


def mode_choices() -> list[str]:
    """Every preset of ``settings.PRESETS`` as the sampler shows it, in that order."""
    return [mode_label(name) for name in PRESETS]


def default_mode() -> str:
    """The label of ``settings.DEFAULT_PRESET``, the sampler's default mode."""
    return mode_label(DEFAULT_PRESET)


def preset_of(label: str) -> str:
    """The preset name behind a combo label; ValueError naming the choices otherwise."""
    for name in PRESETS:
        if mode_label(name) == label:
            return name
    raise ValueError(f"mode={quote(label)} is not allowed: pick one of {mode_choices()}.")


def as_mode_note(name: str) -> str:
    """What 'as mode' means for a switch: the modes whose preset turns it on."""
    on = [mode_label(preset) for preset in PRESETS
          if getattr(AccelerationSettings.preset(preset), name)]
    where = f"on in {', '.join(on)}" if on else "off in every mode"
    return f"'{AS_MODE}' follows the sampler's mode ({where})."


def is_lossy(name: str) -> bool:
    """True for the relaxed rule and its knobs (``lantern_*``, ``gsd_*``)."""
    return name == "relaxed" or any(name.startswith(rule + "_") for rule in RELAXED_RULES
                                    if rule != "none")


def _default(field: Field) -> object:
    return field.default if field.default is not MISSING else field.default_factory()


def _number_or_none(kind: object) -> type | None:
    """``int`` or ``float`` for a type hint ``int | None`` or ``float | None``; else None."""
    args = typing.get_args(kind)
    if typing.get_origin(kind) not in (typing.Union, types.UnionType) or len(args) != 2 \
            or type(None) not in args:
        return None
    number = next(arg for arg in args if arg is not type(None))
    return number if number in (int, float) else None


def _lowest(name: str) -> float:
    """The lowest value a field's widget offers for a real setting (0 when its range is open)."""
    low = FIELD_WIDGETS.get(name, (None, None, None, None))[1]
    return 0 if low is None else low


def setting_value(cls: type, name: str, value: object) -> object:
    """The setting behind a widget value: None for a value below the range of a field that may
    be None (see ``NONE_WIDGET_VALUES``) or for the label of ``NONE_SWITCH_LABELS``, True and
    False for "on" and "off" there, the value itself otherwise."""
    if name in NONE_SWITCH_LABELS:
        return {NONE_SWITCH_LABELS[name]: None, **SWITCH_VALUES}.get(value, value)
    kind = typing.get_type_hints(cls)[name]
    if _number_or_none(kind) is not None and isinstance(value, (int, float)) \
            and value < _lowest(name):
        return None
    return value


def field_widget(cls: type, name: str, switch: bool = False) -> tuple:
    """The ComfyUI input spec of one dataclass field; ``switch`` makes a bool an 'as mode' combo."""
    hints = typing.get_type_hints(cls)
    field = next(f for f in fields(cls) if f.name == name)
    kind = hints[name]
    tooltip, low, high, step = FIELD_WIDGETS.get(
        name, (f"{name.replace('_', ' ')} (see the node's help page).", None, None, None))
    if is_lossy(name):
        tooltip = LOSSY + tooltip
    default = WIDGET_DEFAULTS.get(name, _default(field))
    if name in NONE_SWITCH_LABELS:
        return ([NONE_SWITCH_LABELS[name], *SWITCH_VALUES],
                {"default": NONE_SWITCH_LABELS[name], "tooltip": tooltip})
    number = _number_or_none(kind)
    if number is not None:
        kind = number
        low = NONE_WIDGET_VALUES.get(name, _lowest(name) - 1)  # values below the range: None
        default = low if default is None else default
    if typing.get_origin(kind) is typing.Literal:
        return (list(typing.get_args(kind)), {"default": default, "tooltip": tooltip})
    if kind is bool:
        if switch:
            return (list(SWITCH_CHOICES), {"default": AS_MODE,
                                           "tooltip": f"{tooltip} {as_mode_note(name)}"})
        return ("BOOLEAN", {"default": default, "tooltip": tooltip})
    options: dict = {"default": default, "tooltip": tooltip}
    if kind is int:
        options.update(min=-INT_LIMIT if low is None else int(low),
                       max=INT_LIMIT if high is None else int(high), step=int(step or 1))
        return ("INT", options)
    if kind is float:
        options.update(min=-1e9 if low is None else low, max=1e9 if high is None else high,
                       step=step or 0.01)
        return ("FLOAT", options)
    raise TypeError(f"{cls.__name__}.{name} has type {quote(kind)}, which no widget shows.")


def window_widget() -> tuple:
    """The sampler's window: the setting's widget, where ``OWN_WINDOW`` (the default) keeps each
    mode's own window, so AUTO gets its longest window and SJD / PAC / PAC+VP theirs."""
    kind, options = field_widget(AccelerationSettings, "window")
    own = ", ".join(f"{mode_label(name)} {AccelerationSettings.preset(name).window}"
                    for name in PRESETS if AccelerationSettings.preset(name).window > 1)
    return (kind, options | {"default": OWN_WINDOW, "min": OWN_WINDOW,
                             "tooltip": f"{options['tooltip']} {OWN_WINDOW} = the mode's own "
                                        f"window ({own})."})


def chosen_window(value: int) -> int | None:
    """The window the sampler's widget asks for; None keeps the mode's own."""
    return None if value == OWN_WINDOW else value


# settings the nodes leave at their default: compiling the stages is not measured on a GPU yet
TOOL_ONLY = ("compile_stages",)


def acceleration_option_fields() -> list[str]:
    """The fields of the SJD Acceleration Options node: every AccelerationSettings field but
    ``window``, which sits on the sampler, and those in ``TOOL_ONLY``."""
    return [f.name for f in fields(AccelerationSettings)
            if f.name != "window" and f.name not in TOOL_ONLY]


def sampling_fields() -> list[str]:
    """The fields of the SJD Sampling Options node: every SamplingSettings field."""
    return [f.name for f in fields(SamplingSettings)]


def switches() -> set[str]:
    """The on/off fields of AccelerationSettings (AC, PD, VP, and any added later)."""
    hints = typing.get_type_hints(AccelerationSettings)
    return {f.name for f in fields(AccelerationSettings)
            if hints[f.name] is bool and f.name not in TOOL_ONLY}


# option node key -> the AccelerationSettings fields its widgets set, in widget order; together
# they are ``acceleration_option_fields()`` (a test checks it)
OPTION_GROUPS: dict[str, tuple[str, ...]] = {
    "SJDDraftingOptions": ("init", "adaptive_continuation", "proactive_drafting",
                           "pd_candidates", "pd_depth", "verification_prediction", "vp_rises",
                           "vp_top_k", "vp_decay"),
    "SJDLossyAcceptance": ("relaxed", "lantern_neighbours", "lantern_delta", "gsd_rank_radius",
                           "gsd_prob_tolerance", "gsd_embedding_tolerance"),
    "SJDSpeedOptions": ("adaptive_shape", "adaptive_tree", "shape_cost", "compile"),
}


def option_widgets(names: tuple[str, ...]) -> dict[str, tuple]:
    """The widgets of these AccelerationSettings fields; on/off fields as 'as mode' combos."""
    return {name: field_widget(AccelerationSettings, name, switch=True) for name in names}
