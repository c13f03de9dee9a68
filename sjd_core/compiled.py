"""Compiled decoding: the session's network per fed shape, and (where asked) the engine's
speculative stages, through torch's public API.

One function, :func:`backend`, decides how compiled code runs on a device:

- ``"cuda graphs"`` on CUDA: the network's eager kernels recorded as one CUDA graph per fed
  shape (:class:`CapturedNetwork`): one launch instead of one per kernel, which is what a
  decoding step of a large model is bound by; measured on a GPU (``docs/speed.md``). The stages,
  where ``compile_stages`` asks for them, compile with inductor in its CUDA-graph mode
  (``mode="reduce-overhead"``), not yet measured on a GPU, so opt-in.
- ``"inductor"`` elsewhere (:class:`CompiledNetwork`, :class:`CompiledStages`): ``torch.compile``
  with torch's automatic dynamic shapes: a function compiles for the sizes of its first call, and
  the first call whose sizes differ compiles one graph in which the sizes that changed are
  symbolic; that graph then serves every later length (windows, trees, rows leaving the batch).
  So a generation that feeds many shapes compiles a few graphs, not one per shape.

The session keeps every shape inside the network a function of the fed shape alone (see
:mod:`.models.session.slot_session`) and passes every tensor that changes between forwards as an
argument.

Compiling must never cost a generation: when compiling, recording or running a graph raises
anything, the call is repeated eagerly and every later call runs eagerly too, with one warning
for the run's summary. Repeating the call is safe: the network only writes the fed tokens' keys
and values at their planned columns, which the eager run writes again; a stage writes the same
values again. Past torch's own limit of graphs per function (``recompile_limit``), torch runs the
function uncompiled and logs a warning of its own; automatic dynamic shapes keep a process far
below it.

Inductor's graphs outlive a generation (torch keeps them per function), so a later generation of
the same shapes does not compile again. CUDA graphs belong to their generation (the network's
hold its session's cache addresses) and are recorded again by the next one, in about the time of
an eager call each; at most ``MAX_CAPTURED_SHAPES`` per generation (each holds memory of its
own), later shapes run eagerly.
"""
from __future__ import annotations

import time
import types
from collections.abc import Callable, Hashable, Sequence

import torch

from .messages import first_line

__all__ = ["MAX_CAPTURED_SHAPES", "CapturedNetwork", "CompiledNetwork", "CompiledStages",
           "backend", "compile_network", "compile_stages"]

MAX_CAPTURED_SHAPES = 8  # CUDA graphs recorded per generation; later shapes run eagerly

Network = Callable[..., torch.Tensor]  # (inputs, layout, mask, block) -> logits


def backend(device: torch.device) -> str:
    """How compiled code runs on ``device``: ``"cuda graphs"`` on CUDA, ``"inductor"`` elsewhere
    (see the module)."""
    return "cuda graphs" if device.type == "cuda" else "inductor"


def compile_network(network: Network, device: torch.device, ready: Callable[[], bool],
                    buffers: Callable[[], tuple[torch.Tensor, ...]]
                    ) -> CapturedNetwork | CompiledNetwork:
    """``network`` compiled for ``device`` (:func:`backend`); eager until ``ready()``.
    ``buffers()``: the tensors it writes in place, whose addresses a CUDA graph holds."""
    if backend(device) == "cuda graphs":
        return CapturedNetwork(network, device, ready, buffers)
    return CompiledNetwork(network, ready)


def compile_stages(device: torch.device) -> CompiledStages:
    """What runs the engine's stages compiled on ``device``: inductor, in its CUDA-graph mode on
    CUDA (:func:`backend`)."""
    return CompiledStages("reduce-overhead" if backend(device) == "cuda graphs" else None)


def _failure(error: Exception, setting: str = "compile=True", what: str = "the network",
             step: str = "torch.compile") -> str:
    """The warning for a run whose ``step`` (compiling, or recording a CUDA graph) of ``what``
    failed with ``error``."""
    return (f"{setting}: {step} failed ({type(error).__name__}: {first_line(error)}), "
            f"so {what} ran uncompiled for the rest of this generation (the same "
            "distribution, only slower)")


class _PerShape:
    """What every way of compiling keeps: the shapes run compiled (``shapes``), those run
    eagerly past a cap (``eager_shapes``), the calls that may have compiled (``compilations``:
    the first call of each shape in a generation; only those can compile or record), the
    failure; and which calls run eagerly."""

    def __init__(self, ready: Callable[[], bool], cap: int | None = None) -> None:
        self._ready, self._cap = ready, cap
        self.shapes: set[tuple] = set()
        self.eager_shapes: set[tuple] = set()
        self.failure: str | None = None
        self.on_first_call: Callable[[], None] | None = None  # told before a call that may compile
        self.first_call_seconds = 0.0  # seconds of the calls that may have compiled

    def report(self) -> dict:
        """What the trace records: shapes compiled and run eagerly, seconds of the calls that
        may have compiled, and the failure if any."""
        return {"compiled_shapes": len(self.shapes), "eager_shapes": len(self.eager_shapes),
                "compile_seconds": round(self.first_call_seconds, 3), "failure": self.failure}

    @property
    def compilations(self) -> int:
        """Calls that may have compiled: the first of each shape."""
        return len(self.shapes)

    def _first_call(self, shape: tuple, call: Callable[[], object]) -> object:
        """``call()``, booking ``shape`` as run compiled once it returned; where it is the first
        of ``shape`` (it may compile or record, seconds on a CPU), ``on_first_call`` is told
        first and its time counted in ``first_call_seconds``."""
        if shape in self.shapes:
            return call()
        if self.on_first_call is not None:
            self.on_first_call()
        started = time.perf_counter()
        result = call()
        self.first_call_seconds += time.perf_counter() - started
        self.shapes.add(shape)
        return result

    def _runs_eagerly(self, shape: tuple) -> bool:
        """Whether a call of ``shape`` runs uncompiled: after a failure, past the cap (recorded
        in ``eager_shapes``), or before ``ready()``."""
        if (self._cap is not None and shape not in self.shapes
                and len(self.shapes) >= self._cap):
            self.eager_shapes.add(shape)
        return self.failure is not None or shape in self.eager_shapes or not self._ready()


class CompiledNetwork(_PerShape):
    """``network(*tensors)`` compiled by inductor with automatic dynamic shapes (see the
    module), or eager: until ``ready()`` (a forward that allocates the cache would compile a path
    the later ones do not take), and after a failure.

    shapes: the graphs the calls that ran compiled went through, as torch picks them
    (:meth:`_graph_of`: sizes that changed are symbolic; inductor compiles again for other
    strides); ``compilations``: the first call of each (only those can compile, and each that
    does takes far longer than the network runs); ``failure``: why compiling stopped, a sentence
    for the run's warnings (None while it works).
    """

    def __init__(self, network: Network, ready: Callable[[], bool] = lambda: True) -> None:
        super().__init__(ready)
        self._eager = network
        self._first_shapes: dict[int, tuple[int, ...]] = {}  # per argument, its first shape
        self._varied: set[tuple[int, int]] = set()  # (argument, dimension) that changed size
        try:
            self._compiled = torch.compile(network, fullgraph=False)
        except Exception as error:  # torch.compile refuses this Python or platform
            self._compiled = None
            self.failure = _failure(error)

    def __call__(self, *tensors: torch.Tensor) -> torch.Tensor:
        shape = self._graph_of(tensors)
        if self._runs_eagerly(shape):
            return self._eager(*tensors)
        try:
            return self._first_call(shape, lambda: self._compiled(*tensors))
        except Exception as error:  # any failure of compiling falls back to eager
            self.failure = _failure(error)
            return self._eager(*tensors)

    def _graph_of(self, tensors: tuple[torch.Tensor, ...]) -> tuple:
        """The graph inductor runs ``tensors`` through, as its automatic dynamic shapes pick it:
        a graph already booked whose sizes they fit, else a new one of their layout
        (:func:`_layout_of`) in which every size that has differed from the first call's is
        symbolic (None) unless it is 0 or 1 (torch specialises those); a tensor with a symbolic
        size keeps only whether it is contiguous of its strides."""
        layout = _layout_of(tensors)
        booked = next((graph for graph in self.shapes if _serves(graph, layout, tensors)), None)
        if booked is not None:  # no size differs from its argument's first but symbolic ones
            return booked
        for argument, (shape, _) in enumerate(layout):  # torch keeps sizes per argument
            first_shape = self._first_shapes.setdefault(argument, shape)
            if len(shape) == len(first_shape):
                self._varied |= {(argument, dimension) for dimension, (size, first_size)
                                 in enumerate(zip(shape, first_shape)) if size != first_size}
        graph = []
        for argument, ((shape, strides), tensor) in enumerate(zip(layout, tensors)):
            symbolic = [(argument, dimension) in self._varied and size > 1
                        for dimension, size in enumerate(shape)]
            graph.append((tuple(None if s else size for s, size in zip(symbolic, shape)),
                          tensor.is_contiguous() if any(symbolic) else strides))
        return tuple(graph)


def _serves(graph: tuple, layout: tuple, tensors: tuple[torch.Tensor, ...]) -> bool:
    """Whether ``graph`` (see :meth:`CompiledNetwork._graph_of`) takes arguments of ``layout``:
    the same sizes where it has them, any size above 1 where it is symbolic."""
    if len(graph) != len(layout):
        return False
    for (sizes, strides), (shape, tensor_strides), tensor in zip(graph, layout, tensors):
        if len(sizes) != len(shape) or not all(size > 1 if wanted is None else size == wanted
                                               for wanted, size in zip(sizes, shape)):
            return False
        if strides != (tensor.is_contiguous() if None in sizes else tensor_strides):
            return False
    return True


class CompiledStages(_PerShape):
    """Functions of tensors (the decoding stages) compiled whole by inductor
    (``fullgraph=True``, automatic dynamic shapes; ``mode`` ``"reduce-overhead"`` adds CUDA
    graphs on CUDA) per shape the caller names (a tree shape: each function and shape compiles
    under a code object of its own, :func:`_own_code`) and called with the batch's ``rows``, or
    eager after a failure (see the module).

    Where the network is one graph, the stages around it still dispatch their operations one by
    one: some 400 per iteration of PAC+VP, each a kernel launch on a GPU. Compiled, they become
    a few fused kernels each. A stage that changes its arguments in place (``draft`` its window
    state, ``commit`` the codes) does so compiled too.
    """

    SETTING = "compile_stages=True"

    def __init__(self, mode: str | None = None) -> None:
        super().__init__(lambda: True)
        self.mode = mode
        self._compiled: dict[tuple, Callable] = {}

    def __call__(self, function: Callable, shape: Hashable, rows: int, *args):
        key = (function, shape, rows)
        if self._runs_eagerly(key):
            return function(*args)
        try:
            compiled = self._compiled.get(key[:2])
            if compiled is None:
                compiled = self._compiled[key[:2]] = torch.compile(
                    _own_code(function, shape), fullgraph=True, mode=self.mode)
            return self._first_call(key, lambda: compiled(*args))
        except Exception as error:  # eager from here on (see the module)
            self.failure = _failure(error, self.SETTING, "the decoding stages")
            return function(*args)

    def report(self) -> dict:
        """The shapes' report, and the calls that may have compiled."""
        return {**super().report(), "graphs": self.compilations}


_OWN_CODE: dict[tuple, types.FunctionType] = {}


def _own_code(function: types.FunctionType, key: Hashable) -> types.FunctionType:
    """``function`` under a code object of its own for ``key``, the same one for the same key
    all through the process. Torch keeps a function's graphs, and counts them against its limit
    of graphs per function (``recompile_limit``, 8 by default; past it a ``fullgraph`` function
    fails), per code object: each tree shape of a stage then has its own few graphs (a batch's
    rows leaving add some), and every later generation finds them."""
    own = _OWN_CODE.get((function.__code__, key))
    if own is None:
        code = function.__code__.replace()  # equal, but another object
        own = types.FunctionType(code, function.__globals__, function.__name__,
                                 function.__defaults__, function.__closure__)
        own.__kwdefaults__ = function.__kwdefaults__
        _OWN_CODE[(function.__code__, key)] = own
    return own


def _shape_of(tensors: tuple[torch.Tensor, ...]) -> tuple:
    """The shapes of ``tensors``: what a CUDA graph is recorded for (see :func:`_layout_of`)."""
    return tuple(tuple(t.shape) for t in tensors)


def _layout_of(tensors: tuple[torch.Tensor, ...]) -> tuple:
    """The shapes and strides of ``tensors``: what inductor's graphs are specialised to (the
    same shapes with other strides compile again; a CUDA graph copies its arguments in, and
    needs only the shapes)."""
    return tuple((tuple(t.shape), t.stride()) for t in tensors)


class _Graph:
    """One recorded CUDA graph: copies of the tensors it was recorded with (``inputs``), which
    it reads, and the output it writes."""

    def __init__(self, function: Callable, tensors: Sequence[torch.Tensor],
                 stream: torch.cuda.Stream | None) -> None:
        self.inputs = [tensor.clone() for tensor in tensors]
        self.output = self._record(function, stream)

    def _record(self, function: Callable, stream: torch.cuda.Stream | None) -> torch.Tensor:
        """Record ``function`` on the copies of the arguments; its output."""
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=stream, capture_error_mode="thread_local"):
            return function(*self.inputs)

    def replay(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """The output for these ``tensors``; valid until the next replay of this graph."""
        for recorded, tensor in zip(self.inputs, tensors):
            recorded.copy_(tensor)
        self._replay()
        return self.output

    def _replay(self) -> None:
        """Run the recorded kernels (on their own, so that a test on the CPU can stand in)."""
        self.graph.replay()


class CapturedNetwork(_PerShape):
    """``network(*tensors)`` recorded as one CUDA graph per fed shape and replayed (see the
    module).

    The first call of a shape runs eagerly on a side stream (which also warms up what the
    network calls, as a recording needs), then records the graph on copies of the arguments;
    later calls copy their arguments there and replay. ``buffers()`` gives the tensors the network
    writes in place (the cache): a graph holds their addresses, so when they change (the cache
    grew, rows left the batch) every graph is dropped and recorded again when next needed.
    Until ``ready()`` (the cache allocated and settled), calls run eagerly: a recording must not
    allocate or move the cache.

    shapes: the fed shapes that ran as graphs; ``eager_shapes``: those that ran eagerly because
    ``MAX_CAPTURED_SHAPES`` were recorded already; ``recordings``: graphs recorded (re-recordings
    included; ``compilations``); ``failure``: why recording stopped, a sentence for the run's warnings.
    """

    def __init__(self, network: Network, device: torch.device, ready: Callable[[], bool],
                 buffers: Callable[[], tuple[torch.Tensor, ...]]) -> None:
        super().__init__(ready, MAX_CAPTURED_SHAPES)
        self._device, self._stream = device, None
        self._eager, self._buffers = network, buffers
        self._graphs: dict[tuple, _Graph] = {}
        self._addresses: tuple[int, ...] = ()
        self._recordings = 0

    def __call__(self, *tensors: torch.Tensor) -> torch.Tensor:
        shape = _shape_of(tensors)
        if self._runs_eagerly(shape):
            return self._eager(*tensors)
        addresses = tuple(buffer.data_ptr() for buffer in self._buffers())
        if addresses != self._addresses:
            self._graphs.clear()
            self._addresses = addresses
        if shape in self._graphs:
            return self._graphs[shape].replay(tensors)
        output = self._on_side_stream(lambda: self._eager(*tensors))
        if not self._ready() or addresses != tuple(b.data_ptr() for b in self._buffers()):
            return output  # that run allocated or moved the cache: record at the next call
        try:
            self._graphs[shape] = self._first_call(
                shape, lambda: _Graph(self._eager, tensors, self._stream))
        except Exception as error:  # recording refused an operation: eager from here on
            self._graphs.clear()
            self.failure = _failure(error, step="recording a CUDA graph")
            return output
        self._recordings += 1
        return output

    def _on_side_stream(self, call: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``call()`` on a side stream (where a recording must run), ordered after and before
        the current stream's work."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(self._device)
        current = torch.cuda.current_stream(self._device)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            result = call()
        current.wait_stream(self._stream)
        return result

    @property
    def compilations(self) -> int:
        """Graphs recorded, re-recordings included (each call that recorded one may take about
        an eager call's time more)."""
        return self._recordings

    def report(self) -> dict:
        """The shapes' report, and the graphs recorded."""
        return {**super().report(), "recordings": self.compilations}
