"""Acceptance rules: the exact speculative test on a draft tree, and the relaxed LANTERN / GSD.

Exact rule (``sjd_core/decoding/ALGORITHMS.md``, section 2): a draft ``x ~ q`` is accepted with
probability ``min(1, p(x)/q(x))``, written ``u * q(x) <= p(x)`` with ``u`` uniform in (0, 1];
after a rejection the slot is drawn from ``norm(max(0, p - q))`` and the result is distributed
exactly as ``p``.

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
from .sampling import MIN_MASS, residual, sample
from .settings import AccelerationSettings

ACCEPTED, RESIDUAL, BONUS, RELAXED, FORCED = 1, 2, 3, 4, 5
COMMIT_KINDS = {0: "not committed", ACCEPTED: "draft accepted", RESIDUAL: "residual draw",
                BONUS: "bonus draw", RELAXED: "relaxed accept", FORCED: "forced"}


class ExactAcceptance:
    """The lossless test: masses ``p(x)`` and ``q(x)`` themselves."""

    uses_q = False  # the rule reads only q(x), never the whole draft distribution
    relaxes = False  # never accepts what the exact rule rejects

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
    relaxes = True

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
    relaxes = True

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


def lantern_defaults(codebook_size: int) -> tuple[int, float]:
    """LANTERN's (k, delta) for a codebook: the published k = 1000, delta = 0.1 at 8192 codes
    and above; below, k in proportion to the codebook and delta to its square root.

    The published values suit large codebooks; on the 512-code reference model they accept
    almost any draft (probe accuracy 60% against AR's 80% on 50 images), while k = 62,
    delta = 0.025 keep it near AR (78%) and still commit 15% more codes per forward pass.
    """
    scale = min(1.0, codebook_size / 8192)
    return max(1, min(1000, round(1000 * scale), codebook_size - 1)), 0.1 * scale ** 0.5


def acceptance_rule(settings: AccelerationSettings, embeddings: torch.Tensor | None):
    """The acceptance rule object for ``settings.relaxed``."""
    if settings.relaxed == "none":
        return ExactAcceptance()
    if embeddings is None:
        raise ValueError(f"relaxed={settings.relaxed!r} needs the model's codebook embeddings, "
                         "and this model provides none; use relaxed='none'.")
    if settings.relaxed == "lantern":
        neighbours, delta = lantern_defaults(embeddings.shape[0])
        return LanternAcceptance(embeddings, settings.lantern_neighbours or neighbours,
                                 delta if settings.lantern_delta is None else settings.lantern_delta)
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
    sibling_tests: torch.Tensor | None = None  # (B,) PD candidates 2..K tested along the path
    sibling_passes: torch.Tensor | None = None  # (B,) of those, the ones that passed


@dataclass
class _Test:
    """One candidate per parent, tested: the verdicts and what they rest on."""

    accept: torch.Tensor  # (B, N) candidate accepted
    relaxed: torch.Tensor | None  # (B, N) accepted only because the rule is relaxed (None: exact)
    probability: torch.Tensor  # (B, N) acceptance probability min(1, p/q); NaN where not tested


def check_candidate(rule, p: torch.Tensor, q: torch.Tensor | None, x: torch.Tensor,
                    live: torch.Tensor, u: torch.Tensor, p_x: torch.Tensor,
                    q_x: torch.Tensor) -> _Test:
    """Step k of recursive rejection sampling without replacement, for every parent at once.

    At a parent whose children are candidates ``x_1 .. x_K`` of one slot, drawn without
    replacement from the slot's draft distribution ``q``, with ``p`` the parent's target:

        p_1 = p, q_1 = q
        accept x_k with probability min(1, p_k(x_k) / q_k(x_k))
        otherwise p_{k+1} = norm(max(0, p_k - q_k)), q_{k+1} = q_k without x_k, renormalised

    Why it is exact (Jeon et al. 2024): given that ``x_1 .. x_{k-1}`` were rejected, ``x_k`` is
    distributed as ``q_k`` (sampling without replacement), so step k is the single-draft test of
    ``p_k`` against ``q_k``; by the exactness lemma a draw that passes step k, or failing it, the
    rest of the procedure, is distributed as ``p_k``. By induction from k = K down (where the
    remainder is a plain draw from ``p_{K+1}``), the child taken is distributed as ``p_1 = p``.

    Here ``p``/``q`` are step k's distributions (``q`` only for rules that read all of it),
    ``x``/``live`` the candidate and whether it exists and is still in play, ``u`` its uniform in
    (0, 1], and ``p_x``/``q_x`` the masses ``p_k(x)``/``q_k(x)``. ``rule`` may enlarge the two
    masses (relaxed acceptance); the exact rule leaves them as they are.
    """
    p_mass, q_mass = rule.masses(p, q, x, p_x, q_x)
    accept = live & (u * q_mass <= p_mass)
    probability = torch.where(live, (p_mass / q_mass.clamp_min(1e-30)).clamp_max(1.0),
                              float("nan"))
    relaxed = accept & ~(u * q_x <= p_x) if rule.relaxes else None
    return _Test(accept, relaxed, probability)


def without_candidate(q: torch.Tensor, x: torch.Tensor, q_x: torch.Tensor,
                      rejected: torch.Tensor) -> torch.Tensor:
    """``q_{k+1}``: ``q`` without the rejected candidate ``x`` (of mass ``q_x``), renormalised
    by the mass left (``q`` sums to 1); ``q`` itself where ``x`` was not rejected, or where
    nothing is left."""
    left = (1.0 - q_x)[..., None]
    keep = rejected[..., None] & (left > MIN_MASS)
    return torch.where(keep, q.scatter(-1, x[..., None], 0.0) / left.clamp_min(MIN_MASS), q)


def _masses(dist: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return dist.gather(-1, x[..., None]).squeeze(-1)


def verify_tree(tree: DraftTree, p: torch.Tensor, node_tokens: torch.Tensor,
                node_valid: torch.Tensor, q_slots: torch.Tensor, uniforms: torch.Tensor,
                final_uniform: torch.Tensor, rule, count_siblings: bool = False) -> Verdict:
    """Test every parent's candidates, find the accepted path and draw the slot after it.

    ``p`` (B, T, V): target after each fed node; ``node_tokens``/``node_valid`` (B, T);
    ``q_slots`` (B, W, V): draft distribution per window offset (W >= the tree's window);
    ``uniforms`` (B, T, K): one per candidate; ``final_uniform`` (B,) for the last draw.

    Every node's first candidate is tested at once with gathered masses (a chain is the case
    K = 1); the PD tree's inner nodes then test candidates 2..K with :func:`check_candidate`,
    carrying full residual distributions (only there). The path follows the accepted child of
    each node from the root. At its end the slot is drawn from what recursive rejection left
    (the residual after the rejected candidates), or from the target itself when no candidate
    was tested there (a bonus draw after a fully accepted chain). With ``count_siblings`` (for
    ``auto``'s estimate of how often a further candidate passes) the verdict also counts, per
    row, the candidates 2..K tested along the path and those that passed.
    """
    batch, size, vocab = p.shape
    child_slot = tree.depth.clamp_max(q_slots.shape[1] - 1)  # the slot a node's children fill
    rows = torch.arange(batch, device=p.device)
    first_child = tree.children[:, 0]
    child_or_root = first_child.clamp_min(0)
    x = node_tokens.index_select(1, child_or_root)
    live = (first_child >= 0) & node_valid.index_select(1, child_or_root)
    q_nodes = q_slots.index_select(1, child_slot) if rule.uses_q else None
    q_x = q_slots[rows[:, None], child_slot, x]
    first = check_candidate(rule, p, q_nodes, x, live, uniforms[..., 0], _masses(p, x), q_x)
    chosen = torch.where(first.accept, first_child, -1)  # the accepted child of every node
    taken = first.probability  # probability of the accepting test, else of the first test
    relaxed = first.relaxed
    inner_end = sibling_tests = None
    if tree.branching > 1:
        inner, kids = tree.inner_nodes, tree.children[tree.inner_nodes]  # (I,), (I, K)
        kid_or_root = kids.clamp_min(0).flatten()
        cand = node_tokens.index_select(1, kid_or_root).view(batch, *kids.shape)
        cand_live = (kids >= 0) & node_valid.index_select(1, kid_or_root).view(batch, *kids.shape)
        p_k, q_k = p.index_select(1, inner), q_slots.index_select(1, child_slot[inner])
        u_inner = uniforms.index_select(1, inner)
        first_accepted = first.accept.index_select(1, inner)
        first_rejected = ~first_accepted
        searching = first_rejected
        q_x = q_x.index_select(1, inner)
        rank = torch.where(first_accepted, 0, -1)  # which candidate each inner node took
        inner_taken = taken.index_select(1, inner)
        inner_relaxed = None if relaxed is None else relaxed.index_select(1, inner)
        for k in range(1, tree.branching):
            rejected = searching & cand_live[..., k - 1]
            p_k = residual(p_k, q_k, rejected[..., None])
            q_k = without_candidate(q_k, cand[..., k - 1], q_x, rejected)
            x_k = cand[..., k]
            q_x = _masses(q_k, x_k)
            step = check_candidate(rule, p_k, q_k, x_k, cand_live[..., k] & searching,
                                   u_inner[..., k], _masses(p_k, x_k), q_x)
            rank = torch.where(step.accept, k, rank)
            inner_taken = torch.where(step.accept, step.probability, inner_taken)
            if inner_relaxed is not None:
                inner_relaxed = inner_relaxed | step.relaxed
            searching = searching & ~step.accept
        inner_end = residual(p_k, q_k, (searching & cand_live[..., -1])[..., None])
        if count_siblings:
            sibling_tests = torch.where(rank > 0, rank, cand_live[..., 1:].sum(-1)) * first_rejected
        chosen.index_copy_(1, inner, torch.where(rank >= 0, kids.expand(batch, -1, -1).gather(
            2, rank.clamp_min(0)[..., None]).squeeze(-1), -1))
        taken.index_copy_(1, inner, inner_taken)
        if relaxed is not None:
            relaxed.index_copy_(1, inner, inner_relaxed)

    edge = torch.ones(batch, size, dtype=torch.bool, device=p.device)
    edge[:, 1:] = chosen.index_select(1, tree.parent[1:]) == torch.arange(1, size, device=p.device)
    on_path = ~((~edge)[:, None, :] & tree.ancestors).any(-1)
    sibling_passes = None
    if sibling_tests is not None:
        inner_on_path = on_path.index_select(1, tree.inner_nodes)
        sibling_passes = ((rank > 0) & inner_on_path).sum(-1)
        sibling_tests = (sibling_tests * inner_on_path).sum(-1)
    deepest = torch.where(on_path, tree.depth, -1).argmax(-1)
    accepted = tree.depth[deepest]
    path = tree.route[deepest]

    tested_at_end = live[rows, deepest]
    p_end = p[rows, deepest]
    end = torch.where(tested_at_end[:, None], residual(p_end, q_slots[rows, child_slot[deepest]]),
                      p_end)
    if inner_end is not None:
        at_inner = tree.inner_index[deepest]
        end = torch.where((at_inner >= 0)[:, None], inner_end[rows, at_inner.clamp_min(0)], end)
    final_token = sample(end, final_uniform)

    offsets = torch.arange(tree.window, device=p.device)
    before_end = offsets < accepted[:, None]
    next_nodes = torch.cat([path[:, 1:], path[:, -1:]], dim=1)
    tokens = torch.where(offsets == accepted[:, None], final_token[:, None],
                         node_tokens.gather(1, next_nodes))
    final_kind = torch.where(tested_at_end, RESIDUAL, BONUS)
    accepted_kind = (ACCEPTED if relaxed is None
                     else torch.where(relaxed.gather(1, path), RELAXED, ACCEPTED))
    kinds = torch.where(before_end, accepted_kind, final_kind[:, None])
    probability = torch.where(before_end | tested_at_end[:, None], taken.gather(1, path),
                              float("nan"))
    return Verdict(path, accepted, tokens, kinds, probability, sibling_tests, sibling_passes)
