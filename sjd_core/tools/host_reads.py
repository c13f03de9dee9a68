"""Counting what makes the host wait on the device: values read back, and copies from the host
that the host waits for (see :class:`HostReads`)."""

from __future__ import annotations

import sys
import time
import weakref
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

from ..transfer import host_to_device, pack

__all__ = ["HostReads"]

_ONE_PATH = (host_to_device.__code__, pack.__code__)  # host data's way to the device


class HostReads(TorchFunctionMode):
    """Counts tensor operations that read values back to the host (or depend on them), and
    host-to-device copies the host waits for; sums the seconds spent in the reads (on a GPU, the
    host waiting for the device).

    A copy from the host is ``Tensor.to``/``cuda``/``copy_`` from host memory to the device, host
    data made into a device tensor (``torch.tensor(data, device=...)``, ``as_tensor``,
    ``asarray``, ``new_tensor``), or a host tensor (not a single number) used in an operation
    with device tensors (on CUDA an index copied over, or an error). It does not block when it is
    ``non_blocking`` from pinned memory, and nothing inside :func:`sjd_core.transfer.host_to_device`
    or :func:`~sjd_core.transfer.pack` (the one path for host data) counts.

    Which memory is the host's:

    - by default, the CPU's: copies count only to another device, and a run on the CPU shows
      none. Every read counts, whatever the device (a GPU run reads few host tensors), but a
      CPU tensor moved to a ``torch.device`` naming the CPU is not read (on a CPU run that is
      the run's own device, as ``to_device`` passes it; ``.cpu()`` and ``.to("cpu")`` read),
      and numpy's view of a tensor is a read only off the CPU (another device's cannot be
      viewed at all).
    - with ``cpu_is_device``, for runs on the CPU that must still see what would make a GPU run
      wait: the CPU stands for the device, and a tensor is host memory only where the counted
      code made it so: from host data without a device (``torch.tensor(data)``,
      ``torch.from_numpy``...), by a factory without a device (``torch.arange(n)``), moved with
      ``.cpu()`` or ``.to("cpu")`` (the string; a ``torch.device`` names the device), or by
      operations on host tensors only. Tensors made before counting started are device tensors.
      Reads of host tensors do not count, and numpy's view of a device tensor is a read.
    """

    READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero",
             "masked_select", "unique", "argwhere"}
    VIEWS = {"numpy", "__array__"}
    COPIES = {"to", "cuda", "cpu", "copy_"}
    FROM_HOST_DATA = {"tensor", "as_tensor", "asarray", "new_tensor"}

    def __init__(self, cpu_is_device: bool = False) -> None:
        super().__init__()
        self.cpu_is_device = cpu_is_device
        self.count = 0
        self.blocking_copies = 0
        self.read_seconds = 0.0
        self._host: dict[int, weakref.ref] = {}  # with cpu_is_device: the host tensors, by id
        self._from_numpy = torch.from_numpy

    # ------------------------------------------------------------------ the mode
    def __enter__(self) -> "HostReads":
        if self.cpu_is_device:  # torch.from_numpy bypasses torch function modes
            self._from_numpy = torch.from_numpy
            torch.from_numpy = self._tagged_from_numpy
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        if self.cpu_is_device:
            torch.from_numpy = self._from_numpy
        return super().__exit__(*exc)

    def _tagged_from_numpy(self, array):
        tensor = self._from_numpy(array)
        if not _inside_host_to_device():
            self._mark_host(tensor)
        return tensor

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in self.COPIES:
            return self._copy(func, name, args, kwargs)
        if name in self.FROM_HOST_DATA:
            return self._from_host_data(func, name, args, kwargs)
        inputs = [a for a in _flatten((args, kwargs)) if isinstance(a, torch.Tensor)]
        if self._mixes_host_and_device(inputs) and not _inside_host_to_device():
            self.blocking_copies += 1
        if self._reads(name, args):
            result = self._timed(func, args, kwargs)
        else:
            result = func(*args, **kwargs)
        if self.cpu_is_device:
            self._propagate(inputs, kwargs, result)
        return result

    # ------------------------------------------------------------------ what counts
    def _reads(self, name: str, args: tuple) -> bool:
        """Whether the operation needs values of a device tensor on the host."""
        if name == "__getitem__":
            masks = [a for a in _flatten(args[1:])
                     if isinstance(a, torch.Tensor) and a.dtype == torch.bool]
            return any(self._read_from(mask) for mask in masks)
        if name in self.READS:
            return self._read_from(args[0])
        if name in self.VIEWS:
            device_side = not self._is_host(args[0]) if self.cpu_is_device else \
                args[0].device.type != "cpu"
            return device_side
        return False

    def _copy(self, func, name: str, args: tuple, kwargs: dict):
        """``to``, ``cuda``, ``cpu`` and ``copy_``: a blocking copy from the host, a read to it,
        or neither."""
        if name == "copy_":
            target, source = args[0], args[1]
            to_host = self._is_host(target)
            non_blocking = kwargs.get("non_blocking", False) or (len(args) > 2 and bool(args[2]))
        else:
            source = args[0]
            to_host = self._target_is_host(name, args, kwargs)
            non_blocking = kwargs.get("non_blocking", False)
        from_host = isinstance(source, torch.Tensor) and self._is_host(source)
        if from_host and to_host is False and not (non_blocking and source.is_pinned()) \
                and not _inside_host_to_device():
            self.blocking_copies += 1
        # by default every move to the CPU reads (as ``cpu`` always has); a copy_ reads only
        # from the device
        if to_host and (not from_host or (not self.cpu_is_device and name != "copy_")):
            result = self._timed(func, args, kwargs)
        else:
            result = func(*args, **kwargs)
        if self.cpu_is_device and name != "copy_":
            result = self._on_side(result, source, to_host if to_host is not None else from_host)
        return result

    def _from_host_data(self, func, name: str, args: tuple, kwargs: dict):
        """``torch.tensor``/``as_tensor``/``asarray`` and ``Tensor.new_tensor``: a blocking copy
        when host data becomes a device tensor."""
        data = args[1] if name == "new_tensor" else args[0]
        host_data = not isinstance(data, torch.Tensor) or self._is_host(data)
        device = kwargs.get("device")
        if device is None and name == "as_tensor" and len(args) > 2:
            device = args[2]
        if device is not None:
            to_host = self._names_host(device, data)
        elif name == "new_tensor":
            to_host = self._is_host(args[0])
        else:  # no device: the data's own (host data stays on the host)
            to_host = host_data
        if to_host is None:
            to_host = host_data
        if host_data and not to_host and not _inside_host_to_device():
            self.blocking_copies += 1
        result = func(*args, **kwargs)
        if self.cpu_is_device:
            result = self._on_side(result, data, to_host and not _inside_host_to_device())
        return result

    def _mixes_host_and_device(self, inputs: list[torch.Tensor]) -> bool:
        """Whether a host tensor (not a single number) meets a device tensor."""
        host = [self._is_host(tensor) for tensor in inputs]
        return not all(host) and any(is_host and tensor.dim() > 0
                                     for is_host, tensor in zip(host, inputs))

    def _read_from(self, tensor: torch.Tensor) -> bool:
        return not self.cpu_is_device or not self._is_host(tensor)

    def _timed(self, func, args: tuple, kwargs: dict):
        """Run a read, counted and timed."""
        self.count += 1
        started = time.perf_counter()
        result = func(*args, **kwargs)
        self.read_seconds += time.perf_counter() - started
        return result

    # ------------------------------------------------------------------ host or device
    def _is_host(self, tensor: torch.Tensor) -> bool:
        if not self.cpu_is_device:
            return tensor.device.type == "cpu"
        known = self._host.get(id(tensor))
        return known is not None and known() is tensor

    def _names_host(self, device: torch.device | str, source) -> bool | None:
        """Whether moving ``source`` to ``device`` goes to the host (True), to the device (False)
        or nowhere (None).

        With ``cpu_is_device`` only the string "cpu" names the host. By default the CPU is the
        host, but a ``torch.device`` naming it for a CPU source moves nothing: on a CPU run that
        is the run's own device (as ``to_device`` passes it), which a GPU run would not read back.
        """
        if self.cpu_is_device:
            return isinstance(device, str) and device.startswith("cpu")
        if torch.device(device).type != "cpu":
            return False
        on_cpu = not isinstance(source, torch.Tensor) or source.device.type == "cpu"
        return True if isinstance(device, str) or not on_cpu else None

    def _target_is_host(self, name: str, args: tuple, kwargs: dict) -> bool | None:
        """Where ``to``/``cuda``/``cpu`` moves a tensor: the host (True), the device (False), or
        nowhere (None: ``to`` of a dtype only)."""
        if name == "cpu":
            return True
        if name == "cuda":
            return False
        target = kwargs.get("device")
        for value in args[1:]:
            if isinstance(value, (str, torch.device)):
                target = value
            elif isinstance(value, torch.Tensor):
                return self._is_host(value)
        return None if target is None else self._names_host(target, args[0])

    def _on_side(self, result: torch.Tensor, source, host: bool) -> torch.Tensor:
        """``result`` marked as host memory or as the device's. On the CPU a move returns its
        source itself where nothing changes: then an alias, so that the source keeps its side."""
        if result is source and self._is_host(source) != host:
            result = result.view_as(result)
        if host:
            self._mark_host(result)
        return result

    def _mark_host(self, result) -> None:
        for tensor in _flatten((result,)):
            if isinstance(tensor, torch.Tensor):
                self._host[id(tensor)] = weakref.ref(tensor)

    def _propagate(self, inputs: list[torch.Tensor], kwargs: dict, result) -> None:
        """Results of operations on host tensors only, and of factories without a device, are
        host tensors."""
        if inputs:
            on_host = all(self._is_host(tensor) for tensor in inputs)
        else:
            device = kwargs.get("device")
            on_host = device is None or bool(self._names_host(device, None))
        if on_host:
            self._mark_host(result)


def _inside_host_to_device() -> bool:
    """Whether the caller runs inside :func:`sjd_core.transfer.host_to_device` or
    :func:`~sjd_core.transfer.pack`."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in _ONE_PATH:
            return True
        frame = frame.f_back
    return False


def _flatten(items) -> Iterator:
    for item in items:
        if isinstance(item, (tuple, list)):
            yield from _flatten(item)
        elif isinstance(item, dict):
            yield from _flatten(item.values())
        else:
            yield item
