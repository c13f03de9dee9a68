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
tested at once (a loop over the ``K`` candidate ranks builds the residuals, never one over slots),
and the accepted path is read off with one product with the ancestor matrix.

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
    drafted: torch.Tensor  # (B, L) node fed as offset j's draft: the path's next node
    on_path: torch.Tensor  # (B, T) the nodes of the accepted path (the root and accepted ones)
    sibling_tests: torch.Tensor | None = None  # (B,) PD candidates 2..K tested along the path
    sibling_passes: torch.Tensor | None = None  # (B,) of those, the ones that passed


@dataclass
class _Test:
    """One candidate per parent, tested: the verdicts and what they rest on."""

    accept: torch.Tensor  # (B, N) candidate accepted
    relaxed: torch.Tensor | None  # (B, N) accepted only because the rule is relaxed (None: exact)
    probability: torch.Tensor  # (B, N) acceptance probability min(1, p/q) (read only where live)


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

    Here ``p``/``q`` are step k's distributions (``p`` only for relaxed rules, ``q`` only for
    rules that read all of it; None otherwise),
    ``x``/``live`` the candidate and whether it exists and is still in play, ``u`` its uniform in
    (0, 1], and ``p_x``/``q_x`` the masses ``p_k(x)``/``q_k(x)``. ``rule`` may enlarge the two
    masses (relaxed acceptance); the exact rule leaves them as they are.
    """
    p_mass, q_mass = rule.masses(p, q, x, p_x, q_x)
    accept = live & (u * q_mass <= p_mass)
    probability = (p_mass / q_mass.clamp_min(1e-30)).clamp_max(1.0)
    relaxed = accept & ~(u * q_x <= p_x) if rule.relaxes else None
    return _Test(accept, relaxed, probability)


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
    K = 1). At the PD tree's inner nodes :func:`_later_candidates` tests candidates 2..K (the
    only place full residual distributions are carried). The path follows the accepted child of
    each node from the root. At its end the slot is drawn from what recursive rejection left
    (the residual after the rejected candidates), or from the target itself when no candidate
    was tested there (a bonus draw after a fully accepted chain). With ``count_siblings`` (for
    ``auto``'s estimate of how often a further candidate passes) the verdict also counts, per
    row, the candidates 2..K tested along the path and those that passed.
    """
    vocab = p.shape[-1]
    x = node_tokens.index_select(1, tree.first_child)
    live = tree.has_child & node_valid.index_select(1, tree.first_child)
    q_nodes = q_slots.index_select(1, tree.depth)  # a node's children fill the slot at its depth
    q_x = _masses(q_nodes, x)
    first = check_candidate(rule, p, q_nodes if rule.uses_q else None, x, live,
                            uniforms[..., 0], _masses(p, x), q_x)
    chosen = tree.first_child * first.accept  # the accepted child of every node, 0 for none
    taken = first.probability  # probability of the accepting test, else of the first test
    relaxed = first.relaxed
    later = sibling_tests = None
    if tree.branching > 1:
        later = _later_candidates(tree, rule, p, q_nodes, node_tokens, node_valid, uniforms,
                                  first, count_siblings)
        sibling_tests = later.sibling_tests
        chosen.index_copy_(1, tree.inner_nodes, later.chosen)
        taken.index_copy_(1, tree.inner_nodes, later.taken)
        if relaxed is not None:
            relaxed.index_copy_(1, tree.inner_nodes, later.relaxed)

    left = (chosen.index_select(1, tree.parent_or_root) != tree.node_ids)  # by the node's parent
    on_path = (left.to(tree.on_path_weights.dtype) @ tree.on_path_weights) == 0
    sibling_passes = None
    if sibling_tests is not None:
        inner_on_path = on_path.index_select(1, tree.inner_nodes)
        sibling_passes = (later.sibling_passed & inner_on_path).sum(-1)
        sibling_tests = (sibling_tests * inner_on_path).sum(-1)
    deepest = torch.where(on_path, tree.depth, -1).argmax(-1, keepdim=True)  # (B, 1)
    numbers, flags = (table.index_select(0, deepest[:, 0]) for table in tree.end_tables)
    window = tree.window
    path, drafted, accepted = numbers[:, :window], numbers[:, window:-2], numbers[:, -2]
    before_end, at_end = flags[:, :window], flags[:, window:-2]

    # the slot after the path is drawn from the residual left at its end: after the first
    # candidate's rejection, or at an inner node after every live candidate's; the target itself
    # where nothing was tested
    tested_at_end = live.gather(1, deepest)  # (B, 1)
    deepest_v = deepest[..., None].expand(-1, -1, vocab)
    end_p, end_q = p.gather(1, deepest_v)[:, 0], q_nodes.gather(1, deepest_v)[:, 0]  # (B, V)
    end_rejected = tested_at_end
    if later is not None:
        inner_end, outer_end = flags[:, -2:-1], flags[:, -1:]  # (B, 1)
        at_inner_v = numbers[:, -1:, None].expand(-1, -1, vocab)
        # there the rejections are already subtracted: the draw normalises what they left
        end_p = torch.where(inner_end, later.left_over.gather(1, at_inner_v)[:, 0], end_p)
        end_q = end_q * outer_end
        end_rejected = end_rejected | inner_end
    final_token = sample(residual(end_p, end_q, end_rejected), final_uniform)

    tokens = torch.where(at_end, final_token[:, None], node_tokens.gather(1, drafted))
    final_kind = torch.where(tested_at_end, RESIDUAL, BONUS)
    accepted_kind = (ACCEPTED if relaxed is None
                     else torch.where(relaxed.gather(1, path), RELAXED, ACCEPTED))
    kinds = torch.where(before_end, accepted_kind, final_kind)
    probability = torch.where(before_end | (at_end & tested_at_end), taken.gather(1, path),
                              float("nan"))
    return Verdict(path, accepted, tokens, kinds, probability, drafted, on_path, sibling_tests,
                   sibling_passes)


@dataclass
class _LaterCandidates:
    """The PD tree's inner nodes after testing their candidates 2..K (each (B, I) unless said)."""

    chosen: torch.Tensor  # the accepted child, 0 for none
    taken: torch.Tensor  # probability of the accepting test, else of the first test
    relaxed: torch.Tensor | None  # accepted only because the rule is relaxed
    sibling_tests: torch.Tensor | None  # candidates 2..K tested (those before the accepted
    # one); None when not asked for
    sibling_passed: torch.Tensor | None  # whether one of candidates 2..K passed; None when
    # not asked for
    left_over: torch.Tensor  # (B, I, V) what every live candidate's rejection left of the
    # target, not normalised: where no candidate passed, the slot is drawn from it


def _later_candidates(tree: DraftTree, rule, p: torch.Tensor, q_nodes: torch.Tensor,
                      node_tokens: torch.Tensor, node_valid: torch.Tensor,
                      uniforms: torch.Tensor, first: _Test, count_siblings: bool
                      ) -> _LaterCandidates:
    """Recursive rejection at every inner node, candidates 2..K tested in one call.

    Candidate k is only reached after 1..k-1 were rejected, so its distributions are
    ``p_k``/``q_k`` of that chain of rejections whatever the tests said: they are built for every
    inner node (a live candidate always counts as rejected; where an earlier one passed, the
    values are never read), then all K - 1 tests run at once and each node takes its first
    passing candidate.

    The chain is kept as unnormalised weights ``r_k = s_k * p_k`` (``s_k`` their sum, ``r_1 =
    p``): ``r_{k+1} = max(0, r_k - (s_k / left_k) * q)``, with ``left_k`` the draft mass of the
    candidates not yet drawn. ``q`` need not lose the drawn candidates: a candidate the exact
    rule rejected has ``p_k(x) < q_k(x)``, so its weight is 0 from then on, and subtracting more
    there changes nothing (the same holds for LANTERN, whose masses only add target mass; GSD,
    which reads ``q_k`` whole and can reject a code that ``p`` favours, removes them). Where a
    candidate is not live the factor is 0 and the weights stay as they were (candidates are live
    up to a point, so the chain stops there); after the last candidate they are what the slot is
    drawn from when none passed.
    """
    inner = tree.inner_nodes
    batch, (count, branching) = p.shape[0], tree.inner_children.shape
    kids = tree.inner_children.flatten()
    candidates = node_tokens.index_select(1, kids).view(batch, count, branching)
    live = tree.inner_child_exists & node_valid.index_select(1, kids).view(batch, count, branching)
    weights, draft = p.index_select(1, inner), q_nodes.index_select(1, inner)
    draft_at = draft.gather(-1, candidates)  # (B, I, K) q(x_k)
    # (B, I, K) the draft mass left for candidate k: 1 - q(x_1) - ... - q(x_{k-1})
    left = (draft_at - draft_at.cumsum(-1)).add_(1.0).clamp_min_(MIN_MASS)
    factor = live / left  # r_k's sum times this scales q to q_k (0 where not live)
    # (B, I, 1) views per candidate, made in one operation each
    factors, candidate_at = factor[..., None].unbind(2), candidates[..., None].unbind(2)
    mass = None  # s_1 = 1
    target_weights, sums, targets, drafts = [], [], [], []
    for k in range(branching):
        scale = factors[k] if mass is None else factors[k] * mass
        weights = torch.addcmul(weights, draft, scale, value=-1.0).clamp_min_(0.0)
        mass = weights.sum(-1, keepdim=True)
        if rule.uses_q:
            draft = draft.scatter(-1, candidate_at[k], 0.0)
        if k + 1 < branching:
            target_weights.append(weights.gather(-1, candidate_at[k + 1]))
            sums.append(mass)
            if rule.relaxes:
                targets.append(weights / mass.clamp_min(MIN_MASS))
            if rule.uses_q:
                drafts.append(draft / left[..., k + 1:k + 2])
    x_later = candidates[..., 1:]
    test = check_candidate(rule, torch.stack(targets, dim=2) if rule.relaxes else None,
                           torch.stack(drafts, dim=2) if rule.uses_q else None,
                           x_later, live[..., 1:], uniforms.index_select(1, inner)[..., 1:],
                           torch.cat(target_weights, -1) / torch.cat(sums, -1).clamp_min_(MIN_MASS),
                           (draft_at / left)[..., 1:])
    # each inner node's first passing candidate, K when none passed: candidate 1's test, the
    # later ones', then a column that always passes; what is taken from each test is laid out
    # the same way, with the first test's again where none passed
    first_accepted = first.accept.index_select(1, inner)[..., None]
    first_taken = first.probability.index_select(1, inner)[..., None]
    rank = torch.cat([first_accepted, test.accept, tree.inner_passes.expand(batch, -1, -1)],
                     -1).to(torch.int8).argmax(-1, keepdim=True)  # (B, I, 1)
    chosen = tree.inner_choices.take(rank + tree.inner_choice_rows)[..., 0]
    taken = torch.cat([first_taken, test.probability, first_taken], -1).gather(-1, rank)[..., 0]
    relaxed = None
    if first.relaxed is not None:
        first_relaxed = first.relaxed.index_select(1, inner)[..., None]
        relaxed = torch.cat([first_relaxed, test.relaxed, first_relaxed], -1).gather(
            -1, rank)[..., 0]
    sibling_tests = sibling_passed = None
    if count_siblings:
        rank = rank[..., 0]
        sibling_tests = torch.where(rank < branching, rank, live[..., 1:].sum(-1))
        sibling_passed = (rank > 0) & (rank < branching)
    return _LaterCandidates(chosen, taken, relaxed, sibling_tests, sibling_passed, weights)
