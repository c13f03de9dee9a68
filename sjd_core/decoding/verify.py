"""Acceptance rules, and the verifier that decides which drafts of a fed tree are committed.

Glossary (``docs/algorithms.md``, sections 2 and 5, has the proofs):

- *candidate*: a code drafted for a slot. A node's children are the candidates ``x_1 .. x_K`` of
  the slot after it, drawn without replacement from that slot's draft distribution ``q``.
- *target*: ``p``, the model's distribution for the slot after a node, given the path to it.
- *accepted*: a candidate that passed its test ``u <= p_k(x_k) / q_k(x_k)``, ``u`` uniform in
  (0, 1]. The candidates of a node are tested in order; the first accepted one is the node's
  child on the *path*, which starts at the root and goes as deep as acceptances go.
- *residual*: what rejections leave of the target, ``p_{k+1} = norm(max(0, p_k - q_k))`` with
  ``q_{k+1}`` = ``q_k`` without ``x_k``, renormalised (recursive rejection sampling without
  replacement, Jeon et al. 2024). Where no candidate of the path's last node passed, the slot
  after it is drawn from the residual: by the exactness lemma the code committed there, accepted
  or drawn, follows ``p``.
- *bonus*: a draw from the target itself, after a path's last node whose children were not
  tested (the end of the window, or a tree leaf).
- *left over*: the residual kept as weights ``r_k = s_k * p_k`` that are not normalised
  (``r_1 = p``). Once candidates ``1 .. k-1`` were rejected, step k rejects with probability
  ``s_{k+1} / s_k``; so a residual whose sum is below ``MIN_MASS`` is reached with probability
  below ``MIN_MASS``, and there the slot is drawn from the node's own target instead (the
  *fallback*: it moves a slot's distribution by less than ``MIN_MASS``).

Relaxed rules (LANTERN, GSD) replace ``(p(x), q(x))`` in the test by larger masses; they are lossy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .drafting import DraftTree
from .sampling import normalise, passes, residual, sample
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
    ``u <= (p(x) + p(A(x))) / q(x)``. Never accepts less often than the exact rule on the same
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
    ``embedding_tolerance`` of ``x``'s. Accept if ``u <= sum_G p / sum_G q``; on rejection the
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

    The published values suit large codebooks: on a small one a thousand neighbours are most of
    the codebook and almost any draft would pass. ``sjd_core.tools.reference.benchmark`` measures
    the quality and the forward passes of both on the 512-code reference model.
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


def check_candidate(rule, p: torch.Tensor | None, q: torch.Tensor | None, x: torch.Tensor,
                    live: torch.Tensor, u: torch.Tensor, p_x: torch.Tensor,
                    q_x: torch.Tensor) -> _Test:
    """Test candidate ``x`` of every parent at once: accepted with probability
    ``min(1, p_x / q_x)``, where it is ``live`` (it exists and is still in play).

    ``p_x``/``q_x`` are the masses ``p_k(x)``/``q_k(x)`` of the step the candidate is tested at,
    ``u`` its uniform in (0, 1]; ``p``/``q`` the whole distributions of that step for the
    relaxed rules that read them (None otherwise). ``rule`` may enlarge the two masses (relaxed
    acceptance); the exact rule leaves them as they are.
    """
    p_mass, q_mass = rule.masses(p, q, x, p_x, q_x)
    ratio = p_mass / q_mass
    accept = live & (u <= ratio)  # as :func:`~.sampling.passes` tests it
    relaxed = accept & ~passes(u, p_x, q_x) if rule.relaxes else None
    return _Test(accept, relaxed, ratio.clamp_max(1.0))


def verify_tree(tree: DraftTree, p: torch.Tensor, node_tokens: torch.Tensor,
                node_valid: torch.Tensor, q_slots: torch.Tensor, test_uniforms: torch.Tensor,
                final_uniform: torch.Tensor, rule, count_siblings: bool = False) -> Verdict:
    """Test every node's candidates, follow the accepted path and draw the slot after it.

    ``p`` (B, T, V): the target after each fed node; ``node_tokens``/``node_valid`` (B, T): the
    fed codes and whether each is a candidate in play; ``q_slots`` (B, W, V): the draft
    distribution of each window offset (W >= the tree's window); ``test_uniforms`` (B, T, K):
    one per candidate, by its parent and rank; ``final_uniform`` (B,): the draw after the path.
    With ``count_siblings`` (for ``auto``'s estimate of how often a further candidate passes)
    the verdict also counts, per row, the candidates 2..K tested along the path and those that
    passed.
    """
    q_nodes = q_slots.index_select(1, tree.depth)  # a node's children fill the slot at its depth
    tests = _test_every_node(tree, rule, p, q_nodes, node_tokens, node_valid, test_uniforms)
    end, on_path = _path_end(tree, tests.chosen)
    final = sample(_distribution_after(tree, end, tests, p, q_nodes), final_uniform)
    verdict = _verdict(tree, end, final, tests, node_tokens, on_path)
    if count_siblings and tests.siblings_tested is not None:
        inner_on_path = on_path.index_select(1, tree.inner_nodes)
        verdict.sibling_tests = (tests.siblings_tested * inner_on_path).sum(-1)
        verdict.sibling_passes = (tests.sibling_passed & inner_on_path).sum(-1)
    return verdict


@dataclass
class _NodeTests:
    """Every fed node's candidates, tested (each (B, T) unless said)."""

    chosen: torch.Tensor  # the node's accepted child, 0 where none passed
    probability: torch.Tensor  # acceptance probability of the test that passed, else the first's
    relaxed: torch.Tensor | None  # the child passed only because the rule is relaxed
    tested: torch.Tensor  # whether the node's first candidate was tested
    left_over: torch.Tensor | None = None  # (B, I, V) the inner nodes' residual weights after
    # every live candidate's rejection: where none passed, the slot is drawn from them
    siblings_tested: torch.Tensor | None = None  # (B, I) candidates 2..K tested
    sibling_passed: torch.Tensor | None = None  # (B, I) whether one of candidates 2..K passed

    def take(self, test: _Test, child: torch.Tensor) -> None:
        """Where ``test`` accepted, its candidate ``child`` is the node's child on the path."""
        self.chosen = torch.where(test.accept, child, self.chosen)
        self.probability = torch.where(test.accept, test.probability, self.probability)
        if self.relaxed is not None:
            self.relaxed = torch.where(test.accept, test.relaxed, self.relaxed)


def _mass_at(dist: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``dist[..., x]`` for one code ``x`` per distribution."""
    return dist.gather(-1, x[..., None]).squeeze(-1)


def _test_every_node(tree: DraftTree, rule, p: torch.Tensor, q_nodes: torch.Tensor,
                     node_tokens: torch.Tensor, node_valid: torch.Tensor,
                     uniforms: torch.Tensor) -> _NodeTests:
    """Every node's first candidate against the node's target and its slot's draft
    distribution (a chain is the case K = 1); then, at the tree's inner nodes, candidates 2..K
    (:func:`_test_later_candidates`)."""
    first_child = tree.children[:, 0]  # -1 for a leaf
    x = node_tokens.index_select(1, first_child.clamp_min(0))
    live = (first_child >= 0) & node_valid.index_select(1, first_child.clamp_min(0))
    first = check_candidate(rule, p, q_nodes if rule.uses_q else None, x, live,
                            uniforms[..., 0], _mass_at(p, x), _mass_at(q_nodes, x))
    tests = _NodeTests(torch.where(first.accept, first_child, 0), first.probability,
                       first.relaxed, live)
    if tree.branching > 1:
        _test_later_candidates(tree, rule, p, q_nodes, node_tokens, node_valid, uniforms, tests)
    return tests


def _test_later_candidates(tree: DraftTree, rule, p: torch.Tensor, q_nodes: torch.Tensor,
                           node_tokens: torch.Tensor, node_valid: torch.Tensor,
                           uniforms: torch.Tensor, tests: _NodeTests) -> None:
    """Candidates 2..K of every inner node, rank by rank, by recursive rejection; the first
    that passes becomes the node's child in ``tests``.

    Candidate k is reached only after candidates 1..k-1 were rejected, so it is tested against
    the target and draft that chain of rejections leaves, whatever the earlier tests said (where
    one of them passed, the later results are never taken).
    """
    inner = tree.inner_nodes
    children = tree.children.index_select(0, inner)  # (I, K), -1 where absent
    candidates = node_tokens[:, children.clamp_min(0)]  # (B, I, K)
    live = (children >= 0) & node_valid[:, children.clamp_min(0)]
    uniforms = uniforms.index_select(1, inner)
    chain = _Rejections(p.index_select(1, inner), q_nodes.index_select(1, inner))
    node = _NodeTests(tests.chosen.index_select(1, inner), tests.probability.index_select(1, inner),
                      None if tests.relaxed is None else tests.relaxed.index_select(1, inner),
                      tests.tested.index_select(1, inner))
    searching = node.chosen == 0
    siblings_tested, sibling_passed = torch.zeros_like(node.chosen), torch.zeros_like(searching)
    for rank in range(1, tree.branching):
        chain.reject(candidates[..., rank - 1], live[..., rank - 1])
        tested = live[..., rank] & searching
        test = chain.test(rule, candidates[..., rank], tested, uniforms[..., rank])
        node.take(test, children[:, rank])
        siblings_tested += tested
        sibling_passed |= test.accept
        searching &= ~test.accept
    chain.reject(candidates[..., -1], live[..., -1])
    tests.chosen = tests.chosen.index_copy(1, inner, node.chosen)
    tests.probability = tests.probability.index_copy(1, inner, node.probability)
    if tests.relaxed is not None:
        tests.relaxed = tests.relaxed.index_copy(1, inner, node.relaxed)
    tests.left_over, tests.siblings_tested, tests.sibling_passed = (chain.target, siblings_tested,
                                                                   sibling_passed)


class _Rejections:
    """Recursive rejection without replacement at every inner node at once.

    Holds the target left, ``r_k = s_k * p_k`` (not normalised, ``r_1 = p``, ``s_k`` its sum),
    and the draft left, ``q`` without the candidates drawn so far (not normalised: its sum
    ``left_k`` is the draft mass of the codes not yet drawn, and ``q_k`` = draft / ``left_k``).
    Both sums are direct sums, never one minus the mass drawn, which cancels when a candidate
    held almost all of it.
    """

    def __init__(self, target: torch.Tensor, draft: torch.Tensor) -> None:
        self.target, self.draft = target, draft
        self._sums()

    def _sums(self) -> None:
        self.mass = self.target.sum(-1, keepdim=True)  # s_k
        self.left = self.draft.sum(-1, keepdim=True)  # left_k

    def test(self, rule, x: torch.Tensor, live: torch.Tensor, u: torch.Tensor) -> _Test:
        """Candidate ``x`` (B, I) against ``p_k(x) = r_k(x) / s_k`` and ``q_k(x)``."""
        return check_candidate(rule, self.target / self.mass if rule.relaxes else None,
                               self.draft / self.left if rule.uses_q else None, x, live, u,
                               _mass_at(self.target, x) / self.mass[..., 0],
                               _mass_at(self.draft, x) / self.left[..., 0])

    def reject(self, x: torch.Tensor, live: torch.Tensor) -> None:
        """Candidate ``x`` (B, I), drawn from ``q_k``, was rejected where ``live``:
        ``r_{k+1} = max(0, r_k - s_k * q_k)``, and ``x`` leaves the draft. Candidates are live up
        to a point, so past it the draft is never read again."""
        scale = torch.where(live[..., None], self.mass / self.left, 0.0)  # s_k / left_k
        self.target = torch.addcmul(self.target, self.draft, scale, value=-1.0).clamp_min_(0.0)
        self.draft = self.draft.scatter(-1, x[..., None], 0.0)
        self._sums()


def _path_end(tree: DraftTree, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The accepted path's last node (B,) and its nodes (B, T): a node is on the path when it
    and each of its ancestors below the root is its parent's chosen child."""
    node_ids = torch.arange(tree.size, device=chosen.device)
    chosen_by_parent = chosen.index_select(1, tree.parent.clamp_min(0)) == node_ids
    chosen_by_parent[:, 0] = True  # the root starts every path
    on_path = ~((~chosen_by_parent)[:, None, :] & tree.ancestors).any(-1)
    end = torch.where(on_path, tree.depth, -1).argmax(-1)
    return end, on_path


def _row_at(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``values[b, index[b]]`` (B, V) of ``values`` (B, N, V)."""
    return values.gather(1, index[:, None, None].expand(-1, 1, values.shape[-1]))[:, 0]


def _distribution_after(tree: DraftTree, end: torch.Tensor, tests: _NodeTests, p: torch.Tensor,
                        q_nodes: torch.Tensor) -> torch.Tensor:
    """What the slot after the path's last node ``end`` (B,) is drawn from (B, V): the residual
    its rejected candidates left, or its target where none was tested (a bonus draw) and where
    the residual is empty (the fallback of the glossary)."""
    target = _row_at(p, end)
    drawn_from = residual(target, _row_at(q_nodes, end), tests.tested.gather(1, end[:, None]))
    if tests.left_over is not None:
        place = tree.inner_index.index_select(0, end)  # -1 for a node that is not inner
        left_over = normalise(_row_at(tests.left_over, place.clamp_min(0)), target)
        drawn_from = torch.where((place >= 0)[:, None], left_over, drawn_from)
    return drawn_from


def _verdict(tree: DraftTree, end: torch.Tensor, final: torch.Tensor, tests: _NodeTests,
             node_tokens: torch.Tensor, on_path: torch.Tensor) -> Verdict:
    """The codes committed along the path that ends at ``end``, then ``final``, and how each
    was committed."""
    path = tree.route.index_select(0, end)  # (B, W): the path, then the stale route below it
    accepted = tree.depth.index_select(0, end)
    drafted = torch.cat([path[:, 1:], path[:, -1:]], 1)  # offset j's draft: the path's next node
    before_end, at_end = tree.offsets < accepted[:, None], tree.offsets == accepted[:, None]
    tokens = torch.where(at_end, final[:, None], node_tokens.gather(1, drafted))
    tested_at_end = tests.tested.gather(1, end[:, None])
    accepted_kind = (ACCEPTED if tests.relaxed is None
                     else torch.where(tests.relaxed.gather(1, path), RELAXED, ACCEPTED))
    kinds = torch.where(before_end, accepted_kind, torch.where(tested_at_end, RESIDUAL, BONUS))
    probability = torch.where(before_end | (at_end & tested_at_end),
                              tests.probability.gather(1, path), float("nan"))
    return Verdict(path, accepted, tokens, kinds, probability, drafted, on_path)
