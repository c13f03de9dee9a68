"""Acceptance rules: the exact speculative test on a draft tree, and the relaxed LANTERN / GSD.

Exact rule (ALGORITHMS.md): a draft ``x ~ q`` is accepted with probability ``min(1, p(x)/q(x))``,
written ``u * q(x) <= p(x)`` with ``u`` uniform in (0, 1]; after a rejection the slot is drawn
from ``norm(max(0, p - q))`` and the result is distributed exactly as ``p``.

On a tree, each node's children are the ``K`` candidates of the next slot, drawn without
replacement from that slot's q. They are tested in order by recursive rejection sampling without
replacement (Jeon et al. 2024): after rejecting ``x_k``, ``p <- norm(max(0, p - q))`` and
``q <- q`` without ``x_k``, renormalised; the first accepted child is taken; if none is, the slot
is drawn from the final residual. A chain is the case ``K = 1``. Every parent of the tree is
tested at once (the loop runs over the ``K`` candidates, never over slots), and the accepted path
is read off with one ancestor-matrix reduction.

Relaxed rules replace ``(p(x), q(x))`` in the test by larger masses; they are lossy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .drafting import DraftTree
from .sampling import normalise, race, residual
from .settings import AccelerationSettings

ACCEPTED, RESIDUAL, BONUS, RELAXED, FORCED = 1, 2, 3, 4, 5
COMMIT_KINDS = {0: "not committed", ACCEPTED: "draft accepted", RESIDUAL: "residual draw",
                BONUS: "bonus draw", RELAXED: "relaxed accept", FORCED: "forced"}


class ExactAcceptance:
    """The lossless test: masses ``p(x)`` and ``q(x)`` themselves."""

    uses_q = False  # the rule reads only q(x), never the whole draft distribution

    def masses(self, p: torch.Tensor, q: torch.Tensor, x: torch.Tensor, p_x: torch.Tensor,
               q_x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return p_x, q_x


class LanternAcceptance:
    """LANTERN (Jang et al. 2025), LOSSY: credit a draft with the mass of its look-alikes.

    ``A(x)`` = the ``k`` codes nearest to ``x`` in the codebook's latent space, taken in order of
    distance while their cumulative target mass stays ``<= delta``. Accept if
    ``u * q(x) <= p(x) + p(A(x))``. Never accepts less often than the exact rule on the same
    uniforms; adds at most ``delta`` of mass; ``delta = 0`` is the exact rule.
    """

    uses_q = False

    def __init__(self, embeddings: torch.Tensor, neighbours: int, delta: float) -> None:
        self.delta = delta
        self.table = nearest_codes(embeddings, neighbours)

    def masses(self, p, q, x, p_x, q_x):
        near = self.table[x]  # (B, T, k)
        mass = p.gather(-1, near).cumsum(-1)
        added = torch.where(mass <= self.delta, mass, torch.zeros_like(mass)).amax(-1)
        return p_x + added, q_x


class GsdAcceptance:
    """Grouped speculative decoding (So et al. 2025), LOSSY: test a group of similar codes.

    The rule implemented: ``G(x)`` = ``x`` plus the codes whose rank in ``p`` is within
    ``rank_radius`` of ``x``'s rank, whose probability differs from ``p(x)`` by less than
    ``prob_tolerance`` and whose unit-normalised codebook embedding is within squared distance
    ``embedding_tolerance`` of ``x``'s. Accept if ``u * sum_G q <= sum_G p``; on rejection the
    usual residual. Defaults follow the published code: radius 7, 0.15, 0.5.
    """

    uses_q = True

    def __init__(self, embeddings: torch.Tensor, rank_radius: int, prob_tolerance: float,
                 embedding_tolerance: float) -> None:
        self.unit = torch.nn.functional.normalize(embeddings.float(), dim=-1)
        self.radius = rank_radius
        self.prob_tolerance = prob_tolerance
        self.embedding_tolerance = embedding_tolerance

    def masses(self, p, q, x, p_x, q_x):
        codes = torch.arange(p.shape[-1], device=p.device)
        level, code = p_x[..., None], x[..., None]
        before = (p > level) | ((p == level) & (codes < code))  # ranked ahead of x
        after = ~before & (codes != code)
        radius = min(self.radius, p.shape[-1] - 1)
        above = torch.topk(torch.where(before, -p, float("-inf")), radius, dim=-1)
        below = torch.topk(torch.where(after, p, float("-inf")), radius, dim=-1)
        group = torch.cat([above.indices, below.indices], dim=-1)  # (B, T, 2r)
        exists = torch.cat([above.values, below.values], dim=-1) > float("-inf")
        p_group = p.gather(-1, group)
        close_p = (p_group - level).abs() < self.prob_tolerance
        distance = (self.unit[group] - self.unit[x][..., None, :]).pow(2).sum(-1)
        member = exists & close_p & (distance < self.embedding_tolerance)
        zero = torch.zeros_like(p_group)
        p_mass = p_x + torch.where(member, p_group, zero).sum(-1)
        q_mass = q_x + torch.where(member, q.gather(-1, group), zero).sum(-1)
        return p_mass, q_mass


def nearest_codes(embeddings: torch.Tensor, count: int, chunk: int = 1024) -> torch.Tensor:
    """(V, count) indices of each code's nearest other codes by Euclidean distance, nearest first."""
    emb = embeddings.float()
    count = min(count, emb.shape[0] - 1)
    rows = []
    for start in range(0, emb.shape[0], chunk):
        block = torch.cdist(emb[start:start + chunk], emb)
        block[torch.arange(block.shape[0]), torch.arange(start, start + block.shape[0])] = float("inf")
        rows.append(torch.topk(block, count, dim=-1, largest=False).indices)
    return torch.cat(rows)


def acceptance_rule(settings: AccelerationSettings, embeddings: torch.Tensor | None):
    """The acceptance rule object for ``settings.relaxed``."""
    if settings.relaxed == "none":
        return ExactAcceptance()
    if embeddings is None:
        raise ValueError(f"relaxed={settings.relaxed!r} needs the model's codebook embeddings, "
                         "and this model provides none; use relaxed='none'.")
    if settings.relaxed == "lantern":
        return LanternAcceptance(embeddings, settings.lantern_neighbours, settings.lantern_delta)
    return GsdAcceptance(embeddings, settings.gsd_rank_radius, settings.gsd_prob_tolerance,
                         settings.gsd_embedding_tolerance)


@dataclass
class Verdict:
    """Outcome of one iteration's verification, per batch row."""

    path: torch.Tensor  # (B, L) node at each depth (accepted, then the stale route below it)
    accepted: torch.Tensor  # (B,) drafts accepted along the path
    tokens: torch.Tensor  # (B, L) code committed at offset j (valid for j <= accepted)
    kinds: torch.Tensor  # (B, L) commit kind at offset j
    probability: torch.Tensor  # (B, L) acceptance probability of the test at offset j (NaN: none)


def verify_tree(tree: DraftTree, p: torch.Tensor, node_tokens: torch.Tensor,
                node_valid: torch.Tensor, q_slots: torch.Tensor, uniforms: torch.Tensor,
                final_noise: torch.Tensor, rule) -> Verdict:
    """Recursive rejection sampling over every parent at once, then the accepted path.

    ``p`` (B, T, V): target distribution after each fed node; ``node_tokens``/``node_valid``
    (B, T); ``q_slots`` (B, L, V): draft distribution per window offset; ``uniforms`` (B, T, K);
    ``final_noise`` (B, V) for the residual or bonus draw at the end of the path.

    The first candidate of every parent is tested with gathered scalars; only the parents that
    have siblings (the PD tree's inner nodes) carry full residual distributions through the
    later candidates, and the final residual is formed for the one node where the path ends.
    """
    batch, size, vocab = p.shape
    window = q_slots.shape[1]
    parent_slot = tree.depth.clamp_max(window - 1)

    def q_of(nodes: torch.Tensor) -> torch.Tensor:
        return q_slots.gather(1, parent_slot[nodes][None, :, None].expand(batch, -1, vocab))

    def test(k, nodes, p_nodes, q_nodes, q_x):
        child = tree.children[nodes, k]
        x = node_tokens.gather(1, child.clamp_min(0).expand(batch, -1))
        live = (child >= 0) & node_valid.gather(1, child.clamp_min(0).expand(batch, -1))
        p_x = p_nodes.gather(-1, x[..., None]).squeeze(-1)
        q_x = q_x(x)
        p_mass, q_mass = rule.masses(p_nodes, q_nodes, x, p_x, q_x)
        u = uniforms[:, nodes, k]
        accept = live & (u * q_mass <= p_mass)
        probability = (p_mass / q_mass.clamp_min(1e-30)).clamp_max(1.0)
        return x, live, accept, accept & ~(u * q_x <= p_x), probability

    every = torch.arange(size, device=p.device)
    rows = torch.arange(batch, device=p.device)[:, None]
    x, live, accept, relaxed, probability = test(
        0, every, p, q_of(every) if rule.uses_q else None,
        lambda x: q_slots[rows, parent_slot, x])
    nan = torch.full_like(probability, float("nan"))
    first_probability = torch.where(live, probability, nan)
    taken_probability = torch.where(accept, probability, nan)
    chosen = torch.where(accept, tree.children[:, 0], -1)
    tested = live
    final_inner = None
    if tree.branching > 1:
        inner = tree.inner_nodes
        p_in, q_in = p[:, inner], q_of(inner)
        decided = accept[:, inner]
        for k in range(1, tree.branching):
            step = (live[:, inner] & ~decided) if k == 1 else (live_k & ~decided)
            step = step[..., None]
            previous = x[:, inner] if k == 1 else x_k
            q_next = normalise(q_in.scatter(-1, previous[..., None], 0.0), q_in)
            p_in, q_in = torch.where(step, residual(p_in, q_in), p_in), torch.where(step, q_next, q_in)
            x_k, live_k, accept_k, relaxed_k, probability_k = test(
                k, inner, p_in, q_in, lambda x: q_in.gather(-1, x[..., None]).squeeze(-1))
            live_k = live_k & ~decided
            accept_k = accept_k & live_k
            index = inner.expand(batch, -1)
            chosen = chosen.scatter(1, index, torch.where(accept_k, tree.children[inner, k],
                                                          chosen[:, inner]))
            taken_probability = taken_probability.scatter(
                1, index, torch.where(accept_k, probability_k, taken_probability[:, inner]))
            relaxed = relaxed.scatter(1, index, relaxed[:, inner] | (relaxed_k & accept_k))
            decided = decided | accept_k
        last = (live_k & ~decided)[..., None]
        final_inner = torch.where(last, residual(p_in, q_in), p_in)
    edge = torch.zeros_like(live)
    edge[:, 1:] = chosen.gather(1, tree.parent[1:].expand(batch, -1)) == every[1:]
    edge[:, 0] = True
    on_path = ~((~edge)[:, None, :] & tree.ancestors[None]).any(-1)
    deepest = torch.where(on_path, tree.depth, -1).argmax(-1)
    accepted = tree.depth[deepest]
    path = tree.route[deepest]
    ends_tested = tested.gather(1, deepest[:, None]).squeeze(1)
    p_end = p.gather(1, deepest[:, None, None].expand(-1, 1, vocab)).squeeze(1)
    q_end = q_slots.gather(1, parent_slot[deepest][:, None, None].expand(-1, 1, vocab)).squeeze(1)
    final_dist = torch.where(ends_tested[:, None], residual(p_end, q_end), p_end)
    if final_inner is not None:
        slot_in_inner = tree.inner_index[deepest]
        from_inner = final_inner.gather(1, slot_in_inner.clamp_min(0)[:, None, None]
                                        .expand(-1, 1, vocab)).squeeze(1)
        final_dist = torch.where((slot_in_inner >= 0)[:, None], from_inner, final_dist)
    final_token = race(final_dist, final_noise)
    offsets = torch.arange(window, device=p.device)
    next_nodes = torch.cat([path[:, 1:], path[:, -1:]], dim=1)
    tokens = torch.where(offsets == accepted[:, None], final_token[:, None],
                         node_tokens.gather(1, next_nodes))
    final_kind = torch.where(ends_tested, RESIDUAL, BONUS)
    kinds = torch.where(offsets < accepted[:, None],
                        torch.where(relaxed.gather(1, path), RELAXED, ACCEPTED),
                        final_kind[:, None].expand(-1, window))
    probability = torch.where(offsets < accepted[:, None], taken_probability.gather(1, path),
                              first_probability.gather(1, path))
    return Verdict(path, accepted, tokens, kinds, probability)
