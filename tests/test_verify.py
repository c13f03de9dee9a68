"""The verifier and the draft tree on hand-made inputs: tree shape, relaxed rules' promises."""

from __future__ import annotations

import pytest
import torch

from sjd_core.decoding.drafting import DraftTree
from sjd_core.decoding.settings import AccelerationSettings
from sjd_core.decoding.verify import (ExactAcceptance, GsdAcceptance, LanternAcceptance, acceptance_rule,
                             nearest_codes, verify_tree)

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
