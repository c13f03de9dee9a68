"""The all-in-one sampler of the pack's first release, kept so that saved workflows load and run.

New workflows use SJD Sampler with the SJD Acceleration Options and SJD Sampling Options nodes;
this node is hidden from the node library (``DEPRECATED``) and takes every setting as a widget.
Its widgets and their order must not change: saved workflows store widget values by position.
"""

from __future__ import annotations

from ..sjd_core.messages import quote
from ..sjd_core.decoding.settings import INIT_RULES, RELAXED_RULES, AccelerationSettings, SamplingSettings
from .generation import RESOLUTIONS, Prompting, check_resolution, run_sampler
from .handles import (CODES_TYPE, CUSTOM, FAMILY_RECIPE, MODEL_TYPE, TRACE_TYPE, LoadedModel,
                      SamplingChoice)
from .widgets import BATCH_TOOLTIP, FIELD_WIDGETS, LOSSY

NODE = "SJD Sampler (all options, old)"
MODES = {"PAC+VP": "pac+vp", "PAC": "pac", "SJD": "sjd", "AR": "ar", "custom": None}
DEFAULT_MODE = "PAC+VP"
SAMPLING_CHOICES = (FAMILY_RECIPE, CUSTOM)
SWITCHES = ("adaptive_continuation", "proactive_drafting", "verification_prediction")
PROMPTING = ("prompt", "negative_prompt", "resolution", "batch_size", "seed")


def _int(default: int, low: int, high: int, tooltip: str, step: int = 1) -> tuple:
    return ("INT", {"default": default, "min": low, "max": high, "step": step, "tooltip": tooltip})


def _float(default: float, low: float, high: float, step: float, tooltip: str) -> tuple:
    return ("FLOAT", {"default": default, "min": low, "max": high, "step": step,
                      "tooltip": tooltip})


def _bool(default: bool, tooltip: str) -> tuple:
    return ("BOOLEAN", {"default": default, "tooltip": tooltip})


def acceleration_settings(mode: str, widgets: dict) -> AccelerationSettings:
    """The engine's settings for a mode preset (or ``custom``) and the node's widget values.

    A preset fixes which of AC / PD / VP are on (and ``AR`` fixes window=1); ``custom`` takes the
    switches as they are. Every other setting applies in every mode.
    """
    if mode not in MODES:
        raise ValueError(f"{NODE}: mode={quote(mode)} is not allowed: pick one of {list(MODES)}.")
    names = {f for f in AccelerationSettings.__dataclass_fields__} - set(SWITCHES) - {"window"}
    shared = {name: widgets[name] for name in names if name in widgets}
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
        return SamplingSettings(**{name: widgets[name] for name in
                                   ("guidance", "temperature", "top_k", "top_p")})
    except ValueError as error:
        raise ValueError(f"{NODE}: {error}") from error


class SJDSamplerLegacy:
    """The first release's sampler: every setting as a widget (hidden; for saved workflows)."""

    DEPRECATED = True
    DESCRIPTION = ("The first release's all-in-one sampler, kept so that saved workflows run; new "
                   "workflows use SJD Sampler with the SJD Acceleration Options and SJD Sampling "
                   "Options nodes. Draws images as code grids with speculative Jacobi decoding "
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
        return {
            "required": {
                "model": (MODEL_TYPE, {"tooltip": "A model from SJD Model Loader."}),
                "prompt": ("STRING", {
                    "multiline": True, "default": "sneaker",
                    "tooltip": "What to draw. The embedded reference model takes a Fashion-MNIST "
                               "class name (t-shirt, trouser, pullover, dress, coat, sandal, "
                               "shirt, sneaker, bag, ankle boot)."}),
                "negative_prompt": ("STRING", {
                    "multiline": True, "default": "",
                    "tooltip": "What to steer away from with guidance; empty uses the family's "
                               "unconditional context. Ignored when guidance is 1.0."}),
                "resolution": (list(RESOLUTIONS), {
                    "default": "default",
                    "tooltip": "Image size in pixels (width x height). 'default' is the family's "
                               "own size; the Loader's info output lists every size the loaded "
                               "model supports."}),
                "batch_size": _int(1, 1, 64, BATCH_TOOLTIP),
                "seed": ("INT", {"default": 0, "min": 0, "max": 2**53 - 1,
                                 "control_after_generate": True,
                                 "tooltip": "Random seed; the same seed and settings give the "
                                            "same image. Lossless modes draw from the same "
                                            "distribution but not the same sample per seed."}),
                "sampling": (list(SAMPLING_CHOICES), {
                    "default": FAMILY_RECIPE,
                    "tooltip": "'family recipe' uses the model's official guidance, temperature, "
                               "top-k and top-p (see the Loader's info); 'custom' uses the four "
                               "inputs below."}),
                "guidance": _float(3.0, 0.0, 30.0, 0.1,
                                   "Classifier-free guidance scale (custom sampling only); 1.0 "
                                   "turns guidance off and skips the unconditional pass."),
                "temperature": _float(1.0, 0.01, 5.0, 0.01,
                                      "Softmax temperature (custom sampling only); lower is "
                                      "more conservative."),
                "top_k": _int(0, 0, 1_000_000, "Keep the k most likely codes (custom sampling "
                                               "only); 0 = off, 1 = greedy."),
                "top_p": _float(1.0, 0.01, 1.0, 0.01,
                                "Nucleus sampling mass (custom sampling only); 1.0 = off."),
                "mode": (list(MODES), {
                    "default": DEFAULT_MODE,
                    "tooltip": "AR: plain autoregression, one code per forward pass. SJD: "
                               "speculative Jacobi decoding. PAC: SJD with adaptive continuation "
                               "and proactive drafting. PAC+VP: PAC with verification "
                               "prediction. All four are lossless. custom: use the AC / PD / VP "
                               "toggles below."}),
                "window": _int(16, 1, 256, "Codes guessed and checked per forward pass (not used "
                                           "by AR); 1 is plain autoregression."),
                "init": (list(INIT_RULES), {"default": "uniform",
                                            "tooltip": FIELD_WIDGETS["init"][0]}),
                "adaptive_continuation": _bool(True, "AC (custom mode only): after a rejection, "
                                                     "keep later guesses that still fit. "
                                                     "Lossless."),
                "proactive_drafting": _bool(True, "PD (custom mode only): try K alternatives "
                                                  "for the first D-1 window slots as a tree. "
                                                  "Lossless."),
                "pd_candidates": _int(4, 1, 16, "K: alternatives per slot in the PD tree."),
                "pd_depth": _int(3, 1, 16, "D: depth of the PD tree, counting the root; at most "
                                           "the window."),
                "verification_prediction": _bool(True, "VP (custom mode only): guess codes whose "
                                                       "probability kept rising. Lossless."),
                "vp_rises": _int(3, 1, 64, "N: rises in a row that make VP prefer a code."),
                "vp_top_k": _int(50, 1, 100_000, "VP considers only the k most likely codes."),
                "vp_decay": _float(0.5, 0.0, 0.99, 0.01,
                                   "Weight of the past in VP's running average (0 = only the "
                                   "latest step)."),
                "relaxed": (list(RELAXED_RULES), {
                    "default": "none",
                    "tooltip": "none = exact acceptance (lossless). " + LOSSY + "lantern accepts "
                               "guesses close to the target in the codebook; gsd accepts guesses "
                               "near the top of the target's ranking. Faster, slightly different "
                               "images."}),
                "lantern_neighbours": _int(1000, 1, 1_000_000,
                                           LOSSY + "LANTERN k: codebook neighbours whose "
                                                   "probability mass a guess may borrow."),
                "lantern_delta": _float(0.1, 0.0, 1.0, 0.01,
                                        LOSSY + "LANTERN delta: the most probability mass (total "
                                                "variation) a guess may borrow."),
                "gsd_rank_radius": _int(7, 0, 100_000, LOSSY + "GSD: a guess within this many "
                                                               "ranks of the top may pass."),
                "gsd_prob_tolerance": _float(0.15, 0.0, 10.0, 0.01,
                                             LOSSY + "GSD: how much less likely than the target's "
                                                     "choice a guess may be."),
                "gsd_embedding_tolerance": _float(0.5, 0.0, 100.0, 0.01,
                                                  LOSSY + "GSD: how far (codebook embedding "
                                                          "distance) a guess may lie."),
            },
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
