"""Do the compiled speculative stages draw from the target? A short chi-square check on a device.

PAC+VP's stages (:func:`.stages.draft`, then :func:`.stages.conclude`: verify, commit and
advance), run as a generation runs them (:func:`sjd_core.compiled.compile_stages`: inductor, in
its CUDA-graph mode on CUDA), decode many rows at once on a bigram network: the logits after a fed
code are a fixed row of a random table over a small codebook (a conditional and an
unconditional table, guided). The image is then a Markov chain whose target after code ``a`` is
row ``a`` of ``P`` (guidance, temperature and top-k applied to the tables in float64, written
from the rule, not with the engine's ``process``: :func:`target_distribution`, which the
exactness tests use too), so the codes at slots ``s`` and ``s + 1`` have probability
``(P^(s+1))[start, x] * P[x, y]``. Every row commits at least one slot per
iteration, so after ``s + 2`` iterations both are committed. A later pair than the first
(``s = 4`` by default) lets redrafts, adaptive continuation and VP's history take part.

The verdict: Pearson's chi-square over the ``V * V`` pairs (cells expected fewer than 5 times
pooled into one; a draw in a cell of probability 0 fails outright); FAIL when its p-value is
below :data:`FAIL_BELOW` (a correct sampler fails one run in a thousand).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from ..compiled import compile_stages
from ..decoding.drafting import Canvas, DraftTree, WindowState
from ..decoding.sampling import IterationUniforms
from ..decoding.settings import AccelerationSettings, SamplingSettings
from ..decoding.stages import conclude, draft
from ..decoding.verify import acceptance_rule

VOCAB = 8
SAMPLING = SamplingSettings(guidance=3.0, temperature=1.0, top_k=6)  # top-k leaves zeros
LOGIT_SCALE = 0.5  # the tables' standard deviation: targets neither flat nor one-hot
START = 0  # the code before slot 0
PAIR_SLOT = 4  # the pair tallied: slots 4 and 5
FAIL_BELOW = 1e-3  # p-value under which the check fails
MIN_EXPECTED = 5.0  # cells expected fewer times are pooled


def bigram_tables(vocab: int, device: torch.device, seed: int = 0
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Random conditional and unconditional logits (V, V), float32: row ``a`` follows code
    ``a``."""
    generator = torch.Generator().manual_seed(seed)
    cond, uncond = (LOGIT_SCALE * torch.randn(vocab, vocab, generator=generator)
                    for _ in range(2))
    return cond.to(device), uncond.to(device)


def target_distribution(cond: np.ndarray, uncond: np.ndarray | None,
                        guidance: float | np.ndarray, temperature: float, top_k: int,
                        top_p: float) -> np.ndarray:
    """The target of each row of raw logits (..., V), in float64, written from the rule, not
    with the engine's ``process`` (so that a mistake there is caught); ``guidance`` may be an
    array of scales that broadcasts against the logits (one per slot):

    1. classifier-free guidance on raw logits, ``l = l_u + s * (l_c - l_u)`` (no unconditional
       logits: ``l = l_c``);
    2. division by the temperature;
    3. top-k: every code whose value is at least the k-th largest value is kept, so codes tied
       with the k-th value are all kept (``top_k = 0`` or ``>= V``: all);
    4. top-p on the softmax of what top-k kept: codes in order of probability (ties: lower code
       first) are kept while the mass of the codes before them is below ``top_p``, i.e. the
       smallest set of most likely codes whose mass reaches ``top_p`` (``top_p = 1``: all);
    5. softmax over the kept codes.
    """
    cond = np.asarray(cond, dtype=np.float64)
    if uncond is None:
        logits = cond
    else:
        uncond = np.asarray(uncond, dtype=np.float64)
        logits = uncond + guidance * (cond - uncond)
    logits = logits / temperature
    vocab = logits.shape[-1]
    kept = np.ones(logits.shape, dtype=bool)
    if 0 < top_k < vocab:
        kth = -np.sort(-logits, axis=-1)[..., top_k - 1:top_k]  # the k-th largest value
        kept = logits >= kth
    top = np.where(kept, logits, -np.inf).max(axis=-1, keepdims=True)
    weights = np.where(kept, np.exp(logits - top), 0.0)
    probs = weights / weights.sum(axis=-1, keepdims=True)
    if top_p < 1.0:  # a code stays while the codes strictly more likely hold less than top_p
        more_likely = probs[..., None, :] > probs[..., :, None]
        mass_above = np.where(more_likely, probs[..., None, :], 0.0).sum(-1)
        probs = np.where((mass_above < top_p) & (probs > 0), probs, 0.0)
        probs = probs / probs.sum(axis=-1, keepdims=True)
    return probs


def float64_target(cond: torch.Tensor, uncond: torch.Tensor,
                   sampling: SamplingSettings) -> torch.Tensor:
    """The target after each code of the bigram tables, (V, V) float64 on the CPU
    (:func:`target_distribution`)."""
    return torch.from_numpy(target_distribution(
        cond.cpu().numpy(), uncond.cpu().numpy(), sampling.guidance, sampling.temperature,
        sampling.top_k, sampling.top_p))


def pair_probabilities(target: torch.Tensor, slot: int, start: int = START) -> torch.Tensor:
    """Probability of every pair of codes (x at ``slot``, y at ``slot + 1``), flat as
    ``x * V + y``, of the chain that starts after code ``start``."""
    at_slot = torch.linalg.matrix_power(target, slot + 1)[start]
    return (at_slot[:, None] * target).flatten()


class _SharedStream:
    """Uniforms in (0, 1] for every row from one generator, as the stages take them
    (``IterationUniforms.take``); rows are independent, which is all this check needs."""

    def __init__(self, rows: int, device: torch.device, seed: int) -> None:
        self.rows, self.device = rows, device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def uniform(self, count: int) -> torch.Tensor:
        """(rows, count) fresh uniforms in (0, 1]."""
        drawn = torch.rand(self.rows, count, generator=self.generator, device=self.device)
        return drawn.neg_().add_(1.0)


@dataclass
class _Rows:
    """What the stages keep per row between iterations, as the engine keeps it."""

    state: WindowState
    codes: torch.Tensor  # flat, each row ``slots`` codes and a spare slot
    row_start: torch.Tensor
    committed: torch.Tensor
    anchor: torch.Tensor


def _fresh_rows(rows: int, window: int, slots: int, settings: AccelerationSettings,
                device: torch.device) -> _Rows:
    """Rows that have committed nothing, after code :data:`START`."""
    return _Rows(WindowState.empty(rows, window, VOCAB, device, settings.verification_prediction),
                 torch.zeros(rows * (slots + 1), dtype=torch.long, device=device),
                 torch.arange(rows, device=device) * (slots + 1),
                 torch.zeros(rows, dtype=torch.long, device=device),
                 torch.full((rows,), START, dtype=torch.long, device=device))


@torch.inference_mode()
def draw_pairs(cond: torch.Tensor, uncond: torch.Tensor, sampling: SamplingSettings, rows: int,
               slot: int = PAIR_SLOT, seed: int = 0) -> tuple[torch.Tensor, dict]:
    """Decode ``rows`` rows by PAC+VP's compiled stages on the bigram tables for ``slot + 2``
    iterations; each row's pair at ``slot``, ``slot + 1`` (flat, as
    :func:`pair_probabilities`) and the stages' compile report."""
    device = cond.device
    settings = AccelerationSettings.preset("pac+vp").for_codebook(VOCAB)
    tree = DraftTree.for_settings(settings, device)
    slots = (slot + 2) * tree.window + 1  # no row can finish: each iteration commits <= window
    run, shape = compile_stages(device), (tree.window, tree.profile)
    kept = _fresh_rows(rows, tree.window, slots, settings, device)
    stream, rule = _SharedStream(rows, device, seed), acceptance_rule(settings, None)
    for _ in range(slot + 2):
        numbers = IterationUniforms.take(stream, tree.size, tree.branching, tree.window,
                                         tree.tree_levels, VOCAB)
        canvas = Canvas(kept.codes, kept.row_start, kept.committed, kept.anchor, slots, slots)
        drafts = run(draft, shape, rows, kept.state, tree, canvas, settings.init, numbers)
        outcome = run(conclude, shape, rows, tree, cond[drafts.tokens], uncond[drafts.tokens], sampling,
                      sampling.guidance, drafts, kept.state, numbers, rule, False, kept.committed,
                      kept.row_start, kept.codes, None, slots, slots, settings)
        kept.state, kept.committed, kept.anchor = outcome.state, outcome.committed, outcome.anchor
    grid = kept.codes.view(rows, slots + 1)
    return (grid[:, slot] * VOCAB + grid[:, slot + 1]).cpu(), run.report()


def chi_square(pairs: torch.Tensor, probabilities: torch.Tensor,
               min_expected: float = MIN_EXPECTED) -> dict:
    """Pearson's chi-square of ``pairs`` (flat cell indices) against ``probabilities``
    (computed in float64): statistic, degrees of freedom, p-value; cells expected fewer than
    ``min_expected`` times are pooled, and a draw in a cell of probability 0 gives p = 0."""
    counts = torch.bincount(pairs, minlength=len(probabilities)).double()
    impossible = int(counts[probabilities == 0].sum())
    expected = probabilities.double() * len(pairs)
    large = expected >= min_expected
    observed = torch.cat([counts[large], counts[~large & (probabilities > 0)].sum()[None]])
    wanted = torch.cat([expected[large], expected[~large].sum()[None]])
    used = wanted > 0
    statistic = ((observed[used] - wanted[used]) ** 2 / wanted[used]).sum()
    dof = int(used.sum()) - 1
    p_value = 0.0 if impossible else float(torch.special.gammaincc(
        torch.tensor(dof / 2.0, dtype=torch.float64), statistic / 2.0))
    return {"statistic": float(statistic), "dof": dof, "p_value": p_value,
            "impossible_draws": impossible, "passed": p_value >= FAIL_BELOW}


def run_check(device: torch.device, rows: int, slot: int = PAIR_SLOT) -> dict:
    """The check on ``device`` with ``rows`` draws: the chi-square verdict, the draws, the
    slots tallied, seconds taken and the stages' compile report."""
    started = time.perf_counter()
    cond, uncond = bigram_tables(VOCAB, device)
    pairs, stages = draw_pairs(cond, uncond, SAMPLING, rows, slot)
    verdict = chi_square(pairs, pair_probabilities(float64_target(cond, uncond, SAMPLING), slot))
    return {**verdict, "draws": rows, "slots": [slot, slot + 1], "vocab": VOCAB,
            "stages": stages, "seconds": time.perf_counter() - started}


def describe(check: dict) -> str:
    """One line: PASS or FAIL with the statistic, the sample and how the stages ran."""
    if "error" in check:
        return f"draw check: failed to run: {check['error']}"
    stages = check["stages"]
    compiled = (f"stages compiled, {stages['graphs']} graphs" if not stages["failure"]
                else f"stages ran uncompiled: {stages['failure']}")
    verdict = "PASS" if check["passed"] else "FAIL"
    return (f"draw check (PAC+VP's stages, {compiled}; codes at slots {check['slots'][0]} and "
            f"{check['slots'][1]} of {check['draws']:,} draws over {check['vocab']} codes against "
            f"the float64 target): {verdict}: chi-square {check['statistic']:.1f} on "
            f"{check['dof']} degrees of freedom, p = {check['p_value']:.3g} (fails below "
            f"{FAIL_BELOW:g}; {check['impossible_draws']} draws of probability 0), "
            f"{check['seconds']:.1f} s")
