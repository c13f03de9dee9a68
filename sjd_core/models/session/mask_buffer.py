"""The attention mask of every forward, kept between forwards and changed only where they differ.

One buffer ``(rows, 1, query_rows, capacity)`` in the mask's dtype: additive floats (0 = attend,
the dtype's most negative value = blocked, what transformers' eager and sdpa attention both
read) or booleans (True = attend). Between forwards every query row of row ``r`` is the same:
columns ``0 .. length_r - 1`` open (but a padded context's front), every column from
``length_r`` on blocked, whatever stale entries the cache holds there. A forward writes the
visibility among its fed tokens into their columns (:func:`write_block`) and attends through the
buffer's first query rows at the full capacity (``view``); a keep's ``settle`` then opens the
columns of the kept tokens and blocks the others, for every query row. Each of these writes only the fed
tokens' columns, through an index tensor, never the cached prefix. Plain autoregression of rows
in step keeps one code per row, all at one column (``open_column``): such columns are opened
together, in one slice write, before the buffer is next read or written, so that steps that
attend without the mask pay nothing for it; a step that reads the mask writes its own column
open in the one query row it reads (its block), so the next such step need not open it first.
"""

from __future__ import annotations

import torch

__all__ = ["MaskBuffer", "mask_values", "settle", "write_block"]


class MaskBuffer:
    """Attention mask of ``rows`` sequences for up to ``query_rows`` fed tokens.

    lengths: (rows,) columns each row holds when the buffer is made (open from the start).
    padding: (rows,) columns in front of a row's context that stay blocked (None: none).
    """

    def __init__(self, lengths: torch.Tensor, query_rows: int, capacity: int, dtype: torch.dtype,
                 device: torch.device, padding: torch.Tensor | None = None) -> None:
        self.dtype, self.device = dtype, device
        boolean = dtype == torch.bool
        self._open, self._blocked = (True, False) if boolean else (0.0, torch.finfo(dtype).min)
        self._opening: tuple[int, int] | None = None  # columns to open in every row: from, to
        self._first_query_behind = False  # whether some of them are not open in query row 0
        self._choices = tuple(torch.tensor(value, dtype=dtype, device=device)
                              for value in (self._open, self._blocked))
        columns = torch.arange(capacity, device=device)
        held = columns[None, :] < lengths.to(device)[:, None]
        if padding is not None:
            held &= columns[None, :] >= padding.to(device)[:, None]
        settled = self.values(held)
        self._set(settled[:, None, None, :].expand(-1, 1, query_rows, -1).contiguous())

    @property
    def buffer(self) -> torch.Tensor:
        """The mask (rows, 1, query_rows, capacity), every column opened so far included."""
        self._open_pending()
        return self._buffer

    @property
    def query_rows(self) -> int:
        return self._buffer.shape[2]

    @property
    def capacity(self) -> int:
        return self._buffer.shape[3]

    @property
    def choices(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The values (attend, blocked) of an additive mask; None for a boolean one."""
        return None if self.dtype == torch.bool else self._choices

    def values(self, allowed: torch.Tensor) -> torch.Tensor:
        """Booleans (True = may attend) as mask values of this buffer's dtype."""
        return mask_values(allowed, self.choices)

    def view(self, tokens: int) -> torch.Tensor:
        """The (rows, 1, tokens, capacity) mask of a forward feeding ``tokens`` tokens. A
        forward of one token reads query row 0 only: the columns ``open_column`` recorded are
        opened first only where some are not open there already."""
        if tokens > 1 or self._first_query_behind:
            self._open_pending()
        return self._buffer[:, :, :tokens]

    def settle(self, columns: torch.Tensor, kept: torch.Tensor) -> None:
        """:func:`settle` on this buffer."""
        settle(*self.settle_arguments(columns.shape[2]), columns, kept)

    def settle_arguments(self, n: int) -> tuple:
        """The buffer's tensors that :func:`settle` of ``n`` fed columns takes, before the
        columns and kept counts: its rows to write through, ``0 .. n - 1`` and its values."""
        return self._rows(), self._offsets(n), self.choices

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep only the rows ``index`` (in that order)."""
        self._set(self.buffer.index_select(0, index if index.device == self.device else index.to(self.device)))

    def reserve(self, query_rows: int, capacity: int) -> None:
        """Make room for ``query_rows`` fed tokens and ``capacity`` columns (a copy when it grows).

        Called between forwards, when every query row of a row is the same.
        """
        if query_rows <= self.query_rows and capacity <= self.capacity:
            return
        rows, _, old_queries, old_capacity = self.buffer.shape
        settled = self.buffer[:, :, :1, :]
        larger = torch.full((rows, 1, max(query_rows, old_queries), max(capacity, old_capacity)),
                            self._blocked, dtype=self.dtype, device=self.device)
        larger[:, :, :, :old_capacity] = settled
        self._set(larger)

    def open_column(self, column: int, open_in_first_query: bool = False) -> None:
        """Open ``column`` of every row to every query (a code each row keeps there at once);
        columns opened one after another are written together, when the buffer is next used.
        ``open_in_first_query``: the forward that fed the code wrote the column open in query
        row 0 already (see :meth:`view`)."""
        if self._opening is None or self._opening[1] != column:
            self._open_pending()
            self._opening = (column, column)
        self._opening = (self._opening[0], column + 1)
        self._first_query_behind |= not open_in_first_query

    def _rows(self) -> torch.Tensor:
        """The buffer's (rows, query_rows, capacity) view to write through, every column opened
        so far included (the host's pending openings written first)."""
        self._open_pending()
        return self._by_row

    def _open_pending(self) -> None:
        """Write the columns ``open_column`` recorded, in one slice."""
        if self._opening is not None:
            start, end = self._opening
            self._opening, self._first_query_behind = None, False
            self._buffer[..., start:end] = self._open

    def _set(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer
        self._by_row = buffer[:, 0]
        self._ranges: dict[int, torch.Tensor] = {}

    def _offsets(self, n: int) -> torch.Tensor:
        """``0 .. n - 1`` shaped (1, 1, n), made once per n."""
        if n not in self._ranges:
            self._ranges[n] = torch.arange(n, device=self.device).view(1, 1, n)
        return self._ranges[n]


def mask_values(allowed: torch.Tensor, choices: tuple[torch.Tensor, torch.Tensor] | None
                ) -> torch.Tensor:
    """Booleans (True = may attend) as mask values: themselves for a boolean mask (``choices``
    None), else the additive ``choices`` (attend, blocked)."""
    if choices is None:
        return allowed
    return torch.where(allowed, *choices)


def settle(rows: torch.Tensor, offsets: torch.Tensor,
           choices: tuple[torch.Tensor, torch.Tensor] | None, columns: torch.Tensor,
           kept: torch.Tensor) -> None:
    """After a keep: the first ``kept[r]`` of the fed columns (rows, 1, n) stay open to every
    later query of row ``r``; the rest are blocked. ``rows``, ``offsets``, ``choices``: the
    buffer's (:meth:`MaskBuffer.settle_arguments`), so that this can run in a compiled stage."""
    queries = rows.shape[1]
    values = mask_values(offsets < kept.view(-1, 1, 1), choices)
    rows.scatter_(2, columns.expand(-1, queries, -1), values.expand(-1, queries, -1))


def write_block(mask: torch.Tensor, columns: torch.Tensor, block: torch.Tensor) -> None:
    """Into a forward's ``mask`` (rows, 1, n, capacity; :meth:`MaskBuffer.view`): token ``i`` of
    row ``r`` sits at column ``columns[r, i]`` (rows, n), and ``block`` (rows or 1, n, n) mask
    values say what each of them sees of the others."""
    rows, n = columns.shape
    mask[:, 0].scatter_(2, columns[:, None].expand(-1, n, -1), block.expand(rows, -1, -1))
