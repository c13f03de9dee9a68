"""Which shape each iteration feeds: the mode's own shape, or the one ``auto`` expects to pay most.

A plan answers ``choose()`` before every iteration with a :class:`~.drafting.DraftTree` and is
told afterwards what that iteration committed and how long it took (``observe``). Because the
choice uses only iterations that are over, it never depends on the draws of the iteration it
shapes, and every lossless shape keeps the output exactly the model's distribution.
"""

from __future__ import annotations

from typing import Protocol

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

    def observe(self, tree: DraftTree, accepted: list[int], seconds: float) -> None:
        """What the iteration fed as ``tree`` committed per row, and its wall-clock seconds."""
        ...

    def describe(self, tree: DraftTree) -> str:
        """A short label of a shape, for the trace and progress reports."""
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

    def observe(self, tree: DraftTree, accepted: list[int], seconds: float) -> None:
        return None

    def describe(self, tree: DraftTree) -> str:
        return describe_shape(tree)

    def notes(self) -> dict:
        return {}


def make_plan(settings: AccelerationSettings, model: ImageTokenModel, request: GenerationRequest,
              sampling: SamplingSettings, device: torch.device) -> Plan:
    """The plan for ``settings``: fixed for every mode but ``auto``."""
    return FixedPlan(settings, device)
