"""The decoding-session contract over a preallocated cache, shared by every model family.

:class:`SlotSession` does the :class:`~sjd_core.models.protocol.DecodingSession` bookkeeping
once: the token layout of each forward (:mod:`.token_layout`, on the host), the key/value cache
(:mod:`.kv_store`) and the attention mask (:mod:`.mask_buffer`), keep, retain and the checks
that the caller's slots and committed counts continue what is cached. A model's session adds
three things: the network inputs of the fed tokens, running the network, and its logits.

Rows: the conditional contexts are rows ``0 .. B-1``, the unconditional ones (with guidance)
rows ``B .. 2B-1``; one forward runs them all.

Per forward the session reads nothing back from the device: the committed counts come from the
caller, the tree's depths are read once per tree (the engine builds one per generation; a single
node needs no read). Its own work is a fixed number of tensor operations on the fed tokens only,
whatever the length of the cached prefix. Plain autoregression's ``advance`` (one code per row,
kept at once) skips most of it between row ends. The layout reaches the device as one packed
tensor (:class:`Fed`), and the network's call, the one compiled or captured, reads the positions
and columns from it and writes the fed tokens' mask block itself: a compiled forward dispatches
only a few operations outside compiled code.

Static shapes: compiled (``compile_network``), inside the network every tensor's shape depends
only on the fed shape (rows, tokens): forwards attend through the mask buffer read at the
cache's full capacity (columns past a row's cached length are blocked there), plain
autoregression under inductor excepted (it reads the columns in use, their number symbolic in
one graph), and new entries go to the cache through index tensors. Eager forwards attend the
same way, and rows in step write their tokens to the cache as one slice; plain autoregression
then attends without a mask where no context is padded (see ``_attention``).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ... import checks
from ...messages import quote
from ..protocol import DecodingSession
from ...compiled import CapturedNetwork, CompiledNetwork, compile_network
from .kv_store import KVStore, compact, compact_columns
from .mask_buffer import MaskBuffer, settle, write_block
from .token_layout import FedLayout, GridLayout
from ...transfer import Packed, host_to_device, pack, to_device

__all__ = ["Fed", "SlotSession", "fed_places", "keep_entries"]


@dataclass
class Fed:
    """The device-side layout of the last forward (see :class:`.token_layout.FedLayout`).

    Its arrays travel as one packed tensor (``layout``), each read through :meth:`part`:
    ``positions`` and ``columns`` (R, tokens) first (what the network call takes, see
    :func:`fed_places`), then ``slots`` (B, T), the slots the layout assumes for the conditional
    rows; where they apply, ``starting`` (R,), rows whose node 0 is the slot -1 token, and
    ``expected_kept`` (R,), tokens the last keep must have kept; with row ends,
    ``token_node``, ``real``, ``row_end`` and ``outputs`` of the layout (its ``visible``
    travels as mask values, see ``SlotSession._visible_block``).
    """

    nodes: int
    tokens: int  # tokens per row
    path_tokens: int  # the most tokens a row can keep: a path, one node per depth
    moved: slice | None  # the kept columns that may have to move (None: none ever moves)
    one_image: bool  # rows in step that keep the same nodes: one image (and its uncond row)
    layout: Packed

    def part(self, name: str) -> torch.Tensor | None:
        """The layout's array ``name``, None where this forward has none."""
        return self.layout.part(name)


def fed_places(layout: torch.Tensor, rows: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions and the cache columns (rows, tokens) of the fed tokens, at the front of a
    forward's packed ``layout`` (:class:`Fed`)."""
    positions, columns = layout[: 2 * rows * tokens].view(2, rows, tokens).unbind()
    return positions, columns


_VISIBLE_BLOCKS = 128  # row-end forwards' mask blocks a session keeps (see _visible_block)


def _without_grad(method: Callable) -> Callable:
    """``torch.no_grad()`` around a session method, entered only where gradients are on: the
    engine decodes in inference mode already, where entering the context would cost every
    step a few microseconds of host time for nothing."""

    @functools.wraps(method)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return method(*args, **kwargs)
        with torch.no_grad():
            return method(*args, **kwargs)

    return run


class SlotSession(DecodingSession):
    """A prefilled session for ``batch_size`` images on a ``grid`` (see the module docstring).

    prefix, start: per row, the length of its context in the cache (its tokens but the slot -1
        token) and the position of its slot -1 token (see :class:`.token_layout.GridLayout`). A
        shorter context is padded at the front, so that every row's image starts at the same
        cache column: rows that have committed as many slots then put their next codes in one
        column, whatever their prompts' lengths.
    max_nodes: the most nodes one forward feeds; the cache is sized once for it. A forward that
        feeds more enlarges the cache (one copy) instead of failing.
    mask_dtype: the attention mask's dtype (the model's dtype for additive masks, or bool).
    """

    def __init__(self, batch_size: int, guided: bool, grid: tuple[int, int], row_end: bool,
                 prefix: Sequence[int], start: Sequence[int], max_nodes: int,
                 device: torch.device, mask_dtype: torch.dtype) -> None:
        if not isinstance(max_nodes, int) or isinstance(max_nodes, bool) or max_nodes < 1:
            raise ValueError(f"max_nodes={quote(max_nodes)} is not allowed: it must be an integer >= 1 "
                             "(the most nodes one forward feeds).")
        self.batch_size, self.guided = batch_size, guided
        self.grid_height, self.grid_width = grid
        self.device = torch.device(device)
        context = np.asarray(prefix, dtype=np.int64)
        self._padding = context.max() - context  # columns in front of each row's context
        self._padded = bool(self._padding.any())
        self.layout = GridLayout(grid, row_end, np.full_like(context, context.max()), start)
        query_rows = self.layout.tokens_per_forward(max_nodes)
        capacity = self.layout.capacity(query_rows)
        self.store = KVStore(len(prefix), capacity)
        self.mask = MaskBuffer(torch.from_numpy(self.layout.prefix), query_rows, capacity, mask_dtype,
                               self.device, torch.from_numpy(self._padding))
        self._fed: Fed | None = None
        self._held: np.ndarray | None = None  # columns each row held before the last forward
        self._kept: torch.Tensor | None = None  # tokens each row kept at the last keep
        self._trees: list[tuple] = []  # (weakref to ancestors, its version, (depth, host, block))
        self._visible_blocks: dict[tuple, torch.Tensor] = {}  # see _visible_block
        self._expected: list[int] | None = None  # committed counts the next advance must give
        self._in_step = False  # whether the next advance may skip the bookkeeping (see advance)
        self._one_node = np.ones((1, 1), dtype=bool)
        # the mask block of a forward of one token per row: it sees itself
        self._one_block = self.mask.values(torch.ones((1, 1, 1), dtype=torch.bool, device=self.device))
        self._network = self._network_step  # the network call of forward and advance
        self._first_column: int | None = None  # where a slice write starts (see _attention)
        self._keep_rows()

    # ------------------------------------------------------------------ what a model adds
    def _inputs(self, codes: torch.Tensor, fed: Fed | None) -> torch.Tensor:
        """Network inputs (R, tokens, ...) of the fed tokens, from ``codes`` (B, T) on the device;
        ``fed`` None: codes only (no slot -1 token, no row end), as an advance feeds them."""
        raise NotImplementedError

    def _run(self, inputs: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None
             ) -> torch.Tensor:
        """Run the network on ``inputs`` writing through ``self.store``; hidden states (R, n, ...).

        ``mask`` (R, 1, n, columns) says which of the cache's first columns each token sees;
        None: every column the store hands back (see ``_attention``).
        """
        raise NotImplementedError

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Codebook logits (R, T, codebook) in float32 on the session's device."""
        raise NotImplementedError

    def _select_rows(self, index: torch.Tensor) -> None:
        """Keep only the rows ``index`` of the model's own per-row state."""

    def compile_network(self) -> CompiledNetwork | CapturedNetwork:
        """Run the network of every later forward and advance compiled for the device
        (:func:`~sjd_core.compiled.compile_network`; the prefill stays eager: it runs once).
        Returns what tells how compiling went."""
        self._network = compile_network(self._network_step, self.device,
                                        lambda: self.store.settled, self.store.buffers)
        return self._network

    def _network_step(self, inputs: torch.Tensor, layout: torch.Tensor,
                      mask: torch.Tensor | None, block: torch.Tensor | None) -> torch.Tensor:
        """The codebook logits of every fed token, in the one call that is compiled or captured
        per fed shape: what the fed tokens see of each other (``block``, mask values (R or 1,
        tokens, tokens)) written into ``mask`` at their columns, :meth:`_hidden_states`, then the
        head. ``layout``: the forward's packed layout (:class:`Fed`), of which the network
        reads the positions and columns; ``mask`` None (no block): see ``_attention``.

        Every call takes the same four arguments: torch counts the graphs of this one function
        against its limit per function (``recompile_limit``), and calls that differ in their
        arguments compile graphs apart."""
        positions, columns = fed_places(layout, inputs.shape[0], inputs.shape[1])
        if mask is not None:
            write_block(mask, columns, block)
        return self._logits(self._hidden_states(inputs, positions, mask, columns))

    def _hidden_states(self, inputs: torch.Tensor, positions: torch.Tensor,
                       mask: torch.Tensor | None, columns: torch.Tensor | None) -> torch.Tensor:
        """The network on the fed tokens, their keys and values written at cache ``columns``
        (R, tokens; None: as one slice from ``_first_column``): every tensor it reads that
        changes between forwards is an argument (the cache's buffers stay where they are).
        The layers that allocated their cache in this call are joined at its end, so that the
        next call is already compiled (``store.settled``)."""
        attended = self._first_column + inputs.shape[1] if mask is None else mask.shape[-1]
        self.store.plan(columns, attended, self._first_column)
        hidden = self._run(inputs, positions, mask)
        self.store.join()
        return hidden

    # ------------------------------------------------------------------ prefill
    def _prefill(self, inputs: torch.Tensor) -> None:
        """Run the contexts (R, n, ...) into cache columns 0 .. n - 1, each one ending at column
        ``n - 1`` (padded at the front: ``context_columns``), through the network step
        uncompiled (it runs once)."""
        n = inputs.shape[1]
        if n == 0:
            return
        padding = torch.from_numpy(self._padding).to(self.device)[:, None]
        order = torch.arange(n, device=self.device)
        capacity = self.store.capacity
        key, query = torch.arange(capacity, device=self.device)[None, None, :], order[None, :, None]
        allowed = (key <= query) & (key >= padding[..., None])
        allowed |= torch.eye(n, capacity, dtype=torch.bool, device=self.device)  # padding sees itself
        positions = (order - padding).clamp_min(0)  # a context's tokens count from 0
        self._first_column = None
        self._hidden_states(inputs, positions, self.mask.values(allowed)[:, None],
                            order.expand(len(self._padding), n))

    def context_columns(self, row: int, length: int) -> slice:
        """The columns of the prefill's input where row ``row`` puts its ``length`` context
        tokens (the slot -1 token excluded): the last ``length`` of them."""
        end = int(self.layout.prefix[row])
        return slice(end - length, end)

    # ------------------------------------------------------------------ forward
    @_without_grad
    def forward(self, codes: torch.Tensor, slots: torch.Tensor,
                ancestors: torch.Tensor | np.ndarray,
                committed: Sequence[int], mark: Callable[[], None] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feed ``codes`` at ``slots`` (B, T) under the (T, T) ``ancestors`` mask; see the protocol."""
        done = self._check_inputs(codes, slots, ancestors, committed)
        self._drop_unkept()
        depth, host_ancestors, tree_block, moved = self._tree_of(ancestors)
        rows_done = self._sequence_counts(done)
        plan = self.layout.plan(rows_done, depth, host_ancestors)
        self._reserve(plan)
        path_tokens = min(self.layout.tokens_per_forward(int(depth.max()) + 1), plan.tokens)
        fed = self._to_device(plan, rows_done == 0 if min(committed) == 0 else None, path_tokens,
                              slice(0, path_tokens) if plan.token_node is not None else moved)
        self._check_continuation(slots, fed)
        inputs = self._inputs(to_device(codes, self.device), fed)
        block = tree_block if plan.visible is None else self._visible_block(plan.visible)
        if mark is not None:
            mark()
        longest = int(plan.lengths.max())
        mask = self._attention(plan.tokens, longest, plan.lengths.min() == longest)
        logits = self._network(inputs, fed.layout.flat, mask, None if mask is None else block)
        outputs = fed.part("outputs")
        if outputs is not None:  # the codes' logits, not the row ends'
            logits = logits.gather(1, outputs[..., None].expand(-1, -1, logits.shape[-1]))
        if mark is not None:
            mark()
        self._fed, self._held = fed, plan.lengths
        self._expected, self._in_step = None, False
        return self._by_guidance(logits)

    def _by_guidance(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The conditional rows' ``logits`` and the unconditional ones' (None without guidance)."""
        if self.guided:
            cond, uncond = logits.chunk(2)
            return cond, uncond
        return logits, None

    def _check_inputs(self, codes: torch.Tensor, slots: torch.Tensor, ancestors: torch.Tensor,
                      committed: Sequence[int]) -> np.ndarray:
        b, t = codes.shape
        if b != self.batch_size or t < 1 or slots.shape != codes.shape or ancestors.shape != (t, t):
            raise ValueError(f"forward got codes {tuple(codes.shape)}, slots {tuple(slots.shape)}, "
                             f"ancestors {tuple(ancestors.shape)}; expected (B={self.batch_size}, T), "
                             "(B, T) and (T, T) with T >= 1.")
        done = None if isinstance(committed, torch.Tensor) or len(committed) != b else np.array(committed)
        last = self.layout.slots
        if done is None or done.dtype.kind not in "iu" or not 0 <= min(committed) <= max(committed) <= last:
            raise ValueError(f"forward got committed={quote(committed)}; it must be a list of "
                             f"{self.batch_size} host integers in [0, {self.layout.slots}], the slots "
                             "each row has committed.")
        return done if done.dtype == np.int64 else done.astype(np.int64)

    def _tree_of(self, ancestors: torch.Tensor | np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, torch.Tensor, slice | None]:
        """(depth (T,), host ancestors (T, T), the tree's mask values (1, T, T) on the device,
        the places along a kept path where a node may sit elsewhere than at its own place).

        A path from the root keeps its nodes in fed order; the k-th of them moves to the k-th
        fed column unless it is already the k-th fed node. The last item covers every k where
        that may fail, over all paths (None: it never fails, as on a chain). Host ancestors (a numpy array, as the engine passes them) need no read; a tensor is read
        to the host once. Either way the result is kept per distinct tree (a tensor changed in
        place is read again, unless made under inference mode, which does not record changes).
        """
        version = None if isinstance(ancestors, np.ndarray) or ancestors.is_inference() \
            else ancestors._version
        for known in self._trees:
            if known[0]() is ancestors and known[1] == version:
                return known[2]
        if isinstance(ancestors, np.ndarray):
            host = ancestors.astype(bool)
        elif ancestors.shape[0] == 1:
            host = np.ones((1, 1), dtype=bool)
        else:
            host = ancestors.to("cpu", torch.bool).numpy()
        block = self.mask.values(host_to_device({"tree": host}, self.device)["tree"])[None]
        place = host.cumsum(1) - 1  # the place of each node on the path to each node
        elsewhere = place[host & (place != np.arange(host.shape[0]))]
        moved = slice(int(elsewhere.min()), int(elsewhere.max()) + 1) if elsewhere.size else None
        shape = (host.sum(1).astype(np.int64) - 1, host, block, moved)
        self._trees = [known for known in self._trees if known[0]() is not None][-15:]
        self._trees.append((weakref.ref(ancestors), version, shape))
        return shape

    def _visible_block(self, visible: np.ndarray) -> torch.Tensor:
        """The mask values of what each token of a forward that feeds row ends sees of the
        others (``visible``, (R, tokens, tokens) host booleans), made on the device once per
        distinct pattern: a tree's nodes end grid rows in at most as many ways as a grid row
        has codes, so most forwards find theirs made (the last ``_VISIBLE_BLOCKS`` are kept)."""
        key = (visible.shape, visible.tobytes())
        block = self._visible_blocks.pop(key, None)
        if block is None:
            block = self.mask.values(host_to_device({"visible": visible}, self.device)["visible"])
        self._visible_blocks[key] = block  # the newest last
        if len(self._visible_blocks) > _VISIBLE_BLOCKS:
            del self._visible_blocks[next(iter(self._visible_blocks))]
        return block

    def _reserve(self, plan: FedLayout) -> None:
        """Enlarge cache and mask when a forward feeds more tokens than they were sized for."""
        if plan.tokens > self.mask.query_rows or plan.width > self.store.capacity:
            query_rows = max(plan.tokens, self.mask.query_rows)
            capacity = self.layout.capacity(query_rows)
            self.store.reserve(capacity)
            self.mask.reserve(query_rows, capacity)

    def _to_device(self, plan: FedLayout, starting: np.ndarray | None, path_tokens: int,
                   moved: slice | None) -> Fed:
        """The layout's arrays on the device, packed (:class:`Fed`); ``starting`` (rows,) marks
        rows whose node 0 is the slot -1 token (None: no row); ``path_tokens`` and ``moved`` as
        in :class:`Fed`."""
        arrays = {"positions": plan.positions, "columns": plan.columns,
                  "slots": plan.slots[: self.batch_size]}
        if starting is not None:
            arrays["starting"] = starting
        if self._kept is not None:
            arrays["expected_kept"] = plan.lengths - self._held
        if plan.token_node is not None:
            arrays.update(token_node=plan.token_node, real=plan.real, row_end=plan.row_end,
                          outputs=plan.outputs)
        one_image = self.batch_size == 1 and bool(plan.lengths.min() == plan.lengths.max())
        return Fed(plan.slots.shape[1], plan.tokens, path_tokens, moved, one_image,
                   pack(arrays, self.device))

    def _check_continuation(self, slots: torch.Tensor, fed: Fed) -> None:
        """Under the tests' device checks (:mod:`sjd_core.checks`), fail when the slots or
        committed counts do not continue what the session cached. The engine computes both
        from what it committed; a check would cost every forward a wait for the device."""
        if not checks.DEVICE_CHECKS:
            return
        continues = bool((to_device(slots, self.device) == fed.part("slots")).all())
        expected_kept = fed.part("expected_kept")
        if expected_kept is not None:
            continues &= bool((self._kept == expected_kept).all())
        if not continues:
            raise RuntimeError("forward: slots and committed do not continue the cache: node 0 "
                               "must sit at slot committed[b] - 1, every node at that slot plus "
                               "its depth in the tree, and committed must grow by the nodes kept "
                               "(a path of the tree)")

    @_without_grad
    def advance(self, codes: torch.Tensor, committed: Sequence[int],
                mark: Callable[[], None] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Plain autoregression's step: feed ``codes`` (B,) at slot ``committed[b] - 1`` of each
        row and keep them; the logits (B, codebook) of the next slot, as ``forward`` gives them.

        The same as ``forward`` of one node and ``keep`` of it, and done that way when a row end
        is due in some row, for the slot -1 token, or after a ``forward``. Otherwise it skips
        their bookkeeping: no layout, no check on the device, the new column opened in the mask
        before the network runs (the code is kept); ``committed`` (a list) must then be the last
        advance's plus one in every row, and nothing else is read from it. Rows may have
        committed different counts (after windows that kept different paths): each code then
        goes to its own row's next column. After an advance, committed counts that do not
        continue it are refused.
        """
        if codes.ndim != 1 or codes.shape[0] != self.batch_size:
            raise ValueError(f"advance got codes of shape {tuple(codes.shape)}; expected "
                             f"(B={self.batch_size},), one code per row.")
        if self._in_step and isinstance(committed, list) and committed == self._expected:
            return self._advance_in_step(codes, committed, mark)
        done = self._check_inputs(codes[:, None], codes[:, None], self._one_node, committed)
        if self._expected is not None and done.tolist() != self._expected:
            raise ValueError(f"advance got committed={quote(committed)}, which does not continue the "
                             "cache: each row must have committed one slot more than at the last "
                             "advance.")
        slots = done[:, None] - 1
        slots_on_device = host_to_device({"slots": slots}, self.device)
        cond, uncond = self.forward(codes[:, None], slots_on_device["slots"], self._one_node,
                                    committed, mark)
        self.keep(self._keep_one)
        self._continue_from(done.tolist())
        return cond[:, 0], None if uncond is None else uncond[:, 0]

    def _advance_in_step(self, codes: torch.Tensor, committed: list[int],
                         mark: Callable[[], None] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``advance`` where the rows have committed ``committed`` slots, continuing the last
        advance, and no code fed ends a grid row: no layout, only each row's next column (see
        :meth:`_next_columns`)."""
        in_step = committed.count(committed[0]) == len(committed)
        held, layout = self._next_columns(committed, in_step)
        inputs = self._inputs(to_device(codes[:, None], self.device), None)
        if mark is not None:
            mark()
        mask = self._attention(1, int(held.max()), in_step)
        if in_step:  # kept at once; a network that reads the mask writes the column open there
            # (a captured one into its graph's own copy of the mask)
            written = mask is not None and not isinstance(self._network, CapturedNetwork)
            self.mask.open_column(int(held[0]), open_in_first_query=written)
        logits = self._network(inputs, layout.flat, mask, None if mask is None else self._one_block)
        if mark is not None:
            mark()
        self._held, self._kept = held, self._kept_one
        self._continue_from(committed)
        return self._by_guidance(logits[:, 0])

    def _next_columns(self, committed: list[int], in_step: bool) -> tuple[np.ndarray, Packed]:
        """Each cached sequence's length ``held`` (R,) after ``committed`` slots per row, which
        is the column of its next code; and the layout of the forward that feeds the codes
        there (positions and columns, (R, 1)). Every row's prefix is as long, so rows in step
        (``in_step``: every count the same) share one column, which the caller opens with the
        ones before it (:meth:`.MaskBuffer.open_column`); rows out of step open theirs here, in
        the mask, through the layout's columns (the codes are kept at once)."""
        counts = (np.int64(committed[0]) if in_step
                  else self._sequence_counts(np.asarray(committed, dtype=np.int64)))
        held = self.layout.cached_length(counts)  # (R,) either way: the prefixes are as long
        offsets = self.layout.code_offset(counts - 1)
        layout = pack({"positions": (self.layout.start + offsets)[:, None],
                       "columns": held[:, None]}, self.device)
        if not in_step:
            self.mask.settle(layout.part("columns")[:, None], self._kept_one)
        return held, layout

    def _attention(self, tokens: int, longest: int, in_step: bool) -> torch.Tensor | None:
        """The mask of a forward feeding ``tokens`` tokens per row after rows of at most
        ``longest`` cached columns (``in_step``: all as long), its length the columns the
        forward attends over, and where the forward writes its tokens as one slice
        (``_first_column``; None: through index tensors).

        Eager, rows in step put their tokens in the same columns, one after another: one slice
        from ``longest``. Compiled or captured, writes go through index tensors (shapes that do
        not depend on where). Plain autoregression (one token per row) attends over the columns
        in use only, up to the longest row's (the mask blocks, for each row, what it does not
        hold): eager, where the rows are in step and no context is padded, with no mask (the
        code sees every column); compiled by inductor, the mask's length says how many columns
        (one graph with that length symbolic serves the image). Every other forward, and every
        forward of a network captured as CUDA graphs (fixed shapes), attends through the mask
        at the cache's full capacity, so that its shapes do not depend on how much is cached
        and its cost does not change along the image (``auto`` compares times of its shapes
        measured at different points of the image; plain autoregression, whose cost grows, it
        times again and again; so a session made for ``auto``'s largest shape, with more
        capacity, costs an AR step no more than one made for AR alone)."""
        eager = not isinstance(self._network, (CompiledNetwork, CapturedNetwork))
        self._first_column = longest if eager and in_step else None
        if tokens > 1 or isinstance(self._network, CapturedNetwork):
            return self.mask.view(tokens)
        if self._first_column is not None and not self._padded:
            return None
        return self.mask.view(1)[..., :longest + 1]

    def _sequence_counts(self, committed: np.ndarray) -> np.ndarray:
        """The committed counts (B,) per cached sequence: the cond rows, then as many uncond."""
        return np.concatenate([committed, committed]) if self.guided else committed

    def _continue_from(self, committed: list[int]) -> None:
        """What the next advance must give after one that fed the codes at slots
        ``committed[b] - 1``: one slot more per row, and the lean step unless a code it
        feeds ends a grid row."""
        self._expected = [count + 1 for count in committed]
        self._in_step = not any(self.layout.ends_row(count) for count in set(committed))

    # ------------------------------------------------------------------ keep and retain
    @_without_grad
    def keep(self, mask: torch.Tensor, run: Callable | None = None) -> None:
        """Keep the entries of the fed nodes where ``mask`` (B, T) is True, per row; drop the rest.

        The kept nodes of a row are a path of the fed tree (at most one node per depth; the next
        forward fails when a row kept more). A kept node keeps all its tokens (code and row end). Kept entries move,
        in fed order, to the columns right after the row's cached prefix (only as many columns
        move as a path can hold); dropped ones are blocked in the mask.

        ``run(function, *arguments)`` calls the device work, :func:`keep_entries` (the engine's
        stage runner, which compiles it per tree shape); None: called as it is.
        """
        fed = self._fed
        if fed is None:
            raise RuntimeError("keep() called without a forward() before it.")
        if tuple(mask.shape) != (self.batch_size, fed.nodes):
            raise ValueError(f"keep got a mask of shape {tuple(mask.shape)}; expected "
                             f"(B={self.batch_size}, T={fed.nodes}), one entry per fed node.")
        self._fed = None
        arguments = (to_device(mask, self.device, torch.bool), self.guided, fed,
                     self.store.buffers(), self.mask.settle_arguments(fed.tokens))
        self._kept = keep_entries(*arguments) if run is None else run(keep_entries, *arguments)

    def _keep_rows(self) -> None:
        """The keep mask of one node and the kept counts of an advance, for the current rows."""
        self._keep_one = torch.ones(self.batch_size, 1, dtype=torch.bool, device=self.device)
        rows = 2 * self.batch_size if self.guided else self.batch_size
        self._kept_one = torch.ones(rows, dtype=torch.int64, device=self.device)

    def _drop_unkept(self) -> None:
        """Throw away the last forward if nobody called keep after it."""
        if self._fed is not None:
            self.keep(torch.zeros(self.batch_size, self._fed.nodes, dtype=torch.bool))

    @_without_grad
    def retain(self, rows: Sequence[int]) -> None:
        """Go on with only these batch rows (increasing indices into the current rows)."""
        listed = list(rows)
        integers = all(isinstance(r, (int, np.integer)) for r in listed)
        if not listed or not integers or listed != sorted(set(listed)) or listed[0] < 0 \
                or listed[-1] >= self.batch_size:
            raise ValueError(f"retain got rows={quote(rows)}; it needs increasing row indices in "
                             f"0..{self.batch_size - 1}, at least one.")
        self._drop_unkept()
        chosen = listed + ([self.batch_size + r for r in listed] if self.guided else [])
        index = np.asarray(chosen)
        on_device = host_to_device({"rows": index}, self.device)["rows"]
        self.layout.select_rows(index)
        self.store.select_rows(on_device)
        self.mask.select_rows(on_device)
        self._select_rows(on_device)
        if self._held is not None:
            self._held = self._held[index]
        if self._kept is not None:
            self._kept = self._kept.index_select(0, on_device)
        if self._expected is not None:
            self._expected = [self._expected[row] for row in listed]
        self.batch_size = len(listed)
        self._keep_rows()


def keep_entries(keep: torch.Tensor, guided: bool, fed: Fed, cache: tuple[torch.Tensor, ...],
                 mask: tuple) -> torch.Tensor:
    """:meth:`SlotSession.keep`'s device work: the kept nodes ``keep`` (B, T) of the forward
    ``fed`` moved to the front of its columns in the ``cache`` groups (``KVStore.buffers()``),
    the mask settled (``mask``: :meth:`.MaskBuffer.settle_arguments`); the tokens each cached
    sequence kept (R,). Plain tensor code, so that a compiled stage can run it."""
    if guided:
        keep = torch.cat([keep, keep])
    token_node = fed.part("token_node")
    if token_node is not None:
        keep = keep.gather(1, token_node) & fed.part("real")
    kept = keep.sum(1)
    if fed.nodes > 1:  # one node keeps all its tokens or none: they are already in place
        kept = kept.clamp_max(fed.path_tokens)  # more fails the next forward's check
    fed_columns = fed.part("columns")
    if fed.moved is not None:
        # one image: every row moves the same columns, so row 0 says which, for all rows
        rows = slice(0, 1) if fed.one_image else slice(None)
        columns = fed_columns[rows]
        order = torch.argsort((~keep[rows]).to(torch.int8), dim=1, stable=True)[:, fed.moved]
        source, target = columns.gather(1, order), columns[:, fed.moved]
        if fed.one_image:
            compact_columns(cache, source[0], target[0])
        else:
            compact(cache, source, target)
    settle(*mask, fed_columns[:, None], kept)
    return kept
