"""The drafting stages on small hand-made tensors: the init rules against a slot-by-slot
reading of their definition, VP's history update, and both traced whole by ``torch.compile``
(``fullgraph=True``: an in-place write into a view of the state, a read of a tensor's value or a
branch on host numbers would break the graph and fail here)."""

from __future__ import annotations

import pytest
import torch

from sjd_core import checks
from sjd_core.decoding.drafting import (ABOVE_INIT, ABOVE_TARGET_INIT, LEFT_INIT, UNIFORM_INIT,
                                        Canvas, WindowState, initial_drafts,
                                        predict_verification)
from sjd_core.decoding.sampling import sample
from sjd_core.decoding.settings import AccelerationSettings

WIDTH, SLOTS, VOCAB = 4, 16, 7
RULES = ["uniform", "left", "above", "above_target"]
VP = AccelerationSettings(verification_prediction=True, vp_rises=1, vp_top_k=3)


@pytest.fixture(autouse=True)
def traceable_draws(monkeypatch):
    """Draws without the all-zero check: it reads the device, which no traced graph may do."""
    monkeypatch.setattr(checks, "DEVICE_CHECKS", False)


def _state_and_canvas(seed: int, committed: list[int], window: int
                      ) -> tuple[WindowState, Canvas, torch.Tensor, torch.Tensor]:
    """A random window over a grid of ``WIDTH`` columns whose rows have committed ``committed``
    slots, offsets 0 and 1 already fed, random column targets; and the uniforms and the slots to
    fill."""
    generator = torch.Generator().manual_seed(seed)
    batch = len(committed)
    state = WindowState.empty(batch, window, VOCAB, torch.device("cpu"), False)
    state.tokens = torch.randint(VOCAB, (batch, window), generator=generator)
    state.q = torch.rand(batch, window, VOCAB, generator=generator).softmax(-1)
    state.fed[:, :2] = True
    codes = torch.randint(VOCAB, (batch * (SLOTS + 1),), generator=generator)
    row_start = torch.arange(batch) * (SLOTS + 1)
    targets = torch.rand(batch, WIDTH + 1, VOCAB, generator=generator).softmax(-1)
    done = torch.tensor(committed)
    canvas = Canvas(codes, row_start, done, codes[row_start + done - 1], WIDTH, SLOTS, targets)
    uniforms = torch.rand(batch, window, generator=generator).clamp_min(1e-6)
    return state, canvas, uniforms, ~state.fed


def _one_hot(code: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(code), VOCAB).float()


def _expected_drafts(rule: str, state: WindowState, canvas: Canvas, uniforms: torch.Tensor,
                     fill: torch.Tensor) -> tuple[list, list, list]:
    """The init rule read slot by slot: per row, each offset's token, q and source."""
    tokens, qs, sources = [], [], []
    for b in range(fill.shape[0]):
        committed = int(canvas.committed[b])
        left_drafts, row_tokens, row_q, row_source = [], [], [], []
        for j in range(fill.shape[1]):
            slot = committed + j
            random_code = min(int(uniforms[b, j] * VOCAB), VOCAB - 1)
            uniform_q = torch.full((VOCAB,), 1.0 / VOCAB)
            if not fill[b, j]:
                left_drafts.append(int(state.tokens[b, j]))
                row_tokens.append(int(state.tokens[b, j]))
                row_q.append(state.q[b, j])
                row_source.append(int(state.source[b, j]))
                continue
            if rule == "uniform" or slot % WIDTH == 0:
                token, q, source = random_code, uniform_q, UNIFORM_INIT
            else:  # the code to the left: the last committed one or the left draft
                token = left_drafts[-1] if j else int(canvas.anchor[b])
                q, source = _one_hot(token), LEFT_INIT
            left_drafts.append(token)
            if rule in ("above", "above_target") and slot >= WIDTH:
                if slot - WIDTH < committed:
                    above = int(canvas.codes[int(canvas.row_start[b]) + slot - WIDTH])
                else:  # inside the window: its draft, or its left draft when made now
                    above = left_drafts[j - WIDTH]
                token, q, source = above, _one_hot(above), ABOVE_INIT
                if rule == "above_target" and slot - WIDTH < committed:
                    q = canvas.column_targets[b, slot % WIDTH]
                    token, source = int(sample(q, uniforms[b, j])), ABOVE_TARGET_INIT
            row_tokens.append(token)
            row_q.append(q)
            row_source.append(source)
        tokens.append(row_tokens)
        qs.append(torch.stack(row_q))
        sources.append(row_source)
    return tokens, qs, sources


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("window", [3, 4, 7])
def test_init_rules_draft_each_new_slot_as_their_definition_says(rule, window):
    """Windows narrower than the grid (every slot above a new offset committed), as wide, and
    wider (slots above inside the window); rows in the first grid row and further down."""
    for seed, committed in enumerate(([1], [3, 9], [6, 2, 9], [4, 8])):
        state, canvas, uniforms, fill = _state_and_canvas(seed, committed, window)
        expected = _expected_drafts(rule, state, canvas, uniforms, fill)
        initial_drafts(rule, state, fill, canvas, uniforms)
        tokens, qs, sources = expected
        assert state.tokens.tolist() == tokens, (seed, committed)
        assert state.source.tolist() == sources, (seed, committed)
        assert torch.equal(state.q, torch.stack(qs)), (seed, committed)


def _traced(function):
    return torch.compile(function, fullgraph=True, backend="eager", dynamic=False)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("window", [3, 6])
def test_init_rules_trace_as_one_graph(rule, window):
    """Rows that committed different numbers of slots (at window 3 every slot above a new one is
    committed in some rows): the rule is one tensor expression, no branch on the host."""
    committed = [6, 2, 9]
    state, canvas, uniforms, fill = _state_and_canvas(3, committed, window)
    eager = WindowState(*state.parts())
    initial_drafts(rule, eager, fill, canvas, uniforms)

    def drafts(tokens, q, source, fed, codes, done, anchor, targets, uniforms, fill):
        state = WindowState(tokens, q, source, fed)
        canvas = Canvas(codes, torch.arange(3) * (SLOTS + 1), done, anchor, WIDTH, SLOTS,
                        targets)
        initial_drafts(rule, state, fill, canvas, uniforms)
        return state.tokens, state.q, state.source

    traced = _traced(drafts)(state.tokens, state.q, state.source, state.fed, canvas.codes,
                             canvas.committed, canvas.anchor, canvas.column_targets, uniforms,
                             fill)
    for got, want in zip(traced, (eager.tokens, eager.q, eager.source)):
        assert torch.equal(got, want)


def _vp_inputs(seed: int, batch: int = 2, window: int = 5):
    """A VP history with some slots known and some rises counted, and new targets."""
    generator = torch.Generator().manual_seed(seed)
    state = WindowState.empty(batch, window, VOCAB, torch.device("cpu"), True)
    probabilities = torch.rand(batch, window, 2, VOCAB, generator=generator).softmax(-1)
    rises = torch.randint(3, (batch, window, 1, VOCAB), generator=generator).float()
    state.vp_history = torch.cat([probabilities, rises], dim=2)
    state.vp_known = torch.rand(batch, window, generator=generator) < 0.6
    targets = (torch.rand(batch, window, VOCAB, generator=generator) * 3).softmax(-1)
    has_target = torch.rand(batch, window, generator=generator) < 0.8
    return state, targets, has_target


def test_vp_keeps_the_history_it_defines():
    """The new mean is ``lerp(p_t, pbar, decay)``, the last distribution ``p_t``, a rise count
    grows by one where ``p_t`` rose and is 0 elsewhere; the old history tensor is not written."""
    state, targets, has_target = _vp_inputs(0)
    old = state.vp_history.clone()
    known = (state.vp_known & has_target)[..., None]
    mean = torch.where(known, old[:, :, 0], targets)
    last = torch.where(known, old[:, :, 1], targets)
    held = state.vp_history
    predict_verification(targets, state, known[..., 0], has_target, VP)
    assert torch.equal(held, old)
    assert torch.equal(state.vp_mean, torch.lerp(targets, mean, VP.vp_decay))
    assert torch.equal(state.vp_last, targets)
    assert torch.equal(state.vp_rises, torch.where(targets > last, old[:, :, 2] + 1, 0.0))
    assert torch.equal(state.vp_known, has_target)


def test_vp_history_update_traces_as_one_graph():
    state, targets, has_target = _vp_inputs(1)
    known = state.vp_known & has_target
    eager = WindowState(*state.parts())
    fused = predict_verification(targets, eager, known, has_target, VP)

    def update(tokens, q, source, fed, history, known_before, targets, known, has_target):
        state = WindowState(tokens, q, source, fed, history, known_before)
        fused = predict_verification(targets, state, known, has_target, VP)
        return fused, state.vp_history, state.vp_known

    traced = _traced(update)(*state.parts(), targets, known, has_target)
    for got, want in zip(traced, (fused, eager.vp_history, eager.vp_known)):
        assert torch.equal(got, want)


def test_a_window_state_resized_keeps_its_first_offsets_and_adds_undrafted_ones():
    state, _, _, _ = _state_and_canvas(0, [9, 14], window=6)
    shorter, longer = state.resized(4), state.resized(9)
    assert torch.equal(shorter.tokens, state.tokens[:, :4])
    assert shorter.q.shape == (2, 4, VOCAB)
    assert torch.equal(longer.q[:, :6], state.q) and torch.equal(longer.fed[:, :6], state.fed)
    assert not longer.fed[:, 6:].any() and longer.q.shape == (2, 9, VOCAB)
