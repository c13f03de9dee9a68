"""Compiled decoding: the session's network per fed shape and the engine's speculative stages
per tree shape, each recorded as CUDA graphs on CUDA and compiled by inductor elsewhere.

The session keeps every shape inside the network a function of the fed shape alone (see
:mod:`.models.session.slot_session`), and passes every tensor that changes between forwards as
an argument, so each shape compiles once. On CUDA, :class:`CapturedNetwork` records the
network's kernels as one CUDA graph per shape and replays it: one launch instead of one per
kernel, which is what a decoding step of a large model is bound by. Elsewhere
:class:`CompiledNetwork` compiles it with ``torch.compile`` (inductor). The engine's stages
(:mod:`.decoding.stages`, where asked) take their tensors as arguments too: on CUDA
:class:`CapturedStages` records each stage as a CUDA graph per tree shape and layout of its
arguments, elsewhere :class:`CompiledStages` compiles them whole by inductor.

Compiling must never cost a generation: shapes past the first ``MAX_COMPILED_SHAPES`` run
eagerly (compile time and graph memory stay bounded), and when compiling, recording or running a
graph raises anything, the call is repeated eagerly and every later call runs eagerly too, with
one warning for the run's summary. Repeating the call is safe: the network only writes the fed
tokens' keys and values at their planned columns, which the eager run writes again; a stage
writes the same values again.

Inductor's graphs outlive a generation (torch keeps them per function), so a later generation of
the same shapes does not compile again. Torch holds at most ``PROCESS_GRAPHS`` of them per
function; past that it would run the function uncompiled without a word, so here it raises, and
the run warns as for any other failure. CUDA graphs belong to their generation (the network's
hold its session's cache addresses) and are recorded again by the next one, in about the time
of an eager call each.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, is_dataclass, replace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .messages import first_line

__all__ = ["MAX_COMPILED_SHAPES", "CapturedNetwork", "CapturedStages", "CompiledNetwork",
           "CompiledStages", "compile_stages"]

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

    def _runs_eagerly(self, shape: tuple, capped: bool = True) -> bool:
        """Whether a call of ``shape`` runs uncompiled: after a failure, past the cap of
        ``MAX_COMPILED_SHAPES`` (recorded in ``eager_shapes``; only where ``capped``: a shape
        that needs no graph of its own is not held to it), or before ``ready()``."""
        if capped and shape not in self.shapes and len(self.shapes) >= MAX_COMPILED_SHAPES:
            self.eager_shapes.add(shape)
        return self.failure is not None or shape in self.eager_shapes or not self._ready()


class CompiledNetwork(_PerShape):
    """``network(*tensors)`` compiled by inductor per fed shape, or eager (see the module);
    eager until ``ready()`` (a forward that allocates the cache would compile a path the later
    ones do not take, and the next one compile again). Each shape compiles for the batch's rows
    when compiling began. Once images finish and their rows leave, the smaller batches run
    through one more graph whose sizes are symbolic (``dynamic=True``), which serves every
    smaller row count and fed shape (torch compiles a single row apart), where compiling per
    shape would compile each one again, seconds each, for the few iterations left.

    shapes: the fed shapes that ran compiled at the batch's rows, each the arguments' shapes and
    strides (inductor compiles again for other strides); ``eager_shapes``: those that ran
    eagerly because ``MAX_COMPILED_SHAPES`` were compiled already; ``compilations``: calls that
    compiled (each takes far longer than the network runs): the first of each full-batch shape
    and those of a smaller batch that compiled a graph; ``failure``: why compiling stopped, a
    sentence for the run's warnings (None while it works).
    """

    def __init__(self, network: Network, device: torch.device,
                 ready: Callable[[], bool] = lambda: True) -> None:
        super().__init__(ready)
        self._eager = network
        self._rows: int | None = None  # the batch's rows when compiling began
        try:
            self._compiled = torch.compile(network, dynamic=False, fullgraph=False)
            self._fewer_rows = torch.compile(network, dynamic=True, fullgraph=False)
        except Exception as error:  # torch.compile refuses this Python or platform
            self._compiled = self._fewer_rows = None
            self.failure = _failure(error)

    def __call__(self, *tensors: torch.Tensor) -> torch.Tensor:
        shape = _layout_of(tensors)
        self._rows = self._rows or len(tensors[0])
        full_batch = len(tensors[0]) == self._rows
        if self._runs_eagerly(shape, capped=full_batch):  # the smaller batches share one graph
            return self._eager(*tensors)
        if full_batch:
            compiled, graphs = self._compiled, 0
            self.compilations += shape not in self.shapes
        else:
            compiled, graphs = self._fewer_rows, _graphs_compiled()
        try:
            with _within_process_limit():
                hidden = compiled(*tensors)
        except Exception as error:  # any failure of compiling falls back to eager
            self.failure = _failure(error)
            return self._eager(*tensors)
        if full_batch:
            self.shapes.add(shape)
        else:
            self.compilations += _graphs_compiled() - graphs
        return hidden


class CompiledStages(_PerShape):
    """Functions of tensors (the decoding stages) compiled whole by inductor
    (``fullgraph=True``) per shape the caller names (a tree shape), off CUDA (on CUDA,
    :class:`CapturedStages` records them as CUDA graphs), or eager (see the module:
    the same cap and fallback as the network's). A function's first graph has the shapes of its
    first call; the next batch size compiles one for every batch size (rows leave the batch as
    their images finish) but a single row, so a tree shape costs at most three graphs per function.

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
    """The shapes of ``tensors``: what a CUDA graph is recorded for (see :func:`_layout_of`)."""
    return tuple(tuple(t.shape) for t in tensors)


def _layout_of(tensors: tuple[torch.Tensor, ...]) -> tuple:
    """The shapes and strides of ``tensors``: what inductor compiles one graph for (a graph is
    specialised to its arguments' strides, so the same shapes with other strides compile again;
    a CUDA graph copies its arguments in, and needs only the shapes)."""
    return tuple((tuple(t.shape), t.stride()) for t in tensors)


_Path = tuple  # field names and indices that lead from a stage's arguments to one object in them


def _nodes(value: object, path: _Path = ()) -> list[tuple[_Path, object]]:
    """``value`` and every object inside it, depth first, each with its path: what dataclasses
    (their fields), tuples and lists hold."""
    nodes = [(path, value)]
    if isinstance(value, (tuple, list)):
        for index, item in enumerate(value):
            nodes += _nodes(item, path + (index,))
    elif is_dataclass(value) and not isinstance(value, type):
        for field in fields(value):
            nodes += _nodes(getattr(value, field.name), path + (field.name,))
    return nodes


def _tensors(value: object) -> list[torch.Tensor]:
    """The tensors inside ``value``, depth first."""
    return [node for _, node in _nodes(value) if isinstance(node, torch.Tensor)]


def _map_tensors(function: Callable[[torch.Tensor], torch.Tensor], value: object) -> object:
    """``value`` with every tensor inside it replaced by ``function(tensor)``, in new dataclasses,
    tuples and lists (the same other objects)."""
    if isinstance(value, torch.Tensor):
        return function(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_map_tensors(function, item) for item in value)
    if is_dataclass(value) and not isinstance(value, type):
        return replace(value, **{field.name: _map_tensors(function, getattr(value, field.name))
                                 for field in fields(value)})
    return value


def _layout(node: object) -> object:
    """What a recording depends on of one object in the arguments: a tensor's shape, dtype and
    device, a container's type (and length), any other value itself, or, where it cannot be
    hashed (a numpy array), its identity."""
    if isinstance(node, torch.Tensor):
        return node.shape, node.dtype, node.device
    if isinstance(node, (tuple, list)):
        return type(node), len(node)
    if is_dataclass(node) and not isinstance(node, type):
        return type(node)
    try:
        hash(node)
    except TypeError:
        return type(node), id(node)
    return type(node), node


def _storage(tensor: torch.Tensor) -> int:
    """Where ``tensor``'s memory starts: equal for tensors that share it (views of one base)."""
    return tensor.untyped_storage().data_ptr()


def _sharing(storages: list[int]) -> tuple[int, ...]:
    """For each tensor (by its :func:`_storage`), the first one that shares its memory."""
    first: dict[int, int] = {}
    return tuple(first.setdefault(storage, index) for index, storage in enumerate(storages))


def _at(value: object, path: _Path) -> object:
    """The object at ``path`` inside ``value``."""
    for key in path:
        value = getattr(value, key) if isinstance(key, str) else value[key]
    return value


def _place(value: object, path: _Path, new: object) -> None:
    """Set the object at ``path`` inside ``value`` to ``new``."""
    parent, key = _at(value, path[:-1]), path[-1]
    if isinstance(key, str):
        setattr(parent, key, new)
    else:
        parent[key] = new


class _Writes(TorchDispatchMode):
    """The memory that operations run inside it write (``storages``, as :func:`_storage`): the
    arguments their schemas mark as written."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: set[int] = set()

    def __torch_dispatch__(self, operation, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for index, argument in enumerate(operation._schema.arguments):
            if argument.alias_info is not None and argument.alias_info.is_write:
                written = args[index] if index < len(args) else kwargs.get(argument.name)
                self.storages.update(_storage(tensor) for tensor in _tensors(written))
        return operation(*args, **kwargs)


class _Graph:
    """One recorded CUDA graph: the arguments it reads (``arguments``, of the same structure as
    those it was recorded with; ``inputs``, their tensors), the output it writes, and its memory
    ``pool`` (which later recordings may share). It reads copies of the arguments' tensors, but
    those in ``in_place`` (their ids), which it reads where they are and holds, so that they
    stay there."""

    def __init__(self, function: Callable, arguments: tuple, stream: torch.cuda.Stream | None,
                 pool: tuple | None = None, in_place: frozenset[int] = frozenset()) -> None:
        self.arguments = _map_tensors(
            lambda tensor: tensor if id(tensor) in in_place else tensor.clone(), arguments)
        self.inputs = _tensors(self.arguments)
        self.output, self.pool = self._record(function, stream, pool)

    def _record(self, function: Callable, stream: torch.cuda.Stream | None,
                pool: tuple | None) -> tuple[object, tuple]:
        """Record ``function`` on the copies of the arguments: its output, and the pool."""
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool, stream=stream,
                              capture_error_mode="thread_local"):
            output = function(*self.arguments)
        return output, self.graph.pool()

    def replay(self, tensors: Sequence[torch.Tensor]) -> object:
        """The output for arguments of these ``tensors`` (in the order of ``inputs``); valid
        until the next replay of this graph."""
        for recorded, tensor in zip(self.inputs, tensors):
            if recorded is not tensor:  # a tensor read in place is already there
                recorded.copy_(tensor)
        self._replay()
        return self.output

    def _replay(self) -> None:
        """Run the recorded kernels (on their own, so that a test on the CPU can stand in)."""
        self.graph.replay()


class _GraphRecorder(_PerShape):
    """What recording CUDA graphs takes besides the shapes' bookkeeping: a side stream, on which
    a shape's first call runs eagerly (which also warms up what it calls, as a recording needs)
    and its graph is recorded."""

    def __init__(self, ready: Callable[[], bool], device: torch.device) -> None:
        super().__init__(ready)
        self._device = device
        self._stream: torch.cuda.Stream | None = None

    def _on_side_stream(self, call: Callable[[], object]) -> object:
        """``call()`` on the side stream, ordered after and before the current stream's work."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(self._device)
        current = torch.cuda.current_stream(self._device)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            result = call()
        current.wait_stream(self._stream)
        return result


class CapturedNetwork(_GraphRecorder):
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
        super().__init__(ready, device)
        self._eager, self._buffers = network, buffers
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
        hidden = self._on_side_stream(lambda: self._eager(*tensors))
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

    def report(self) -> dict:
        """The shapes' report, and the graphs recorded."""
        return {**super().report(), "recordings": self.recordings}


@dataclass
class _StageGraph:
    """A stage's recorded graph and what a replay hands back besides its output: the argument
    tensors the stage writes in place (``written``, indices into the arguments' tensors) and
    the fields of its arguments it sets (``replaced``, their paths)."""

    graph: _Graph
    written: list[int]
    replaced: list[_Path]

    def replay(self, arguments: tuple, tensors: list[torch.Tensor]) -> object:
        """What the stage returns for ``arguments`` (whose tensors are ``tensors``), with their
        changes made as the stage makes them. The graph's output and changes are in its own
        memory, which its next replay overwrites, so the caller gets copies."""
        output = self.graph.replay(tensors)
        for index in self.written:
            tensors[index].copy_(self.graph.inputs[index])
        for path in self.replaced:
            _place(arguments, path, _map_tensors(torch.clone, _at(self.graph.arguments, path)))
        return _map_tensors(torch.clone, output)


class CapturedStages(_GraphRecorder):
    """Functions of tensors (the decoding stages) recorded on CUDA as one CUDA graph per
    function, shape the caller names (a tree shape) and layout of the arguments, and replayed;
    or eager (see the module: the same cap on tree shapes and fallback as the network's).

    The layout is everything a recording depends on (:func:`_layout`): the arguments' structure
    (dataclasses, tuples, lists), their tensors' shapes, dtypes and devices, which of them share
    memory, and every other value. So rows leaving the batch, a changed setting or another
    acceptance rule each record a graph of their own. The tensors of a frozen dataclass (a draft
    tree) that the stage does not write are constants: the graph reads them where they are,
    with no copy per replay, and they are part of the layout (another tree records its own).

    The first call of a layout runs eagerly on the side stream, noting what it writes (the
    memory of argument tensors written in place, and the arguments' fields it sets, as ``draft``
    sets the window state's drafts); then the graph is recorded on copies of the arguments.
    A replay copies the arguments in, and afterwards the written tensors and the set fields back
    out to the caller's arguments, and returns a copy of the output. Where a written tensor
    shares memory with another argument the graph could not keep them the same, so that layout
    runs eagerly. Graphs share one memory pool: a replay leaves nothing in it that a later one
    needs.

    shapes: the tree shapes that ran as graphs; ``eager_shapes``: those that ran eagerly because
    ``MAX_COMPILED_SHAPES`` were recorded already, and layouts that run eagerly as they write a
    tensor that shares memory; ``compilations``: graphs recorded; ``failure``: why recording
    stopped, a sentence for the run's warnings.
    """

    SETTING = CompiledStages.SETTING

    def __init__(self, device: torch.device) -> None:
        super().__init__(lambda: True, device)
        self._graphs: dict[tuple, _StageGraph] = {}
        self._pool: tuple | None = None

    def __call__(self, function: Callable, shape: tuple, *args):
        if self._runs_eagerly(shape):
            return function(*args)
        nodes = _nodes(args)
        tensors = [node for _, node in nodes if isinstance(node, torch.Tensor)]
        storages = [_storage(tensor) for tensor in tensors]
        constants = _constants(nodes)
        layout = (function, shape, tuple(_layout(node) for _, node in nodes), _sharing(storages),
                  tuple(id(tensor) for tensor in constants))
        if layout in self._graphs:
            return self._graphs[layout].replay(args, tensors)
        if layout in self.eager_shapes:
            return function(*args)
        before = _map_tensors(lambda tensor: tensor, args)
        with _Writes() as writes:
            result = self._on_side_stream(lambda: function(*args))
        written = [index for index, storage in enumerate(storages) if storage in writes.storages]
        if any(storages.count(storages[index]) > 1 for index in written):
            self.eager_shapes.add(layout)
            return result
        try:
            replaced = _replaced(args, nodes)
            unwritten = frozenset(id(tensor) for tensor in constants) - {
                id(tensors[index]) for index in written}
            graph = _Graph(function, before, self._stream, self._pool, unwritten)
        except Exception as error:  # recording refused an operation: eager from here on
            self._graphs.clear()
            self.failure = _failure(error, self.SETTING, "the decoding stages",
                                    "recording a CUDA graph")
            return result
        self._pool = graph.pool
        self._graphs[layout] = _StageGraph(graph, written, replaced)
        self.shapes.add(shape)
        self.compilations += 1
        return result

    def report(self) -> dict:
        """The shapes' report, and the graphs recorded."""
        return {**super().report(), "graphs": self.compilations}


def _constants(nodes: list[tuple[_Path, object]]) -> list[torch.Tensor]:
    """The tensors among ``nodes`` that a frozen dataclass holds (at any depth below it)."""
    frozen = [path for path, node in nodes if is_dataclass(node) and not isinstance(node, type)
              and node.__dataclass_params__.frozen]
    return [node for path, node in nodes if isinstance(node, torch.Tensor)
            and any(path[:len(outer)] == outer for outer in frozen)]


def _replaced(arguments: tuple, nodes: list[tuple[_Path, object]]) -> list[_Path]:
    """The paths of the objects in ``arguments`` that are no longer those ``nodes`` listed
    there (before a call that set them), outermost only."""
    replaced: list[_Path] = []
    for path, node in nodes:
        if (not any(path[:len(outer)] == outer for outer in replaced)
                and _at(arguments, path) is not node):
            replaced.append(path)
    return replaced


def compile_stages(device: torch.device) -> CapturedStages | CompiledStages:
    """What runs the engine's stages compiled on ``device``: CUDA graphs on CUDA (a stage's
    hundred small operations become one launch), inductor elsewhere (fused kernels)."""
    return CapturedStages(device) if device.type == "cuda" else CompiledStages()
