"""Where the tokens of a forward sit: structural tokens, sequence positions and cache columns.

Everything here is computed on the host, from each row's committed count (host integers the
engine passes) and the depths of the fed tree (read once per tree), so no input building waits
for the device.

Sequence of one row: ``context... | s(-1) | code(0) ... code(W-1) [row end] | code(W) ...``.
``s(-1)`` is the last context token (position ``start``); the code of slot ``s`` sits at position
``start + 1 + s`` plus one per row end before it. The row's cache holds its context but ``s(-1)``
in columns ``0 .. prefix - 1`` (the session pads a shorter context at the front, so that every
row's prefix is as long), then one column per cached token in sequence order, so a row that has
committed ``c`` slots holds slots ``-1 .. c - 2`` (and their row ends).

A forward feeds, per row, each node's code token and, when the node's slot ends a grid row, the
row end after it (its output is the prediction of the next row's first code). A forward that feeds
row ends is padded at the end with tokens that see only themselves (and are never kept) to a
token count fixed per tree: room for the most row ends its nodes can bring inside the image, or
twice its nodes at the image's end, where every node past the last slot sits on that slot. So a
tree is fed in at most three shapes, and a compiled network compiles few graphs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["CAPACITY_STEP", "FedLayout", "GridLayout"]

# Cache capacities are multiples of this many columns, so that contexts of different lengths give
# the same cache shape, and a compiled network the same graphs.
CAPACITY_STEP = 64


@dataclass
class FedLayout:
    """The tokens of one forward for ``R`` rows, ``T`` nodes and ``tokens`` tokens per row.

    ``token_node``, ``real``, ``row_end``, ``outputs`` and ``visible`` are None when no row ends
    are fed: then token ``i`` is node ``i`` and the tree's own ancestor mask applies.
    """

    tokens: int
    width: int  # cache columns the forward needs: to the end of the longest row's fed tokens
    slots: np.ndarray  # (R, T) each node's slot, clamped to the grid
    positions: np.ndarray  # (R, tokens) sequence position of each token
    columns: np.ndarray  # (R, tokens) cache column each token is written to
    lengths: np.ndarray  # (R,) columns each row held before this forward
    token_node: np.ndarray | None = None  # (R, tokens) node of each token (padding: 0)
    real: np.ndarray | None = None  # (R, tokens) False for padding tokens
    row_end: np.ndarray | None = None  # (R, tokens) True for row-end tokens
    outputs: np.ndarray | None = None  # (R, T) token whose output answers each node
    visible: np.ndarray | None = None  # (R, tokens, tokens) which fed token each token sees


class GridLayout:
    """The token layout of ``R`` rows decoding a ``grid`` of codes after their contexts.

    prefix: columns each row's context takes in the cache (its length without ``s(-1)``).
    start: sequence position of each row's ``s(-1)`` token.
    row_end: whether a structural token follows the last code of every grid row.
    """

    def __init__(self, grid: tuple[int, int], row_end: bool, prefix: Sequence[int],
                 start: Sequence[int]) -> None:
        self.height, self.width = grid
        self.slots = self.height * self.width
        self.has_row_end = row_end
        self.prefix = np.asarray(prefix, dtype=np.int64)
        self.start = np.asarray(start, dtype=np.int64)
        self._offsets: dict[int, np.ndarray] = {}
        self._padded_tokens: dict[bytes, int] = {}  # per tree (its depths): see padded_tokens

    def cached_length(self, committed: np.ndarray) -> np.ndarray:
        """Columns a row holds after committing ``committed`` slots (slots -1 .. committed - 2)."""
        if self.has_row_end:
            committed = committed + np.maximum(committed - 1, 0) // self.width
        return self.prefix + committed

    def capacity(self, tokens_per_forward: int) -> int:
        """Columns that hold the longest context, the whole image and one forward after it,
        rounded up to a multiple of ``CAPACITY_STEP``."""
        image = self.slots + (self.height if self.has_row_end else 0)
        needed = int(self.prefix.max()) + image + tokens_per_forward
        return -(-needed // CAPACITY_STEP) * CAPACITY_STEP

    def tokens_per_forward(self, nodes: int) -> int:
        """The most tokens ``nodes`` nodes can take: each may bring a row end."""
        return 2 * nodes if self.has_row_end else nodes

    def select_rows(self, index: np.ndarray) -> None:
        """Keep only the rows ``index`` (in that order)."""
        self.prefix, self.start = self.prefix[index], self.start[index]

    def positions_of(self, slots: np.ndarray) -> np.ndarray:
        """Sequence position of the code at each of ``slots`` (R, T) of each row."""
        return self.start[:, None] + self.code_offset(slots)

    def code_offset(self, slots: np.ndarray | int) -> np.ndarray | int:
        """How far past its row's ``start`` the code of each of ``slots`` sits (an array or an
        integer alike): one position per slot, and one per row end before it."""
        if self.has_row_end:
            return 1 + slots + np.maximum(slots, 0) // self.width
        return 1 + slots

    def ends_row(self, slots: np.ndarray | int) -> np.ndarray | bool:
        """Whether a row end follows the code at each of ``slots`` (it ends a grid row); an
        array or an integer alike."""
        if not self.has_row_end:
            return np.zeros(np.shape(slots), dtype=bool)
        return (slots >= 0) & (slots % self.width == self.width - 1)

    def plan(self, committed: np.ndarray, depth: np.ndarray, ancestors: np.ndarray | None
             ) -> FedLayout:
        """Layout of a forward feeding nodes of ``depth`` (T,) after ``committed`` (R,) slots.

        ``ancestors`` (T, T) host booleans are needed only when the forward feeds row ends (to
        build the token-level mask); pass None for a single node.
        """
        slots = np.minimum(committed[:, None] - 1 + depth, self.slots - 1)
        positions = self.positions_of(slots)
        lengths = self.cached_length(committed)
        row_ends = {}
        ends = self.ends_row(slots)
        if ends.any():
            row_ends = self._row_ends(ends, positions, ancestors, self.padded_tokens(depth))
            positions = row_ends.pop("positions")
        n = positions.shape[1]
        if n not in self._offsets:
            self._offsets[n] = np.arange(n)
        return FedLayout(tokens=n, width=int(lengths.max()) + n, slots=slots, positions=positions,
                         columns=lengths[:, None] + self._offsets[n], lengths=lengths, **row_ends)

    def padded_tokens(self, depth: np.ndarray) -> int:
        """Tokens of a forward of nodes at ``depth`` (T,) that feeds row ends, inside the image:
        its nodes and the row ends of the most nodes whose slots can end a grid row together
        (their depths are congruent modulo the grid's width)."""
        key = depth.tobytes()
        if key not in self._padded_tokens:
            together = np.bincount(depth % self.width, minlength=self.width).max()
            self._padded_tokens[key] = len(depth) + int(together)
        return self._padded_tokens[key]

    @staticmethod
    def _row_ends(ends: np.ndarray, code_positions: np.ndarray, ancestors: np.ndarray,
                  padded: int) -> dict:
        """The fields of a layout in which every node whose slot ends a grid row (``ends``) has
        a row-end token right after its code, padded to ``padded`` tokens (to twice the nodes
        where more are needed, at the image's end)."""
        rows, nodes = ends.shape
        per_node = 1 + ends.astype(np.int64)
        after = per_node.cumsum(1)  # one past each node's last token
        first = after - per_node  # each node's code token
        needed = int(after[:, -1].max())
        tokens = padded if needed <= padded else 2 * nodes
        row_index = np.arange(rows)[:, None]
        token_node = np.zeros((rows, tokens), dtype=np.int64)
        real = np.zeros((rows, tokens), dtype=bool)
        row_end = np.zeros((rows, tokens), dtype=bool)
        token_node[row_index, first] = np.arange(nodes)
        real[row_index, first] = True
        end_rows, end_nodes = np.nonzero(ends)
        end_tokens = first[end_rows, end_nodes] + 1
        token_node[end_rows, end_tokens] = end_nodes
        real[end_rows, end_tokens] = row_end[end_rows, end_tokens] = True

        query, key = token_node[:, :, None], token_node[:, None, :]
        sees = ancestors[query, key]
        order = np.arange(tokens)
        own_row_end = (query == key) & (order[None, None, :] > order[None, :, None])  # hidden from its code
        sees &= ~own_row_end & real[:, :, None] & real[:, None, :]
        return {"positions": code_positions[row_index, token_node] + row_end, "token_node": token_node,
                "real": real, "row_end": row_end, "outputs": after - 1,
                "visible": sees | np.eye(tokens, dtype=bool)}
