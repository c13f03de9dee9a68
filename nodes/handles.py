"""The values that travel along the pack's own wire types, and the checks made when they meet.

``SJD_MODEL`` carries a loaded model, ``SJD_CODES`` the code grids of one sampler run (and the
model that can decode them), ``SJD_TRACE`` the trace of one run with what was asked for, so that a
node receiving two of them can tell whether they belong together. ``SJD_ACCELERATION`` carries the
settings of one or more chained SJD option nodes, ``SJD_SAMPLING`` the choice of an SJD Sampling
Options node: a recipe of the loaded model by name, or validated custom ``SamplingSettings``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..sjd_core.messages import quote
from ..sjd_core.models.protocol import ImageTokenModel
from ..sjd_core.decoding.settings import AccelerationSettings, SamplingSettings
from ..sjd_core.decoding.trace import Trace

MODEL_TYPE = "SJD_MODEL"
CODES_TYPE = "SJD_CODES"
TRACE_TYPE = "SJD_TRACE"
ACCELERATION_TYPE = "SJD_ACCELERATION"
SAMPLING_TYPE = "SJD_SAMPLING"
FAMILY_RECIPE = "family recipe"  # the loaded model's first (default) official recipe
CUSTOM = "custom"  # the Sampling Options node's own four numbers


@dataclass
class LoadedModel:
    """A model from the loader node: the adapter, its ComfyUI memory handle and how it was loaded."""

    model: ImageTokenModel
    patcher: Any  # comfy.model_patcher.ModelPatcher inside ComfyUI, None outside
    name: str
    dtype: torch.dtype

    @property
    def family(self) -> str:
        return self.model.family


@dataclass(frozen=True)
class RunInfo:
    """What one sampler run was asked for; two runs with equal ``request_key`` drew the same thing."""

    run_id: str
    model_name: str
    family: str
    prompt: str
    negative_prompt: str
    resolution: tuple[int, int]
    batch_size: int
    seed: int
    mode: str

    @property
    def request_key(self) -> tuple:
        return (self.model_name, self.prompt, self.negative_prompt, self.resolution,
                self.batch_size, self.seed)

    def describe(self) -> str:
        return (f"{self.family} '{self.model_name}', prompt {quote(self.prompt)}, "
                f"{self.resolution[0]}x{self.resolution[1]}, batch {self.batch_size}, "
                f"seed {self.seed}, mode {self.mode}")


@dataclass
class SamplerCodes:
    """Code grids (B, H, W) on the CPU, with the model that drew them."""

    codes: torch.Tensor
    loaded: LoadedModel
    run: RunInfo


@dataclass
class SamplerTrace:
    """A run's trace together with what the run was asked for."""

    trace: Trace
    run: RunInfo



@dataclass(frozen=True)
class AccelerationOptions:
    """Settings that replace a mode preset's own: field name -> value of AccelerationSettings.

    A switch (AC, PD, VP) left 'as mode' is absent, so the preset decides it.
    """

    overrides: dict[str, Any] = field(default_factory=dict)

    def merged(self, other: AccelerationOptions) -> AccelerationOptions:
        """These settings and ``other``'s together; ValueError naming a setting the two give
        different values, since neither node could then be said to decide it."""
        for name, value in other.overrides.items():
            if name in self.overrides and self.overrides[name] != value:
                raise ValueError(f"{name} is set twice, to {quote(self.overrides[name])} and to "
                                 f"{quote(value)}, by two SJD option nodes: set it on one of "
                                 "them only.")
        return AccelerationOptions(self.overrides | other.overrides)

    def settings(self, preset: str, window: int | None) -> AccelerationSettings:
        """The preset with ``window`` (unless the preset is plain autoregression; None keeps the
        preset's own) and these overrides; ValueError from the settings when they contradict
        each other."""
        base = AccelerationSettings.preset(preset)
        chosen = dict(self.overrides)
        if base.window > 1 and window is not None:
            chosen["window"] = window
        return AccelerationSettings.preset(preset, **chosen)


@dataclass(frozen=True)
class SamplingChoice:
    """Which sampling settings a run uses: ``FAMILY_RECIPE``, the name of one of the loaded
    model's official recipes, or ``CUSTOM`` with the ``custom`` settings."""

    recipe: str = FAMILY_RECIPE
    custom: SamplingSettings | None = None

    def __post_init__(self) -> None:
        if (self.recipe == CUSTOM) != (self.custom is not None):
            raise ValueError(f"recipe={quote(self.recipe)}: custom settings go with recipe "
                             f"'{CUSTOM}' and only with it.")

    def settings(self, loaded: LoadedModel) -> SamplingSettings:
        """The settings for the loaded model; ValueError naming the model's recipes when it has
        no recipe of that name."""
        if self.custom is not None:
            return self.custom
        recipes = loaded.model.recipes
        name = next(iter(recipes)) if self.recipe == FAMILY_RECIPE else self.recipe
        if name not in recipes:
            listing = ", ".join(quote(known) for known in recipes)
            raise ValueError(f"recipe={quote(self.recipe)} is not a recipe of the {loaded.family} "
                             f"model '{loaded.name}': its recipes are {listing}. Pick one of "
                             f"them, '{FAMILY_RECIPE}' (its first) or '{CUSTOM}' on SJD "
                             "Sampling Options.")
        chosen = recipes[name]
        return SamplingSettings.of_recipe(chosen)
