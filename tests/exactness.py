"""Exact joint distributions of a tiny synthetic model, an independent tree verifier, and a
goodness-of-fit test.

The target distribution is written from the rule in float64, without the engine's
``sampling.process`` (:func:`sjd_core.tools.draw_check.target_distribution`, the reference the
pack's GPU check draws against too), so that a mistake in ``process`` (the guidance formula, the
order of the steps, ties at the k-th value, the top-p boundary) changes the enumerated joint and
is caught. The goodness-of-fit test is the GPU check's chi-square
(:func:`sjd_core.tools.draw_check.chi_square`).

The joint of a whole image is the product of these targets slot by slot, each given the codes
before it, from the model's own raw logits: the distribution plain autoregression samples and
every lossless mode must reproduce.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import torch

from sjd_core.decoding import verify
from sjd_core.decoding.drafting import DraftTree
from sjd_core.decoding.engine import generate
from sjd_core.decoding.sampling import normalise, residual, sample
from sjd_core.decoding.settings import AccelerationSettings, SamplingSettings
from sjd_core.models.protocol import GenerationRequest
from sjd_core.models.synthetic import SyntheticModel
from sjd_core.tools.draw_check import chi_square, target_distribution

PROMPT = "a red fox"
NEGATIVE = "blur"


def tiny_model() -> SyntheticModel:
    """5 codes on a 2 x 3 grid: conditionals differ by context, and with the sampling below about
    180 images are likely enough to be expected at least 5 times in 20,000 samples."""
    return SyntheticModel(codebook_size=5, grid=(2, 3), width=16, layers=1, heads=2,
                          sharpness=1.5, seed=3)


def tiny_sampling() -> SamplingSettings:
    """Guidance, temperature, top-k and top-p all active, so every step of the rule matters."""
    return SamplingSettings(guidance=2.0, temperature=0.8, top_k=4, top_p=0.9)


def all_images(model: SyntheticModel) -> torch.Tensor:
    """Every code grid of the model, flattened, in base-V order (row i is image i)."""
    height, width = model.grid
    return torch.tensor(list(itertools.product(range(model.codebook_size),
                                               repeat=height * width)))


def conditional_logits(model: SyntheticModel, sampling: SamplingSettings
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Raw (cond, uncond) logits of every slot of every image given the codes before it,
    (images, slots, V), fed one slot per forward pass as plain autoregression feeds them."""
    images = all_images(model)
    session = model.start(GenerationRequest(prompt=PROMPT, negative_prompt=NEGATIVE,
                                            batch_size=len(images), guidance=sampling.guidance,
                                            max_nodes=1))
    chain = torch.ones(1, 1, dtype=torch.bool)
    keep = torch.ones(len(images), 1, dtype=torch.bool)
    previous = torch.zeros(len(images), 1, dtype=torch.long)
    conds, unconds = [], []
    for slot in range(images.shape[1]):
        cond, uncond = session.forward(previous, torch.full_like(previous, slot - 1), chain,
                                       [slot] * len(images))
        session.keep(keep)
        conds.append(cond[:, 0])
        unconds.append(None if uncond is None else uncond[:, 0])
        previous = images[:, slot:slot + 1]
    return torch.stack(conds, 1), (None if unconds[0] is None else torch.stack(unconds, 1))


def joint_from_logits(cond: torch.Tensor, uncond: torch.Tensor | None,
                      sampling: SamplingSettings,
                      slot_scales: list[float] | None = None) -> torch.Tensor:
    """Probability of every image from its slots' raw logits (see :func:`conditional_logits`);
    with ``slot_scales``, slot i is guided with ``slot_scales[i]`` instead of
    ``sampling.guidance``."""
    guidance = (sampling.guidance if slot_scales is None
                else np.asarray(slot_scales, dtype=np.float64)[:, None])  # (slots, 1)
    targets = target_distribution(cond.numpy(), None if uncond is None else uncond.numpy(),
                                  guidance, sampling.temperature, sampling.top_k,
                                  sampling.top_p)
    images = np.array(list(itertools.product(range(cond.shape[-1]), repeat=cond.shape[1])))
    picked = np.take_along_axis(targets, images[..., None], axis=-1)[..., 0]
    return torch.from_numpy(picked.prod(axis=1))


def enumerate_joint(model: SyntheticModel, sampling: SamplingSettings) -> torch.Tensor:
    """Probability of every image (flattened base-V index), float64, from :func:`target_distribution`."""
    return joint_from_logits(*conditional_logits(model, sampling), sampling)


BATCH_LIMIT = 10_000  # images per generate call: two test workers' batches fit in memory


def sample_images(model: SyntheticModel, sampling: SamplingSettings,
                  acceleration: AccelerationSettings, count: int, seed: int) -> torch.Tensor:
    """Flattened base-V index of ``count`` images generated by the engine, in batches of at most
    ``BATCH_LIMIT`` (row b of a batch drawn with seed s uses seed s + b, so the batches draw
    what one batch of ``count`` would)."""
    codes = [generate(model, GenerationRequest(prompt=PROMPT, negative_prompt=NEGATIVE,
                                               batch_size=min(BATCH_LIMIT, count - start)),
                      sampling, acceleration, seed + start).codes
             for start in range(0, count, BATCH_LIMIT)]
    flat = torch.cat(codes).flatten(1)
    weights = model.codebook_size ** torch.arange(flat.shape[1] - 1, -1, -1)
    return (flat * weights).sum(1)


def goodness_of_fit(samples: torch.Tensor, probability: torch.Tensor,
                    min_expected: float = 5.0) -> float:
    """Pearson chi-square p-value of ``samples`` against ``probability`` (cells expected fewer
    than ``min_expected`` times pooled into one; a sample in a cell of probability zero makes it
    0)."""
    return chi_square(samples, probability, min_expected)["p_value"]


def loop_verify_tree(tree: DraftTree, p: torch.Tensor, node_tokens: torch.Tensor,
                     node_valid: torch.Tensor, q_slots: torch.Tensor, uniforms: torch.Tensor,
                     final_uniform: torch.Tensor, rule=None, take: str = "first",
                     count_siblings: bool = False) -> verify.Verdict:
    """Recursive rejection sampling on the draft tree, written node by node (for tests only).

    At every node its children (the candidates of the next slot) are tested in order against
    the node's target ``p`` and the slot's draft distribution ``q``; after a rejection
    ``p <- norm(max(0, p - q))`` and ``q <- q`` without the candidate. ``take="first"`` takes the
    first accepted child (the exact rule). ``take="last"`` keeps testing after an acceptance and
    takes the last accepted child, a broken variant for the power tests. The path follows the
    taken children from the root; the slot after it is drawn from what the recursion left at
    its end (the target itself when nothing was tested there). Only ``path``, ``accepted`` and
    ``tokens`` of the verdict carry meaning (``count_siblings`` is accepted and ignored: the
    verdict counts no siblings).
    """
    batch, size, _ = p.shape
    rows = torch.arange(batch)
    taken = torch.full((batch, size), -1, dtype=torch.long)
    leftover = p.clone()  # what the slot after each node is drawn from if the path ends there
    for node in range(size):
        slot = min(int(tree.depth[node]), q_slots.shape[1] - 1)
        p_k, q_k = p[:, node], q_slots[:, slot]
        searching = torch.ones(batch, dtype=torch.bool)
        tested = torch.zeros(batch, dtype=torch.bool)
        for rank, child in enumerate(tree.children[node].tolist()):
            if child < 0:
                continue
            x = node_tokens[:, child]
            live = node_valid[:, child]
            if take == "first":
                live = live & searching
            p_x, q_x = p_k[rows, x], q_k[rows, x]
            accept = live & (uniforms[:, node, rank] * q_x <= p_x)
            taken[:, node] = torch.where(accept, child, taken[:, node])
            searching &= ~accept
            rejected = (live & ~accept)[:, None]
            q_rest = normalise(q_k.scatter(-1, x[:, None], 0.0), q_k)
            p_k, q_k = (torch.where(rejected, residual(p_k, q_k), p_k),
                        torch.where(rejected, q_rest, q_k))
            tested |= live
        leftover[:, node] = torch.where(tested[:, None], p_k, p[:, node])
    node = torch.zeros(batch, dtype=torch.long)
    for _ in range(tree.window - 1):
        node = torch.where(taken[rows, node] >= 0, taken[rows, node], node)
    accepted = tree.depth[node]
    path = tree.route[node]
    final = sample(leftover[rows, node], final_uniform)
    kinds = torch.where(torch.arange(tree.window) < accepted[:, None], verify.ACCEPTED,
                        verify.RESIDUAL)
    return verdict_of_path(tree, path, accepted, final, node_tokens, kinds,
                           torch.full(kinds.shape, math.nan))


def verdict_of_path(tree, path: torch.Tensor, accepted: torch.Tensor, final: torch.Tensor,
                    node_tokens: torch.Tensor, kinds: torch.Tensor,
                    probability: torch.Tensor) -> verify.Verdict:
    """The verdict of a path (B, W) of ``tree`` accepted up to depth ``accepted`` (B,), with
    ``final`` (B,) the code drawn after it: the committed codes, the node fed as each offset's
    draft, and the nodes on the accepted path."""
    following = torch.cat([path[:, 1:], path[:, -1:]], dim=1)
    tokens = torch.where(torch.arange(tree.window) == accepted[:, None], final[:, None],
                         node_tokens.gather(1, following))
    on_path = ((path[:, tree.depth] == torch.arange(len(tree.depth)))
               & (tree.depth <= accepted[:, None]))
    return verify.Verdict(path, accepted, tokens, kinds, probability, following, on_path)
