"""Counting what makes the host wait on the device: values read back, and copies from the host
that the host waits for (see :class:`HostReads`)."""

from __future__ import annotations

import time

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["HostReads"]


class HostReads(TorchFunctionMode):
    """Counts tensor operations that read values back to the host (or depend on them), and
    host-to-device copies the host waits for; sums the seconds spent in the reads (on a GPU, the
    host waiting for the device).

    numpy's view of a tensor counts only off the CPU: a CPU tensor's memory is the host's, and
    another device's cannot be viewed at all. A copy from the host does not block when it is
    ``non_blocking`` from pinned memory.
    """

    READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu",
             "masked_select", "unique", "argwhere", "__len__"}
    VIEWS = {"numpy", "__array__"}
    COPIES = {"to", "cuda", "copy_"}

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.blocking_copies = 0
        self.read_seconds = 0.0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        boolean_index = name == "__getitem__" and any(
            isinstance(a, torch.Tensor) and a.dtype == torch.bool for a in _flatten(args[1:]))
        moves_to_host = name == "to" and any(str(a).startswith("cpu") for a in args[1:])
        viewed_off_the_cpu = name in self.VIEWS and args[0].device.type != "cpu"
        if name in self.COPIES and _blocks_the_host(name, args, kwargs):
            self.blocking_copies += 1
        if name in self.READS or boolean_index or moves_to_host or viewed_off_the_cpu:
            self.count += 1
            started = time.perf_counter()
            result = func(*args, **kwargs)
            self.read_seconds += time.perf_counter() - started
            return result
        return func(*args, **kwargs)


def _blocks_the_host(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether ``Tensor.to``/``cuda``/``copy_`` moves host memory to a device and waits for it."""
    if name == "copy_":
        target, source = args[0], args[1]
        device = target.device
    else:
        source = args[0]
        device = kwargs.get("device")
        if name == "cuda":
            device = device if device is not None else "cuda"
        for value in args[1:]:
            if isinstance(value, (str, torch.device)):
                device = value
            elif isinstance(value, torch.Tensor):
                device = value.device
    if not isinstance(source, torch.Tensor) or source.device.type != "cpu" or device is None:
        return False
    if torch.device(device).type == "cpu":
        return False
    non_blocking = kwargs.get("non_blocking", False) or (name == "copy_" and len(args) > 2
                                                        and bool(args[2]))
    return not (non_blocking and source.is_pinned())


def _flatten(items):
    for item in items:
        if isinstance(item, (tuple, list)):
            yield from _flatten(item)
        else:
            yield item
