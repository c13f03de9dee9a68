"""Preallocated keys and values of every attention layer, written and compacted in place.

A layer's storage is one buffer ``(2, rows, heads, capacity, head_dim)``: its keys, then its
values. It is allocated at the layer's first write, on the device and in the dtype of what the
layer writes, so layers that an accelerate ``device_map`` runs elsewhere keep their cache there.
Row ``r`` holds its entries in columns ``0 .. length_r - 1``; columns past that hold stale but
finite values that the attention mask blocks.

Per forward the session says where the new entries go (``plan``: a column per row and fed token,
rows may differ) and how many columns attention reads (``width``); each layer then writes its new
entries in place (one slice copy when every row writes the same columns, an indexed write
otherwise) and reads views of its buffers. ``compact`` moves entries within rows (keeping an
accepted path). Both touch only the columns they are given, so their cost does not grow with the
cached prefix; ``select_rows`` and ``reserve`` copy the whole cache once.
"""

from __future__ import annotations

import torch

from .transfer import to_device

__all__ = ["KVStore"]


class KVStore:
    """The key/value cache of ``rows`` sequences, ``capacity`` columns each, for any number of layers."""

    def __init__(self, rows: int, capacity: int) -> None:
        self.rows, self.capacity = rows, capacity
        self.width = 0
        self._buffers: list[torch.Tensor | None] = []  # per layer: (2, rows, heads, capacity, dim)
        self._views: list[tuple[torch.Tensor, torch.Tensor] | None] = []  # per layer: its keys, values
        self._columns: torch.Tensor | None = None
        self._first: int | None = None  # where every row's new entries start, when rows agree
        self._write_indices: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def plan(self, columns: torch.Tensor | None, width: int, first: int | None = None) -> None:
        """The next write puts token ``i`` of row ``r`` at column ``columns[r, i]``; layers then
        read columns ``0 .. width - 1``. ``first``: when every row writes columns ``first,
        first + 1, ...`` (the caller knows it on the host), so that one slice takes the write
        (``columns`` may then be None)."""
        self._columns, self.width, self._first = columns, width, first
        self._write_indices.clear()

    def update(self, layer: int, keys: torch.Tensor, values: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write a layer's new (rows, heads, tokens, dim) keys and values; return its cached views."""
        cached_keys, cached_values = self._layer(layer, keys, values)
        if self._first is not None:
            written = slice(self._first, self._first + keys.shape[2])
            cached_keys[:, :, written] = keys
            cached_values[:, :, written] = values
            return cached_keys[:, :, : self.width], cached_values[:, :, : self.width]
        rows, columns = self._write_index(keys.device)
        cached_keys[rows, :, columns] = keys.transpose(1, 2)
        cached_values[rows, :, columns] = values.transpose(1, 2)
        return cached_keys[:, :, : self.width], cached_values[:, :, : self.width]

    def compact(self, source: torch.Tensor, target: torch.Tensor) -> None:
        """In every row, move the entries at columns ``source`` (rows, n) to columns ``target``.

        Each entry moves as a whole (its ``dim`` values at once), one indexed copy per layer.
        """
        indices: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        for buffer in self._buffers:
            if buffer is None:
                continue
            if buffer.device not in indices:
                rows = torch.arange(source.shape[0], device=buffer.device)[:, None]
                indices[buffer.device] = (rows, to_device(source, buffer.device),
                                          to_device(target, buffer.device))
            rows, take, put = indices[buffer.device]
            buffer[:, rows, :, put] = buffer[:, rows, :, take]

    def compact_columns(self, source: torch.Tensor, target: torch.Tensor) -> None:
        """``compact`` where every row moves the same columns ``source`` (n,) to ``target`` (n,):
        one selection and one indexed copy per layer over all rows at once."""
        for buffer in self._buffers:
            if buffer is not None:
                buffer.index_copy_(3, to_device(target, buffer.device),
                                   buffer.index_select(3, to_device(source, buffer.device)))

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep only the rows ``index`` (in that order)."""
        self._set([None if b is None else b.index_select(1, index if index.device == b.device else index.to(b.device)) for b in self._buffers])
        self.rows = index.shape[0]

    def reserve(self, capacity: int) -> None:
        """Make room for ``capacity`` columns per row (a copy of the cache when it grows)."""
        if capacity <= self.capacity:
            return
        grown = []
        for buffer in self._buffers:
            if buffer is not None:
                larger = buffer.new_zeros((*buffer.shape[:3], capacity, buffer.shape[4]))
                larger[:, :, :, : self.capacity] = buffer
                buffer = larger
            grown.append(buffer)
        self._set(grown)
        self.capacity = capacity

    def _set(self, buffers: list[torch.Tensor | None]) -> None:
        self._buffers = buffers
        self._views = [None if b is None else (b[0], b[1]) for b in buffers]

    def _layer(self, layer: int, keys: torch.Tensor, values: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's (keys, values) buffers, allocated like ``keys`` at its first write."""
        if layer < len(self._views) and self._views[layer] is not None:
            return self._views[layer]
        if keys.shape != values.shape or keys.dtype != values.dtype:
            raise ValueError(f"layer {layer} writes keys {tuple(keys.shape)} {keys.dtype} and "
                             f"values {tuple(values.shape)} {values.dtype}: this cache stores "
                             "keys and values of the same shape and dtype together.")
        buffers = self._buffers + [None] * (layer + 1 - len(self._buffers))
        rows, heads, _, dim = keys.shape
        buffers[layer] = keys.new_zeros((2, rows, heads, self.capacity, dim))
        self._set(buffers)
        return self._views[layer]

    def _write_index(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, 1) row numbers and the planned (rows, n) columns on ``device``, which index a
        layer's (rows, heads, capacity, dim) buffer at every new entry; made once per forward
        and device."""
        if device not in self._write_indices:
            rows = torch.arange(self._columns.shape[0], device=device)[:, None]
            self._write_indices[device] = (rows, to_device(self._columns, device))
        return self._write_indices[device]
