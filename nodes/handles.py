"""The values that travel along the pack's own wire types, and the checks made when they meet.

``SJD_MODEL`` carries a loaded model, ``SJD_CODES`` the code grids of one sampler run (and the
model that can decode them), ``SJD_TRACE`` the trace of one run with what was asked for, so that a
node receiving two of them can tell whether they belong together. ``SJD_ACCELERATION`` carries the
options of an SJD Acceleration Options node, ``SJD_SAMPLING`` a validated ``SamplingSettings``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..sjd_core.models.protocol import ImageTokenModel
from ..sjd_core.decoding.settings import AccelerationSettings
from ..sjd_core.decoding.trace import Trace

MODEL_TYPE = "SJD_MODEL"
CODES_TYPE = "SJD_CODES"
TRACE_TYPE = "SJD_TRACE"
ACCELERATION_TYPE = "SJD_ACCELERATION"
SAMPLING_TYPE = "SJD_SAMPLING"


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
        return (f"{self.family} '{self.model_name}', prompt {self.prompt!r}, "
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

    def settings(self, preset: str, window: int) -> AccelerationSettings:
        """The preset with ``window`` (unless the preset is plain autoregression) and these
        overrides; ValueError from the settings when they contradict each other."""
        base = AccelerationSettings.preset(preset)
        chosen = dict(self.overrides)
        if base.window > 1:
            chosen["window"] = window
        return AccelerationSettings.preset(preset, **chosen)
