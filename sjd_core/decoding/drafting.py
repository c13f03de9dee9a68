"""How drafts are made: init rules, SJD re-draws, AC coupling, PD trees and VP fusion.

The window holds, for offsets ``j = 0 .. W-1`` after the committed prefix, a draft token and the
distribution ``q_j`` it was really drawn from. The verifier tests drafts against ``q_j``; keeping
that pairing honest is what makes every mode here exact (``docs/algorithms.md``,
section 2, the exactness lemma). An iteration may feed only the first ``L <= W`` offsets; the
others keep their drafts. All functions work on whole (B, W, V) tensors: no loop over slots, no
device reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..transfer import host_to_device
from .sampling import (MIN_MASS, NEGLIGIBLE, flush_negligible, kth_largest, passes,
                       race_top, residual, sample)
from .settings import AccelerationSettings

_MEAN_FLOOR = 1e-30  # past means below count as this: keeps growth finite where a code had 0


def uniform_profile(candidates: int, depth: int) -> tuple[int, ...]:
    """The PD tree of ``candidates`` (K) per slot and ``depth`` (D) levels counting the root, as
    candidates per level: ``(K,) * (D - 1)``; ``()`` (a chain) when K = 1."""
    return (candidates,) * (depth - 1) if candidates > 1 else ()


def tree_profiles(candidates: int, depth: int) -> list[tuple[int, ...]]:
    """Every tree within K = ``candidates`` and D = ``depth``: candidates per level, at least two
    at the first level, never more at a level than at the one before (a level's nodes all sit
    under the previous level's)."""
    profiles: list[tuple[int, ...]] = []

    def extend(profile: tuple[int, ...], most: int) -> None:
        if profile:
            profiles.append(profile)
        if len(profile) < depth - 1:
            for count in range(1 if profile else 2, most + 1):
                extend(profile + (count,), count)

    extend((), candidates)
    return profiles


@dataclass(frozen=True)
class DraftTree:
    """The fixed shape of the nodes fed in one iteration, built once per shape.

    Node 0 is the root (the last committed token, depth 0). With proactive drafting the tree's
    ``profile`` (K_1, ..., K_m) gives every node of depth ``d - 1 < m`` ``K_d`` children, the
    candidates of window offset ``d - 1``; past the tree a single chain continues from the main
    path (candidate 0 at every level) to depth ``window - 1``. Without PD the whole window is that
    chain. Nodes 0 .. window - 1 are the main path; the others follow in breadth-first order.
    """

    window: int
    profile: tuple[int, ...]  # candidates per tree level; () for a chain
    tree_levels: int  # offsets 0 .. tree_levels-1 carry candidates
    branching: int  # the most candidates of any level (1 for a chain)
    parent: torch.Tensor  # (T,) -1 for the root
    depth: torch.Tensor  # (T,)
    flat_source: torch.Tensor  # (T,) index into [window drafts, further candidates flattened]
    children: torch.Tensor  # (T, branching) child node ids, -1 where absent
    ancestors: torch.Tensor  # (T, T) bool, ancestors and self
    host_ancestors: np.ndarray  # the same on the host, for sessions (no read back)
    route: torch.Tensor  # (T, window) node at each depth on the path through a node (see build)
    inner_nodes: torch.Tensor  # (I,) nodes whose children are candidates (the PD tree's inside)
    inner_index: torch.Tensor  # (T,) position of each node in inner_nodes, -1 for the others
    offsets: torch.Tensor  # (window,) the window's offsets 0 .. window - 1

    @property
    def size(self) -> int:
        return int(self.parent.numel())

    @staticmethod
    def for_settings(settings: AccelerationSettings, device: torch.device) -> "DraftTree":
        """The fixed shape of ``settings``: its window, with the K x D tree when PD is on."""
        profile = (uniform_profile(settings.pd_candidates, settings.pd_depth)
                   if settings.proactive_drafting else ())
        return DraftTree.build(settings.window, profile, device)

    @staticmethod
    def build(window: int, profile: tuple[int, ...], device: torch.device) -> "DraftTree":
        """A chain of ``window`` nodes, or with a ``profile`` the PD tree of candidates per level
        (see the class) plus the chain.

        ``route[v, t]`` is the ancestor of ``v`` at depth ``t`` for ``t <= depth(v)``, and below
        ``v`` the first-candidate descendant (then the chain): the nodes whose outputs give the
        stale distributions of the slots after a path that ends at ``v``.
        """
        profile = tuple(profile)
        if profile and (profile[0] < 2 or len(profile) >= window
                        or any(b > a or b < 1 for a, b in zip(profile, profile[1:]))):
            raise ValueError(f"profile={profile} is not a PD tree for window {window}: it needs "
                             "at least 2 candidates at its first level, never more at a level "
                             "than at the one before, and fewer levels than the window")
        levels = len(profile)
        branching = max(profile, default=1)
        parent, depth, source, children = _main_path_first(window, *_grow(window, profile))
        size = len(parent)
        child_table = np.full((size, branching), -1, dtype=np.int64)
        for node, kids in enumerate(children):
            child_table[node, : len(kids)] = kids
        ancestors, route = _ancestors_and_routes(window, parent, depth, children)
        inner = [node for node in range(size) if depth[node] < levels]
        inner_index = np.full(size, -1, dtype=np.int64)
        inner_index[inner] = np.arange(len(inner))

        lists = {"parent": parent, "depth": depth, "source": source, "inner": inner,
                 "offsets": range(window)}
        tables = host_to_device({**{name: np.asarray(values, dtype=np.int64)
                                    for name, values in lists.items()},
                                 "child_table": child_table, "ancestors": ancestors,
                                 "route": route, "inner_index": inner_index}, device)
        return DraftTree(window, profile, levels, branching, tables["parent"], tables["depth"],
                         tables["source"], tables["child_table"], tables["ancestors"], ancestors,
                         tables["route"], tables["inner"], tables["inner_index"],
                         tables["offsets"])


def _grow(window: int, profile: tuple[int, ...]) -> tuple[list[int], list[int], list[int],
                                                          list[list[int]], list[int]]:
    """The tree level by level (parent, depth, window source, children), and its main path of
    first candidates; past the profile's levels only the main path's chain continues."""
    levels, branching = len(profile), max(profile, default=1)
    parent, depth, source = [-1], [0], [0]
    children: list[list[int]] = [[]]
    level_nodes = [0]
    main = [0]
    for d in range(1, window):
        new_level = []
        parents = level_nodes if d <= levels else [main[-1]]
        for p in parents:
            for rank in range(profile[d - 1] if d <= levels else 1):
                node = len(parent)
                parent.append(p)
                depth.append(d)
                # a first candidate is the window's draft; the others follow the window
                source.append(d - 1 if rank == 0
                              else window + (d - 1) * (branching - 1) + rank - 1)
                children.append([])
                children[p].append(node)
                new_level.append(node)
        level_nodes = new_level
        main.append(children[main[-1]][0])
    return parent, depth, source, children, main


def _main_path_first(window: int, parent: list[int], depth: list[int], source: list[int],
                     children: list[list[int]], main: list[int]
                     ) -> tuple[list[int], list[int], list[int], list[list[int]]]:
    """The nodes renumbered with the main path first, then the rest breadth-first: an accepted
    path along the main path is then already in place in the cache, and others differ only
    inside the tree. The main path becomes nodes 0 .. window - 1."""
    size = len(parent)
    on_main = set(main)
    order = main + [node for node in range(size) if node not in on_main]
    new_id = np.empty(size, dtype=np.int64)
    new_id[order] = np.arange(size)
    return ([-1 if parent[node] < 0 else int(new_id[parent[node]]) for node in order],
            [depth[node] for node in order], [source[node] for node in order],
            [[int(new_id[kid]) for kid in children[node]] for node in order])


def _ancestors_and_routes(window: int, parent: list[int], depth: list[int],
                          children: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Each node's ancestors (and itself) as a (T, T) table, and its route (see ``build``)."""
    size = len(parent)
    ancestors = np.zeros((size, size), dtype=bool)
    route = np.zeros((size, window), dtype=np.int64)
    for node in range(size):
        walk = node
        while walk >= 0:
            ancestors[node, walk] = True
            route[node, depth[walk]] = walk
            walk = parent[walk]
        below = node
        for d in range(depth[node] + 1, window):
            below = children[below][0] if children[below] else d  # main path: node d
            route[node, d] = below
    return ancestors, route


# How the draft of a slot was made (recorded per committed slot in the trace).
(NO_DRAFT, UNIFORM_INIT, LEFT_INIT, ABOVE_INIT, ABOVE_TARGET_INIT, TARGET_DRAW, AC_KEPT,
 AC_REPLACED, VP_DRAW, PD_SIBLING) = range(10)
DRAFT_SOURCES = {NO_DRAFT: "no draft", UNIFORM_INIT: "uniform init", LEFT_INIT: "copy of left",
                 ABOVE_INIT: "copy of above", ABOVE_TARGET_INIT: "drawn from the target above",
                 TARGET_DRAW: "drawn from target", AC_KEPT: "kept by AC",
                 AC_REPLACED: "replaced by AC", VP_DRAW: "drawn by VP", PD_SIBLING: "PD sibling"}


@dataclass
class WindowState:
    """Drafts for window offsets 0..W-1 and, for VP, each slot's probability history."""

    tokens: torch.Tensor  # (B, W) first-candidate draft per offset
    q: torch.Tensor  # (B, W, V) what each draft was drawn from
    source: torch.Tensor  # (B, W) int8, how each draft was made (DRAFT_SOURCES)
    fed: torch.Tensor  # (B, W) bool, whether the slot has had a target (its draft is not an init)
    # (B, W, 3, V) VP's history of each slot, one tensor so that the window moves it at once:
    # the views vp_mean, vp_last and vp_rises
    vp_history: torch.Tensor | None = None
    vp_known: torch.Tensor | None = None  # (B, W) whether the slot has a history yet

    @property
    def vp_mean(self) -> torch.Tensor:
        """(B, W, V) the exponentially weighted past distributions."""
        return self.vp_history[:, :, 0]

    @property
    def vp_last(self) -> torch.Tensor:
        """(B, W, V) the last iteration's distribution."""
        return self.vp_history[:, :, 1]

    @property
    def vp_rises(self) -> torch.Tensor:
        """(B, W, V) consecutive rises per code (whole numbers, in float32)."""
        return self.vp_history[:, :, 2]

    @staticmethod
    def empty(batch: int, window: int, vocab: int, device: torch.device,
              verification_prediction: bool) -> "WindowState":
        """A window with no drafts yet (every slot is filled by the init rule)."""
        history = ((torch.zeros(batch, window, 3, vocab, device=device),
                    torch.zeros(batch, window, dtype=torch.bool, device=device))
                   if verification_prediction else ())
        return WindowState(torch.zeros(batch, window, dtype=torch.long, device=device),
                           torch.zeros(batch, window, vocab, device=device),
                           torch.zeros(batch, window, dtype=torch.int8, device=device),
                           torch.zeros(batch, window, dtype=torch.bool, device=device), *history)

    def parts(self) -> tuple[torch.Tensor | None, ...]:
        """The fields in order (None for the VP history when VP is off)."""
        return (self.tokens, self.q, self.source, self.fed, self.vp_history, self.vp_known)

    def resized(self, window: int) -> "WindowState":
        """The state for a window of ``window`` offsets: offsets past it are dropped (their
        drafts forgotten); offsets added at the end have no draft yet. Either way new tensors,
        laid out as a fresh state's, strides included (``contiguous`` keeps a cut view's for a
        batch of one): a compiled stage is specialised to its arguments' strides, and a cut
        view's would make torch compile its shape again."""
        have = self.tokens.shape[1]
        if window <= have:
            return WindowState(*(None if x is None else
                                 x[:, :window].clone(memory_format=torch.contiguous_format)
                                 for x in self.parts()))
        batch, _, vocab = self.q.shape
        added = WindowState.empty(batch, window - have, vocab, self.q.device,
                                  self.vp_history is not None)
        return WindowState(*(None if x is None else torch.cat([x, y], dim=1)
                             for x, y in zip(self.parts(), added.parts())))

    def rows(self, index: torch.Tensor) -> "WindowState":
        """The state of the batch rows ``index`` only."""
        return WindowState(*(None if x is None else x[index] for x in self.parts()))


@dataclass
class Canvas:
    """What the init rules may look at: the committed codes and, per column, the last target.

    ``codes`` is flat (row ``b`` of the batch starts at ``row_start[b]``); ``column_targets``
    (B, grid_width, V) holds, for each column, the target distribution of the last committed
    slot in it (None when no rule needs it).
    """

    codes: torch.Tensor
    row_start: torch.Tensor
    committed: torch.Tensor  # (B,) slots committed per row
    anchor: torch.Tensor  # (B,) the last committed code
    width: int
    slots: int  # per image
    column_targets: torch.Tensor | None = None

    def targets_above(self, slot: torch.Tensor) -> torch.Tensor:
        """(B, n, V) the targets held for the columns of the slots ``slot`` (B, n)."""
        columns = self.column_targets.shape[1]  # the grid's columns and a spare one
        return take_rows(self.column_targets, flat_rows(slot % self.width, columns))


def initial_drafts(rule: str, state: WindowState, fill: torch.Tensor, canvas: Canvas,
                   uniforms: torch.Tensor) -> None:
    """Draft the slots about to be fed for the first time (``fill`` (B, W) True) by the init
    rule, in place: made just before their first forward, they use all that is committed.

    Every rule is a proposal fixed before verification, and the slot's q is what its draft was
    drawn from, so the acceptance test stays exact:
    ``uniform``: a uniform random code, q uniform.
    ``left``: the code to the left in the same row (the last committed code, an earlier draft or
    a copy of one), q one-hot (accepted with probability ``p(code)``); the first column falls
    back to uniform.
    ``above``: the code above in the same column (committed, or the draft there, which when it is
    made in the same call is its ``left`` draft), q one-hot; the first row falls back to ``left``.
    ``above_target``: a draw from the committed target of the slot above, q that target; where
    the slot above is not committed yet, ``above``; the first row falls back to ``left``.
    ``uniforms`` (B, W) in (0, 1] make the random draws. Other offsets keep their drafts.
    """
    tokens, q, source = _drafts_by_rule(rule, state, fill, canvas, uniforms)
    state.tokens = torch.where(fill, tokens, state.tokens)
    state.q = torch.where(fill[..., None], q, state.q)
    state.source = torch.where(fill, source, state.source).to(torch.int8)


def _drafts_by_rule(rule: str, state: WindowState, fill: torch.Tensor, canvas: Canvas,
                    uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rule's drafts of every offset of the window: tokens, q and source.

    The slot above offset ``j`` is ``slot - width``: committed when it is below the row's
    committed count, otherwise inside the window at offset ``j - width`` (drafted now or
    before); a slot in the first grid row has none."""
    batch, window, vocab = state.q.shape
    device = state.tokens.device
    offsets = torch.arange(window, device=device)
    slot = canvas.committed[:, None] + offsets
    first_column = slot % canvas.width == 0
    random_tokens = (uniforms * vocab).long().clamp_max(vocab - 1)
    uniform_q = state.q.new_full((1, 1, vocab), 1.0 / vocab)
    if rule == "uniform":
        tokens, q, source = random_tokens, uniform_q.expand(batch, window, -1), UNIFORM_INIT
    else:
        own = torch.where(fill & first_column, random_tokens, state.tokens)
        is_source = ~fill | first_column
        line = torch.cat([canvas.anchor[:, None], own], dim=1)
        positions = torch.arange(window + 1, device=device).expand(batch, -1)
        sources = torch.where(torch.cat([torch.ones_like(is_source[:, :1]), is_source], 1),
                              positions, torch.zeros_like(positions))
        left = line.gather(1, sources.cummax(dim=1).values)[:, 1:]
        tokens = left
        q = torch.where(first_column[..., None], uniform_q, copy_proposal(left, vocab, state.q.dtype))
        source = torch.where(first_column, UNIFORM_INIT, LEFT_INIT)
        if rule in ("above", "above_target"):
            above_slot = slot - canvas.width
            has_above = above_slot >= 0
            above_committed = has_above & (above_slot < canvas.committed[:, None])
            committed_code = canvas.codes[canvas.row_start[:, None] + above_slot.clamp(0, canvas.slots)]
            drafted = torch.where(fill, tokens, state.tokens)  # the slot above may be new too
            in_window = drafted.gather(1, (offsets - canvas.width).clamp_min(0).expand(batch, -1))
            above = torch.where(above_committed, committed_code, in_window)
            above_q = copy_proposal(above, vocab, state.q.dtype)
            above_source = torch.full_like(tokens, ABOVE_INIT)
            if rule == "above_target":  # where the slot above has no target yet: its copy
                column = torch.where(above_committed[..., None], canvas.targets_above(slot),
                                     above_q)
                above, above_q = draw_from_target_above(column, uniforms)
                above_source = torch.where(above_committed, ABOVE_TARGET_INIT, ABOVE_INIT)
            tokens = torch.where(has_above, above, tokens)
            q = torch.where(has_above[..., None], above_q, q)
            source = torch.where(has_above, above_source, source)
    return tokens, q, source


def copy_proposal(codes: torch.Tensor, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """The q of a draft that copies a code (``left``, ``above``): all mass on that code."""
    return torch.nn.functional.one_hot(codes, vocab).to(dtype)


def draw_from_target_above(column: torch.Tensor, uniforms: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """``above_target``'s draft: a draw from the committed target of the slot above, and the
    distribution to record as its q (that same target)."""
    return sample(column, uniforms), column


def add_candidates(state: WindowState, tree: DraftTree, noise: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens, validity and draft source of every fed node except the root.

    Tree offsets get ``K`` candidates without replacement from their q: the current draft first
    (drawn from q, or AC-coupled to it), the others by an exponential race over q with the draft
    removed (``noise`` (B, levels, V) ~ Exp(1)). A candidate is invalid when q has no mass left
    for it (e.g. a one-hot q). Returns (B, T) node tokens (root position left 0), validity and
    source.
    """
    batch = state.tokens.shape[0]
    fed = state.tokens[:, : tree.window]
    flat_tokens, flat_source = fed, state.source[:, : tree.window]
    flat_valid = torch.ones_like(fed, dtype=torch.bool)
    if tree.tree_levels:
        levels = tree.tree_levels
        first = fed[:, :levels]
        rest = state.q[:, :levels].scatter(-1, first[..., None], 0.0)
        others = race_top(rest, noise, tree.branching - 1)
        usable = rest.gather(-1, others).cummin(-1).values > MIN_MASS  # and every one before
        siblings = others.flatten(1)
        flat_tokens = torch.cat([fed, siblings], dim=1)
        flat_valid = torch.cat([flat_valid, usable.flatten(1)], dim=1)
        flat_source = torch.cat([flat_source, torch.full_like(siblings, PD_SIBLING,
                                                              dtype=torch.int8)], dim=1)
    source = tree.flat_source.expand(batch, -1)
    return flat_tokens.gather(1, source), flat_valid.gather(1, source), flat_source.gather(1, source)


def predict_verification(targets: torch.Tensor, state: WindowState, known: torch.Tensor,
                         updated: torch.Tensor, settings: AccelerationSettings) -> torch.Tensor:
    """SJD-VP: bias each slot's draft distribution towards codes whose probability keeps rising.

    ``S = log p_t - log pbar``; codes among the ``vp_top_k`` most likely whose probability rose
    ``vp_rises`` iterations in a row get ``log q' = log p_t + S``, the rest ``log p_t``;
    ``q' = softmax``, computed as the weights ``p_t^2 / pbar`` and ``p_t`` normalised (``pbar``
    at least ``_MEAN_FLOOR``). ``pbar`` is then updated with weight ``1 - vp_decay``. ``state``
    holds the history already shifted to the new window; it gets a new history tensor (the
    mean, ``p_t`` and the rise counts), so no view of the old one is written. ``known`` marks
    slots that have a history, ``updated`` those that have one after this update (the slots with
    a target). Returns q' (B, W, V).
    """
    known3 = known[..., None]
    mean = torch.where(known3, state.vp_mean, targets)
    last = torch.where(known3, state.vp_last, targets)
    # a new history has last == targets: no rise
    rises = (state.vp_rises + 1) * (targets > last)
    top = min(settings.vp_top_k, targets.shape[-1])
    # among the top codes and above 0: a flushed target is 0 or at least NEGLIGIBLE
    kth = kth_largest(targets, top).clamp_min(NEGLIGIBLE)
    boosted = (rises >= settings.vp_rises) & (targets >= kth)
    weights = torch.where(boosted, targets * (targets / mean.clamp_min(_MEAN_FLOOR)), targets)
    fused = flush_negligible(weights / weights.sum(-1, keepdim=True))
    state.vp_history = torch.stack([torch.lerp(targets, mean, settings.vp_decay), targets, rises],
                                   dim=2)
    state.vp_known = updated
    return fused


def flat_rows(index: torch.Tensor, width: int) -> torch.Tensor:
    """The (B * n,) positions ``b * width + index[b, j]`` of a per-row ``index`` (B, n) into
    tensors of shape (B, width, ...) with their first two axes flattened, for :func:`take_rows`."""
    batch = index.shape[0]
    return (index + torch.arange(0, batch * width, width, device=index.device)[:, None]).flatten()


def take_rows(values: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    """``values[b, index[b, j]]`` (B, n, ...) with ``flat`` from :func:`flat_rows`: one
    selection of whole entries along the flattened first two axes (each slot's distribution is
    taken at once, by one index per slot)."""
    batch = values.shape[0]
    return values.flatten(0, 1).index_select(0, flat).view(batch, -1, *values.shape[2:])


def shift_window(state: WindowState, source: torch.Tensor, in_range: torch.Tensor) -> WindowState:
    """Move every row's window forward by its commit count: new offset ``j`` of row ``b`` takes
    old offset ``source[b, j]`` (``j`` plus the count, clamped to the window); ``in_range``
    (B, W) marks the offsets that came from inside the old window (the others are new: no
    draft yet). VP's ``vp_known`` is moved as it is: :func:`redraft` keeps only the slots with
    a target."""
    flat = flat_rows(source, source.shape[1])

    def take(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else take_rows(x, flat)

    return WindowState(state.tokens.gather(1, source), take(state.q),
                       state.source.gather(1, source), state.fed.gather(1, source) & in_range,
                       take(state.vp_history),
                       None if state.vp_known is None else state.vp_known.gather(1, source))


def redraft(state: WindowState, targets: torch.Tensor, has_target: torch.Tensor,
            settings: AccelerationSettings, keep_test: torch.Tensor,
            draw: torch.Tensor) -> WindowState:
    """New drafts for the uncommitted slots that have a (stale) target distribution.

    ``state`` is already shifted to the new window; ``targets`` (B, W, V) are the stale targets
    where ``has_target``. Without AC each draft is drawn afresh from the draw distribution (the
    target, or VP's q'); with AC the old draft is kept when ``u <= q'(d) / q_old(d)`` and
    otherwise replaced by a draw from ``norm(max(0, q' - q_old))``, the maximal coupling, so the
    new draft is distributed exactly as q'. Either way the slot's q becomes the distribution the
    new draft follows (q' itself, never the unfused target: verifying VP drafts against the
    target, as the SJD-VP paper appears to do, is not exact). ``keep_test`` and ``draw`` (B, W):
    the uniforms of AC's keep tests and of the draws. Slots without a target (new to the window)
    are drafted the same way, from what the shift left there, and marked not ``fed``, so that the
    init rule drafts them before they are fed: no selection is spent on keeping what they held.
    """
    if settings.verification_prediction:
        draw_from = predict_verification(targets, state, state.vp_known & has_target,
                                         has_target, settings)
        fresh_source = VP_DRAW
    else:
        draw_from, fresh_source = targets, TARGET_DRAW
    if settings.adaptive_continuation:
        old = state.tokens[..., None]
        keep = passes(keep_test, draw_from.gather(-1, old).squeeze(-1),
                      state.q.gather(-1, old).squeeze(-1))
        tokens = torch.where(keep, state.tokens, sample(residual(draw_from, state.q), draw))
        source = torch.where(keep, AC_KEPT, AC_REPLACED).to(torch.int8)
    else:
        tokens = sample(draw_from, draw)
        source = torch.full_like(state.tokens, fresh_source, dtype=torch.int8)
    state.tokens, state.q, state.source = tokens, draw_from, source
    # a tensor of its own: with VP, vp_known is has_target, and arguments that alias each other
    # would compile a stage a second time
    state.fed = has_target.clone()
    return state
