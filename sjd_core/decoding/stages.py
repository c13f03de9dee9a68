"""The device stages of one speculative iteration: draft, (feed), verify, commit, advance.

Each stage is a function of tensors and fixed settings only: it reads nothing back to the host,
takes no branch on a tensor's value and makes no shape that depends on one, so each traces as
one graph (``torch.compile(fullgraph=True)``, ``tests/test_stages.py``) and can be captured per
tree shape. Feeding is the session's ``forward``: its host layout of the fed tokens, then the
network, compiled or captured per fed shape on its own (:mod:`sjd_core.compiled`). The
engine (:meth:`.engine._Decoder.speculative_step`) calls ``draft``, feeds, then
:func:`conclude` (``verify``, ``commit`` and ``advance`` in one call, so that compiled or
captured they are one graph: the target and the verdict between them stay inside it), keeps
the trace and reads the committed counts back once. A plain autoregressive step after the
network is one stage too, :func:`autoregressive`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .drafting import (NO_DRAFT, Canvas, DraftTree, WindowState, add_candidates, flat_rows,
                       initial_drafts, redraft, shift_window, take_rows)
from .sampling import IterationUniforms, exponential, process, sample
from .settings import AccelerationSettings, SamplingSettings
from .verify import BONUS, Verdict, verify_tree

__all__ = ["Commit", "Drafts", "Drawn", "Outcome", "advance", "autoregressive", "commit",
           "conclude", "draft", "verify"]


@dataclass
class Drafts:
    """What one iteration feeds, per row and tree node."""

    tokens: torch.Tensor  # (B, T) the fed codes; node 0 is the last committed code
    valid: torch.Tensor  # (B, T) whether each node is a candidate in play
    source: torch.Tensor  # (B, T) the window offset or PD candidate each node's code came from
    slots: torch.Tensor  # (B, T) the slot each node's code sits at (past the image: its last)


@dataclass
class Commit:
    """Where one iteration's committed codes went, for the trace and the session's keep."""

    count: torch.Tensor  # (B, 1) slots committed per row
    window_slots: torch.Tensor  # (B, W) the slot of each window offset
    entered: torch.Tensor  # (B, W) flat indices of those slots (the spare slot past the image)
    committing: torch.Tensor  # (B, W) the offsets committed now
    writes: torch.Tensor  # (B, W) flat indices into the codes (a spare slot where not committing)
    sources: torch.Tensor  # (B, W) int8: how each committed code's draft was made


def draft(state: WindowState, tree: DraftTree, canvas: Canvas, rule: str,
          numbers: IterationUniforms) -> Drafts:
    """Draft the window's slots that have none yet by the init rule (``state`` in place), then
    the tree's nodes: each offset's draft, and PD's further candidates at the tree levels."""
    initial_drafts(rule, state, ~state.fed, canvas, numbers.init)
    tokens, valid, source = add_candidates(
        state, tree, exponential(numbers.race) if tree.tree_levels else None)
    tokens[:, 0] = canvas.anchor
    slots = ((canvas.committed - 1)[:, None] + tree.depth).clamp_max(canvas.slots - 1)
    return Drafts(tokens, valid, source, slots)


def verify(tree: DraftTree, cond: torch.Tensor, uncond: torch.Tensor | None,
           sampling: SamplingSettings, scale: float | torch.Tensor, drafts: Drafts,
           q: torch.Tensor, numbers: IterationUniforms, rule,
           count_siblings: bool) -> tuple[torch.Tensor, Verdict]:
    """The target after every fed node (from the network's logits) and the verdict on the
    drafts: the accepted path and the code drawn after it."""
    target = process(cond, uncond, sampling, scale)
    return target, verify_tree(tree, target, drafts.tokens, drafts.valid, q, numbers.tests,
                               numbers.final, rule, count_siblings=count_siblings)


def commit(tree: DraftTree, target: torch.Tensor, verdict: Verdict, drafts: Drafts,
           committed: torch.Tensor, row_start: torch.Tensor, codes: torch.Tensor,
           column_targets: torch.Tensor | None, slots: int, width: int) -> Commit:
    """Write the accepted path and the code after it into ``codes`` (flat, rows of ``slots``
    and a spare slot that takes every write past the image) and, where an init rule needs it,
    each column's latest target into ``column_targets``."""
    offsets = tree.offsets
    count = torch.minimum(verdict.accepted + 1, slots - committed)[:, None]
    tested = drafts.source.gather(1, verdict.drafted)
    sources = torch.where(verdict.kinds == BONUS, NO_DRAFT, tested).to(torch.int8)
    window_slots = committed[:, None] + offsets
    committing = offsets < count
    writes = row_start[:, None] + torch.where(committing, window_slots, slots)
    codes.scatter_(0, writes.flatten(), verdict.tokens.flatten())
    if column_targets is not None:
        # a column takes the target of its latest committed slot (the last grid row's), so
        # that no column is written twice; the others go to the spare column
        latest = committing & (offsets >= count - width)
        columns = torch.where(latest, window_slots % width, width)
        column_targets.view(-1, column_targets.shape[-1]).index_copy_(
            0, flat_rows(columns, column_targets.shape[1]),
            take_rows(target, flat_rows(verdict.path, tree.size)).flatten(0, 1))
    entered = row_start[:, None] + window_slots.clamp_max(slots)
    return Commit(count, window_slots, entered, committing, writes, sources)


def advance(state: WindowState, tree: DraftTree, target: torch.Tensor, verdict: Verdict,
            count: torch.Tensor, committed: torch.Tensor, settings: AccelerationSettings,
            numbers: IterationUniforms) -> tuple[WindowState, torch.Tensor, torch.Tensor]:
    """Move every row's window past what it committed and redraft the slots that now have a
    (stale) target; the new state, committed counts and last committed codes."""
    window = tree.window
    anchor = verdict.tokens.gather(1, count - 1)[:, 0]
    new_offsets = tree.offsets + count
    has_target = new_offsets < window  # the offset was fed now: it has a (stale) target
    moved_from = new_offsets.clamp_max(window - 1)
    shifted = shift_window(state, moved_from, has_target)
    stale = take_rows(target, flat_rows(verdict.path.gather(1, moved_from), tree.size))
    return (redraft(shifted, stale, has_target, settings, numbers.keep, numbers.draw),
            committed + count[:, 0], anchor)


@dataclass
class Outcome:
    """What verifying, committing and advancing leave for the engine: the verdict and where its
    codes went (for the trace, the session's keep and the iteration's read), the target's
    largest probability at each node of the path (for the trace), and the advanced window."""

    verdict: Verdict
    made: Commit
    path_peaks: torch.Tensor  # (B, L) the target's largest probability at each path node
    state: WindowState
    committed: torch.Tensor  # (B,) slots committed per row, after this iteration
    anchor: torch.Tensor  # (B,) each row's last committed code
    kept: torch.Tensor  # (B, T) the fed nodes whose cache entries stay: the committed path
    read: torch.Tensor  # (B,) or (B + 2,): ``committed``, then PD's sibling tests and passes


def conclude(tree: DraftTree, cond: torch.Tensor, uncond: torch.Tensor | None,
             sampling: SamplingSettings, scale: float | torch.Tensor, drafts: Drafts,
             state: WindowState, numbers: IterationUniforms, rule, count_siblings: bool,
             committed: torch.Tensor, row_start: torch.Tensor, codes: torch.Tensor,
             column_targets: torch.Tensor | None, slots: int, width: int,
             settings: AccelerationSettings) -> Outcome:
    """:func:`verify`, :func:`commit` and :func:`advance`, in that order, on the network's
    logits of the fed ``drafts`` (``state`` is the window they were drafted from; it is left as
    it is, and the outcome holds the advanced one)."""
    target, verdict = verify(tree, cond, uncond, sampling, scale, drafts, state.q, numbers, rule,
                             count_siblings)
    made = commit(tree, target, verdict, drafts, committed, row_start, codes, column_targets,
                  slots, width)
    path_peaks = target.amax(-1).gather(1, verdict.path)
    advanced, now_committed, anchor = advance(state, tree, target, verdict, made.count,
                                              committed, settings, numbers)
    kept = verdict.on_path & (tree.depth < made.count)
    return Outcome(verdict, made, path_peaks, advanced, now_committed, anchor, kept,
                   _host_read(now_committed, verdict))


def _host_read(committed: torch.Tensor, verdict: Verdict) -> torch.Tensor:
    """What the engine reads back once per iteration: the committed counts, and where PD counts
    its siblings, their tests and passes summed over the batch."""
    if verdict.sibling_tests is None:
        return committed
    return torch.cat([committed, verdict.sibling_tests.sum()[None],
                      verdict.sibling_passes.sum()[None]])


@dataclass
class Drawn:
    """What a plain autoregressive step leaves: the code drawn and where it went."""

    token: torch.Tensor  # (B,) the code drawn, now each row's last committed code
    written: torch.Tensor  # (B,) its flat index into the codes
    peak: torch.Tensor  # (B,) the target's largest probability (for the trace)
    committed: torch.Tensor  # (B,) slots committed per row, after this step


def autoregressive(cond: torch.Tensor, uncond: torch.Tensor | None, sampling: SamplingSettings,
                   scale: float | torch.Tensor, uniforms: torch.Tensor, committed: torch.Tensor,
                   row_start: torch.Tensor, codes: torch.Tensor,
                   column_targets: torch.Tensor | None, width: int) -> Drawn:
    """Plain autoregression after the network: the target of each row's next slot from the
    logits, one code drawn from it at ``uniforms`` (B, 1), written into ``codes`` (flat); where
    an init rule needs it, the target as its column's latest in ``column_targets``."""
    target = process(cond, uncond, sampling, scale)
    token = sample(target, uniforms[:, 0])
    written = row_start + committed
    codes.index_put_((written,), token)
    if column_targets is not None:
        rows = torch.arange(len(committed), device=committed.device)
        column_targets.index_put_((rows, committed % width), target)
    return Drawn(token, written, target.amax(-1), committed + 1)
