"""Logits -> target distribution, and the sampling helpers every mode shares.

``process`` is the one definition of the target distribution (CFG on raw logits, temperature,
top-k, top-p): plain autoregression and every speculative mode call it, so "lossless" has a single
meaning. Draws invert a CDF at a uniform, and candidates without replacement use exponential races
(``argmax(p / E)`` with ``E ~ Exp(1)``, taken as a top-k); neither needs a device synchronisation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .. import checks
from .settings import SamplingSettings

MIN_MASS = 1e-12  # below this a distribution's mass counts as empty (see ``normalise``)
NEGLIGIBLE = 1e-30  # probabilities below this are set to 0 (see ``flush_negligible``)
# the largest float32 below NEGLIGIBLE: ``threshold`` zeroes values up to it, i.e. those below NEGLIGIBLE
_LAST_FLUSHED = float(np.nextafter(np.float32(NEGLIGIBLE), np.float32(0.0)))


def process(cond_logits: torch.Tensor, uncond_logits: torch.Tensor | None,
            settings: SamplingSettings, scale: float | torch.Tensor | None = None) -> torch.Tensor:
    """Target probabilities (float32, same shape as the logits) from raw codebook logits.

    Order: ``l = l_u + s * (l_c - l_u)`` (only when unconditional logits are given), divide by the
    temperature, keep the ``top_k`` largest, keep the smallest set of most likely codes whose mass
    reaches ``top_p`` (:func:`nucleus_floor`), softmax, and probabilities below ``NEGLIGIBLE`` set
    to 0.

    ``s`` is ``scale``: the guidance of the slots whose targets these are, from
    :meth:`.guidance.SlotGuidance.at` (a number, or float32 ``(..., 1)`` broadcast over the
    codebook); None means ``settings.guidance``, which only the constant schedule allows.
    """
    logits = cond_logits.to(torch.float32)
    if uncond_logits is not None:
        if scale is None:
            if settings.guidance_schedule != "constant":
                raise ValueError(
                    f"guidance_schedule={settings.guidance_schedule!r} gives every slot its own "
                    "scale: process needs the scale of the slots (SlotGuidance.at), not None.")
            scale = settings.guidance
        logits = torch.lerp(uncond_logits.to(torch.float32), logits, scale)
    if settings.temperature != 1.0:
        logits = logits / settings.temperature
    vocab = logits.shape[-1]
    if 0 < settings.top_k < vocab:
        kth = kth_largest(logits, settings.top_k)
        logits = torch.where(logits >= kth, logits, float("-inf"))
    if settings.top_p < 1.0:
        units = mass_units(torch.softmax(logits, dim=-1))
        logits = torch.where(units >= nucleus_floor(units, settings.top_p), logits, float("-inf"))
    return flush_negligible(torch.softmax(logits, dim=-1))


MASS_UNIT = 2.0 ** -60  # top-p counts probability in whole units of this


def mass_units(probabilities: torch.Tensor) -> torch.Tensor:
    """Probabilities as whole ``MASS_UNIT`` s (int64, rounded down): sums of them are exact in
    any order, and a float32 probability of at least ``2**-37`` (7e-12) is counted exactly, so
    that a long tail of tiny probabilities keeps its mass (at most one unit lost per code)."""
    return (probabilities.to(torch.float32) / MASS_UNIT).to(torch.int64)


def nucleus_floor(units: torch.Tensor, top_p: float) -> torch.Tensor:
    """The fewest units top-p keeps, per distribution (..., 1), of masses in ``mass_units``: a
    code is kept when the codes with more units than it hold fewer than ``top_p`` of the mass.

    So the kept codes are the smallest set of most likely codes whose mass reaches ``top_p``;
    codes tied at its edge are all kept, and since every sum is exact, no order among equals
    and no order of summation can change the result (see :func:`_floor_of_sorted`).
    """
    ascending = torch.sort(units, dim=-1).values
    return _floor_of_sorted(ascending, math.ceil(top_p / MASS_UNIT))


def kth_largest(values: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k``-th largest of ``values`` along the last axis (..., 1), equal values counted
    apart."""
    return torch.topk(values, k, dim=-1).values[..., -1:]


def _floor_of_sorted(ascending: torch.Tensor, need: int) -> torch.Tensor:
    """Top-p's floor from units sorted in ascending order, ``need`` the units top-p asks for.

    With ``A`` the running sums from the smallest code up and ``total`` the last of them, the
    codes above ascending position ``i`` hold ``total - A[i]``; the floor's position is the
    first ``i`` where that is below ``need``, i.e. the number of running sums ``<= total - need``
    (0, all codes kept, when the units hold less than ``need`` in all; at most the last
    position, since ``need >= 1``). One search per distribution, no reversal of the order.
    """
    running = ascending.cumsum(-1)  # int64, at most 2**60 and a little: exact
    position = torch.searchsorted(running, running[..., -1:] - need, right=True)
    return ascending.gather(-1, position)


def flush_negligible(probabilities: torch.Tensor) -> torch.Tensor:
    """Set probabilities below ``NEGLIGIBLE`` to 0.

    They carry no measurable mass, and float32 values that small are subnormal, which slows
    arithmetic on them on many processors.
    """
    return torch.nn.functional.threshold(probabilities, _LAST_FLUSHED, 0.0)


def normalise(weights: torch.Tensor, fallback: torch.Tensor,
              where: torch.Tensor | None = None) -> torch.Tensor:
    """``weights / weights.sum()`` along the last axis; ``fallback`` where the mass is ~0, and
    where ``where`` (..., 1) is False (one selection for both)."""
    mass = weights.sum(-1, keepdim=True)
    keep = mass > MIN_MASS if where is None else where & (mass > MIN_MASS)
    return torch.where(keep, weights / mass.clamp_min(MIN_MASS), fallback)


def residual(p: torch.Tensor, q: torch.Tensor, where: torch.Tensor | None = None) -> torch.Tensor:
    """``norm(max(0, p - q))``: what a rejected draft is replaced by (exactness lemma); ``p``
    itself where ``where`` (..., 1) is False.

    When ``p == q`` the residual is empty; a draft from q is then always accepted, so the value
    returned (``p``) is never used for a draw that matters.
    """
    return normalise((p - q).clamp_min(0.0), p, where)


class EmptyDistributionError(RuntimeError):
    """A draw was asked of weights that are all 0 (only raised under the tests' device checks,
    :mod:`sjd_core.checks`)."""


def sample(dist: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One draw per distribution along the last axis, by inverting its CDF at ``u`` in (0, 1].

    The smallest index whose cumulative mass reaches ``u`` times the total, so a code of
    probability 0 is never drawn, and the weights need not be normalised. ``u`` has the
    distributions' leading shape. Every caller passes weights with mass (an empty residual
    falls back to its target first); with the device checks on (:mod:`sjd_core.checks`), weights
    that are all 0 raise :class:`EmptyDistributionError` (a read from the device, so only in
    tests) instead of giving code 0.
    """
    if checks.DEVICE_CHECKS and not bool((dist > 0).any(-1).all()):
        raise EmptyDistributionError("a draw from weights that are all 0 "
                                     f"(shape {tuple(dist.shape)})")
    cdf = dist.cumsum(-1)
    point = (u * cdf[..., -1])[..., None]
    return torch.searchsorted(cdf, point).squeeze(-1).clamp_max(dist.shape[-1] - 1)


def passes(u: torch.Tensor, target_mass: torch.Tensor, draft_mass: torch.Tensor) -> torch.Tensor:
    """The acceptance test of a draft: ``u <= p(x) / q(x)``, so it passes with probability
    ``min(1, p(x) / q(x))`` for ``u`` uniform in (0, 1].

    Written as a ratio rather than ``u * q(x) <= p(x)``: with a tiny ``q(x)`` the product can
    round to 0 and pass a code of ``p(x) = 0``, while the ratio is 0 there, and NaN (no mass
    on either side) fails.
    """
    return u <= target_mass / draft_mass


def race_top(dist: torch.Tensor, noise: torch.Tensor, count: int) -> torch.Tensor:
    """``count`` draws without replacement (in draw order), given ``noise ~ Exp(1)``.

    ``argmax(p / E)`` with independent ``E ~ Exp(1)`` is a draw from ``p`` (an exponential race);
    the ``count`` largest are draws without replacement in order (the Gumbel-top-k trick).
    """
    return torch.topk(dist / noise, count, dim=-1).indices


def entropy(p: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in nats along the last axis."""
    return -(p * torch.log(p.clamp_min(1e-30))).sum(-1)


class RowRandom:
    """One random stream per batch row, so a row's result depends only on its own seed.

    Each row draws its uniforms in blocks from its own generator and hands them out in order
    (:meth:`uniform`); every row takes the same amount per iteration whatever the batch, so
    image b of a batch draws the same numbers as the same seed generated alone, also after other
    rows have finished (:meth:`retain`); its codes then agree wherever the batched and single
    logits agree. Handing out a block's next numbers is one slice and one copy, whatever the
    batch.
    """

    block = 4096  # uniforms drawn per row at a time (more when one iteration needs more)

    def __init__(self, seeds: Sequence[int], device: torch.device) -> None:
        self.device = torch.device(device)
        self.generators = [torch.Generator(device=self.device).manual_seed(int(s)) for s in seeds]
        self.buffer = torch.empty(len(seeds), 0, device=self.device)
        self.used = 0

    def uniform(self, count: int) -> torch.Tensor:
        """(B, count) uniforms in (0, 1] (never 0, so ``u <= p / q`` needs ``p > 0``), in a
        tensor of their own: a view into the buffer would start wherever the stream has got to,
        and a compiled stage's graph would depend on that place."""
        if self.used + count > self.buffer.shape[1]:
            size = max(self.block, count)
            fresh = torch.empty(len(self.generators), size, device=self.device)
            for row, generator in zip(fresh, self.generators):
                torch.rand(size, generator=generator, out=row)
            self.buffer, self.used = fresh.neg_().add_(1.0), 0
        out = self.buffer[:, self.used:self.used + count].clone()
        self.used += count
        return out

    def retain(self, rows: Sequence[int], index: torch.Tensor) -> None:
        """Keep the streams of these rows only (the others' images are finished); ``index``:
        ``rows`` on the device."""
        self.generators = [self.generators[row] for row in rows]
        self.buffer = self.buffer[index]


@dataclass(frozen=True)
class IterationUniforms:
    """The uniforms of one speculative iteration, by purpose, from each row's own stream.

    Kept as one block (B, n), each purpose a slice of it made where a stage reads it: inside a
    compiled stage, the slicing is part of its graph instead of operations the host dispatches
    before the call.
    """

    block: torch.Tensor  # (B, n) every purpose's numbers, one after another
    shapes: tuple[tuple[str, tuple[int, ...]], ...]  # each purpose's shape per row, in order

    @property
    def tests(self) -> torch.Tensor:
        """(B, T, K) one per candidate test, by parent node and rank."""
        return self._part("tests")

    @property
    def final(self) -> torch.Tensor:
        """(B,) the draw of the slot after the accepted path."""
        return self._part("final")

    @property
    def keep(self) -> torch.Tensor:
        """(B, W) AC's tests of whether a slot keeps its old draft."""
        return self._part("keep")

    @property
    def draw(self) -> torch.Tensor:
        """(B, W) the redrafts' draws."""
        return self._part("draw")

    @property
    def init(self) -> torch.Tensor:
        """(B, W) the init rule's draws."""
        return self._part("init")

    @property
    def race(self) -> torch.Tensor:
        """(B, levels, V) the PD candidates' race (see :func:`exponential`)."""
        return self._part("race")

    def _part(self, purpose: str) -> torch.Tensor:
        start = 0
        for name, shape in self.shapes:
            size = math.prod(shape)
            if name == purpose:
                return self.block[:, start:start + size].reshape(self.block.shape[0], *shape)
            start += size
        raise KeyError(purpose)

    @staticmethod
    def take(random: RowRandom, nodes: int, candidates: int, window: int, levels: int,
             vocab: int) -> "IterationUniforms":
        """The next numbers of every row's stream, for a tree of ``nodes`` nodes with at most
        ``candidates`` per parent and ``levels`` levels of candidates, in a window of
        ``window`` offsets over ``vocab`` codes. The amount depends only on that shape."""
        shapes = (("tests", (nodes, candidates)), ("final", ()), ("keep", (window,)),
                  ("draw", (window,)), ("init", (window,)), ("race", (levels, vocab)))
        block = random.uniform(sum(math.prod(shape) for _, shape in shapes))
        return IterationUniforms(block, shapes)


def exponential(uniforms: torch.Tensor) -> torch.Tensor:
    """Exp(1) draws from uniforms in (0, 1], kept away from 0 for races."""
    return uniforms.log().neg_().clamp_min_(1e-30)
