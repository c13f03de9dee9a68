"""Which shape each iteration feeds: the mode's own shape, or the one ``auto`` expects to pay most.

A plan answers ``choose()`` before every iteration with a :class:`~.drafting.DraftTree` and is
told afterwards what that iteration committed (``observe``). Because the choice uses only
iterations that are over, it never depends on the draws of the iteration it shapes, and every
lossless shape, chosen this way, keeps the output exactly the model's distribution.

``auto`` (:class:`AutoPlan`) moves among plain autoregression, windows of several lengths and
windows with a proactive-drafting tree towards the shape measured to commit the most codes per
second on this model and machine (see the class docstring).
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
class _Measured:
    """Codes per second of one shape, from blocks of settled iterations (exponentially weighted)."""

    rate: float = 0.0
    blocks: int = 0
    when: int = 0  # the block count of the plan when last measured

    def add(self, rate: float, when: int) -> None:
        self.rate = rate if not self.blocks else self.rate + 0.5 * (rate - self.rate)
        self.blocks += 1
        self.when = when


@dataclass
class _Profile:
    """What ``auto`` learnt about one model, device, batch and settings."""

    shapes: dict[tuple[int, bool], _Measured] = field(default_factory=dict)
    best: tuple[int, bool] | None = None
    blocks: int = 0


# Profiles live as long as their model: {model: {key: _Profile}}.
_PROFILES: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()
_SETTLE = 4  # iterations after a change of shape that are not measured (drafts settle first)
_MEASURE = 8  # iterations measured per block
_MARGIN = 0.1  # a neighbour must be this much faster to be moved to
_RECHECK = 6  # blocks after which a measured neighbour is measured again


def _ladder(settings: AccelerationSettings) -> list[int]:
    """Window lengths auto moves along: 1 (AR), then 4, 8, 16, ... up to ``settings.window``."""
    top = settings.window
    return [1] + sorted({n for n in (4, 8, 16, 32, 64, 128) if n < top} | {top})


def largest_shape(settings: AccelerationSettings) -> int:
    """The most nodes one forward of ``settings`` feeds (for ``auto``, over all its shapes)."""
    device = torch.device("cpu")
    if settings.adaptive_shape and settings.proactive_drafting:
        return DraftTree.build(settings.window, settings.pd_candidates, settings.pd_depth,
                               device).size
    return DraftTree.for_settings(settings, device).size


class AutoPlan:
    """Cost-aware speculation: a hill climb over window lengths (and a PD tree or none) by the
    codes per second each shape is measured to commit.

    Shapes are points ``(i, tree)`` of a ladder of window lengths (i = 0 is plain
    autoregression) with or without the settings' PD tree. The plan runs a shape for a block
    (a few settling iterations, then a few measured ones), records its codes per second, and
    moves to the fastest of the best shape and its neighbours (one step along the ladder, the
    tree switched), measuring each neighbour it has not measured lately. Timings are the
    iterations' own, so measuring costs no extra forward pass; what it learns is kept for the
    next generation with the same model, device, batch and settings.
    """

    def __init__(self, settings: AccelerationSettings, model: ImageTokenModel,
                 request: GenerationRequest, sampling: SamplingSettings, device: torch.device,
                 seconds_of: Callable[[int], float | None]) -> None:
        self.settings, self.device = settings, device
        self.ladder = _ladder(settings)
        self.trees: dict[tuple[int, bool], DraftTree] = {}
        self.max_nodes = largest_shape(settings)
        self.mode_name = settings.mode_name
        self.seconds_of = seconds_of  # seconds of iteration i, None while not known yet
        key = (str(device), request.batch_size, sampling, settings, request.resolution)
        try:
            profiles = _PROFILES.setdefault(model, {})
        except TypeError:  # a model that cannot be weakly referenced keeps no profile
            profiles = {}
        self.profile = profiles.setdefault(key, _Profile())
        start = self.ladder.index(min(16, settings.window)) if min(16, settings.window) \
            in self.ladder else len(self.ladder) - 1
        self.current = self.profile.best or (start, False)
        self.profile.best = self.current
        self.in_block = 0  # iterations of the current block so far
        self.block: list[tuple[int, float]] = []  # (iteration, codes per row) measured
        self.iteration = 0

    def tree(self, shape: tuple[int, bool]) -> DraftTree:
        if shape not in self.trees:
            window, with_tree = self.ladder[shape[0]], shape[1]
            if with_tree:
                self.trees[shape] = DraftTree.build(window, self.settings.pd_candidates,
                                                    self.settings.pd_depth, self.device)
            else:
                self.trees[shape] = DraftTree.build(window, 1, 1, self.device)
        return self.trees[shape]

    def _allowed(self, shape: tuple[int, bool]) -> bool:
        index, with_tree = shape
        if not 0 <= index < len(self.ladder):
            return False
        return not with_tree or (self.settings.proactive_drafting
                                 and self.ladder[index] >= self.settings.pd_depth)

    def choose(self) -> DraftTree:
        return self.tree(self.current)

    def observe(self, tree: DraftTree, accepted: list[int], warm: bool) -> None:
        self.in_block += 1
        settle = 0 if self.current[0] == 0 else _SETTLE
        if self.in_block > settle and warm or self.current[0] == 0:
            self.block.append((self.iteration, float(np.mean(accepted))))
        self.iteration += 1
        if len(self.block) < _MEASURE:
            return
        seconds = [self.seconds_of(i) for i, _ in self.block]
        if any(value is None for value in seconds):
            return  # the device has not finished them yet: measure a little longer
        rate = sum(codes for _, codes in self.block) / max(sum(seconds), 1e-9)
        profile = self.profile
        profile.blocks += 1
        profile.shapes.setdefault(self.current, _Measured()).add(rate, profile.blocks)
        self._next_block()

    def _next_block(self) -> None:
        profile = self.profile
        measured = profile.shapes
        best = max(measured, key=lambda shape: measured[shape].rate)
        if profile.best in measured and \
                measured[best].rate < measured[profile.best].rate * (1 + _MARGIN):
            best = profile.best  # move only for a clear gain
        profile.best = best
        index, with_tree = best
        neighbours = [shape for shape in ((index - 1, with_tree), (index + 1, with_tree),
                                          (index, not with_tree)) if self._allowed(shape)]
        stale = [shape for shape in neighbours if shape not in measured
                 or profile.blocks - measured[shape].when >= _RECHECK]
        self.current = stale[0] if stale else best
        self.in_block, self.block = 0, []

    def notes(self) -> dict:
        best = self.profile.best
        return {"auto_best_shape": describe_shape(self.tree(best)) if best else None}


def make_plan(settings: AccelerationSettings, model: ImageTokenModel, request: GenerationRequest,
              sampling: SamplingSettings, device: torch.device,
              seconds_of: Callable[[int], float | None]) -> Plan:
    """The plan for ``settings``: fixed for every mode but ``auto`` (``adaptive_shape``)."""
    if settings.adaptive_shape:
        return AutoPlan(settings, model, request, sampling, device, seconds_of)
    return FixedPlan(settings, device)
