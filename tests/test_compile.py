"""The ``compile`` and ``compile_stages`` settings: the network compiled (by inductor, or as CUDA
graphs per fed shape, replayed here by a stand-in on the CPU), and the speculative stages
compiled whole, draw what eager draws.

Compiled logits differ from eager ones only by float rounding; on this model and seed no draw
flips, so the codes are bit-identical in every mode (on another model a draw may flip, as
between batch sizes). AUTO chooses its shapes by forward passes here (by time its choice would
follow the compiled speed), and compiled it also feeds each of its shapes once early, to compile
them: its uncompiled run feeds the shapes the compiled one chose, in the same order.

Inductor compiles on a CPU take seconds per graph, so the model is the engine tests' small
synthetic one with one layer; the modes share the network's graphs, which compile once.
``torch.compiler.set_stance("fail_on_recompile")`` shows where nothing compiles again.
"""

from dataclasses import replace

import pytest
import torch

from sjd_core.decoding import engine
from sjd_core.decoding.engine import generate
from sjd_core.decoding.settings import AccelerationSettings, SamplingSettings
from sjd_core.decoding.trace import summary_text
from sjd_core.models.protocol import GenerationRequest
from sjd_core import compiled
from sjd_core.models.session import slot_session
from sjd_core.decoding.drafting import DraftTree
from sjd_core.compiled import (MAX_CAPTURED_SHAPES, CapturedNetwork, CompiledNetwork,
                               CompiledStages, backend, compile_stages)
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
def test_compiled_codes_equal_eager(model, mode, monkeypatch):
    compiled_run, eager = run_and_replay_eagerly(model, mode, monkeypatch, compile=True)
    assert torch.equal(compiled_run.codes, eager.codes)
    report = compiled_run.trace.meta["compile"]
    assert report["failure"] is None and compiled_run.trace.summary()["warnings"] == []
    assert report["compiled_shapes"] >= 1 and report["eager_shapes"] == 0
    assert "compile" not in eager.trace.meta


@pytest.mark.slow
@pytest.mark.usefixtures("without_device_checks")  # a compiled stage cannot read its weights back
@pytest.mark.parametrize("mode, batch", [("pac+vp", 3), ("pac+vp", 1), ("above_target+ac", 1)])
def test_compiled_stages_draw_the_eager_codes(model, mode, batch):
    """Draft; verify, commit and advance together; and the session's keep, each compiled whole
    (with the network uncompiled): the same codes, a shape per stage, tree shape and rows (rows
    leave the batch as they finish), and a second generation that compiles nothing again."""
    eager = run(model, MODES[mode], batch=batch)
    compiled_run = run(model, replace(MODES[mode], compile_stages=True), batch=batch)
    assert torch.equal(compiled_run.codes, eager.codes)
    report = compiled_run.trace.meta["compile_stages"]
    assert report["failure"] is None and compiled_run.trace.summary()["warnings"] == []
    assert 3 <= report["compiled_shapes"] == report["graphs"] <= 3 * batch
    assert report["eager_shapes"] == 0
    assert "compile" not in compiled_run.trace.meta and "compile_stages" not in eager.trace.meta
    with torch.compiler.set_stance("fail_on_recompile"):  # kept by torch for the process
        again = run(model, replace(MODES[mode], compile_stages=True), batch=batch)
    assert torch.equal(again.codes, eager.codes)
    assert again.trace.meta["compile_stages"]["failure"] is None


@pytest.mark.slow
@pytest.mark.usefixtures("without_device_checks")  # a compiled stage cannot read its weights back
def test_a_window_cut_shorter_runs_the_graph_its_shape_compiled(model, monkeypatch):
    """``auto`` feeding a shorter window after a longer one cuts the window state: the stages of
    the shorter shape must run the graph they compiled from a fresh state, not compile again
    for a cut view's strides (an unannounced compile, seconds on a CPU, that ``auto`` and
    ``gpu_check`` would time as the shape's cost)."""
    window = {n: DraftTree.build(n, (), torch.device("cpu")) for n in (8, 16)}
    settings = replace(MODES["sjd"], compile_stages=True)

    def feeding(trees: list) -> None:
        monkeypatch.setattr(engine, "make_plan", lambda *args: _Replay("sjd", trees))

    feeding([window[8]] * 2 + [window[16]] * 40)  # each shape's graphs, from a fresh state
    first = run(model, settings)
    feeding([window[8]] * 2 + [window[16]] * 2 + [window[8]] * 40)
    with torch.compiler.set_stance("fail_on_recompile"):
        again = run(model, settings)
    assert first.trace.meta["compile_stages"]["failure"] is None
    assert again.trace.meta["compile_stages"]["failure"] is None
    feeding([window[8]] * 2 + [window[16]] * 2 + [window[8]] * 40)
    assert torch.equal(again.codes, run(model, MODES["sjd"]).codes)


def test_a_stage_compile_failure_falls_back_to_eager_with_one_warning(model, monkeypatch):
    def no_compiler(function, **options):
        assert options == {"fullgraph": True, "mode": None}

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
    network = CompiledNetwork(lambda x, p, m: x + 1)
    assert torch.equal(network(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 1, 3, 4)),
                       torch.ones(2, 3))
    assert "Dynamo is not supported on this Python" in network.report()["failure"]


def test_one_graph_of_symbolic_lengths_serves_every_later_shape():
    """Torch's automatic dynamic shapes: the first call compiles for its sizes, the first call
    of another fed length compiles one graph with the length symbolic, and every later length
    runs through it; so do rows leaving the batch, once a second row count compiled. The first
    call of each of these graphs counts as one that may compile (it is not timed), and no
    other call does: a length of 1 goes back to the first graph, torch's own choice too."""
    def network(inputs, positions, mask):
        return inputs * 2 + positions + mask.sum((1, 3))

    compiled_network = CompiledNetwork(network)
    def call(rows: int, tokens: int) -> None:
        inputs = torch.rand(rows, tokens)
        out = compiled_network(inputs, torch.zeros(rows, tokens), torch.zeros(rows, 1, tokens, 8))
        assert torch.equal(out, inputs * 2)

    for rows, tokens in ((3, 1), (3, 4), (2, 4)):  # compiles: static, length, rows symbolic
        call(rows, tokens)
    with torch.compiler.set_stance("fail_on_recompile"):
        for rows, tokens in ((3, 2), (3, 7), (3, 33), (2, 9), (3, 1), (3, 4)):
            call(rows, tokens)
    report = compiled_network.report()
    assert report.pop("compile_seconds") > 0.0  # three compiles
    assert report == {"compiled_shapes": 3, "eager_shapes": 0, "failure": None}
    assert compiled_network.compilations == 3  # the first call of each graph


def test_arguments_of_new_strides_count_as_a_shape_as_inductor_compiles_them_again():
    """Inductor specialises a graph to its arguments' strides: the same shapes with other
    strides may compile again, so they count as a layout of their own (untimed at first)."""
    def doubled(inputs, positions):
        return inputs * 2 + positions

    network = CompiledNetwork(doubled)
    square = torch.ones(3, 3)
    for inputs in (square, square.t()):
        assert torch.equal(network(inputs, torch.zeros(3, 3)), inputs * 2)
    with torch.compiler.set_stance("fail_on_recompile"):  # a layout booked compiles no more
        for inputs in (square + 1, square.t() + 1):
            assert torch.equal(network(inputs, torch.zeros(3, 3)), inputs * 2)
    assert network.compilations == 2
    report = network.report()
    assert report.pop("compile_seconds") > 0.0
    assert report == {"compiled_shapes": 2, "eager_shapes": 0, "failure": None}


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
    the copies of the arguments; a replay runs it again on those copies and writes what it gives
    into the output the recording gave, the same tensor at every replay, as a graph's kernels
    write the same memory."""

    recorded: list = []
    refuse = False

    def _record(self, function, stream):
        if self.refuse:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        self.function = function
        self.recorded.append(self)
        return function(*self.inputs)

    def _replay(self):
        self.output.copy_(self.function(*self.inputs))


@pytest.fixture
def replayed_graphs(monkeypatch):
    monkeypatch.setattr(compiled, "_Graph", _ReplayedGraph)
    monkeypatch.setattr(_ReplayedGraph, "recorded", [])
    monkeypatch.setattr(CapturedNetwork, "_on_side_stream", lambda self, call: call())
    return _ReplayedGraph


def test_cuda_sessions_capture_graphs_and_others_compile_with_inductor(model, monkeypatch):
    session = model.start(GenerationRequest(prompt="a red fox", guidance=2.0, max_nodes=4))
    assert isinstance(session.compile_network(), CompiledNetwork)
    monkeypatch.setattr(session, "device", torch.device("cuda"))
    assert isinstance(session.compile_network(), CapturedNetwork)
    assert compile_stages(torch.device("cpu")).mode is None
    assert compile_stages(torch.device("cuda")).mode == "reduce-overhead"
    assert [backend(torch.device(name)) for name in ("cuda", "cpu", "mps")] == [
        "cuda graphs", "inductor", "inductor"]


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
    report = network.report()
    assert report.pop("compile_seconds") >= 0.0
    assert report == {"compiled_shapes": 2, "eager_shapes": 0, "recordings": 3, "failure": None}
    for tokens in range(6, 6 + MAX_CAPTURED_SHAPES):
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
    def captured_on_the_cpu(network, device, ready, buffers):
        return CapturedNetwork(network, device, ready, buffers)

    monkeypatch.setattr(slot_session, "compile_network", captured_on_the_cpu)
    monkeypatch.setattr(compiled, "MAX_CAPTURED_SHAPES", 64)
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
    drafts of each row pass differently) runs its last forwards with fewer rows, compiled, and
    draws the eager codes."""
    rows = []
    call = compiled.CompiledNetwork.__call__

    def spied(network, *tensors):
        rows.append(len(tensors[0]))
        return call(network, *tensors)

    monkeypatch.setattr(compiled.CompiledNetwork, "__call__", spied)
    settings = MODES["above_target+ac"]
    compiled_run = run(model, replace(settings, compile=True), batch=3)
    assert min(rows) < max(rows) and compiled_run.trace.meta["compile"]["failure"] is None
    assert compiled_run.trace.meta["compile"]["eager_shapes"] == 0
    assert torch.equal(compiled_run.codes, run(model, settings, batch=3).codes)


@pytest.mark.parametrize("network, batch", [("eager", 1), ("eager", 3), ("inductor", 1),
                                            ("inductor", 3), ("captured", 1)])
def test_plain_autoregression_reads_the_columns_in_use_whatever_the_sessions_capacity(
        model, monkeypatch, replayed_graphs, network, batch):
    """Eager and compiled by inductor, at any batch, a plain autoregressive step attends over
    the cache's columns in use (its cost grows along the image, and compiled never above
    eager's), so a session made for ``auto``'s largest shape, with more capacity, costs an AR
    step what one made for AR alone does; compiled, through two graphs: the first step's and
    one whose length is symbolic. CUDA graphs hold fixed shapes: every step attends over the
    whole capacity."""
    attended, capacity = [], []
    attention = slot_session.SlotSession._attention

    def spied(session, tokens, *rows):  # (outside the network: compiled code holds no spy)
        mask = attention(session, tokens, *rows)
        if tokens == 1:  # one token per row: an AR step (the prefill feeds more)
            attended[-1].append(session._first_column + 1 if mask is None else mask.shape[-1])
            capacity[-1] = session.store.capacity
        return mask

    monkeypatch.setattr(slot_session.SlotSession, "_attention", spied)
    if network == "captured":
        monkeypatch.setattr(slot_session, "compile_network", CapturedNetwork)
    compiling = {"compile": network != "eager"}
    ar_steps = [DraftTree.build(1, (), torch.device("cpu"))] * 36
    results = []
    for settings in (MODES["ar"], AccelerationSettings.preset("auto", shape_cost="passes")):
        attended.append([]), capacity.append(0)
        monkeypatch.setattr(engine, "make_plan", lambda settings, *rest: _Replay(
            settings.mode_name, list(ar_steps)))
        results.append(run(model, replace(settings, **compiling), batch))
    ar, auto = attended
    assert capacity[1] > capacity[0]
    if network == "captured":  # (recording a graph runs the network once more)
        assert set(ar) == {capacity[0]} and set(auto) == {capacity[1]}
    else:
        assert ar == auto == list(range(ar[0], ar[0] + 36))
    if network == "inductor":
        assert [r.trace.meta["compile"]["compiled_shapes"] for r in results] == [2, 2]
    eager_ar = run(model, MODES["ar"], batch).codes
    assert all(torch.equal(result.codes, eager_ar) for result in results)


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
    compiled_network = CompiledNetwork(lambda x: x + 1, lambda: settled[0])
    for network in (captured, compiled_network):
        assert torch.equal(network(torch.zeros(2)), torch.ones(2))
        assert network.compilations == 0 and not network.shapes
    settled[0] = True
    for network in (captured, compiled_network):
        network(torch.zeros(2))
        assert network.compilations == 1 and len(network.shapes) == 1
    assert len(replayed_graphs.recorded) == 1 and len(calls) == 1


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
            self.shapes.add(calls[0])  # a new shape: a call that may have compiled
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


def test_a_step_that_may_compile_is_announced_before_it_and_its_time_summed(model, monkeypatch):
    """Before the first call of each shape (it may compile, seconds on a CPU) the progress hears a
    ``compiling`` report; the seconds of those calls reach the summary line, and the command-line
    bar says so while they run."""
    import time

    def slow_first_compile(network, **options):
        seen = set()

        def compiled_network(*args):
            shapes = tuple(arg.shape for arg in args)
            if shapes not in seen:  # compiles: 0.6 s
                seen.add(shapes)
                time.sleep(0.6)
            return network(*args)
        return compiled_network

    monkeypatch.setattr(torch, "compile", slow_first_compile)
    reports = []
    result = generate(model, GenerationRequest(prompt="a red fox"), SAMPLING,
                      replace(MODES["sjd"], compile=True), seed=3, on_iteration=reports.append)
    compiling = [r for r in reports if r.compiling]
    report = result.trace.meta["compile"]
    assert len(compiling) == report["compiled_shapes"] >= 1
    assert report["compile_seconds"] >= 0.6 * len(compiling)
    assert len(reports) - len(compiling) == result.trace.summary()["nfe"]
    summary = result.trace.summary()
    assert summary["compile_seconds"] == report["compile_seconds"]
    assert f"compiling took {summary['compile_seconds']:.1f} s (once per process)" in \
        summary_text(summary)
    from sjd_core.tools.cli import COMPILING, ImageProgress

    bar = ImageProgress("SJD")
    bar(compiling[0])
    assert bar.bar.postfix == COMPILING
    bar(next(r for r in reports if not r.compiling))
    assert not bar.bar.postfix
    bar.close()


def _tagged(values: torch.Tensor, tag: str) -> torch.Tensor:
    """A stage whose graph depends on a value torch cannot make symbolic (a string)."""
    return values * 2 if tag.endswith("0") else values + len(tag)


def test_each_stage_shape_compiles_under_its_own_code_object_past_torch_s_limit():
    """Torch keeps at most 8 graphs per code object (``recompile_limit``; past it a fullgraph
    function fails): twelve shapes that each need a graph of their own all run compiled, and the
    same shape in a later generation finds its graph (nothing compiles again)."""
    values = torch.arange(3.0)
    stages = CompiledStages()
    for number in range(12):
        tag = f"shape {number}"
        want = _tagged(values, tag)
        assert torch.equal(stages(_tagged, (number,), 3, values, tag), want)
    assert stages.report()["failure"] is None and stages.report()["compiled_shapes"] == 12
    later = CompiledStages()
    with torch.compiler.set_stance("fail_on_recompile"):
        assert torch.equal(later(_tagged, (5,), 3, values, "shape 5"), _tagged(values, "shape 5"))
    assert later.report()["failure"] is None
    assert compiled._own_code(_tagged, (5,)) is compiled._own_code(_tagged, (5,))
    assert compiled._own_code(_tagged, (5,)).__code__ is not _tagged.__code__
