"""Preallocated keys and values of every attention layer, written and compacted in place.

A layer's storage is one buffer ``(2, rows, heads, capacity, head_dim)``: its keys, then its
values. It is allocated at the layer's first write, on the device and in the dtype of what the
layer writes, so layers that an accelerate ``device_map`` runs elsewhere keep their cache there.
After the forward in which the layers first write, :meth:`KVStore.join` moves the layers that
share a device, dtype and shape into one tensor ``(layers, 2, rows, heads, capacity, head_dim)``,
whose slices the layers then use, so that moving or selecting entries is one operation for all of
them instead of one per layer.
Row ``r`` holds its entries in columns ``0 .. length_r - 1``; columns past that hold stale but
finite values (zeros before their first write) that the attention mask blocks.

Per forward the session says where the new entries go (``plan``: a column per row and fed token,
rows may differ, as a tensor) and how many leading columns the forward attends over; each layer
then writes its new entries in place with one indexed write (or, where the session knows the
rows' tokens start at one column, one slice) and attends over those columns of its buffers under
the mask. Most forwards attend over every column of the capacity, so that the shapes inside the
network depend only on the fed shape (rows, tokens), never on how much is cached (see the
session's ``_attention``). :func:`compact` and :func:`compact_columns` move entries within
rows (keeping an accepted path) and touch only the columns they are given: functions of the
store's ``buffers()``, so that they can run inside a compiled stage; ``select_rows`` and
``reserve`` copy the whole cache once.
"""

from __future__ import annotations

import torch

from ...transfer import to_device

__all__ = ["KVStore", "compact", "compact_columns"]


class KVStore:
    """The key/value cache of ``rows`` sequences, ``capacity`` columns each, for any number of layers."""

    def __init__(self, rows: int, capacity: int) -> None:
        self.rows, self.capacity = rows, capacity
        # the storage: tensors (layers, 2, rows, heads, capacity, dim), and where each layer sits
        # in them (group, index; None before its first write)
        self._groups: list[torch.Tensor] = []
        self._places: list[tuple[int, int] | None] = []
        self._views: list[tuple[torch.Tensor, torch.Tensor] | None] = []  # per layer: keys, values
        self._columns: torch.Tensor | None = None
        self._attended = capacity  # leading columns the next forward attends over
        self._first: int | None = None  # where a slice write starts (see plan)
        self._apart = False  # whether some layer was allocated since the last join
        self._write_indices: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def plan(self, columns: torch.Tensor | None, attended: int, first: int | None = None) -> None:
        """The next write puts token ``i`` of row ``r`` at column ``columns[r, i]`` (rows,
        tokens), and the forward attends over the first ``attended`` columns. ``first``: the
        column where every row's tokens start, one after another, when the caller knows it on
        the host (a slice write then replaces the indexed one; ``columns`` may then be None)."""
        self._columns, self._attended, self._first = columns, attended, first
        self._write_indices.clear()

    def update(self, layer: int, keys: torch.Tensor, values: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write a layer's new (rows, heads, tokens, dim) keys and values at the planned columns;
        return its (rows, heads, attended, dim) buffers (see ``plan``)."""
        cached_keys, cached_values = self._layer(layer, keys, values)
        if self._first is not None:
            written = slice(self._first, self._first + keys.shape[2])
            cached_keys[:, :, written], cached_values[:, :, written] = keys, values
        else:
            rows, columns = self._write_index(keys.device)
            cached_keys[rows, :, columns] = keys.transpose(1, 2)
            cached_values[rows, :, columns] = values.transpose(1, 2)
        return cached_keys[:, :, :self._attended], cached_values[:, :, :self._attended]

    @property
    def settled(self) -> bool:
        """Whether the layers have their storage, joined: from then on a forward allocates
        nothing and takes no branch that an earlier one did not (what compiling needs)."""
        return bool(self._groups) and not self._apart

    def buffers(self) -> tuple[torch.Tensor, ...]:
        """The tensors holding every layer's entries: what the network writes in place (a new
        tensor here means a new address)."""
        return tuple(self._groups)

    def join(self) -> None:
        """Move the layers held apart that share a device, dtype and shape into one tensor.

        Called after every forward (nothing to do unless a layer was allocated since the last
        call). Each layer is copied in and its own buffer let go before the next, so the cache
        never needs twice its memory.
        """
        if not self._apart:
            return
        self._apart = False
        apart: dict[tuple, list[int]] = {}
        for layer, place in enumerate(self._places):
            if place is not None and self._groups[place[0]].shape[0] == 1:
                group = self._groups[place[0]]
                apart.setdefault((group.device, group.dtype, group.shape), []).append(layer)
        for layers in apart.values():
            if len(layers) < 2:
                continue
            first = self._groups[self._places[layers[0]][0]]
            joined = first.new_empty((len(layers), *first.shape[1:]))
            for index, layer in enumerate(layers):
                group = self._places[layer][0]
                joined[index] = self._groups[group][0]
                self._groups[group] = joined  # the layer's own buffer and views are let go
                self._places[layer] = (group, index)
                self._views[layer] = (joined[index, 0], joined[index, 1])
        self._set(self._groups)

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep only the rows ``index`` (in that order)."""
        self._set([group.index_select(2, to_device(index, group.device)) for group in self._groups])
        self.rows = index.shape[0]

    def reserve(self, capacity: int) -> None:
        """Make room for ``capacity`` columns per row (a copy of the cache when it grows)."""
        if capacity <= self.capacity:
            return
        grown = []
        for group in self._groups:
            larger = group.new_zeros((*group.shape[:4], capacity, group.shape[5]))
            larger[:, :, :, :, : self.capacity] = group
            grown.append(larger)
        self._set(grown)
        self.capacity = capacity

    def _set(self, groups: list[torch.Tensor]) -> None:
        """Use ``groups`` (one tensor per group, some possibly named twice after a join) and
        point every layer at its slice."""
        distinct = {id(group): group for group in groups}
        number = {key: n for n, key in enumerate(distinct)}
        self._groups = list(distinct.values())
        self._places = [None if place is None else (number[id(groups[place[0]])], place[1])
                        for place in self._places]
        self._views = [None if place is None else
                       (self._groups[place[0]][place[1], 0], self._groups[place[0]][place[1], 1])
                       for place in self._places]

    def _layer(self, layer: int, keys: torch.Tensor, values: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's (keys, values) buffers, allocated like ``keys`` at its first write."""
        if layer < len(self._views) and self._views[layer] is not None:
            return self._views[layer]
        if keys.shape != values.shape or keys.dtype != values.dtype:
            raise ValueError(f"layer {layer} writes keys {tuple(keys.shape)} {keys.dtype} and "
                             f"values {tuple(values.shape)} {values.dtype}: this cache stores "
                             "keys and values of the same shape and dtype together.")
        missing = layer + 1 - len(self._places)
        self._places += [None] * max(0, missing)
        rows, heads, _, dim = keys.shape
        self._places[layer] = (len(self._groups), 0)
        self._apart = True
        self._set(self._groups + [keys.new_zeros((1, 2, rows, heads, self.capacity, dim))])
        return self._views[layer]

    def _write_index(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, 1) row numbers and the planned (rows, n) columns on ``device``, which index a
        layer's (rows, heads, capacity, dim) buffer at every new entry; made once per forward
        and device."""
        if device not in self._write_indices:
            rows = torch.arange(self._columns.shape[0], device=device)[:, None]
            self._write_indices[device] = (rows, to_device(self._columns, device))
        return self._write_indices[device]


def compact(groups: tuple[torch.Tensor, ...], source: torch.Tensor, target: torch.Tensor) -> None:
    """In every row of the store's ``groups`` (``KVStore.buffers()``), move the entries at
    columns ``source`` (rows, n) to columns ``target``.

    Each entry moves as a whole (its ``dim`` values at once), one indexed copy per group of
    layers.
    """
    indices: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    for group in groups:
        if group.device not in indices:
            rows = torch.arange(source.shape[0], device=group.device)[:, None]
            indices[group.device] = (rows, to_device(source, group.device),
                                     to_device(target, group.device))
        rows, take, put = indices[group.device]
        group[:, :, rows, :, put] = group[:, :, rows, :, take]


def compact_columns(groups: tuple[torch.Tensor, ...], source: torch.Tensor,
                    target: torch.Tensor) -> None:
    """:func:`compact` where every row moves the same columns ``source`` (n,) to ``target``
    (n,): one selection and one indexed copy per group of layers, over all rows at once."""
    for group in groups:
        group.index_copy_(4, to_device(target, group.device),
                          group.index_select(4, to_device(source, group.device)))
