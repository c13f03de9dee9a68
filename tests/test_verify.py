"""The verifier and the draft tree on hand-made inputs: tree shape, relaxed rules' promises."""

from __future__ import annotations

import pytest
import torch

from exactness import goodness_of_fit
from sjd_core import checks
from sjd_core.decoding import sampling, verify
from sjd_core.decoding.drafting import DraftTree, WindowState, add_candidates
from sjd_core.decoding.sampling import exponential, process, sample
from sjd_core.decoding.settings import AccelerationSettings, SamplingSettings
from sjd_core.decoding.verify import (ExactAcceptance, GsdAcceptance, LanternAcceptance,
                                      acceptance_rule, nearest_codes, verify_tree)

VOCAB = 12


def test_pd_tree_shape_matches_the_published_count():
    tree = DraftTree.build(16, (4, 4), torch.device("cpu"))
    assert tree.size == 1 + 4 + 16 + 13  # root, two levels of 4 candidates, chain to depth 15
    assert int(tree.depth.max()) == 15
    # nodes 0..15 are the main path (every node's first candidate), then the rest breadth-first
    assert tree.depth[:16].tolist() == list(range(16))
    assert tree.children[:15, 0].tolist() == list(range(1, 16))
    assert tree.depth[16:].tolist() == [1] * 3 + [2] * 15
    assert tree.inner_nodes.tolist() == [0, 1, 16, 17, 18]
    for node in range(tree.size):  # every node sees exactly its ancestors and itself
        walk, seen = node, set()
        while walk >= 0:
            seen.add(walk)
            walk = int(tree.parent[walk])
        assert set(torch.nonzero(tree.ancestors[node]).flatten().tolist()) == seen
    chain = DraftTree.for_settings(AccelerationSettings(window=5), torch.device("cpu"))
    assert chain.size == 5 and torch.equal(chain.ancestors, torch.ones(5, 5).tril().bool())


def _case(seed: int, settings: AccelerationSettings, batch: int = 64):
    """Random targets, draft distributions, drafts and uniforms for one verification."""
    g = torch.Generator().manual_seed(seed)
    tree = DraftTree.for_settings(settings, torch.device("cpu"))
    p = torch.softmax(torch.randn(batch, tree.size, VOCAB, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(batch, settings.window, VOCAB, generator=g) * 2, -1)
    tokens = torch.randint(0, VOCAB, (batch, tree.size), generator=g)
    valid = torch.ones(batch, tree.size, dtype=torch.bool)
    uniforms = 1 - torch.rand(batch, tree.size, tree.branching, generator=g)
    final = 1 - torch.rand(batch, generator=g)
    return tree, p, tokens, valid, q, uniforms, final


EMBEDDINGS = torch.randn(VOCAB, 4, generator=torch.Generator().manual_seed(1))


def test_lantern_never_accepts_less_than_the_exact_rule_on_the_same_uniforms():
    for settings in (AccelerationSettings(window=6),
                     AccelerationSettings(window=6, proactive_drafting=True, pd_candidates=3)):
        for seed in range(5):
            case = _case(seed, settings)
            exact = verify_tree(*case, ExactAcceptance())
            relaxed = verify_tree(*case, LanternAcceptance(EMBEDDINGS, 5, 0.3))
            # on a chain the accepted prefix can only grow; on a tree the accepted child may
            # change, but where the exact rule accepts some candidate of the first slot, so does
            # LANTERN (each test it makes is at least as lenient on the same uniform)
            if settings.proactive_drafting:
                assert ((relaxed.accepted >= 1) | (exact.accepted == 0)).all()
            else:
                assert (relaxed.accepted >= exact.accepted).all()
            assert (relaxed.accepted > exact.accepted).any()


def test_lantern_adds_at_most_delta_and_is_exact_at_delta_zero():
    g = torch.Generator().manual_seed(4)
    p = torch.softmax(torch.randn(32, 6, VOCAB, generator=g), -1)
    x = torch.randint(0, VOCAB, (32, 6), generator=g)
    p_x = p.gather(-1, x[..., None]).squeeze(-1)
    q_x = torch.rand(32, 6, generator=g)
    for delta in (0.05, 0.2, 0.6):
        p_mass, q_mass = LanternAcceptance(EMBEDDINGS, 6, delta).masses(p, None, x, p_x, q_x)
        added = p_mass - p_x
        assert (added >= 0).all() and (added <= delta + 1e-6).all() and (added > 0).any()
        assert torch.equal(q_mass, q_x)
    p_mass, _ = LanternAcceptance(EMBEDDINGS, 6, 0.0).masses(p, None, x, p_x, q_x)
    assert torch.equal(p_mass, p_x)
    case = _case(9, AccelerationSettings(window=6))
    exact, zero = verify_tree(*case, ExactAcceptance()), verify_tree(
        *case, LanternAcceptance(EMBEDDINGS, 6, 0.0))
    assert torch.equal(exact.tokens, zero.tokens) and torch.equal(exact.accepted, zero.accepted)


def test_lantern_neighbours_are_the_nearest_codes_in_order():
    points = torch.tensor([[0.0], [1.0], [3.0], [7.0]])
    assert nearest_codes(points, 2).tolist() == [[1, 2], [0, 2], [1, 0], [2, 1]]


def test_gsd_groups_similar_codes_and_is_exact_with_zero_tolerances():
    embeddings = torch.tensor([[1.0, 0.0], [0.99, 0.1], [0.0, 1.0], [-1.0, 0.0]])
    p = torch.tensor([[[0.35, 0.30, 0.25, 0.10]]])
    q = torch.tensor([[[0.10, 0.60, 0.10, 0.20]]])
    x = torch.tensor([[0]])
    p_x, q_x = p[..., 0], q[..., 0]
    rule = GsdAcceptance(embeddings, rank_radius=2, prob_tolerance=0.15, embedding_tolerance=0.5)
    p_mass, q_mass = rule.masses(p, q, x, p_x, q_x)
    # code 1 is close in rank, probability and embedding; code 2 is far in embedding
    assert torch.allclose(p_mass, torch.tensor([[0.65]])) and torch.allclose(q_mass, torch.tensor([[0.70]]))
    zero = GsdAcceptance(embeddings, rank_radius=2, prob_tolerance=0.0, embedding_tolerance=0.0)
    assert torch.equal(torch.stack(zero.masses(p, q, x, p_x, q_x)), torch.stack([p_x, q_x]))
    case = _case(3, AccelerationSettings(window=6))
    exact = verify_tree(*case, ExactAcceptance())
    same = verify_tree(*case, GsdAcceptance(EMBEDDINGS, 7, 0.0, 0.0))
    assert torch.equal(exact.tokens, same.tokens) and torch.equal(exact.accepted, same.accepted)


def test_exact_verification_on_a_chain_is_the_leading_run_of_passed_tests():
    case = _case(2, AccelerationSettings(window=6), batch=256)
    tree, p, tokens, valid, q, uniforms, noise = case
    verdict = verify_tree(*case, ExactAcceptance())
    p_x = p[:, :5].gather(-1, tokens[:, 1:, None]).squeeze(-1)
    q_x = q[:, :5].gather(-1, tokens[:, 1:, None]).squeeze(-1)
    passed = uniforms[:, :5, 0] * q_x <= p_x
    leading = torch.cumprod(passed.int(), 1).sum(1)
    assert torch.equal(verdict.accepted, leading)
    assert torch.equal(verdict.tokens[:, :5][passed.cumprod(1).bool()],
                       tokens[:, 1:][passed.cumprod(1).bool()])


def test_relaxed_acceptance_without_codebook_embeddings_is_refused():
    with pytest.raises(ValueError, match="relaxed='gsd' needs the model's codebook embeddings"):
        acceptance_rule(AccelerationSettings(window=4, relaxed="gsd"), None)
    assert isinstance(acceptance_rule(AccelerationSettings(window=4), None), ExactAcceptance)


# ------------------------------------------------------------------ one PD node, peaky drafts
def _committed_at_one_node(p: torch.Tensor, q: torch.Tensor, candidates: int, samples: int,
                           seed: int) -> torch.Tensor:
    """(samples,) the code committed after the root of a PD node with target ``p`` and draft
    distribution ``q`` (V,): ``candidates`` drawn without replacement by the engine's own
    drafting, tested by :func:`verify_tree`; by the exactness lemma it follows ``p``."""
    g = torch.Generator().manual_seed(seed)
    vocab = p.numel()
    tree = DraftTree.build(2, (candidates,), torch.device("cpu"))
    q_window = q.expand(samples, 2, vocab).contiguous()
    first = sample(q_window[:, 0], 1 - torch.rand(samples, generator=g))
    state = WindowState(torch.stack([first, first], 1), q_window,
                        torch.zeros(samples, 2, dtype=torch.int8),
                        torch.ones(samples, 2, dtype=torch.bool))
    race = exponential(1 - torch.rand(samples, 1, vocab, generator=g))
    node_tokens, node_valid, _ = add_candidates(state, tree, race)
    verdict = verify_tree(tree, p.expand(samples, tree.size, vocab), node_tokens, node_valid,
                          q_window, 1 - torch.rand(samples, tree.size, candidates, generator=g),
                          1 - torch.rand(samples, generator=g), ExactAcceptance())
    return verdict.tokens[:, 0]


NODE_SAMPLES = 200_000
PEAKY_DRAFTS = {"q(x_1) = 1 - 4e-9": [1 - 4e-9, 2e-9, 2e-9],
                "q(x_1) = 1 - 4e-7": [1 - 4e-7, 2e-7, 2e-7]}
NODE_TARGETS = {"almost all on code 1": [1e-9, 1 - 2e-9, 1e-9], "spread": [0.2, 0.5, 0.3]}


@pytest.mark.parametrize("draft", list(PEAKY_DRAFTS))
@pytest.mark.parametrize("target", list(NODE_TARGETS))
def test_one_pd_node_commits_the_target_s_frequencies_under_a_peaky_draft(draft, target):
    """Two candidates drawn from a draft whose first code holds all but 4e-9 (or 4e-7) of the
    mass: the committed code's frequencies are the target's (chi-square p > 1e-3 over 200,000
    draws). ``1 - q(x_1)`` in float32 is 0 for the first draft and 4% off for the second."""
    p = torch.tensor(NODE_TARGETS[target])
    codes = _committed_at_one_node(p, torch.tensor(PEAKY_DRAFTS[draft]), 2, NODE_SAMPLES, seed=3)
    frequency = torch.bincount(codes, minlength=3).double() / NODE_SAMPLES
    value = goodness_of_fit(codes, p.double())
    print(f"\none node, {draft}, target {target}: frequencies {frequency.tolist()}, "
          f"p = {value:.3g}")
    assert value > 1e-3


def test_one_pd_node_with_the_left_mass_by_cancellation_is_rejected():
    """The old formula ``1 - q(x_1)`` (float32, clamped to 1e-12) in the same test: rejected."""
    from test_exactness import _LeftMassByCancellation

    exact = verify._Rejections
    verify._Rejections = _LeftMassByCancellation
    try:
        p = torch.tensor(NODE_TARGETS["spread"])
        codes = _committed_at_one_node(p, torch.tensor(PEAKY_DRAFTS["q(x_1) = 1 - 4e-9"]), 2,
                                       NODE_SAMPLES, seed=3)
    finally:
        verify._Rejections = exact
    frequency = torch.bincount(codes, minlength=3).double() / NODE_SAMPLES
    value = goodness_of_fit(codes, p.double())
    print(f"\none node, left mass by cancellation: frequencies {frequency.tolist()}, p = {value:.3g}")
    assert value < 1e-6


def test_an_empty_residual_draws_from_the_node_s_target_never_code_0():
    """A target that is the draft scaled by a rounding (``1 - 2**-20``, exact in float32), and
    uniforms of 1: every candidate is rejected, and what the rejections leave is 0 everywhere.
    The slot is drawn from ``p`` (the fallback), never code 0 (which ``p`` gives probability
    0), on a chain and at a PD node, and no draw is made from weights that are all 0
    (the device checks are on in the tests)."""
    assert checks.DEVICE_CHECKS
    q = torch.tensor([0.0, 0.5, 0.25, 0.25])
    p = q * (1 - 2.0 ** -20)
    samples = 4000
    for candidates in (1, 2):
        tree = DraftTree.build(2, (candidates,) if candidates > 1 else (), torch.device("cpu"))
        node_tokens = torch.tensor([0, 1, 2][:tree.size]).expand(samples, -1)
        verdict = verify_tree(tree, p.expand(samples, tree.size, 4), node_tokens,
                              torch.ones(samples, tree.size, dtype=torch.bool),
                              q.expand(samples, 2, 4), torch.ones(samples, tree.size, candidates),
                              1 - torch.rand(samples, generator=torch.Generator().manual_seed(2)),
                              ExactAcceptance())
        assert int(verdict.accepted.max()) == 0  # every candidate was rejected
        codes = verdict.tokens[:, 0]
        assert int((codes == 0).sum()) == 0, candidates
        assert goodness_of_fit(codes, p.double()) > 1e-3, candidates


def test_a_draw_from_weights_that_are_all_0_is_an_error_in_tests():
    assert checks.DEVICE_CHECKS
    with pytest.raises(sampling.EmptyDistributionError):
        sample(torch.tensor([[0.2, 0.8], [0.0, 0.0]]), torch.tensor([0.5, 0.5]))
    assert sample(torch.tensor([[0.2, 0.8], [0.0, 3.0]]), torch.tensor([0.5, 0.5])).tolist() == [1, 1]


def _half_precision_logits(dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A target and a draft distribution over 16,384 codes from logits in ``dtype``, as a real
    model gives them on a GPU: a few likely codes and a long tail of codes near 1e-9; the
    draft's first code holds all but a few 1e-7 of its mass."""
    g = torch.Generator().manual_seed(seed)
    vocab = 16_384
    target = -21.0 + 0.5 * torch.randn(vocab, generator=g)
    target[:4] = torch.tensor([0.0, -0.6, -1.4, -3.0])
    draft = -25.0 + 0.5 * torch.randn(vocab, generator=g)
    draft[:4] = torch.tensor([2.0, -14.0, -15.0, -16.0])
    p, q = (process(logits.to(dtype)[None], None, SamplingSettings())[0] for logits in (target, draft))
    return p, q


@pytest.mark.slow
@pytest.mark.parametrize("dtype,candidates", [(torch.bfloat16, 2), (torch.float16, 3),
                                              (torch.bfloat16, 4)])
def test_half_precision_logits_over_16384_codes_stay_exact(dtype, candidates):
    """The committed code follows the target computed from half-precision logits (chi-square
    p > 1e-3 over 10,000 draws, the tail pooled): the draft mass left after its first code is
    summed, not cancelled."""
    p, q = _half_precision_logits(dtype, seed=candidates)
    assert float(1 - q.double().max()) < 1e-6 and float(p[p > 0].min()) < 2e-9
    codes = torch.cat([_committed_at_one_node(p, q, candidates, 1000, seed=chunk)
                       for chunk in range(10)])
    value = goodness_of_fit(codes, p.double())
    print(f"\n{dtype}, K = {candidates}: code frequencies {torch.bincount(codes)[:4].tolist()} "
          f"of {len(codes)}, p = {value:.3g}")
    assert value > 1e-3


@pytest.mark.parametrize("settings", [AccelerationSettings(window=6),
                                      AccelerationSettings(window=6, proactive_drafting=True,
                                                           pd_candidates=3, pd_depth=3)],
                         ids=["chain", "tree"])
def test_verification_traces_as_one_graph(settings, monkeypatch):
    """The verifier is one stage of the iteration's device step: no value read back, no branch
    on one, no write into a view (``fullgraph=True`` fails on any of them)."""
    monkeypatch.setattr(checks, "DEVICE_CHECKS", False)  # its check reads the weights back
    tree, *tensors = _case(4, settings, batch=8)
    rule = ExactAcceptance()

    def verified(*tensors):
        verdict = verify_tree(tree, *tensors, rule, count_siblings=True)
        return verdict.path, verdict.accepted, verdict.tokens, verdict.kinds, verdict.on_path

    traced = torch.compile(verified, fullgraph=True, backend="eager", dynamic=False)
    for got, want in zip(traced(*tensors), verified(*tensors)):
        assert torch.equal(got, want)
