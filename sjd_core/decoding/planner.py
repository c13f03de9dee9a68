"""Which shape each iteration feeds: the mode's own shape, or the one ``auto`` expects to pay most.

A plan answers ``choose()`` before every iteration with a :class:`~.drafting.DraftTree` and is
told afterwards what that iteration committed (``observe``). Because the choice uses only
iterations that are over, it never depends on the draws of the iteration it shapes, and every
lossless shape, chosen this way, keeps the output exactly the model's distribution.

``auto`` (:class:`AutoPlan`) picks among plain autoregression, windows of several lengths and
windows with a proactive-drafting tree the shape expected to commit the most codes per second on
this model and machine (see the class docstring).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np
import torch

from ..models.protocol import GenerationRequest, ImageTokenModel
from .drafting import DraftTree
from .settings import AccelerationSettings, SamplingSettings


def describe_shape(tree: DraftTree) -> str:
    """A short label: ``AR``, ``window 8`` or ``window 16, PD 4x3`` (K candidates, depth D)."""
    if tree.window == 1:
        return "AR"
    if tree.tree_levels:
        return f"window {tree.window}, PD {tree.branching}x{tree.tree_levels + 1}"
    return f"window {tree.window}"


class Plan(Protocol):
    """Chooses the shape of every iteration."""

    max_nodes: int  # the most nodes any chosen shape feeds
    mode_name: str

    def choose(self) -> DraftTree:
        """The shape of the next iteration."""
        ...

    def observe(self, tree: DraftTree, rows: list[int], accepted: list[int], warm: bool) -> None:
        """What the iteration just fed as ``tree`` committed for each image ``rows[i]``;
        ``warm`` is False when its drafts were only just initialised."""
        ...

    def notes(self) -> dict:
        """What the plan wants recorded in the trace's meta."""
        ...


class FixedPlan:
    """Every iteration feeds the shape the settings name."""

    def __init__(self, settings: AccelerationSettings, device: torch.device) -> None:
        self.tree = DraftTree.for_settings(settings, device)
        self.max_nodes = self.tree.size
        self.mode_name = settings.mode_name

    def choose(self) -> DraftTree:
        return self.tree

    def observe(self, tree: DraftTree, rows: list[int], accepted: list[int], warm: bool) -> None:
        return None

    def notes(self) -> dict:
        return {}


_MEMORY = 0.98  # per counted iteration: what the acceptance counts remember
_HYSTERESIS = 0.05  # another shape must be expected this much faster to be switched to
_PROBE = 64  # iterations between two runs of the longest window when it is itself the best
_PROBE_RUN = 10  # iterations per run of the longest window; the first few settle, uncounted
_SETTLE = 5  # iterations of a run not counted: slots it adds were never fed before
_PRIOR_HAZARD = 0.3  # rejection rate assumed at a depth before any draft was tested there
_LENGTHS = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)

@dataclass
class _Profile:
    """What ``auto`` learnt about one model, device, batch and settings; kept across generations.

    ``at_risk``/``stopped``: decayed counts of drafts tested and rejected at each depth of a
    window (a draft at depth j is tested when the j - 1 before it passed). ``tree_gain``: codes
    per iteration of tree shapes over what the window alone is expected to give.
    ``seconds``: exponentially weighted seconds per iteration by fed node count (1: the plain
    autoregressive step).
    """

    window: int
    at_risk: np.ndarray = None
    stopped: np.ndarray = None
    tree_gain: float = 1.0
    seconds: dict[int, float] = field(default_factory=dict)
    generations: int = 0
    until_probe: int = 0  # iterations left before the next run of the longest window
    current: int = -1  # index of the shape the last generation ended with

    def __post_init__(self) -> None:
        self.at_risk = np.zeros(self.window)
        self.stopped = np.zeros(self.window)

    def time(self, nodes: int, seconds: float) -> None:
        old = self.seconds.get(nodes)
        self.seconds[nodes] = seconds if old is None else old + 0.2 * (seconds - old)


# Profiles live as long as their model: {model: {key: _Profile}}.
_PROFILES: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()


def largest_shape(settings: AccelerationSettings) -> int:
    """The most nodes one forward of ``settings`` feeds (for ``auto``, over all its shapes)."""
    device = torch.device("cpu")
    if settings.adaptive_shape and settings.proactive_drafting:
        return DraftTree.build(settings.window, settings.pd_candidates, settings.pd_depth,
                               device).size
    return DraftTree.for_settings(settings, device).size


class AutoPlan:
    """Cost-aware speculation: every iteration, the shape expected to commit the most codes per
    second.

    Expected codes of a window of ``L`` slots: ``1 + sum_{j < L} S(j)``, where ``S(j)`` is the
    chance that the first ``j`` drafts pass. ``S`` is estimated per depth (a survival estimate:
    a draft at depth j counts only where the j - 1 before it passed) on the longest window, in
    its settled iterations: drafts there have been refined as often as they can be, and the
    estimate then predicts shorter windows well, while an estimate made on a short window would
    see its drafts less refined and underrate every longer one. So the longest window (in turn
    with and without its tree) runs now and then for a few iterations, more rarely the more it
    costs against the best shape. A tree's expected codes are the window's times the gain trees
    showed there. The cost of a shape is its measured seconds per iteration, or a line in fed
    nodes through the shapes measured so far; plain autoregression (its own, leaner step)
    competes with its own measured time. The iterations themselves are the timing probes, so
    measuring costs no extra forward pass. What is learnt is kept for the next generation with
    the same model, device, batch and settings.
    """

    def __init__(self, settings: AccelerationSettings, model: ImageTokenModel,
                 request: GenerationRequest, sampling: SamplingSettings, device: torch.device,
                 seconds_of: Callable[[int], float | None]) -> None:
        self.settings, self.device = settings, device
        self.max_nodes = largest_shape(settings)
        self.mode_name = settings.mode_name
        self.seconds_of = seconds_of  # seconds of iteration i, None while not known yet
        lengths = [n for n in _LENGTHS if n < settings.window] + [settings.window]
        self.shapes = [DraftTree.build(1, 1, 1, device)]
        self.shapes += [DraftTree.build(n, 1, 1, device) for n in lengths]
        self.probes = [self.shapes[-1]]  # the longest window, and its tree
        if settings.proactive_drafting:
            trees = [DraftTree.build(n, settings.pd_candidates, settings.pd_depth, device)
                     for n in lengths if n >= settings.pd_depth]
            self.shapes += trees
            self.probes.append(trees[-1])
        key = (str(device), request.batch_size, sampling, settings, request.resolution)
        try:
            profiles = _PROFILES.setdefault(model, {})
        except TypeError:  # a model that cannot be weakly referenced keeps no profile
            profiles = {}
        self.profile = profiles.setdefault(key, _Profile(settings.window))
        self.profile.generations += 1
        short = next(t for t in self.shapes if t.window == min(4, settings.window))
        # a new profile times AR and a short window once (the costs), then runs the probes
        self.queue = [self.shapes[0], short] if self.profile.generations == 1 else []
        self.current = (self.shapes[self.profile.current] if self.profile.current >= 0
                        else self.probes[0])
        self.previous: DraftTree | None = None
        self.run = 0  # iterations in a row of the same shape
        self.probes_made = 0
        self.pending: list[tuple[int, int]] = []  # (iteration, fed nodes) not timed yet
        self.iteration = 0

    # ------------------------------------------------------------------ choosing
    def choose(self) -> DraftTree:
        if self.queue:
            return self.queue.pop(0)
        self.profile.until_probe -= 1
        if self.profile.until_probe <= 0:
            probe = self.probes[self.probes_made % len(self.probes)]
            self.probes_made += 1
            self.queue = [probe] * (_PROBE_RUN - 1)
            survival = self._survival()
            best = max(self._rate(shape, survival) for shape in self.shapes)
            cost = best / max(self._rate(probe, survival), 1e-12)  # >= 1: how much slower
            self.profile.until_probe = int(_PROBE * cost * cost)
            return probe
        survival = self._survival()
        rates = [self._rate(shape, survival) for shape in self.shapes]
        best = max(range(len(self.shapes)), key=rates.__getitem__)
        if rates[best] > self._rate(self.current, survival) * (1 + _HYSTERESIS):
            self.current = self.shapes[best]
        return self.current

    def _survival(self) -> np.ndarray:
        """``S(j)``, j = 0 .. window - 1: the chance that the first j drafts pass.

        Each depth's rejection rate has a weak prior.
        """
        at_risk, stopped = self.profile.at_risk[1:], self.profile.stopped[1:]
        hazard = (stopped + _PRIOR_HAZARD) / (at_risk + 1.0)
        return np.concatenate([[1.0], np.cumprod(1.0 - hazard)])

    def _rate(self, shape: DraftTree, survival: np.ndarray) -> float:
        """Expected codes per second of ``shape``."""
        if shape.window == 1:
            codes = 1.0
        else:
            codes = float(survival[:shape.window].sum())
            if shape.tree_levels:
                codes *= self.profile.tree_gain
        return codes / self._seconds(shape)

    def _seconds(self, shape: DraftTree) -> float:
        """Measured seconds per iteration, or a line in fed nodes through the measured shapes."""
        measured = self.profile.seconds
        if shape.size in measured and (shape.window > 1) == (shape.size > 1):
            return measured[shape.size]
        points = [(nodes, seconds) for nodes, seconds in measured.items() if nodes > 1]
        if len(points) >= 2:
            slope, intercept = np.polyfit(*np.array(points, dtype=float).T, 1)
            return max(intercept + max(slope, 0.0) * shape.size, 1e-9)
        if points:
            nodes, seconds = points[0]
            return seconds * (1 + shape.size / nodes) / 2  # until a second size is timed
        return float(shape.size)

    # ------------------------------------------------------------------ learning
    def observe(self, tree: DraftTree, rows: list[int], accepted: list[int], warm: bool) -> None:
        self.run = self.run + 1 if tree is self.previous else 1
        self.previous = tree
        if tree in self.probes and warm and self.run > _SETTLE:
            self._count(tree, np.asarray(accepted))
        self.pending.append((self.iteration, tree.size))
        self.iteration += 1
        still = []
        for iteration, nodes in self.pending:
            seconds = self.seconds_of(iteration)
            if seconds is None:
                still.append((iteration, nodes))
            else:
                self.profile.time(nodes, seconds)
        self.pending = still

    def _count(self, tree: DraftTree, counts: np.ndarray) -> None:
        """Drafts tested and rejected per depth of the longest window, or its tree's gain."""
        profile = self.profile
        if tree.tree_levels:
            expected = float(self._survival()[:tree.window].sum())
            profile.tree_gain += 0.2 * (float(counts.mean()) / expected - profile.tree_gain)
            return
        profile.at_risk *= _MEMORY
        profile.stopped *= _MEMORY
        depths = np.arange(profile.window)
        for passed in counts - 1:  # drafts that passed, per row
            tested = min(passed + 1, tree.window - 1)
            profile.at_risk += (depths >= 1) & (depths <= tested)
            if passed + 1 <= tree.window - 1:
                profile.stopped[passed + 1] += 1

    def notes(self) -> dict:
        self.profile.current = self.shapes.index(self.current)
        survival = self._survival()
        best = max(self.shapes, key=lambda shape: self._rate(shape, survival))
        return {"auto_best_shape": describe_shape(best)}


def make_plan(settings: AccelerationSettings, model: ImageTokenModel, request: GenerationRequest,
              sampling: SamplingSettings, device: torch.device,
              seconds_of: Callable[[int], float | None]) -> Plan:
    """The plan for ``settings``: fixed for every mode but ``auto`` (``adaptive_shape``)."""
    if settings.adaptive_shape:
        return AutoPlan(settings, model, request, sampling, device, seconds_of)
    return FixedPlan(settings, device)
