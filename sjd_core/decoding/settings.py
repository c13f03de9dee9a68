"""User-facing settings of the sampler, validated once, in one place.

Every mode of the engine is a combination of these options: ``window=1`` is plain autoregression,
``window>1`` is speculative Jacobi decoding, and AC, PD, VP and relaxed acceptance are switches on
top of it. Presets name the combinations users ask for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Literal

from ..messages import quote

InitRule = Literal["uniform", "left", "above", "above_target"]
RelaxedRule = Literal["none", "lantern", "gsd"]
ShapeCost = Literal["time", "passes"]
GuidanceSchedule = Literal["constant", "lumina-mgpt-2"]

INIT_RULES: tuple[str, ...] = ("uniform", "left", "above", "above_target")
SHAPE_COSTS: tuple[str, ...] = ("time", "passes")
RELAXED_RULES: tuple[str, ...] = ("none", "lantern", "gsd")
GUIDANCE_SCHEDULES: tuple[str, ...] = ("constant", "lumina-mgpt-2")  # see :mod:`.guidance`
PRESETS: tuple[str, ...] = ("auto", "ar", "sjd", "pac", "pac+vp")
DEFAULT_PRESET = "auto"  # what the nodes, the demo and the benchmarks run unless told otherwise

# Limits that keep every run finite: larger values would only allocate without end. The nodes'
# widgets stop at the same values; these hold for the API and for edited workflow files too.
MAX_WINDOW = 256
MAX_PD_CANDIDATES = 16
MAX_PD_DEPTH = 16
MAX_TREE_NODES = 1024  # nodes one forward feeds: the PD tree plus the chain after it


def require(condition: bool, setting: str, value: object, allowed: str) -> None:
    """Raise ValueError naming the setting, its value (quoted) and what is allowed, unless
    ``condition`` holds."""
    if not condition:
        raise ValueError(f"{setting}={quote(value)} is not allowed: {setting} must be {allowed}.")


def _finite(setting: str, value: float) -> None:
    require(isinstance(value, (int, float)) and math.isfinite(value), setting, value,
             "a finite number (not NaN or infinity)")


def _no_bool(setting: str, value: object, allowed: str) -> None:
    """``True`` and ``False`` are ints to Python; refuse them where a number is meant."""
    require(not isinstance(value, bool), setting, value, allowed)


def tree_nodes(window: int, candidates: int, depth: int) -> int:
    """Nodes one forward feeds: the PD tree (``candidates`` children per node, ``depth`` levels
    counting the root) plus the chain to the end of the window; a plain window is a chain."""
    levels = depth - 1 if candidates > 1 else 0
    return sum(candidates ** level for level in range(levels + 1)) + window - 1 - levels


def _auto_within(base: dict, window: object, overridden: set[str]) -> dict:
    """``auto``'s preset fitted into ``window``: its tree no deeper than the window, and at
    window 1 (where nothing is drafted) plain autoregression. Only what the caller did not set
    is fitted; a window that is no integer is left for the settings' own check to refuse."""
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        return base
    fitted = dict(base)
    if "pd_depth" not in overridden:
        fitted["pd_depth"] = max(2, min(base["pd_depth"], window))
    if window == 1:
        fitted.update({name: False for name in ("adaptive_continuation", "proactive_drafting",
                                                 "adaptive_shape") if name not in overridden})
    return fitted


@dataclass(frozen=True)
class SamplingSettings:
    """How logits become the target distribution: CFG -> temperature -> top-k -> top-p.

    ``top_k=0`` and ``top_p=1.0`` switch those filters off. Greedy decoding is ``top_k=1``.
    ``guidance=1.0`` means no classifier-free guidance (the unconditional context is not run).
    ``guidance_schedule`` is how the scale varies along the image: ``constant`` (``guidance``
    at every code) or ``lumina-mgpt-2`` (Lumina-mGPT 2.0's official sampler, which starts from
    ``guidance`` and never guides below 4); see :mod:`.guidance`. A schedule depends on the
    code's position alone, so every mode stays exact.
    """

    guidance: float = 1.0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    guidance_schedule: GuidanceSchedule = "constant"  # last: saved node widgets stay in place

    def __post_init__(self) -> None:
        for name in ("guidance", "temperature", "top_p"):
            _finite(name, getattr(self, name))
        require(self.guidance >= 0, "guidance", self.guidance, ">= 0 (1.0 = no guidance)")
        require(isinstance(self.guidance_schedule, str)
                and self.guidance_schedule in GUIDANCE_SCHEDULES, "guidance_schedule",
                self.guidance_schedule, f"one of {GUIDANCE_SCHEDULES}")
        require(self.temperature > 0, "temperature", self.temperature,
                 "> 0 (for greedy decoding set top_k=1)")
        require(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", self.top_k,
                 "an integer >= 0 (0 = off, 1 = greedy)")
        require(0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1] (1.0 = off)")
        _no_bool("top_k", self.top_k, "an integer >= 0 (0 = off, 1 = greedy)")

    @classmethod
    def of_recipe(cls, recipe: object, **overrides: object) -> "SamplingSettings":
        """The settings of an official recipe (an object with these settings' fields by name,
        such as a model's ``SamplingDefaults``; a field it lacks keeps its default), with
        ``overrides`` on top."""
        return cls(**{f.name: getattr(recipe, f.name, f.default) for f in fields(cls)} | overrides)


@dataclass(frozen=True)
class AccelerationSettings:
    """Which speculative decoding mode runs, as options of one loop.

    window: slots that can be committed per forward pass; 1 is plain autoregression (AR). With
        ``adaptive_shape`` the longest window the plan may feed.
    init: how slots entering the window are first drafted: ``uniform`` random codes; ``left``
        (repeat the code to the left in the same row; the first column falls back to uniform);
        ``above`` (repeat the code above in the same column; the first row falls back to left);
        ``above_target`` (draw from the committed target distribution of the slot above; the
        first row falls back to left). Lossless, all of them.
    adaptive_continuation (AC): after a rejection, couple each later draft to its new target
        instead of re-drawing it, so good drafts survive. Lossless.
    proactive_drafting (PD): draft ``pd_candidates`` (K) alternatives for each of the first
        ``pd_depth - 1`` window slots as a tree (depth counts the root). Lossless.
    verification_prediction (VP): draw drafts from a distribution biased towards codes whose
        probability rose ``vp_rises`` (N) iterations in a row, among the ``vp_top_k`` most likely;
        ``vp_decay`` weighs the running average of past distributions. Lossless.
    relaxed: ``none`` (exact), ``lantern`` or ``gsd``. LOSSY: the output is no longer exactly the
        model's distribution.
    adaptive_shape (auto): every iteration feed the shape (plain autoregression, a window of
        any length up to ``window``, with or without a PD tree up to ``pd_candidates`` x
        ``pd_depth``) expected to commit the most codes per second, from this model's measured
        costs and acceptance so far. Lossless.
    adaptive_tree: with ``adaptive_shape`` and PD, every tree within ``pd_candidates`` x
        ``pd_depth`` competes, with its own number of candidates per level (fewer where drafts
        pass more often), instead of only the full K x D tree. Lossless; without both it has no
        effect.
    shape_cost: what ``adaptive_shape`` spends per committed code: ``time``, as measured on this
        machine, or ``passes``: every shape of at most ``window`` nodes costs one forward pass (a
        device with room to spare), so the window and the tree share that node budget. Lossless.
    compile: run the network compiled (:func:`sjd_core.compiled.backend`): on CUDA recorded as
        CUDA graphs, one per fed shape, at most 8 per generation (later shapes run uncompiled; one
        launch per forward instead of one per kernel, which bounds a decoding step of a large
        model); elsewhere compiled by inductor (``torch.compile``) with automatic dynamic sizes:
        the first shape compiles, and the first of another length compiles one graph that serves
        every later one (seconds each on a CPU, on the first generation of a process). None (the
        default): on for CUDA only (see ``compiles_on``). Where compiling fails the run goes on
        uncompiled, with a warning. Lossless: compiled logits differ from uncompiled ones only by
        float rounding (about 1e-6 to 1e-5), so the distribution is the same, but on a long image
        a draw may flip and the rest of that image differ, as between batch sizes.
    compile_stages: also compile the speculative iteration's stages (draft, verify, commit,
        advance: some 400 small operations per PAC+VP iteration, each a kernel launch on a GPU),
        as two calls (draft; verify, commit and advance), and plain autoregression's step after
        the network (target, draw, commit) as one, each whole, by inductor with automatic
        dynamic sizes (on CUDA in its CUDA-graph mode, ``mode="reduce-overhead"``). Off by
        default, and not on the nodes, until a GPU run shows that it pays (``python -m
        sjd_core.tools.gpu_check`` times it): on a CPU it costs seconds of compiling per graph and
        pays only where verifying over a large codebook is a large part of an iteration.
        Lossless, as ``compile``.
    """

    window: int = 16
    init: InitRule = "uniform"
    adaptive_continuation: bool = False
    proactive_drafting: bool = False
    pd_candidates: int = 4
    pd_depth: int = 3
    verification_prediction: bool = False
    vp_rises: int = 3
    vp_top_k: int = 50
    vp_decay: float = 0.5
    relaxed: RelaxedRule = "none"
    lantern_neighbours: int | None = None  # None: scaled to the codebook (see verify)
    lantern_delta: float | None = None  # None: scaled to the codebook (see verify)
    gsd_rank_radius: int = 7
    gsd_prob_tolerance: float = 0.15
    gsd_embedding_tolerance: float = 0.5
    adaptive_shape: bool = False
    adaptive_tree: bool = False
    shape_cost: ShapeCost = "time"
    compile: bool | None = None
    compile_stages: bool = False

    def __post_init__(self) -> None:
        require(isinstance(self.window, int) and self.window >= 1, "window", self.window,
                 "an integer >= 1 (1 = plain autoregression)")
        require(self.init in INIT_RULES, "init", self.init, f"one of {INIT_RULES}")
        require(self.relaxed in RELAXED_RULES, "relaxed", self.relaxed,
                 f"one of {RELAXED_RULES}")
        require(self.shape_cost in SHAPE_COSTS, "shape_cost", self.shape_cost,
                 f"one of {SHAPE_COSTS}")
        require(isinstance(self.pd_candidates, int) and self.pd_candidates >= 1,
                 "pd_candidates", self.pd_candidates, "an integer >= 1")
        require(isinstance(self.pd_depth, int) and self.pd_depth >= 1, "pd_depth",
                 self.pd_depth, "an integer >= 1")
        require(isinstance(self.vp_rises, int) and self.vp_rises >= 1, "vp_rises",
                 self.vp_rises, "an integer >= 1")
        require(isinstance(self.vp_top_k, int) and self.vp_top_k >= 1, "vp_top_k",
                 self.vp_top_k, "an integer >= 1")
        _finite("vp_decay", self.vp_decay)
        require(0 <= self.vp_decay < 1, "vp_decay", self.vp_decay, "in [0, 1)")
        require(self.lantern_neighbours is None or (isinstance(self.lantern_neighbours, int)
                                                     and self.lantern_neighbours >= 1),
                 "lantern_neighbours", self.lantern_neighbours,
                 "an integer >= 1, or None (scaled to the codebook)")
        for name in ("lantern_delta", "gsd_prob_tolerance", "gsd_embedding_tolerance"):
            if getattr(self, name) is None and name == "lantern_delta":
                continue
            _finite(name, getattr(self, name))
            require(getattr(self, name) >= 0, name, getattr(self, name), ">= 0")
        require(self.lantern_delta is None or self.lantern_delta <= 1, "lantern_delta",
                 self.lantern_delta, "in [0, 1], or None (scaled to the codebook)")
        require(isinstance(self.gsd_rank_radius, int) and self.gsd_rank_radius >= 0,
                 "gsd_rank_radius", self.gsd_rank_radius, "an integer >= 0")
        self._check_speculative()
        self._check_limits()

    def _check_speculative(self) -> None:
        """What needs drafts needs a window above 1, and a PD tree fits inside the window."""
        speculative = self.window > 1
        for name in ("adaptive_continuation", "proactive_drafting", "verification_prediction",
                     "adaptive_shape"):
            require(not getattr(self, name) or speculative, name, getattr(self, name),
                     "False when window=1 (plain autoregression has no drafts); raise window")
        require(self.relaxed == "none" or speculative, "relaxed", self.relaxed,
                 "'none' when window=1 (plain autoregression has no drafts); raise window")
        if self.proactive_drafting:
            require(self.pd_depth <= self.window, "pd_depth", self.pd_depth,
                     f"<= window ({self.window}); the tree lives inside the window")
            require(self.pd_depth >= 2, "pd_depth", self.pd_depth,
                     ">= 2 with proactive drafting (depth counts the root)")

    def _check_limits(self) -> None:
        """The upper limits (``MAX_*``), and switches and counts of the right Python type."""
        _no_bool("window", self.window, "an integer >= 1 (1 = plain autoregression)")
        require(self.window <= MAX_WINDOW, "window", self.window,
                 f"an integer in [1, {MAX_WINDOW}] (1 = plain autoregression)")
        for name, high in (("pd_candidates", MAX_PD_CANDIDATES), ("pd_depth", MAX_PD_DEPTH)):
            value = getattr(self, name)
            _no_bool(name, value, "an integer >= 1")
            require(value <= high, name, value, f"an integer in [1, {high}]")
        for name in ("vp_rises", "vp_top_k", "lantern_neighbours", "gsd_rank_radius"):
            _no_bool(name, getattr(self, name), "an integer")
        for name in ("adaptive_continuation", "proactive_drafting", "verification_prediction",
                     "adaptive_shape", "adaptive_tree", "compile_stages"):
            require(isinstance(getattr(self, name), bool), name, getattr(self, name),
                     "True or False")
        require(self.compile is None or isinstance(self.compile, bool), "compile", self.compile,
                 "True, False or None (on for CUDA only)")
        if self.proactive_drafting:
            nodes = tree_nodes(self.window, self.pd_candidates, self.pd_depth)
            require(nodes <= MAX_TREE_NODES, "pd_depth", self.pd_depth,
                     f"small enough that one forward feeds at most {MAX_TREE_NODES} nodes: "
                     f"pd_candidates={self.pd_candidates}, pd_depth={self.pd_depth} and "
                     f"window={self.window} would feed {nodes:,}; lower pd_candidates or pd_depth")

    def for_codebook(self, codebook_size: int) -> "AccelerationSettings":
        """These settings on a model of ``codebook_size`` codes: ``auto`` tries at most as many
        candidates per slot as there are codes (no tree on a codebook of one code); a fixed
        mode with more PD candidates than codes is refused (:meth:`check_codebook`)."""
        if self.adaptive_shape and self.proactive_drafting and self.pd_candidates > codebook_size:
            return replace(self, pd_candidates=codebook_size,
                           proactive_drafting=codebook_size >= 2)
        self.check_codebook(codebook_size)
        return self

    def check_codebook(self, codebook_size: int) -> None:
        """Refuse what a model with ``codebook_size`` codes cannot draft (before any work)."""
        if self.proactive_drafting:
            require(self.pd_candidates <= codebook_size, "pd_candidates", self.pd_candidates,
                     f"at most the model's codebook size ({codebook_size}): a slot has no more "
                     "distinct codes to try")

    def compiles_on(self, device_type: str) -> bool:
        """Whether the network runs compiled on a device of this type (``"cuda"``, ``"cpu"``...):
        ``compile``, or where it is None, on CUDA only (CUDA graphs pay from the first
        generation on; inductor's compile time pays only over many images)."""
        return device_type == "cuda" if self.compile is None else self.compile

    @property
    def lossless(self) -> bool:
        """True when the output follows the model's own distribution exactly."""
        return self.relaxed == "none"

    @property
    def mode_name(self) -> str:
        """A short human label such as ``SJD+AC+PD+VP+LANTERN`` (``AR`` for window 1)."""
        if self.window == 1:
            return "AR"
        parts = ["AUTO" if self.adaptive_shape else "SJD"]
        # auto's label names only what differs from its own preset (AC and PD on, VP off)
        parts += [tag for tag, on in (("AC", self.adaptive_continuation),
                                      ("PD", self.proactive_drafting),
                                      ("VP", self.verification_prediction))
                  if on and not (self.adaptive_shape and tag != "VP")]
        if self.relaxed != "none":
            parts.append(self.relaxed.upper())
        return "+".join(parts)

    @classmethod
    def preset(cls, name: str, **overrides: object) -> "AccelerationSettings":
        """``auto``, ``ar``, ``sjd``, ``pac`` (SJD+AC+PD) or ``pac+vp``, with optional overrides.

        ``auto`` is cost-aware speculation with everything that pays on its own: AC, drafts for
        new slots from the target above, PD trees and windows up to 32 chosen per iteration. With
        a shorter ``window`` its trees are only as deep as the window (depth 2 at window 2), and
        at window 1 it is plain autoregression.
        """
        base = {
            "auto": dict(window=32, init="above_target", adaptive_continuation=True,
                         proactive_drafting=True, pd_candidates=3, pd_depth=3,
                         adaptive_shape=True),
            "ar": dict(window=1),
            "sjd": dict(),
            "pac": dict(adaptive_continuation=True, proactive_drafting=True),
            "pac+vp": dict(adaptive_continuation=True, proactive_drafting=True,
                           verification_prediction=True),
        }
        require(isinstance(name, str), "preset", name, f"one of {PRESETS}")
        key = name.lower().replace(" ", "")
        require(key in base, "preset", name, f"one of {PRESETS}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - known)
        require(not unknown, "override", unknown, f"names of AccelerationSettings fields {sorted(known)}")
        chosen = base[key]
        if key == "auto":
            chosen = _auto_within(chosen, overrides.get("window", chosen["window"]), set(overrides))
        return replace(cls(**chosen), **overrides)
