"""Which shape each iteration feeds: the mode's own shape, or the one ``auto`` expects to pay most.

A plan answers ``choose()`` before every iteration with a :class:`~.drafting.DraftTree` and is
told afterwards what that iteration committed (``observe``). Because the choice uses only
iterations that are over, it never depends on the draws of the iteration it shapes, and every
lossless shape, chosen this way, keeps the output exactly the model's distribution.

``auto`` (:class:`AutoPlan`) picks, among plain autoregression, windows of several lengths and
proactive-drafting trees, the shape with the most expected codes committed per second:

* cost: each shape's measured seconds per iteration (the iterations themselves are the timing
  probes, so measuring costs no extra forward pass); a shape not run yet is estimated from a
  straight line in the number of fed nodes fitted to the shapes that were;
* acceptance: each shape's measured codes per iteration; a window not run yet is estimated from
  the survival of drafts along the window (per depth, from the windows that were run), a tree
  from that times the gain trees showed over windows.

What it learns is kept for the next generation with the same model, device, batch and settings,
so exploring is paid once. It re-plans every few iterations and, when plain autoregression is
best, still tries the best speculative shape now and then.
"""

from __future__ import annotations

import math
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

    def observe(self, tree: DraftTree, accepted: list[int], warm: bool) -> None:
        """What the iteration just fed as ``tree`` committed per row; ``warm`` is False when its
        drafts were only just initialised (its acceptance says little about the shape)."""
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

    def observe(self, tree: DraftTree, accepted: list[int], warm: bool) -> None:
        return None

    def notes(self) -> dict:
        return {}


@dataclass
class _ShapeStats:
    """Exponentially weighted record of one shape's iterations."""

    timed: int = 0  # iterations whose seconds are known
    seconds: float = 0.0  # seconds per iteration
    counted: int = 0  # iterations with settled drafts
    committed: float = 0.0  # codes committed per row per iteration

    def add_seconds(self, value: float, weight: float = 0.25) -> None:
        self.seconds = value if not self.timed else self.seconds + weight * (value - self.seconds)
        self.timed += 1

    def add_committed(self, value: float, weight: float = 0.25) -> None:
        self.committed = value if not self.counted else \
            self.committed + weight * (value - self.committed)
        self.counted += 1


@dataclass
class _Profile:
    """What ``auto`` learnt about one model, device, batch and settings."""

    window: int
    shapes: dict[str, _ShapeStats] = field(default_factory=dict)
    at_risk: np.ndarray = None  # (window,) drafts tested at each depth of a window
    stopped: np.ndarray = None  # (window,) drafts rejected at each depth
    generations: int = 0

    def __post_init__(self) -> None:
        self.at_risk = np.zeros(self.window)
        self.stopped = np.zeros(self.window)

    def stats(self, label: str) -> _ShapeStats:
        return self.shapes.setdefault(label, _ShapeStats())


# Profiles live as long as their model: {model: {key: _Profile}}.
_PROFILES: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()
_PRIOR_HAZARD = 0.3  # rejection chance per depth assumed where nothing was measured yet
_PRIOR_TREE_GAIN = 1.1  # codes per iteration of a tree over the window of the same length
_OPTIMISM = 0.3  # exploration bonus for shapes seen few times
_DWELL = 3  # iterations between two choices (drafts need a few iterations to settle)
_RETRY = 48  # while plain autoregression wins, iterations between two speculative tries


def _menu(settings: AccelerationSettings, device: torch.device) -> list[DraftTree]:
    """AR, windows of several lengths up to ``settings.window``, and PD trees within it."""
    top = settings.window
    lengths = sorted({n for n in (2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128) if n < top} | {top})
    shapes = [DraftTree.build(1, 1, 1, device)]
    shapes += [DraftTree.build(n, 1, 1, device) for n in lengths]
    if settings.proactive_drafting:
        trees = {(k, d) for k in (2, settings.pd_candidates) for d in (2, settings.pd_depth)
                 if k > 1 and d >= 2}
        for candidates, depth in sorted(trees):
            for n in sorted({min(16, top), top}):
                if depth <= n:
                    shapes.append(DraftTree.build(n, candidates, depth, device))
    return shapes


def largest_shape(settings: AccelerationSettings) -> int:
    """The most nodes one forward of ``settings`` feeds (for ``auto``, over its whole menu)."""
    device = torch.device("cpu")
    if settings.adaptive_shape:
        return max(tree.size for tree in _menu(settings, device))
    return DraftTree.for_settings(settings, device).size


class AutoPlan:
    """Cost-aware speculation: the shape expected to commit the most codes per second."""

    def __init__(self, settings: AccelerationSettings, model: ImageTokenModel,
                 request: GenerationRequest, sampling: SamplingSettings, device: torch.device,
                 seconds_of: Callable[[int], float | None]) -> None:
        self.menu = {describe_shape(tree): tree for tree in _menu(settings, device)}
        self.max_nodes = max(tree.size for tree in self.menu.values())
        self.mode_name = settings.mode_name
        self.seconds_of = seconds_of  # seconds of iteration i, None while not known yet
        key = (str(device), request.batch_size, sampling.guidance != 1.0, sampling, settings,
               request.resolution)
        try:
            profiles = _PROFILES.setdefault(model, {})
        except TypeError:  # a model that cannot be weakly referenced keeps no profile
            profiles = {}
        self.profile = profiles.setdefault(key, _Profile(settings.window))
        self.profile.generations += 1
        largest = max(self.menu.values(), key=lambda tree: tree.size)
        longest = self.menu[f"window {settings.window}"]
        short = self.menu[f"window {max(2, settings.window // 4)}"] \
            if f"window {max(2, settings.window // 4)}" in self.menu else longest
        fresh = self.profile.generations == 1
        # a new profile times AR once and runs three shapes that span the costs
        self.queue = ([self.menu["AR"]] + [largest] * 3 + [longest] * 3 + [short] * 2
                      if fresh else [])
        self.current, self.held = longest, 0
        self.since_speculation = 0
        self.pending: list[tuple[int, str, float, bool]] = []  # iteration, shape, committed, warm
        self.iteration = 0

    # ------------------------------------------------------------------ choosing
    def choose(self) -> DraftTree:
        if self.queue:
            self.current = self.queue.pop(0)
        elif self.held <= 0:
            self.current = self._best()
            self.held = _DWELL
        self.held -= 1
        return self.current

    def _best(self) -> DraftTree:
        rates = {label: self._rate(label) for label in self.menu}
        best = max(rates, key=rates.get)
        if best == "AR":
            self.since_speculation += 1
            if self.since_speculation * _DWELL >= _RETRY:
                self.since_speculation = 0
                best = max((label for label in rates if label != "AR"), key=rates.get)
        else:
            self.since_speculation = 0
        return self.menu[best]

    def _rate(self, label: str) -> float:
        """Expected codes per second of a shape, with a bonus for shapes seen few times."""
        stats = self.profile.shapes.get(label) or _ShapeStats()
        committed = stats.committed if stats.counted >= 2 else self._committed(label)
        seconds = stats.seconds if stats.timed else self._seconds(label)
        return committed / max(seconds, 1e-9) * (1 + _OPTIMISM / math.sqrt(1 + stats.timed))

    def _committed(self, label: str) -> float:
        """Codes per iteration of a shape from the measured survival of drafts per depth."""
        tree = self.menu[label]
        if tree.window == 1:
            return 1.0
        at_risk, stopped = self.profile.at_risk, self.profile.stopped
        survive, expected, hazard = 1.0, 1.0, _PRIOR_HAZARD
        for depth in range(1, tree.window):
            if at_risk[depth] >= 3:
                hazard = stopped[depth] / at_risk[depth]
            survive *= 1.0 - hazard
            expected += survive
        if tree.tree_levels:
            expected *= self._tree_gain()
        return expected

    def _tree_gain(self) -> float:
        gains = []
        for label, stats in self.profile.shapes.items():
            tree = self.menu.get(label)
            if tree is not None and tree.tree_levels and stats.counted >= 2:
                chain = self._committed(f"window {tree.window}") \
                    if f"window {tree.window}" in self.menu else None
                if chain:
                    gains.append(stats.committed / chain)
        return float(np.mean(gains)) if gains else _PRIOR_TREE_GAIN

    def _seconds(self, label: str) -> float:
        """Seconds per iteration of a shape not timed yet: a line in fed nodes through the
        speculative shapes that were timed (AR, when not timed, as a one-node shape)."""
        points = [(self.menu[name].size, stats.seconds) for name, stats in
                  self.profile.shapes.items()
                  if name in self.menu and name != "AR" and stats.timed]
        nodes = self.menu[label].size
        if not points:
            return float(nodes)  # nothing timed yet: cost in proportion to nodes
        sizes, seconds = np.array(points, dtype=float).T
        if len(set(sizes)) < 2:
            return float(seconds.mean()) * (1 + nodes / max(sizes.mean(), 1)) / 2
        slope, intercept = np.polyfit(sizes, seconds, 1)
        return max(intercept + max(slope, 0.0) * nodes, 1e-6)

    # ------------------------------------------------------------------ learning
    def observe(self, tree: DraftTree, accepted: list[int], warm: bool) -> None:
        label = describe_shape(tree)
        self.pending.append((self.iteration, label, float(np.mean(accepted)), warm))
        self.iteration += 1
        if warm and tree.window > 1 and not tree.tree_levels:
            depths = np.arange(self.profile.window)
            for count in accepted:  # count - 1 drafts passed, the next one (if any) failed
                tested = min(count, tree.window - 1)
                self.profile.at_risk += (depths >= 1) & (depths <= tested)
                if count <= tree.window - 1:
                    self.profile.stopped[count] += 1
        still = []
        for iteration, name, committed, was_warm in self.pending:
            seconds = self.seconds_of(iteration)
            if seconds is None:
                still.append((iteration, name, committed, was_warm))
                continue
            stats = self.profile.stats(name)
            stats.add_seconds(seconds)
            if was_warm:
                stats.add_committed(committed)
        self.pending = still

    def notes(self) -> dict:
        return {"auto_profile_generations": self.profile.generations}


def make_plan(settings: AccelerationSettings, model: ImageTokenModel, request: GenerationRequest,
              sampling: SamplingSettings, device: torch.device,
              seconds_of: Callable[[int], float | None]) -> Plan:
    """The plan for ``settings``: fixed for every mode but ``auto`` (``adaptive_shape``)."""
    if settings.adaptive_shape:
        return AutoPlan(settings, model, request, sampling, device, seconds_of)
    return FixedPlan(settings, device)
