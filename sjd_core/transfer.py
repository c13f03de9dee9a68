"""Getting tensors where the decoding needs them without waiting for the device.

Both run on the hot path of every iteration: a tensor already in place is returned as it is, and
host data reaches the device in one copy that the host does not wait for.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["host_to_device", "to_device"]


def to_device(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``tensor`` on ``device`` (and in ``dtype`` when given), copied only when it is elsewhere."""
    if tensor.device == device and (dtype is None or tensor.dtype == dtype):
        return tensor
    return tensor.to(device, dtype)


def host_to_device(arrays: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    """Host arrays as tensors on ``device`` (booleans stay booleans, integers become int64).

    The CPU shares the arrays' memory; another device gets them in one copy, asynchronous from
    pinned memory on CUDA.
    """
    if device.type == "cpu":
        return {name: torch.from_numpy(array) for name, array in arrays.items()}
    flat = torch.from_numpy(np.concatenate([array.astype(np.int64).ravel() for array in arrays.values()]))
    sent = flat.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else flat.to(device)
    parts = sent.split([array.size for array in arrays.values()])
    return {name: part.view(array.shape).to(torch.bool if array.dtype == bool else torch.int64)
            for part, (name, array) in zip(parts, arrays.items())}
