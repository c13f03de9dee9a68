"""The synthetic model's cache behaves like a real KV cache: windows, trees and kept rows give
the same logits as feeding the same tokens one at a time from scratch."""

from __future__ import annotations

import torch

from sjd_core.models.protocol import GenerationRequest
from sjd_core.models.synthetic import SyntheticModel

MODEL = SyntheticModel(codebook_size=16, grid=(3, 4), width=32, layers=2, seed=2)
GUIDED = GenerationRequest(prompt="a boat", negative_prompt="fog", batch_size=2, guidance=3.0)


def _chain(length: int) -> torch.Tensor:
    return torch.ones(length, length, dtype=torch.bool).tril()


def _stepwise(codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits after slot -1 and each code of ``codes`` (B, n), one forward per code."""
    session = MODEL.start(GUIDED)
    batch, length = codes.shape
    conds, unconds = [], []
    previous = torch.zeros(batch, 1, dtype=torch.long)
    for slot in range(-1, length):
        fed = previous if slot < 0 else codes[:, slot:slot + 1]
        cond, uncond = session.forward(fed, torch.full((batch, 1), slot), _chain(1), [slot + 1] * batch)
        session.keep(torch.ones(batch, 1, dtype=torch.bool))
        conds.append(cond)
        unconds.append(uncond)
    return torch.cat(conds, 1), torch.cat(unconds, 1)


def test_window_forward_equals_one_code_at_a_time():
    codes = torch.randint(0, 16, (2, 7), generator=torch.Generator().manual_seed(0))
    step_cond, step_uncond = _stepwise(codes)
    session = MODEL.start(GUIDED)
    first = torch.zeros(2, 1, dtype=torch.long)
    cond, uncond = session.forward(first, torch.full((2, 1), -1), _chain(1), [0, 0])
    session.keep(torch.ones(2, 1, dtype=torch.bool))
    window_cond, window_uncond = session.forward(codes, torch.arange(7).expand(2, -1), _chain(7), [1, 1])
    torch.testing.assert_close(torch.cat([cond, window_cond], 1), step_cond, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([uncond, window_uncond], 1), step_uncond, atol=1e-5,
                               rtol=1e-5)
    assert not torch.allclose(step_cond[:, 1], step_cond[:, 2])  # conditionals do change


def test_tree_of_drafts_equals_each_branch_alone():
    # root (slot -1) with children a, b (slot 0); each has children c, d (slot 1)
    tokens = torch.tensor([[0, 3, 9, 5, 6, 5, 6]])
    parents = [-1, 0, 0, 1, 1, 2, 2]
    ancestors = torch.zeros(7, 7, dtype=torch.bool)
    for node in range(7):
        walk = node
        while walk >= 0:
            ancestors[node, walk] = True
            walk = parents[walk]
    depth = torch.tensor([[-1, 0, 0, 1, 1, 1, 1]])
    request = GenerationRequest(prompt="a boat", negative_prompt="fog", batch_size=1, guidance=3.0)
    tree_cond, _ = MODEL.start(request).forward(tokens, depth, ancestors, [0])
    for leaf in (3, 4, 5, 6):
        branch = [0, parents[leaf], leaf]
        alone, _ = MODEL.start(request).forward(tokens[:, branch], torch.tensor([[-1, 0, 1]]),
                                               _chain(3), [0])
        torch.testing.assert_close(tree_cond[:, branch], alone, atol=1e-5, rtol=1e-5)


def test_keeping_an_accepted_path_then_continuing_equals_a_fresh_forward():
    session = MODEL.start(GUIDED)
    fed = torch.tensor([[0, 4, 7, 1], [0, 2, 2, 8]])
    session.forward(fed, torch.tensor([[-1, 0, 1, 2]] * 2), _chain(4), [0, 0])
    # row 0 keeps slots -1, 0, 1; row 1 keeps only slot -1
    session.keep(torch.tensor([[True, True, True, False], [True, False, False, False]]))
    next_cond, next_uncond = session.forward(torch.tensor([[5], [6]]), torch.tensor([[2], [0]]),
                                             _chain(1), [3, 1])
    fresh_cond, fresh_uncond = _stepwise(torch.tensor([[4, 7, 5], [6, 0, 0]]))
    torch.testing.assert_close(next_cond[0, 0], fresh_cond[0, 3], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(next_cond[1, 0], fresh_cond[1, 1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(next_uncond[1, 0], fresh_uncond[1, 1], atol=1e-5, rtol=1e-5)


def test_prompt_and_guidance_change_the_conditionals():
    plain = MODEL.start(GenerationRequest(prompt="a boat", batch_size=1))
    other = MODEL.start(GenerationRequest(prompt="a tree", batch_size=1))
    start = (torch.zeros(1, 1, dtype=torch.long), torch.full((1, 1), -1), _chain(1), [0])
    a, none = plain.forward(*start)
    b, _ = other.forward(*start)
    assert none is None and not plain.guided
    assert not torch.allclose(a, b)
