"""Compiled decoding: the session's network per fed shape (CUDA graphs on CUDA, inductor
elsewhere) and the engine's speculative stages (inductor).

The session keeps every shape inside the network a function of the fed shape alone (see
:mod:`.models.session.slot_session`), and passes every tensor that changes between forwards as
an argument, so each shape compiles once. On CUDA, :class:`CapturedNetwork` records the
network's kernels as one CUDA graph per shape and replays it: one launch instead of one per
kernel, which is what a decoding step of a large model is bound by. Elsewhere
:class:`CompiledNetwork` compiles it with ``torch.compile`` (inductor). :class:`CompiledStages`
compiles the engine's stages (:mod:`.decoding.stages`) whole, where asked.

Compiling must never cost a generation: shapes past the first ``MAX_COMPILED_SHAPES`` run
eagerly (compile time and graph memory stay bounded), and when compiling, recording or running a
graph raises anything, the call is repeated eagerly and every later call runs eagerly too, with
one warning for the run's summary. Repeating the call is safe: the network only writes the fed
tokens' keys and values at their planned columns, which the eager run writes again; a stage
writes the same values again.

Inductor's graphs outlive a generation (torch keeps them per function), so a later generation of
the same shapes does not compile again. Torch holds at most ``PROCESS_GRAPHS`` of them per
function; past that it would run the function uncompiled without a word, so here it raises, and
the run warns as for any other failure. CUDA graphs belong to their session (they hold its
cache's addresses) and are recorded again by the next one, in about the time of a forward each.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from .messages import first_line

__all__ = ["MAX_COMPILED_SHAPES", "CapturedNetwork", "CompiledNetwork", "CompiledStages"]

MAX_COMPILED_SHAPES = 8  # distinct fed shapes compiled per generation; later ones run eagerly
PROCESS_GRAPHS = 64  # graphs torch keeps per network function, over every generation of a process

Network = Callable[..., torch.Tensor]  # (inputs, positions, mask, columns) -> hidden states


def _failure(error: Exception, setting: str = "compile=True", what: str = "the network",
             step: str = "torch.compile") -> str:
    """The warning for a run whose ``step`` (compiling, or recording a CUDA graph) of ``what``
    failed with ``error``."""
    return (f"{setting}: {step} failed ({type(error).__name__}: {first_line(error)}), "
            f"so {what} ran uncompiled for the rest of this generation (the same "
            "distribution, only slower)")


def _within_process_limit():
    """Torch's recompile limit per function raised to ``PROCESS_GRAPHS``, and made an error
    (past it torch would otherwise run the function uncompiled without a word)."""
    return torch._dynamo.config.patch(recompile_limit=PROCESS_GRAPHS,
                                      fail_on_recompile_limit_hit=True)


class _PerShape:
    """What every way of compiling keeps: the shapes compiled and those run eagerly past the cap,
    the calls that compiled, the failure; and which calls run eagerly."""

    def __init__(self, ready: Callable[[], bool]) -> None:
        self._ready = ready
        self.shapes: set[tuple] = set()
        self.eager_shapes: set[tuple] = set()
        self.compilations = 0
        self.failure: str | None = None

    def report(self) -> dict:
        """What the trace records: shapes compiled and run eagerly, and the failure if any."""
        return {"compiled_shapes": len(self.shapes), "eager_shapes": len(self.eager_shapes),
                "failure": self.failure}

    def _runs_eagerly(self, shape: tuple) -> bool:
        """Whether a call of ``shape`` runs uncompiled: after a failure, past the cap of
        ``MAX_COMPILED_SHAPES`` (recorded in ``eager_shapes``), or before ``ready()``."""
        if shape not in self.shapes and len(self.shapes) >= MAX_COMPILED_SHAPES:
            self.eager_shapes.add(shape)
        return self.failure is not None or shape in self.eager_shapes or not self._ready()


class CompiledNetwork(_PerShape):
    """``network(*tensors)`` compiled by inductor per fed shape, or eager (see the module);
    eager until ``ready()`` (a forward that allocates the cache would compile a path the later
    ones do not take, and the next one compile again). Only the batch's rows when compiling
    began compile: once images finish and their rows leave, a smaller batch would compile every
    shape again, seconds each, for the few iterations left, so those forwards run eagerly.

    shapes: the fed shapes that ran compiled; ``eager_shapes``: those that ran eagerly because
    ``MAX_COMPILED_SHAPES`` were compiled already or rows had left; ``compilations``: calls
    that compiled a shape
    (each takes far longer than the network runs); ``failure``: why compiling stopped, a
    sentence for the run's warnings (None while it works).
    """

    def __init__(self, network: Network, device: torch.device,
                 ready: Callable[[], bool] = lambda: True) -> None:
        super().__init__(ready)
        self._eager = network
        self._rows: int | None = None  # the batch's rows when compiling began
        try:
            self._compiled = torch.compile(network, dynamic=False, fullgraph=False)
        except Exception as error:  # torch.compile refuses this Python or platform
            self._compiled, self.failure = None, _failure(error)

    def __call__(self, *tensors: torch.Tensor) -> torch.Tensor:
        shape = _shape_of(tensors)
        if self._runs_eagerly(shape):
            return self._eager(*tensors)
        self._rows = self._rows or len(tensors[0])
        if len(tensors[0]) != self._rows:
            self.eager_shapes.add(shape)
            return self._eager(*tensors)
        self.compilations += shape not in self.shapes
        try:
            with _within_process_limit():
                hidden = self._compiled(*tensors)
        except Exception as error:  # any failure of compiling falls back to eager
            self.failure = _failure(error)
            return self._eager(*tensors)
        self.shapes.add(shape)
        return hidden


class CompiledStages(_PerShape):
    """Functions of tensors (the decoding stages) compiled whole by inductor
    (``fullgraph=True``) per shape the caller names (a tree shape), or eager (see the module:
    the same cap and fallback as the network's). A function's first graph has the shapes of its
    first call; the next batch size compiles one for every batch size (rows leave the batch as
    their images finish) but a single row, so a tree shape costs at most three graphs per stage.

    Where the network is one graph, the stages around it still dispatch their operations one by
    one: some 400 per iteration of PAC+VP, each a kernel launch on a GPU. Compiled, they become
    a few fused kernels each. A stage that changes its arguments in place (``draft`` its window
    state, ``commit`` the codes) does so compiled too.
    """

    SETTING = "compile_stages=True"

    def __init__(self) -> None:
        super().__init__(lambda: True)
        self._compiled: dict[Callable, Callable] = {}

    def __call__(self, function: Callable, shape: tuple, *args):
        if self._runs_eagerly(shape):
            return function(*args)
        compiled = self._compiled.get(function)
        graphs = _graphs_compiled()
        try:
            if compiled is None:
                compiled = self._compiled[function] = torch.compile(function, fullgraph=True)
            with _within_process_limit():
                result = compiled(*args)
        except Exception as error:  # eager from here on (see the module)
            self.failure = _failure(error, self.SETTING, "the decoding stages")
            return function(*args)
        self.compilations += _graphs_compiled() - graphs
        self.shapes.add(shape)
        return result

    def report(self) -> dict:
        """The shapes' report, and the graphs compiled."""
        return {**super().report(), "graphs": self.compilations}


def _graphs_compiled() -> int:
    """Graphs torch has compiled in this process so far."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _shape_of(tensors: tuple[torch.Tensor, ...]) -> tuple:
    return tuple(tuple(t.shape) for t in tensors)


class _Graph:
    """One recorded CUDA graph: the copies of the arguments it reads and the output it writes."""

    def __init__(self, network: Network, tensors: tuple[torch.Tensor, ...],
                 stream: torch.cuda.Stream) -> None:
        self.inputs = tuple(t.clone() for t in tensors)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=stream, capture_error_mode="thread_local"):
            self.output = network(*self.inputs)

    def replay(self, tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The network's output for ``tensors``; valid until the next replay of this graph."""
        for recorded, tensor in zip(self.inputs, tensors):
            recorded.copy_(tensor)
        self.graph.replay()
        return self.output


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
    ``MAX_COMPILED_SHAPES`` were recorded already; ``recordings``: graphs recorded (re-recordings
    included); ``failure``: why recording stopped, a sentence for the run's warnings.
    """

    def __init__(self, network: Network, device: torch.device, ready: Callable[[], bool],
                 buffers: Callable[[], tuple[torch.Tensor, ...]]) -> None:
        super().__init__(ready)
        self._eager, self._buffers, self._device = network, buffers, device
        self._stream: torch.cuda.Stream | None = None
        self._graphs: dict[tuple, _Graph] = {}
        self._addresses: tuple[int, ...] = ()

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
        hidden = self._on_side_stream(tensors)
        if not self._ready() or addresses != tuple(b.data_ptr() for b in self._buffers()):
            return hidden  # that run allocated or moved the cache: record at the next call
        try:
            self._graphs[shape] = _Graph(self._eager, tensors, self._stream)
        except Exception as error:  # recording refused an operation: eager from here on
            self._graphs.clear()
            self.failure = _failure(error, step="recording a CUDA graph")
            return hidden
        self.shapes.add(shape)
        self.compilations += 1
        return hidden

    @property
    def recordings(self) -> int:
        """Graphs recorded, re-recordings included (each call that compiled recorded one)."""
        return self.compilations

    def _on_side_stream(self, tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The eager call, on the stream the graphs are recorded on (a recording follows a run
        there), ordered after and before the current stream's work."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(self._device)
        current = torch.cuda.current_stream(self._device)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            hidden = self._eager(*tensors)
        current.wait_stream(self._stream)
        return hidden

    def report(self) -> dict:
        """The shapes' report, and the graphs recorded."""
        return {**super().report(), "recordings": self.recordings}
