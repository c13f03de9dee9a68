"""Getting tensors where the decoding needs them without waiting for the device.

They run on the hot path of every iteration: a tensor already in place is returned as it is, and
host data reaches the device in one copy that the host does not wait for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["Packed", "host_to_device", "pack", "to_device"]


def to_device(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``tensor`` on ``device`` (and in ``dtype`` when given), copied only when it is elsewhere."""
    if tensor.device == device and (dtype is None or tensor.dtype == dtype):
        return tensor
    return tensor.to(device, dtype)


@dataclass(frozen=True)
class Packed:
    """Host arrays on the device as one int64 tensor, ``flat``: each array a view of it, made
    where it is read (:meth:`part`), so that inside a compiled region the views are part of its
    graph instead of operations the host dispatches before the call.

    parts: per array, in order, its name, its shape and whether it holds booleans."""

    flat: torch.Tensor
    parts: tuple[tuple[str, tuple[int, ...], bool], ...]

    def part(self, name: str) -> torch.Tensor | None:
        """The array ``name`` (booleans as booleans), or None where none was packed."""
        start = 0
        for own, shape, boolean in self.parts:
            size = math.prod(shape)
            if own == name:
                values = self.flat[start:start + size].view(shape)
                return values.bool() if boolean else values
            start += size
        return None


def pack(arrays: dict[str, np.ndarray], device: torch.device) -> Packed:
    """Host integer or boolean ``arrays`` on ``device`` in one copy (:class:`Packed`): shared
    with the host on the CPU, asynchronous from pinned memory on CUDA."""
    flat = torch.from_numpy(np.concatenate([array.astype(np.int64, copy=False).ravel()
                                            for array in arrays.values()]))
    if device.type == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)
    elif device.type != "cpu":
        flat = flat.to(device)
    return Packed(flat, tuple((name, array.shape, array.dtype == bool)
                              for name, array in arrays.items()))


def host_to_device(arrays: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    """Host arrays as tensors on ``device`` (booleans stay booleans, integers become int64).

    The CPU shares the arrays' memory; another device gets them in one copy (:func:`pack`).
    """
    if device.type == "cpu":
        return {name: torch.from_numpy(array) for name, array in arrays.items()}
    packed = pack(arrays, device)
    return {name: packed.part(name) for name in arrays}
