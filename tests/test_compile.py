"""The ``compile`` and ``compile_stages`` settings: the network compiled per fed shape, and the
speculative stages compiled whole (by inductor, or as CUDA graphs replayed here by a stand-in on
the CPU), draw what eager draws.

Compiled logits differ from eager ones only by float rounding; on this model and seed no draw
flips, so the codes are bit-identical in every mode (on another model a draw may flip, as
between batch sizes). AUTO chooses its shapes by forward passes here (by time its choice would
follow the compiled speed), and compiled it also feeds each of its shapes once early, to compile
them: its uncompiled run feeds the shapes the compiled one chose, in the same order.

Inductor compiles on a CPU take seconds per shape, so the model is the engine tests' small
synthetic one with one layer; the modes share the network's shapes, which compile once.
"""

from dataclasses import dataclass, replace

import pytest
import torch

from sjd_core.decoding import engine
from sjd_core.decoding.engine import generate
from sjd_core.decoding.settings import AccelerationSettings, SamplingSettings
from sjd_core.decoding.trace import summary_text
from sjd_core.models.protocol import GenerationRequest
from sjd_core import compiled
from sjd_core.models.session import slot_session
from sjd_core.compiled import (MAX_COMPILED_SHAPES, CapturedNetwork, CapturedStages,
                               CompiledNetwork, CompiledStages, compile_stages)
from sjd_core.models.reference import WEIGHTS_DIR, ReferenceModel
from sjd_core.models.synthetic import SyntheticModel

SAMPLING = SamplingSettings(guidance=2.0, temperature=1.0, top_k=0, top_p=0.9)
MODES = {"ar": AccelerationSettings.preset("ar"),
         "sjd": AccelerationSettings.preset("sjd"),
         "pac": AccelerationSettings.preset("pac"),
         "pac+vp": AccelerationSettings.preset("pac+vp"),
         "above_target+ac": AccelerationSettings(init="above_target", adaptive_continuation=True),
         "gsd": AccelerationSettings.preset("sjd", relaxed="gsd"),
         "lantern": AccelerationSettings.preset("sjd", relaxed="lantern"),
         "auto": AccelerationSettings.preset("auto", shape_cost="passes")}


@pytest.fixture(scope="module")
def model() -> SyntheticModel:
    return SyntheticModel(codebook_size=32, grid=(6, 6), width=32, layers=1, heads=2,
                          sharpness=2.0, seed=5)


def run(model: SyntheticModel, settings: AccelerationSettings, batch: int = 1):
    return generate(model, GenerationRequest(prompt="a red fox", batch_size=batch), SAMPLING,
                    settings, seed=3)


class _Replay:
    """A plan that feeds the shapes another run chose, in that run's order."""

    def __init__(self, mode_name: str, trees: list) -> None:
        self.mode_name, self.trees, self.warnings = mode_name, list(trees), []

    def choose(self):
        return self.trees.pop(0)

    def observe(self, *args, **kwargs) -> None:
        return None

    def notes(self) -> dict:
        return {}


def run_and_replay_eagerly(model: SyntheticModel, mode: str, monkeypatch, batch: int = 1,
                           **compiling):
    """A run of ``mode`` with the ``compiling`` settings, and its eager run feeding the shapes the
    first one chose, in its order (compiling, ``auto`` feeds each shape once early)."""
    chosen, make_plan = [], engine.make_plan

    def recorded(*args, **kwargs):
        plan = make_plan(*args, **kwargs)
        choose = plan.choose
        plan.choose = lambda: chosen.append(choose()) or chosen[-1]
        return plan

    monkeypatch.setattr(engine, "make_plan", recorded)
    compiled_run = run(model, replace(MODES[mode], **compiling), batch)
    monkeypatch.setattr(engine, "make_plan", lambda settings, *rest: _Replay(
        settings.mode_name, chosen))
    eager = run(model, MODES[mode], batch)
    monkeypatch.setattr(engine, "make_plan", make_plan)
    return compiled_run, eager


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_compiled_codes_equal_eager_and_stay_within_the_shape_cap(model, mode, monkeypatch):
    compiled_run, eager = run_and_replay_eagerly(model, mode, monkeypatch, compile=True)
    assert torch.equal(compiled_run.codes, eager.codes)
    report = compiled_run.trace.meta["compile"]
    assert report["failure"] is None and compiled_run.trace.summary()["warnings"] == []
    assert 1 <= report["compiled_shapes"] <= MAX_COMPILED_SHAPES
    assert "compile" not in eager.trace.meta


@pytest.mark.slow
@pytest.mark.usefixtures("unchecked_draws")  # a compiled stage cannot read its weights back
@pytest.mark.parametrize("mode, batch", [("pac+vp", 3), ("above_target+ac", 1)])
def test_compiled_stages_draw_the_eager_codes(model, mode, batch):
    """Draft, and verify, commit and advance together, compiled whole (with the network
    uncompiled): the same codes, at most three graphs per stage and tree shape (the first batch
    size, every other one, and a single row), and rows that leave the batch add no shape."""
    eager = run(model, MODES[mode], batch=batch)
    compiled_run = run(model, replace(MODES[mode], compile_stages=True), batch=batch)
    assert torch.equal(compiled_run.codes, eager.codes)
    report = compiled_run.trace.meta["compile_stages"]
    assert report["failure"] is None and compiled_run.trace.summary()["warnings"] == []
    assert report["compiled_shapes"] == 1 and report["eager_shapes"] == 0
    assert 2 <= report["graphs"] <= 3 * 2
    assert "compile" not in compiled_run.trace.meta and "compile_stages" not in eager.trace.meta
    again = run(model, replace(MODES[mode], compile_stages=True), batch=batch)
    assert torch.equal(again.codes, eager.codes)
    assert again.trace.meta["compile_stages"]["graphs"] == 0  # kept by torch for the process


def test_a_stage_compile_failure_falls_back_to_eager_with_one_warning(model, monkeypatch):
    def no_compiler(function, **options):
        assert options == {"fullgraph": True}

        def fails(*args):
            raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found")
        return fails

    monkeypatch.setattr(torch, "compile", no_compiler)
    result = run(model, AccelerationSettings.preset("pac+vp", compile_stages=True), batch=2)
    assert torch.equal(result.codes,
                       run(model, AccelerationSettings.preset("pac+vp"), batch=2).codes)
    assert result.trace.summary()["warnings"] == [
        "compile_stages=True: torch.compile failed (RuntimeError: InvalidCxxCompiler: No "
        "working C++ compiler found), so the decoding stages ran uncompiled for the rest of "
        "this generation (the same distribution, only slower)"]
    assert result.trace.meta["compile_stages"]["compiled_shapes"] == 0


def test_stage_shapes_past_the_cap_run_eagerly(monkeypatch):
    compiled_calls = []

    def counted_compile(function, **options):
        def compiled_function(*args):
            compiled_calls.append(args)
            return function(*args)
        return compiled_function

    monkeypatch.setattr(torch, "compile", counted_compile)
    stages = CompiledStages()
    for shape in [*range(MAX_COMPILED_SHAPES + 2), 0]:
        assert stages(torch.add, (shape,), torch.ones(2), shape).tolist() == [1.0 + shape] * 2
    report = stages.report()
    assert (report["compiled_shapes"], report["eager_shapes"]) == (MAX_COMPILED_SHAPES, 2)
    assert [args[1] for args in compiled_calls] == [*range(MAX_COMPILED_SHAPES), 0]


def test_a_compile_failure_falls_back_to_eager_with_one_warning(model, monkeypatch):
    def no_compiler(network, **options):
        def fails(*args):
            raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found\nmore text")
        return fails

    monkeypatch.setattr(torch, "compile", no_compiler)
    settings = AccelerationSettings.preset("pac+vp", compile=True)
    result = run(model, settings)
    assert torch.equal(result.codes, run(model, AccelerationSettings.preset("pac+vp")).codes)
    warnings = result.trace.summary()["warnings"]
    assert len(warnings) == 1
    assert "torch.compile failed (RuntimeError: InvalidCxxCompiler: No working C++ compiler " \
           "found)" in warnings[0] and "ran uncompiled" in warnings[0]
    assert result.trace.meta["compile"]["compiled_shapes"] == 0
    assert "WARNING: compile=True: torch.compile failed" in summary_text(result.trace.summary())


def test_torch_compile_refused_at_once_runs_eagerly(monkeypatch):
    def refused(network, **options):
        raise RuntimeError("Dynamo is not supported on this Python")

    monkeypatch.setattr(torch, "compile", refused)
    network = CompiledNetwork(lambda x, p, m: x + 1, torch.device("cpu"))
    assert torch.equal(network(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 1, 3, 4)),
                       torch.ones(2, 3))
    assert "Dynamo is not supported on this Python" in network.report()["failure"]


def test_shapes_past_the_cap_run_eagerly(monkeypatch):
    calls = {"compiled": 0, "eager": 0}

    def eager(inputs, positions, mask):
        calls["eager"] += 1
        return inputs

    def counted_compile(network, **options):
        assert options in ({"dynamic": False, "fullgraph": False},
                           {"dynamic": True, "fullgraph": False})

        def compiled_network(*args):
            calls["compiled"] += 1
            return network(*args)
        return compiled_network

    monkeypatch.setattr(torch, "compile", counted_compile)
    network = CompiledNetwork(eager, torch.device("cpu"))
    for tokens in [*range(1, MAX_COMPILED_SHAPES + 3), 1, MAX_COMPILED_SHAPES + 2]:
        network(torch.zeros(2, tokens), torch.zeros(2, tokens), torch.zeros(2, 1, tokens, 40))
    assert network.report() == {"compiled_shapes": MAX_COMPILED_SHAPES, "eager_shapes": 2,
                                "failure": None}
    assert calls["compiled"] == MAX_COMPILED_SHAPES + 1  # shape 1 again, compiled
    assert calls["eager"] == MAX_COMPILED_SHAPES + 4  # inside the compiled ones, and 3 eager calls


def test_arguments_of_new_strides_count_as_a_shape_as_inductor_compiles_them_again():
    """Inductor specialises a graph to its arguments' strides: the same shapes with other
    strides compile again, so they count against the cap like a new shape (else a compile would
    go unreported and past the cap)."""
    def doubled(inputs, positions):
        return inputs * 2 + positions

    network = CompiledNetwork(doubled, torch.device("cpu"))
    with torch._dynamo.config.patch(recompile_limit=8):
        graphs_before = compiled._graphs_compiled()
        square = torch.ones(3, 3)
        for inputs in (square, square.t(), square + 1, square.t() + 1):
            assert torch.equal(network(inputs, torch.zeros(3, 3)), inputs * 2)
        graphs = compiled._graphs_compiled() - graphs_before
    assert graphs == network.compilations == 2
    assert network.report() == {"compiled_shapes": 2, "eager_shapes": 0, "failure": None}


def test_rows_that_leave_the_batch_run_through_one_graph_of_symbolic_sizes(monkeypatch):
    """Each shape compiles for the rows the batch had when compiling began; once rows leave,
    every smaller batch runs through the one graph compiled with ``dynamic=True``, also once
    ``MAX_COMPILED_SHAPES`` full-batch shapes took the cap (they do not count against it)."""
    compiled_rows = {False: [], True: []}  # by dynamic

    def counted_compile(network, dynamic, fullgraph):
        def compiled_network(*args):
            compiled_rows[dynamic].append(len(args[0]))
            return network(*args)
        return compiled_network

    monkeypatch.setattr(torch, "compile", counted_compile)
    network = CompiledNetwork(lambda inputs, columns: inputs + 1, torch.device("cpu"))
    for rows in (4, 4, 3, 1, 4):
        assert torch.equal(network(torch.zeros(rows, 2), torch.zeros(rows, 2)),
                           torch.ones(rows, 2))
    assert compiled_rows == {False: [4, 4, 4], True: [3, 1]}
    assert network.report() == {"compiled_shapes": 1, "eager_shapes": 0, "failure": None}
    for tokens in range(3, MAX_COMPILED_SHAPES + 4):  # past the cap at the full batch
        network(torch.zeros(4, tokens), torch.zeros(4, tokens))
    network(torch.zeros(2, 5), torch.zeros(2, 5))
    assert compiled_rows[True] == [3, 1, 2]
    assert network.report()["eager_shapes"] == 2


def test_only_the_forward_that_allocates_the_cache_runs_eagerly(monkeypatch):
    """The shipped model has no context to prefill: its first forward allocates the cache (and
    runs eagerly, as compiling it would trace a path no later forward takes), and the layers are
    joined at its end, so that every later forward runs compiled."""
    calls = {"compiled": 0, "all": 0}
    network_step = slot_session.SlotSession._network_step

    def counted_step(self, *tensors):
        calls["all"] += 1
        return network_step(self, *tensors)

    def counted_compile(network, **options):
        def compiled_network(*args):
            calls["compiled"] += 1
            return network(*args)
        return compiled_network

    monkeypatch.setattr(slot_session.SlotSession, "_network_step", counted_step)
    monkeypatch.setattr(torch, "compile", counted_compile)
    shipped = ReferenceModel(WEIGHTS_DIR, device="cpu")
    request = GenerationRequest(prompt="t-shirt")
    assert shipped.start(request).layout.prefix.max() == 0  # nothing to prefill
    for mode in ("ar", "sjd"):
        result = generate(shipped, request, SAMPLING, replace(MODES[mode], compile=True), seed=3)
        forwards = int(result.trace.summary()["nfe"])
        assert calls == {"compiled": forwards - 1, "all": forwards}, mode
        calls.update(compiled=0, all=0)


class _ReplayedGraph(compiled._Graph):
    """Stands in for a CUDA graph on the CPU, as a graph behaves: recording runs the function on
    the copies of the arguments (what it changes in place changes there); a replay runs it again
    on those copies and writes what it gives into the tensors the recording gave (the output,
    and the arguments' fields it set), the same objects at every replay, as a graph's kernels
    write the same memory."""

    recorded: list = []
    refuse = False

    def _record(self, function, stream, pool):
        if self.refuse:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        self.function, self.pool_given = function, pool
        self.unchanged = compiled._map_tensors(lambda tensor: tensor, self.arguments)
        self.recorded.append(self)
        return function(*self.arguments), pool or f"pool of graph {len(self.recorded)}"

    def _replay(self):
        arguments = compiled._map_tensors(lambda tensor: tensor, self.unchanged)
        output = self.function(*arguments)
        for kept, new in zip(compiled._tensors((self.output, self.arguments)),
                             compiled._tensors((output, arguments))):
            if kept is not new:
                kept.copy_(new)


@pytest.fixture
def replayed_graphs(monkeypatch):
    monkeypatch.setattr(compiled, "_Graph", _ReplayedGraph)
    monkeypatch.setattr(_ReplayedGraph, "recorded", [])
    monkeypatch.setattr(compiled._GraphRecorder, "_on_side_stream", lambda self, call: call())
    return _ReplayedGraph


def test_cuda_sessions_capture_graphs_and_others_compile_with_inductor(model, monkeypatch):
    session = model.start(GenerationRequest(prompt="a red fox", guidance=2.0, max_nodes=4))
    assert isinstance(session.compile_network(), CompiledNetwork)
    monkeypatch.setattr(session, "device", torch.device("cuda"))
    assert isinstance(session.compile_network(), CapturedNetwork)
    assert isinstance(compile_stages(torch.device("cpu")), CompiledStages)
    assert isinstance(compile_stages(torch.device("cuda")), CapturedStages)


def test_a_captured_network_records_a_shape_once_and_replays_it_with_new_arguments(
        replayed_graphs):
    cache = [torch.zeros(3)]
    network = CapturedNetwork(lambda x, columns: x * 2 + columns, torch.device("cuda"),
                              lambda: True, lambda: tuple(cache))
    assert torch.equal(network(torch.ones(2), torch.zeros(2)), torch.full((2,), 2.0))
    assert torch.equal(network(torch.full((2,), 3.0), torch.ones(2)), torch.full((2,), 7.0))
    assert len(replayed_graphs.recorded) == 1  # the second call replayed the first's graph
    network(torch.ones(5), torch.ones(5))
    cache[0] = torch.zeros(4)  # the cache moved (it grew, or rows left): graphs hold old addresses
    network(torch.ones(2), torch.ones(2))
    assert network.report() == {"compiled_shapes": 2, "eager_shapes": 0, "recordings": 3,
                                "failure": None}
    for tokens in range(6, 6 + MAX_COMPILED_SHAPES):
        network(torch.ones(tokens), torch.ones(tokens))
    assert network.report()["eager_shapes"] == 2 and network.report()["compiled_shapes"] == 8


def test_a_refused_recording_runs_eagerly_with_one_warning(model, replayed_graphs, monkeypatch):
    monkeypatch.setattr(replayed_graphs, "refuse", True)
    network = CapturedNetwork(lambda x: x + 1, torch.device("cuda"), lambda: True, tuple)
    assert torch.equal(network(torch.zeros(2)), torch.ones(2))
    assert torch.equal(network(torch.zeros(3)), torch.ones(3))
    failure = network.report()["failure"]
    assert failure.startswith("compile=True: recording a CUDA graph failed (RuntimeError: CUDA "
                              "error: operation not permitted when stream is capturing)")
    assert network.report()["compiled_shapes"] == 0


@pytest.mark.parametrize("mode", ["ar", "pac+vp"])
def test_replayed_graphs_draw_the_eager_codes(model, replayed_graphs, monkeypatch, mode):
    """The session passes its network every tensor that changes per forward (a replay runs on
    copies of the arguments the graph was recorded with)."""
    eager = run(model, MODES[mode], batch=2)
    def captured_on_the_cpu(network, device, ready):
        return CapturedNetwork(network, device, ready, network.__self__.store.buffers)

    monkeypatch.setattr(slot_session, "CompiledNetwork", captured_on_the_cpu)
    monkeypatch.setattr(compiled, "MAX_COMPILED_SHAPES", 64)
    captured = run(model, replace(MODES[mode], compile=True), batch=2)
    assert torch.equal(captured.codes, eager.codes)
    report = captured.trace.meta["compile"]
    assert report["recordings"] >= 1 and report["failure"] is None
    alone = run(model, replace(MODES[mode], compile=True))  # one image: the cache never moves
    report = alone.trace.meta["compile"]
    assert report["recordings"] == report["compiled_shapes"] >= 1  # one graph per shape


@pytest.mark.slow
def test_a_compiled_batch_whose_rows_finish_apart_draws_the_eager_codes(model, monkeypatch):
    """Real inductor graphs: a batch of 3 in which rows finish at different iterations (the
    drafts of each row pass differently) runs its last forwards through the graph of symbolic
    sizes, and draws the eager codes."""
    fewer_rows = []
    call = compiled.CompiledNetwork.__call__

    def spied(network, *tensors):
        if network._rows is not None and len(tensors[0]) != network._rows:
            fewer_rows.append(len(tensors[0]))
        return call(network, *tensors)

    monkeypatch.setattr(compiled.CompiledNetwork, "__call__", spied)
    settings = MODES["above_target+ac"]
    compiled_run = run(model, replace(settings, compile=True), batch=3)
    assert fewer_rows and compiled_run.trace.meta["compile"]["failure"] is None
    assert compiled_run.trace.meta["compile"]["eager_shapes"] == 0
    assert torch.equal(compiled_run.codes, run(model, settings, batch=3).codes)


def test_until_the_cache_is_settled_the_network_runs_eagerly(replayed_graphs, monkeypatch):
    """After an empty prefill the first forward allocates the cache and the next joins it: a
    graph recorded or compiled then would hold a path the later forwards do not take."""
    settled = [False]
    captured = CapturedNetwork(lambda x: x + 1, torch.device("cuda"), lambda: settled[0], tuple)
    calls = []

    def counted_compile(network, **options):
        def compiled_network(*tensors):
            calls.append(tensors[0].shape)
            return network(*tensors)
        return compiled_network

    monkeypatch.setattr(torch, "compile", counted_compile)
    compiled_network = CompiledNetwork(lambda x: x + 1, torch.device("cpu"), lambda: settled[0])
    for network in (captured, compiled_network):
        assert torch.equal(network(torch.zeros(2)), torch.ones(2))
        assert network.compilations == 0 and not network.shapes
    settled[0] = True
    for network in (captured, compiled_network):
        network(torch.zeros(2))
        assert network.compilations == 1 and len(network.shapes) == 1
    assert len(replayed_graphs.recorded) == 1 and len(calls) == 1


@pytest.fixture
def captured_stages(model, replayed_graphs, monkeypatch):
    """``generate`` runs the stages as on a CUDA device, as (stand-in) CUDA graphs; the runners
    it made."""
    made = []

    def as_on_cuda(device):
        assert device == torch.device(model.device)
        made.append(compile_stages(torch.device("cuda")))
        return made[-1]

    monkeypatch.setattr(engine, "compile_stages", as_on_cuda)
    return made


@pytest.mark.parametrize("mode", ["sjd", "pac+vp", "above_target+ac", "gsd", "auto"])
def test_captured_stages_draw_the_eager_codes(model, captured_stages, monkeypatch, mode):
    """Each stage recorded per tree shape and batch size (the two rows leave the batch at
    different iterations) and replayed on copies of its arguments: the eager codes."""
    captured, eager = run_and_replay_eagerly(model, mode, monkeypatch, batch=2,
                                             compile_stages=True)
    assert torch.equal(captured.codes, eager.codes)
    report = captured.trace.meta["compile_stages"]
    assert report["failure"] is None and captured.trace.summary()["warnings"] == []
    assert report["compiled_shapes"] >= 1 and report["eager_shapes"] == 0
    assert isinstance(captured_stages[0], CapturedStages)
    if mode != "auto":  # one tree shape: a graph per stage and batch size
        assert report["graphs"] == 2 * 2


def test_a_replay_hands_back_what_each_stage_changes_in_its_arguments(model, captured_stages):
    """``draft`` sets the window state's drafts, ``conclude`` (in ``commit``) writes the codes
    and the columns' targets in place; nothing else changes an argument."""
    run(model, replace(MODES["above_target+ac"], compile_stages=True), batch=2)
    handed_back = {}
    for layout, recorded in captured_stages[0]._graphs.items():
        tensors = [path for path, node in compiled._nodes(recorded.graph.unchanged)
                   if isinstance(node, torch.Tensor)]
        handed_back.setdefault(layout[0].__name__, set()).add(
            (frozenset(tensors[index] for index in recorded.written), frozenset(recorded.replaced)))
    assert handed_back == {"draft": {(frozenset(), frozenset({(0, "tokens"), (0, "q"),
                                                              (0, "source")}))},
                           "conclude": {(frozenset({(12,), (13,)}), frozenset())}}


@pytest.mark.usefixtures("unchecked_draws")  # targets not handed back are all 0
@pytest.mark.parametrize("dropped", ["written", "replaced"])
def test_replays_that_do_not_hand_back_the_changes_draw_other_codes(model, captured_stages,
                                                                    monkeypatch, dropped):
    """A graph changes only its copies of the arguments: without the changes copied back (the
    codes ``commit`` writes, the drafts ``draft`` sets) the codes go wrong."""
    stage_graph = compiled._StageGraph
    monkeypatch.setattr(compiled, "_StageGraph", lambda graph, written, replaced: stage_graph(
        graph, **{"written": written, "replaced": replaced, dropped: []}))
    captured = run(model, replace(MODES["above_target+ac"], compile_stages=True), batch=2)
    assert captured.trace.meta["compile_stages"]["graphs"] == 4
    assert not torch.equal(captured.codes, run(model, MODES["above_target+ac"], batch=2).codes)


@dataclass
class _Counter:
    total: torch.Tensor
    last: torch.Tensor | None = None


def _count(counter: _Counter, step: torch.Tensor, scale: float) -> torch.Tensor:
    """Changes its arguments as the stages do: a tensor written in place, and a field set."""
    counter.total.add_(step)
    counter.last = step * scale
    return counter.total * 2


def test_a_replay_returns_copies_and_changes_the_arguments_as_the_eager_call(replayed_graphs):
    stages = CapturedStages(torch.device("cuda"))
    counters, outputs = [], []
    for step in (1.0, 2.0, 3.0):
        counters.append(_Counter(torch.zeros(2)))
        outputs.append(stages(_count, (4, ()), counters[-1], torch.full((2,), step), 0.5))
    # kept from one replay to the next, as the engine keeps them
    assert [output.tolist() for output in outputs] == [[2.0] * 2, [4.0] * 2, [6.0] * 2]
    assert [c.total.tolist() for c in counters] == [[1.0] * 2, [2.0] * 2, [3.0] * 2]
    assert [c.last.tolist() for c in counters] == [[0.5] * 2, [1.0] * 2, [1.5] * 2]
    assert len(replayed_graphs.recorded) == 1
    stages(_count, (4, ()), _Counter(torch.zeros(2)), torch.ones(2), 2.0)  # another value
    stages(_count, (4, ()), _Counter(torch.zeros(3)), torch.ones(3), 0.5)  # another size
    assert stages.report() == {"compiled_shapes": 1, "eager_shapes": 0, "failure": None,
                               "graphs": 3}
    assert [g.pool_given for g in replayed_graphs.recorded] == [None] + ["pool of graph 1"] * 2


@dataclass(frozen=True)
class _Scale:
    factor: torch.Tensor


def _scaled(scale: _Scale, values: torch.Tensor) -> torch.Tensor:
    return values * scale.factor


def test_a_frozen_dataclass_s_tensors_are_read_in_place_and_each_records_its_own_graph(
        replayed_graphs):
    """A draft tree's tensors never change: a replay copies only the other arguments in, and
    another tree of the same shapes (other values) records a graph of its own."""
    stages = CapturedStages(torch.device("cuda"))
    triple, double = _Scale(torch.full((2,), 3.0)), _Scale(torch.full((2,), 2.0))
    copied = []
    original_copy = torch.Tensor.copy_

    def counting_copy(tensor, source, *args, **kwargs):
        copied.append(source)
        return original_copy(tensor, source, *args, **kwargs)

    for step in (1.0, 2.0):
        values = torch.full((2,), step)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(torch.Tensor, "copy_", counting_copy)
            assert stages(_scaled, (4, ()), triple, values).tolist() == [3.0 * step] * 2
    graph = replayed_graphs.recorded[0]
    assert graph.inputs[0] is triple.factor and graph.inputs[1] is not values
    assert any(source is values for source in copied)
    assert not any(source is triple.factor for source in copied)
    assert stages(_scaled, (4, ()), double, torch.ones(2)).tolist() == [2.0] * 2
    assert stages(_scaled, (4, ()), triple, torch.ones(2)).tolist() == [3.0] * 2
    assert len(replayed_graphs.recorded) == 2


def _add_to_first(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    first.add_(1.0)
    return second.clone()


def test_a_stage_that_writes_memory_another_argument_shares_runs_eagerly(replayed_graphs):
    """A graph on separate copies of the two would not see the write through the other."""
    stages = CapturedStages(torch.device("cuda"))
    assert stages(_add_to_first, (4, ()), torch.zeros(2), torch.zeros(2)).tolist() == [0.0] * 2
    shared = torch.zeros(2)
    for done in (1.0, 2.0):
        assert stages(_add_to_first, (4, ()), shared, shared[:]).tolist() == [done] * 2
    uniforms = torch.rand(4)  # memory shared but only read: recorded
    assert torch.equal(stages(torch.add, (4, ()), uniforms[:2], uniforms[2:]),
                       uniforms[:2] + uniforms[2:])
    assert len(replayed_graphs.recorded) == 2
    assert stages.report() == {"compiled_shapes": 1, "eager_shapes": 1, "failure": None,
                               "graphs": 2}


def test_a_refused_stage_recording_runs_eagerly_with_one_warning(model, captured_stages,
                                                                 replayed_graphs, monkeypatch):
    monkeypatch.setattr(replayed_graphs, "refuse", True)
    result = run(model, replace(MODES["pac+vp"], compile_stages=True), batch=2)
    assert torch.equal(result.codes, run(model, MODES["pac+vp"], batch=2).codes)
    assert result.trace.summary()["warnings"] == [
        "compile_stages=True: recording a CUDA graph failed (RuntimeError: CUDA error: operation "
        "not permitted when stream is capturing), so the decoding stages ran uncompiled for the "
        "rest of this generation (the same distribution, only slower)"]
    report = result.trace.meta["compile_stages"]
    assert report["compiled_shapes"] == 0 and report["graphs"] == 0


def test_captured_stage_shapes_past_the_cap_run_eagerly(replayed_graphs):
    stages = CapturedStages(torch.device("cuda"))
    for shape in [*range(MAX_COMPILED_SHAPES + 2), 0]:
        assert stages(torch.add, (shape,), torch.ones(2), shape).tolist() == [1.0 + shape] * 2
    assert stages.report() == {"compiled_shapes": MAX_COMPILED_SHAPES, "eager_shapes": 2,
                               "failure": None, "graphs": MAX_COMPILED_SHAPES}
    assert len(replayed_graphs.recorded) == MAX_COMPILED_SHAPES


@pytest.mark.slow
def test_auto_does_not_time_the_iterations_in_which_the_network_compiled(monkeypatch):
    """Every tenth network call here compiles for half a second (as a new shape would, or a CUDA
    graph recorded again after the cache moved); ``auto``'s times stay those of the network
    running."""
    import time

    from sjd_core.decoding import planner

    calls = [0]

    def every_tenth_call_compiles(self, *tensors):
        calls[0] += 1
        if calls[0] % 10 == 0:
            self.compilations += 1
            time.sleep(0.5)
        return self._eager(*tensors)

    monkeypatch.setattr(CompiledNetwork, "__call__", every_tenth_call_compiles)
    monkeypatch.setattr(planner, "_PROFILES", {})
    model = SyntheticModel(codebook_size=32, grid=(16, 16), width=32, layers=1, heads=2,
                           sharpness=2.0, seed=5)
    run(model, replace(MODES["auto"], shape_cost="time", compile=True))
    profile = next(iter(planner._PROFILES[model].values()))
    assert calls[0] >= 40 and len(profile.seconds) >= 2
    assert max(profile.seconds.values()) < 0.2, profile.seconds


@pytest.mark.parametrize("value", [1, "yes", "on"])
def test_compile_must_be_a_bool_or_none(value):
    with pytest.raises(ValueError, match=rf"compile={value!r} is not allowed: compile must be "
                                         r"True, False or None \(on for CUDA only\)"):
        AccelerationSettings(compile=value)


def test_past_the_graphs_torch_keeps_per_function_the_run_warns(monkeypatch):
    """Torch would run the network uncompiled without a word once it holds too many graphs of
    it; the run says so instead."""
    monkeypatch.setattr(compiled, "PROCESS_GRAPHS", 1)

    def doubled(inputs, positions, mask):
        return inputs * 2

    network = CompiledNetwork(doubled, torch.device("cpu"))
    for tokens in (1, 2):
        out = network(torch.ones(2, tokens), torch.zeros(2, tokens), torch.zeros(2, 1, tokens, 8))
        assert torch.equal(out, torch.full((2, tokens), 2.0))
    assert network.shapes == {(((2, 1), (1, 1)), ((2, 1), (1, 1)), ((2, 1, 1, 8), (8, 8, 8, 1)))}
    assert "FailOnRecompileLimitHit" in network.report()["failure"]
