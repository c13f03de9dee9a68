"""The classifier-free guidance scale of every slot: constant, or a schedule along the image.

A schedule gives each slot of the grid its own scale, a function of the slot's position alone
(never of a sampled code). The target of a slot is then still a fixed function of the codes
before it and of its position, which is all the exactness of speculative decoding needs: every
mode verifies a slot against the target plain autoregression samples there, whichever forward
computes it (``docs/algorithms.md``, section 1, "Guidance schedules"). The engine turns the scales
into one table per generation (:class:`SlotGuidance`) and looks up the slots of every fed node
in it, so a window, a draft tree and every batch row get the scale of their own slots.

Schedules (``SamplingSettings.guidance_schedule``):

``constant``
    ``guidance`` at every slot (the processor of the same name in Lumina-mGPT 1's
    ``inference_solver.py``, for one, keeps its scale as given).
``lumina-mgpt-2``
    Lumina-mGPT 2.0's official sampler (:func:`lumina_mgpt_2_scales`).
"""

from __future__ import annotations

import torch

from .settings import SamplingSettings

LUMINA2_FLOOR = 4.0  # Lumina-mGPT 2.0's sampler never guides below this scale (but 1.0 stays off)
LUMINA2_SIZE_TOKENS = 2  # the height and width tokens between the image start and the first code


def lumina_mgpt_2_scales(guidance: float, height: int, width: int) -> list[float]:
    """The scale of every code of a ``height`` x ``width`` grid (raster order) under the
    schedule of Lumina-mGPT 2.0's official sampler, in float64 as it computes it.

    Source: ``lumina_mgpt/inference_solver.py`` of Alpha-VLLM/Lumina-mGPT-2.0,
    ``LLMImageStartTriggeredUnbatchedClassifierFreeGuidanceLogitsProcessor.__call__`` (the
    processor ``generate.py`` passes to every text-to-image generation). It keeps the scale as
    state and, at every token sampled inside the image once ``n >= 2`` tokens follow the image
    start, returns the logits unguided if the scale is exactly 1, else sets
    ``scale = max(4.0, scale * (1 - n / L))`` and guides with it. Here:

    * ``n`` counts every token after the image-start token: the two size tokens, the codes and
      the row ends so far. The code at raster index ``k`` of a grid ``width`` codes wide is
      sampled with ``n = 2 + k + k // width`` (one row end after each finished row).
    * the update runs at the row-end steps too (their token is forced, their scale unused), so
      the scale of code ``k`` is that after the updates ``n = 2, 3, ..., 2 + k + k // width``.
    * ``L`` is ``h_latent_dim * w_latent_dim``, which the processor reads as twice the grid
      counts of the size tokens (``<reserved{8800 + H/32}>``): (H/16)(W/16), a quarter of the
      (H/8)(W/8) codes the image has, so ``L = height * width / 4`` here.

    So a scale of exactly 1 is 1 everywhere (no guidance); any other scale below 4 is 4 from the
    first code on; a scale above 4 falls towards 4 (each factor is below 1) and stays there
    once reached (on the 96 x 96 grid of 768 x 768 px, 5 reaches 4 at code 30, 7 at code 49,
    10 at code 63 and 30 at code 94). The official sampler counts the size tokens it writes
    itself; this pack feeds the same ones.
    """
    slots = height * width
    if guidance == 1.0:
        return [1.0] * slots
    quarter = height * width / 4  # exact for every grid; an integer on Lumina-mGPT 2.0's grids
    scales: list[float] = []
    scale, n = float(guidance), LUMINA2_SIZE_TOKENS - 1
    for k in range(slots):
        if scale == LUMINA2_FLOOR:  # max(4, 4 * f) with f < 1 is 4 for every later token
            return scales + [LUMINA2_FLOOR] * (slots - k)
        position = LUMINA2_SIZE_TOKENS + k + k // width
        while n < position:
            n += 1
            scale = max(LUMINA2_FLOOR, scale * (1 - n / quarter))
        scales.append(scale)
    return scales


def slot_scales(settings: SamplingSettings, height: int, width: int) -> list[float]:
    """The guidance scale of every slot of a ``height`` x ``width`` grid, in raster order."""
    if settings.guidance_schedule == "lumina-mgpt-2":
        return lumina_mgpt_2_scales(settings.guidance, height, width)
    return [settings.guidance] * (height * width)


class SlotGuidance:
    """The scales of one generation's slots, looked up for the slots whose targets are made.

    Where every slot has the same scale (the constant schedule, or a schedule that is flat on
    this grid) :meth:`at` returns that number, and ``sampling.process`` runs as with a constant
    scale; otherwise a float32 table on the device, one entry per slot and a spare one for the
    nodes a window feeds past the last slot (whose targets are never committed). Looking slots
    up is one gather on the device: no read back, no loop over slots, the shape of the slots.
    """

    def __init__(self, settings: SamplingSettings, height: int, width: int,
                 device: torch.device) -> None:
        scales = slot_scales(settings, height, width)
        self.constant: float | None = scales[0] if len(set(scales)) == 1 else None
        self.table = (None if self.constant is not None else
                      torch.tensor(scales + scales[-1:], dtype=torch.float32, device=device))

    def at(self, slots: torch.Tensor) -> float | torch.Tensor:
        """The scale of each of ``slots`` (any shape, values in ``[0, height * width]``) as
        ``(*slots.shape, 1)``, to broadcast over the codebook; the number itself when constant."""
        if self.constant is not None:
            return self.constant
        return self.table[slots].unsqueeze(-1)

    def after(self, node_slots: torch.Tensor) -> float | torch.Tensor:
        """The scales of the targets fed nodes give: a node at slot ``s`` (``-1`` before the
        first code) gives the target of slot ``s + 1``. As :meth:`at`, and without any
        operation when constant."""
        if self.constant is not None:
            return self.constant
        return self.at(node_slots + 1)
