"""The memory-bandwidth floor of one decoding step, and image times projected from a measured
time per iteration.

At batch 1 a step of a large model reads every weight it uses and the KV cache it attends over,
once each, and does little arithmetic per byte read: the bytes it must read, over the device's
bandwidth, are the least time a step can take (the floor). The bandwidth is measured, not taken
from a data sheet: a copy of a large tensor, its bytes read and written over its synchronised
time, the best of a few. A speculative iteration feeds a few dozen nodes but reads the same
weights and cache, so it has the same floor.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

COPY_REPEATS = 5  # timed copies; the fastest counts
# codes committed per iteration as published for Lumina-mGPT 7B at 768 px
PUBLISHED_CODES_PER_ITERATION = {"SJD": 2.22, "SJD-PAC": 4.51}


def copy_bandwidth(device: torch.device, size_bytes: int, repeats: int = COPY_REPEATS) -> float:
    """Bytes per second a copy of a ``size_bytes`` tensor moves on ``device`` (read plus
    written), from the fastest of ``repeats`` synchronised copies after one untimed one."""
    source = torch.ones(size_bytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    fastest = float("inf")
    for _ in range(repeats + 1):
        synchronize(device)
        started = time.perf_counter()
        target.copy_(source)
        synchronize(device)
        fastest = min(fastest, time.perf_counter() - started)
    return 2 * size_bytes / fastest


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def mean_fill_positions(cond_prompt: int, uncond_prompt: int, image_codes: int) -> int:
    """Cached positions of a guided step at the mean fill over an image: each context's prompt
    plus half the image's codes, in the conditional and the unconditional row."""
    return cond_prompt + uncond_prompt + 2 * (image_codes // 2)


@dataclass(frozen=True)
class StepFloor:
    """The bytes a step reads and the floor they give at a measured bandwidth."""

    weight_bytes: int
    cache_bytes: int
    bandwidth: float  # bytes per second

    @property
    def step_bytes(self) -> int:
        """Weights and cache: what one step must read."""
        return self.weight_bytes + self.cache_bytes

    @property
    def floor_ms(self) -> float:
        """Milliseconds to read ``step_bytes`` at ``bandwidth``."""
        return 1e3 * self.step_bytes / self.bandwidth


def projected_image_seconds(codes: int, codes_per_iteration: float,
                            ms_per_iteration: float) -> float:
    """Seconds to decode an image of ``codes`` codes at ``codes_per_iteration`` and
    ``ms_per_iteration`` (the prompt's prefill and the image decoder not counted)."""
    return codes / codes_per_iteration * ms_per_iteration / 1e3
