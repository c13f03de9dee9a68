"""The distribution test and its power check (ALGORITHMS.md, "Exactness tests").

Every lossless mode must draw images from exactly the joint distribution that one-slot-at-a-time
sampling of the model's processed conditionals defines (CFG, temperature and top-k active). The
same test must reject deliberately broken variants of the engine, or it proves nothing.
"""

from __future__ import annotations

import pytest
import torch

from exactness import enumerate_joint, goodness_of_fit, sample_images, tiny_model, tiny_sampling
from sjd_core.decoding import drafting, engine, verify
from sjd_core.decoding.sampling import residual, sample
from sjd_core.decoding.settings import AccelerationSettings

SAMPLES = 6000
POWER_SAMPLES = 16000
PASS_P = 1e-3  # a lossless mode passes when the chi-square p-value is above this
REJECT_P = 1e-6  # a broken variant must be rejected with a p-value below this

TREE = dict(window=4, pd_candidates=2, pd_depth=3)
MODES = {
    "ar": dict(window=1),
    "sjd": dict(window=4),
    "sjd+ac": dict(window=4, adaptive_continuation=True),
    "sjd+pd": dict(TREE, proactive_drafting=True),
    "sjd+ac+pd": dict(TREE, proactive_drafting=True, adaptive_continuation=True),
    "sjd+vp": dict(window=4, verification_prediction=True, vp_rises=1, vp_top_k=4),
    "sjd+ac+pd+vp": dict(TREE, proactive_drafting=True, adaptive_continuation=True,
                         verification_prediction=True, vp_rises=1, vp_top_k=4),
}


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def joint(model):
    return enumerate_joint(model, tiny_sampling())


def test_enumeration_is_a_distribution_with_spread(joint):
    assert abs(float(joint.sum()) - 1.0) < 1e-5
    assert int((joint > 1e-4).sum()) >= 30  # many images are possible...
    assert float(joint.max()) < 0.5  # ...and none dominates


# plain autoregression has no drafts, so it runs once, without an init rule
RUNS = [(mode, init) for mode in MODES for init in ("uniform", "left")
        if not (mode == "ar" and init == "left")]


@pytest.mark.parametrize("mode,init", RUNS)
def test_lossless_modes_sample_the_model_distribution(model, joint, mode, init):
    settings = AccelerationSettings(init=init, **MODES[mode])
    samples = sample_images(model, tiny_sampling(), settings, SAMPLES, seed=11)
    assert goodness_of_fit(samples, joint) > PASS_P


def _p_value(model, joint, settings: AccelerationSettings, samples: int = SAMPLES) -> float:
    return goodness_of_fit(sample_images(model, tiny_sampling(), settings, samples, seed=11),
                           joint)


def test_power_verifying_vp_drafts_against_p_instead_of_q_prime_is_rejected(model, joint,
                                                                             monkeypatch):
    exact_redraft = engine.redraft

    def verified_against_target(state, targets, has_target, *args):
        state = exact_redraft(state, targets, has_target, *args)
        state.q = torch.where(has_target[..., None], targets, state.q)
        return state

    monkeypatch.setattr(engine, "redraft", verified_against_target)
    assert _p_value(model, joint, AccelerationSettings(**MODES["sjd+vp"])) < REJECT_P


def test_power_drawing_siblings_from_a_residual_is_rejected(model, joint, monkeypatch):
    """Siblings 2..K drawn from AC's residual ``norm(max(0, q_new - q_old))`` but verified as
    if drawn from ``q_new`` without the first candidate."""
    exact_redraft, exact_top = engine.redraft, drafting.race_top
    previous_q = {}

    def remember_previous_q(state, *args):
        previous_q["q"] = state.q
        return exact_redraft(state, *args)

    def siblings_from_residual(rest, noise, count):
        if "q" not in previous_q:
            return exact_top(rest, noise, count)
        return exact_top(residual(rest, previous_q["q"][:, : rest.shape[1]]), noise, count)

    exact_drop = engine._Decoder.drop_finished

    def drop_finished(decoder):  # finished images leave the batch: their old q goes too
        going_on = [i for i, done in enumerate(decoder.done) if done < decoder.slots]
        if "q" in previous_q and going_on:
            previous_q["q"] = previous_q["q"][going_on]
        exact_drop(decoder)

    monkeypatch.setattr(engine, "redraft", remember_previous_q)
    monkeypatch.setattr(drafting, "race_top", siblings_from_residual)
    monkeypatch.setattr(engine._Decoder, "drop_finished", drop_finished)
    settings = AccelerationSettings(**MODES["sjd+ac+pd"])
    assert _p_value(model, joint, settings, POWER_SAMPLES) < REJECT_P


def longest_row_verify(tree, p, node_tokens, node_valid, q_slots, uniforms, final_uniform, rule):
    """The published tree rule: test every node on its own against (p, q) and take the longest
    accepted root-to-leaf row, with no residual between siblings."""
    batch, size, vocab = p.shape
    window = q_slots.shape[1]
    parent = tree.parent.clamp_min(0)
    q = q_slots.gather(1, (tree.depth - 1).clamp(0, window - 1)[None, :, None]
                       .expand(batch, -1, vocab))
    p_parent = p[:, parent]
    p_x = p_parent.gather(-1, node_tokens[..., None]).squeeze(-1)
    q_x = q.gather(-1, node_tokens[..., None]).squeeze(-1)
    rank = (tree.children[parent] == torch.arange(size)[:, None]).float().argmax(-1)
    u = uniforms.gather(2, rank[None, :, None].expand(batch, -1, 1)).squeeze(-1)
    passed = node_valid & (u * q_x <= p_x)
    passed[:, 0] = True
    on_row = ~((~passed)[:, None, :] & tree.ancestors[None]).any(-1)
    deepest = torch.where(on_row, tree.depth * size - torch.arange(size), -1).argmax(-1)
    accepted = tree.depth[deepest]
    path = tree.route[deepest]
    first_child = tree.children[deepest, 0]
    has_child = first_child >= 0
    final_q = q.gather(1, first_child.clamp_min(0)[:, None, None].expand(-1, 1, vocab)).squeeze(1)
    final_p = p.gather(1, deepest[:, None, None].expand(-1, 1, vocab)).squeeze(1)
    final = sample(torch.where(has_child[:, None], residual(final_p, final_q), final_p), final_uniform)
    offsets = torch.arange(window)
    next_nodes = torch.cat([path[:, 1:], path[:, -1:]], dim=1)
    tokens = torch.where(offsets == accepted[:, None], final[:, None],
                         node_tokens.gather(1, next_nodes))
    kinds = torch.full((batch, window), verify.ACCEPTED)
    return verify.Verdict(path, accepted, tokens, kinds, torch.full((batch, window), 0.5))


def test_power_taking_the_longest_accepted_row_is_rejected(model, joint, monkeypatch):
    settings = AccelerationSettings(**MODES["sjd+pd"])
    monkeypatch.setattr(engine, "verify_tree", longest_row_verify)
    assert _p_value(model, joint, settings) < REJECT_P


def test_longest_row_verifier_is_exact_on_a_chain(model, joint, monkeypatch):
    """The broken tree rule equals the exact rule when there is no tree (K = 1), so its
    rejection above comes from the tree rule itself, not from a mistake in the replacement."""
    monkeypatch.setattr(engine, "verify_tree", longest_row_verify)
    assert _p_value(model, joint, AccelerationSettings(**MODES["sjd"])) > PASS_P
