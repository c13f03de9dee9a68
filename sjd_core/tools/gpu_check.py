"""Time the decoding on a randomly initialised model of real size: one command, one GPU, one table.

    python -m sjd_core.tools.gpu_check                 # Lumina-mGPT 7B layout, 768 px, bf16, CUDA
    python -m sjd_core.tools.gpu_check --json out.json # the table as JSON too
    python -m sjd_core.tools.gpu_check --tiny          # the same layout at toy width, on the CPU

The model has Lumina-mGPT 7B's shape (32 layers, width 4096, the 65,536-token vocabulary with its
8,192 image codes) with random weights, guidance on (a conditional and an unconditional row).
Random weights say nothing about acceptance; the table measures costs, and where they come from:

* forwards of 1, 16, 34 (the PAC tree) and 64 nodes, with the cache empty, half and fully
  filled with an image's codes: the host's time to dispatch one (wall-clock, no synchronisation)
  and the device's busy time (the profiler's total of kernel time). A host time above the busy
  time means the forward is bound by kernel launches, not by the device;
* plain autoregression, PAC+VP and auto, each eager and compiled (``compile=True``: CUDA graphs
  over a static cache on CUDA), and each with its stages compiled too (``compile_stages=True``:
  inductor, in its CUDA-graph mode on CUDA; for plain autoregression the step after the
  network): per iteration the
  wall-clock, the host's time outside waiting on reads, the device's busy time, codes, reads
  back to the host and blocking host-to-device copies; and the seconds to the first measured
  iteration (which include compiling);
* peak memory;
* the memory-bandwidth floor of a step (:mod:`.bandwidth_floor`): the bytes one step must read
  (the weights it uses, and the KV cache at the mean fill over the image: each context's prompt
  and half the image's codes, conditional and unconditional rows) over the bandwidth of a large
  copy measured on the device; then every run's time per iteration (the device's busy time on
  CUDA, the wall-clock elsewhere, as the column says) as a multiple of the floor and of a
  compiled AR step, its host time's share of its wall time and its seconds to the first
  measured iteration, with the goals for the next GPU run beside them (compiled AR at most 1.5x
  the floor; a speculative iteration with its stages compiled at most 1.3x a compiled AR step
  and its host time at most 20% of its wall time; compiling and capturing at most 120 s cold);
* transformers' own ``generate()`` on the same network, prompts and sampling (its guidance runs
  the unconditional context as a second forward per token; the stock forward masks the image
  tokens, so it draws text tokens): milliseconds per code over a fixed number of tokens;
* projected image times, marked as such: the image's codes at one code per iteration for AR
  and ``generate()``, and at the codes per iteration published for Lumina-mGPT 7B at 768 px
  (SJD 2.22, SJD-PAC 4.51) with the time per iteration of the faster compiled PAC+VP row;
* a distribution check of the compiled stages (:mod:`.draw_check`): PAC+VP's stages, compiled
  or captured as a generation runs them, draw 16,384 pairs of codes over a small codebook,
  compared with their float64 distribution by a chi-square test; PASS or FAIL.

Time: the command must fit in 8 minutes on one H100 from a fresh machine; the estimate is about
3 minutes. Without the ``compiled + stages`` rows, the floor, ``generate()`` and the draw check
it took under 2 minutes on an H200 (model built in 10 s). Each speculative ``compiled + stages``
row runs about 76 iterations of 10 to 65 ms and records a few graphs: some 10 s; AR's, added
later, runs its iterations of under 10 ms and records one stage graph. The parts added last,
estimated from their sizes and from ``--tiny`` on a 2-core CPU (where the whole command takes
40 to 70 s): the bandwidth, six copies of 1 GiB (under a second); ``generate()``, 66 tokens at
two eager forwards each, which dispatch in 34 to 58 ms on that H200 (5 to 8 s); the
projections, arithmetic; the draw check, two stage graphs recorded and six iterations of 16,384
rows of 34 nodes over 8 codes replayed (a few seconds; 2 to 8 s on the CPU, which compiles the
stages by inductor instead).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from operator import itemgetter

import torch

from ..decoding.drafting import DraftTree
from ..decoding import engine
from ..decoding.engine import generate
from ..decoding.planner import LEARNING_ITERATIONS
from ..decoding.settings import AccelerationSettings, SamplingSettings
from ..messages import plural
from ..models.chameleon import (LUMINA, ChameleonImageModel, TokenLayout, lumina_resolutions,
                                synthetic_vocabulary)
from ..models.protocol import GenerationRequest
from ..models.vqgan import VQGANConfig, VQGANDecoder
from ..models.session.slot_session import SlotSession
from . import draw_check
from .bandwidth_floor import (COPY_REPEATS, PUBLISHED_CODES_PER_ITERATION, StepFloor,
                              copy_bandwidth, mean_fill_positions,
                              projected_image_seconds, synchronize)
from .bench import generate_seconds
from .host_reads import HostReads

PROMPT = "a photograph of a red fox sitting in fresh snow at dawn, soft light, high detail"
RESOLUTION = (768, 768)
MODES = ("ar", "pac+vp", "auto")
# how every mode runs: (compile, compile_stages): eager, compiled, and its stages compiled too
WAYS = ((False, False), (True, False), (True, True))
FILLS = {"empty": 0.0, "half": 0.5, "full": 1.0}  # share of the image's codes already cached
FORWARD_NODES = 64  # the largest forward timed: a full cache leaves room for it
SAMPLING = SamplingSettings(guidance=3.0, temperature=1.0, top_k=2000)
# goals for the next GPU run, printed beside the values (not pass/fail claims)
TARGET_AR_FLOOR = 1.5  # compiled AR's step, as a multiple of the floor
TARGET_AR_STEP = 1.3  # a speculative iteration, as a multiple of a compiled AR step
TARGET_HOST_SHARE = 0.20  # a speculative iteration's host time, as a share of its wall time
TARGET_FIRST_SECONDS = 120.0  # compiling and capturing before the first measured iteration, cold


@dataclass(frozen=True)
class Size:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    vocab: int
    vqgan: VQGANConfig
    vq_encoder: dict | None = None  # transformers' ChameleonVQVAEConfig fields (None: the real one)
    copy_bytes: int = 2**30  # the copy that measures the bandwidth
    generate_tokens: int = 64  # tokens transformers' generate() draws in its timed call
    draws: int = 16384  # rows of the draw check


REAL = Size(hidden=4096, intermediate=11008, layers=32, heads=32, vocab=65536,  # Chameleon 7B
            vqgan=VQGANConfig())
TINY = Size(hidden=64, intermediate=128, layers=2, heads=4, vocab=9000,
            vqgan=VQGANConfig(embed_dim=8, z_channels=8, ch=32, ch_mult=(1, 2), num_res_blocks=1,
                              resolution=32),
            vq_encoder={"embed_dim": 8, "latent_channels": 8, "base_channels": 32,
                        "channel_multiplier": [1, 2], "num_res_blocks": 1, "resolution": 32},
            copy_bytes=2**28, generate_tokens=16)


class _WordTokenizer:
    """Whitespace words -> one unknown-token id each: prompt length without tokenizer files."""

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": [3] * len(text.split())}


def build_model(size: Size, device: torch.device, dtype: torch.dtype) -> ChameleonImageModel:
    """A Lumina-mGPT-layout model with random weights, built directly on ``device``."""
    from accelerate import init_empty_weights
    from accelerate.utils import set_module_tensor_to_device
    from transformers import ChameleonConfig, ChameleonForConditionalGeneration

    vocab = synthetic_vocabulary(8192)
    config = ChameleonConfig(
        vocab_size=size.vocab, hidden_size=size.hidden, intermediate_size=size.intermediate,
        num_hidden_layers=size.layers, num_attention_heads=size.heads, num_key_value_heads=size.heads,
        max_position_embeddings=4096, vocabulary_map=vocab, bos_token_id=0, eos_token_id=2,
        pad_token_id=1, vq_config=size.vq_encoder)
    config._attn_implementation = "sdpa"
    with init_empty_weights(include_buffers=False):  # parameters empty, buffers real
        model = ChameleonForConditionalGeneration(config)
    generator = torch.Generator(device=device).manual_seed(0)
    for name, p in list(model.named_parameters()):
        value = torch.empty(p.shape, dtype=dtype, device=device)
        if "norm" in name:  # layer norms: identity (weight 1, bias 0)
            value.fill_(1.0 if name.endswith("weight") else 0.0)
        else:
            value.normal_(0.0, 0.02, generator=generator)
        set_module_tensor_to_device(model, name, device, value=value, dtype=dtype)
    model.to(device)
    vqgan = VQGANDecoder(size.vqgan).to(device).eval()
    resolutions = lumina_resolutions(768)
    layout = TokenLayout.read(vocab, LUMINA, resolutions)
    return ChameleonImageModel(LUMINA, model.eval(), _WordTokenizer(), vqgan, resolutions, layout)


class _Busy:
    """The device's busy time over a stretch of work: the profiler's total of kernel time on CUDA
    (None elsewhere, where the host does the work itself)."""

    def __init__(self, device: torch.device) -> None:
        self.profiler = None
        if device.type == "cuda":
            from torch.profiler import ProfilerActivity, profile

            self.profiler = profile(activities=[ProfilerActivity.CUDA])

    def start(self) -> None:
        if self.profiler is not None:
            self.profiler.start()

    def stop(self) -> float | None:
        """Seconds of kernel time since ``start``."""
        if self.profiler is None:
            return None
        self.profiler.stop()
        kernels = [e for e in self.profiler.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA]
        return sum(e.time_range.elapsed_us() for e in kernels) / 1e6


def filled_session(model: ChameleonImageModel, fill: float):
    """A guided session whose cache holds ``fill`` of the image's codes (random ones, fed as one
    chain and kept), leaving room for a forward of :data:`FORWARD_NODES`; returns it and the
    codes committed."""
    request = GenerationRequest(prompt=PROMPT, guidance=3.0, resolution=RESOLUTION,
                                max_nodes=FORWARD_NODES)
    session = model.start(request)
    codes_per_image = session.grid_height * session.grid_width
    committed = int(fill * (codes_per_image - FORWARD_NODES))
    if committed:
        chain = DraftTree.build(committed, (), model.device)
        codes = torch.randint(0, model.codebook_size, (1, committed), device=model.device)
        session.forward(codes, (chain.depth - 1)[None], chain.ancestors, [0])
        session.keep(torch.ones(1, committed, dtype=torch.bool, device=model.device))
    return session, committed


def time_forward(model: ChameleonImageModel, session, committed: int, tree: DraftTree,
                 repeats: int) -> dict:
    """Median host milliseconds to dispatch one forward feeding ``tree`` after ``committed``
    codes (no synchronisation), and the device's busy milliseconds per forward; each forward is
    thrown away again."""
    device = model.device
    codes = torch.randint(0, model.codebook_size, (1, tree.size), device=device)
    slots = (tree.depth - 1 + committed)[None]
    keep_none = torch.zeros(1, tree.size, dtype=torch.bool, device=device)
    host = []
    for _ in range(repeats + 1):  # the first call warms up
        synchronize(device)
        started = time.perf_counter()
        session.forward(codes, slots, tree.ancestors, [committed])
        host.append(time.perf_counter() - started)
        session.keep(keep_none)
    synchronize(device)
    busy = _Busy(device)
    busy.start()
    for _ in range(repeats):
        session.forward(codes, slots, tree.ancestors, [committed])
        session.keep(keep_none)
    synchronize(device)
    busy_seconds = busy.stop()
    return {"host_ms": 1e3 * statistics.median(host[1:]),
            "busy_ms": None if busy_seconds is None else 1e3 * busy_seconds / repeats}


class _Stop(Exception):
    pass


class ReadWait:
    """Seconds the host spends in the tensor methods that read values back, over a stretch of
    work: the methods are wrapped on the tensor class, so unlike a torch function mode it adds
    nothing to the other operations (whose dispatch time is what is being measured)."""

    METHODS = tuple(sorted(HostReads.READS | {"cpu"}))  # what HostReads counts as reads

    def __init__(self) -> None:
        self.seconds = 0.0
        self._originals: dict[str, object] = {}

    def __enter__(self) -> "ReadWait":
        for name in self.METHODS:
            original = getattr(torch.Tensor, name)
            self._originals[name] = torch.Tensor.__dict__.get(name)  # None: inherited

            def timed(tensor, *args, _original=original, **kwargs):
                started = time.perf_counter()
                try:
                    return _original(tensor, *args, **kwargs)
                finally:
                    self.seconds += time.perf_counter() - started
            setattr(torch.Tensor, name, timed)
        return self

    def __exit__(self, *exc) -> None:
        for name, own in self._originals.items():
            if own is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, own)
        self._originals.clear()


class _Compiling:
    """What compiles inside it: the sessions' compiled networks and the generations' compiled
    stages (their reports: shapes compiled, graphs, failure), which ``generate`` puts in a
    trace only at the end."""

    def __enter__(self) -> dict[str, list]:
        self.made: dict[str, list] = {"network": [], "stages": []}
        self._network, self._stages = SlotSession.compile_network, engine.compile_stages

        def network(session):
            made = self._network(session)
            self.made["network"].append(made)
            return made

        def stages(device):
            made = self._stages(device)
            self.made["stages"].append(made)
            return made
        SlotSession.compile_network, engine.compile_stages = network, stages
        return self.made

    def __exit__(self, *exc) -> None:
        SlotSession.compile_network, engine.compile_stages = self._network, self._stages


def run_name(run: dict) -> str:
    """``pac+vp eager``, ``pac+vp compiled`` or ``pac+vp compiled + stages``."""
    return f"{run['mode']} " + ("compiled + stages" if run["stages"] else
                                "compiled" if run["compiled"] else "eager")


class _Stretches:
    """The stretches of a run that :func:`run_mode` measures, by iterations done: warm-up, then
    ``iterations`` timed, ``counted`` ones under :class:`HostReads` (it slows every operation, so
    it stays out of the timed stretch), then ``profiled`` ones under the profiler. An iteration
    that may compile after the warm-up (a shape's first call, which the ``compiling`` report
    announces) starts every stretch again after it: its seconds are compiling's, no shape's."""

    def __init__(self, device: torch.device, warmup: int, lengths: tuple[int, int, int]) -> None:
        self.device, self.lengths, self.restarts = device, lengths, 0
        self.started = time.perf_counter()
        self._begin_after(warmup)

    def _begin_after(self, done: int) -> None:
        timed, counted, profiled = self.lengths
        self.marks = (done, done + timed, done + timed + counted, done + timed + counted + profiled)
        self.reads, self.waits, self.busy = HostReads(), ReadWait(), _Busy(self.device)
        self.counting = self.profiling = False  # the read counters, the profiler under way
        self.seen: dict = {}

    def step(self, report) -> None:
        if report.compiling:
            if report.iteration >= self.marks[0]:
                self.leave()
                self.restarts += 1
                self._begin_after(report.iteration + 1)
            return
        marks, seen = self.marks, self.seen
        if report.iteration == marks[0]:
            synchronize(self.device)
            seen.update(committed=report.committed[0], began=time.perf_counter(),
                        warmup_seconds=time.perf_counter() - self.started)
            self.waits.__enter__()
        elif report.iteration == marks[1]:
            self.waits.__exit__()
            seen.update(ended=time.perf_counter(), committed_end=report.committed[0])
            self.reads.__enter__()
            self.counting = True
        elif report.iteration == marks[2]:
            self.leave()
            synchronize(self.device)
            self.busy.start()
            self.profiling = True
        elif report.iteration == marks[3]:
            synchronize(self.device)
            seen["busy_seconds"], self.profiling = self.busy.stop(), False
            seen["codes"] = report.codes[:, :min(report.committed)].cpu()
            raise _Stop

    def leave(self) -> None:
        """Undo what a stretch under way put in place (the read counters, the profiler)."""
        self.waits.__exit__()
        if self.counting:
            self.reads.__exit__(None, None, None)
        if self.profiling:
            self.busy.stop()
        self.counting = self.profiling = False


def run_mode(model: ChameleonImageModel, preset: str, compiled: bool, warmup: int,
             iterations: int, counted: int, profiled: int, stages: bool = False) -> dict:
    """``preset`` (guided, 768 px), eager or compiled (``stages``: its stages too), measured in
    the stretches of :class:`_Stretches`: after ``warmup`` iterations (compiling happens there;
    for ``auto`` also the iterations in which a new profile learns, so that what is measured is
    what it settles on), ``iterations`` timed ones (wall-clock, and the host's time outside
    waiting in reads), ``counted`` ones (reads and blocking copies), ``profiled`` ones (device
    busy time)."""
    settings = replace(AccelerationSettings.preset(preset), compile=compiled,
                       compile_stages=stages)
    warmup += LEARNING_ITERATIONS if settings.adaptive_shape else 0
    stretches = _Stretches(model.device, warmup, (iterations, counted, profiled))
    request = GenerationRequest(prompt=PROMPT, resolution=RESOLUTION)
    try:
        with _Compiling() as compiling:
            generate(model, request, SAMPLING, settings, seed=0, on_iteration=stretches.step)
    except _Stop:
        pass
    finally:
        stretches.leave()
    seen, reads = stretches.seen, stretches.reads
    if "busy_seconds" not in seen:
        raise RuntimeError(f"the image ended before {iterations} iterations in a row ran without "
                           f"compiling ({plural(stretches.restarts, 'restart')})")
    wall = seen["ended"] - seen["began"]
    busy_seconds = seen["busy_seconds"]
    return {"mode": preset, "compiled": compiled, "stages": stages, "iterations": iterations,
            "warmup_seconds": seen["warmup_seconds"], "restarts": stretches.restarts,
            "ms_per_iteration": 1e3 * wall / iterations,
            "host_ms_per_iteration": 1e3 * (wall - stretches.waits.seconds) / iterations,
            "busy_ms_per_iteration": None if busy_seconds is None
            else 1e3 * busy_seconds / profiled,
            "codes_per_iteration": (seen["committed_end"] - seen["committed"]) / iterations,
            "reads_per_iteration": reads.count / counted,
            "blocking_copies_per_iteration": reads.blocking_copies / counted,
            "network": compiling["network"][0].report() if compiling["network"] else None,
            "stage_graphs": compiling["stages"][0].report() if compiling["stages"] else None,
            "codes": seen["codes"]}


def forward_shapes(device: torch.device) -> dict[str, DraftTree]:
    return {"1 node": DraftTree.build(1, (), device),
            "16-node window": DraftTree.build(16, (), device),
            "34-node PAC tree": DraftTree.build(16, (4, 4), device),
            "64-node window": DraftTree.build(FORWARD_NODES, (), device)}


def measure(size: Size, device: torch.device, dtype: torch.dtype, warmup: int, iterations: int,
            counted: int, profiled: int, repeats: int, show=None) -> dict:
    """Every number of the table; ``show(table)`` after each step (the table so far)."""
    show = show or (lambda table: None)
    bandwidth = copy_bandwidth(device, size.copy_bytes)  # before the model takes the memory
    built = time.perf_counter()
    model = build_model(size, device, dtype)
    table = {"model": f"Lumina-mGPT layout, {size.layers} layers x {size.hidden}, "
                      f"{str(dtype).removeprefix('torch.')}, {device}, 768 px, guidance on",
             "build_seconds": time.perf_counter() - built, "forwards": [], "runs": [],
             "peak_memory_gib": None}
    table["floor"] = step_floor(model, bandwidth, size.copy_bytes)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    measure_forwards(model, table, repeats, show)
    measure_runs(model, table, (warmup, iterations, counted, profiled), show)
    table["generate"] = _attempt(lambda: time_generate(model, size.generate_tokens))
    table["against_floor"] = against_floor(table)
    table["projected"] = projections(table)
    show(table)
    # the modes' compiled graphs are done with; with them still held, the check's new shapes of
    # the same stages compiled about twice as long on a CPU
    torch.compiler.reset()
    table["draw_check"] = _attempt(lambda: draw_check.run_check(device, size.draws))
    show(table)
    return table


def _attempt(part: Callable[[], dict]) -> dict:
    """``part()``, or what it raised: one part failing leaves the others' numbers."""
    try:
        return part()
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}"}


def measure_forwards(model: ChameleonImageModel, table: dict, repeats: int, show) -> None:
    """The forwards table: every forward shape at every cache fill."""
    for fill, share in FILLS.items():
        session, committed = filled_session(model, share)
        for name, tree in forward_shapes(model.device).items():
            timed = time_forward(model, session, committed, tree, repeats)
            table["forwards"].append({"nodes": name, "cache": fill, "cached_codes": committed,
                                      **timed})
        del session
        show(table)


def measure_runs(model: ChameleonImageModel, table: dict, counts: tuple[int, int, int, int],
                 show) -> None:
    """Every mode every way (``counts``: warm-up, timed, counted and profiled iterations), the
    compiled codes compared with the eager ones, and the peak memory so far."""
    eager_codes, device = {}, model.device
    for preset in MODES:
        for compiled, stages in WAYS:
            run = _attempt(lambda: run_mode(model, preset, compiled, *counts, stages))
            if "error" in run:
                table["runs"].append({"mode": preset, "compiled": compiled, "stages": stages,
                                      **run})
                show(table)
                continue
            codes = run.pop("codes")
            if not compiled:
                eager_codes[preset] = codes
            elif preset in eager_codes:
                run["codes_compared"], run["first_difference"] = _compare(eager_codes[preset],
                                                                          codes)
            table["runs"].append(run)
            if device.type == "cuda":
                table["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            show(table)


def weights_read(model: ChameleonImageModel) -> int:
    """Bytes of the weights one step reads: every decoder layer's and the final norm's, and the
    head's codebook rows (the session's logits cover the codebook alone); the embedding table is
    only indexed, and the image tokenizer is not used."""
    backbone, head = model.model.model, model.model.lm_head.weight
    read = [*backbone.layers.parameters(), *backbone.norm.parameters()]
    return (sum(p.numel() * p.element_size() for p in read)
            + model.codebook_size * head.shape[1] * head.element_size())


def step_floor(model: ChameleonImageModel, bandwidth: float, copy_bytes: int) -> dict:
    """The floor of a guided step at the mean fill over an image (each context's prompt and
    half the image's codes), and at the session's whole cache capacity, which its attention
    reads under a mask (:mod:`.models.session.kv_store`)."""
    session = model.start(GenerationRequest(prompt=PROMPT, guidance=SAMPLING.guidance,
                                            resolution=RESOLUTION))
    codes = session.grid_height * session.grid_width
    positions = mean_fill_positions(len(model.prompt_ids(PROMPT, RESOLUTION)),
                                    len(model.unconditional_ids(RESOLUTION)), codes)
    capacity = session.store.rows * session.store.capacity
    shape, weights = model.memory_shape, weights_read(model)
    at_fill = StepFloor(weights, shape.cache_bytes(positions), bandwidth)
    at_capacity = StepFloor(weights, shape.cache_bytes(capacity), bandwidth)
    return {"copy_bytes": copy_bytes, "bandwidth_gb_s": bandwidth / 1e9, "image_codes": codes,
            "cached_positions": positions, "weight_bytes": weights,
            "cache_bytes": at_fill.cache_bytes, "step_bytes": at_fill.step_bytes,
            "floor_ms": at_fill.floor_ms, "capacity_positions": capacity,
            "capacity_step_bytes": at_capacity.step_bytes,
            "capacity_floor_ms": at_capacity.floor_ms}


def time_generate(model: ChameleonImageModel, new_tokens: int) -> dict:
    """transformers' own ``generate()`` on the same network, prompts and sampling (guided by
    its own classifier-free guidance: the unconditional context as a second forward per token):
    milliseconds per code from a call of ``new_tokens`` less one of a single token (which holds
    the prompts' prefill), after an untimed call. The stock forward masks the image tokens, so
    it draws text tokens: it measures the cost per token."""
    ids = torch.tensor([model.prompt_ids(PROMPT, RESOLUTION)], device=model.device)
    negative = torch.tensor([model.unconditional_ids(RESOLUTION)], device=model.device)

    def seconds(tokens: int) -> float:
        return generate_seconds(model.model, ids, negative, SAMPLING, tokens, seed=0,
                                pad_token_id=model.model.config.pad_token_id)
    seconds(1)
    first = seconds(1)
    return {"new_tokens": new_tokens, "guided": True,
            "ms_per_code": 1e3 * (seconds(new_tokens) - first) / (new_tokens - 1)}


def _compare(eager: torch.Tensor, compiled: torch.Tensor) -> tuple[int, int | None]:
    """Codes both runs committed, and the first slot where they differ (None: nowhere)."""
    n = min(eager.shape[1], compiled.shape[1])
    differs = (eager[:, :n] != compiled[:, :n]).any(0).nonzero()
    return n, int(differs[0]) if len(differs) else None


def _step_ms(run: dict) -> float:
    """A run's milliseconds per iteration: the device's busy time where it was measured
    (CUDA), the wall-clock elsewhere."""
    busy = run["busy_ms_per_iteration"]
    return run["ms_per_iteration"] if busy is None else busy


def targets_of(run: dict) -> list[str]:
    """The goals for the next GPU run that apply to ``run`` (printed beside its values)."""
    targets = [f"x floor <= {TARGET_AR_FLOOR}"] if run["mode"] == "ar" and run["compiled"] else []
    if run["stages"] and run["mode"] != "ar":
        targets += [f"x compiled AR step <= {TARGET_AR_STEP}",
                    f"host <= {TARGET_HOST_SHARE:.0%} of wall"]
    if run["compiled"]:
        targets.append(f"s to first measured <= {TARGET_FIRST_SECONDS:.0f} cold")
    return targets


def against_floor(table: dict) -> list[dict]:
    """Every measured run's time per iteration as a multiple of the floor and of a compiled AR
    step, its host time's share of its wall time, and the targets that apply to it."""
    floor_ms = table["floor"]["floor_ms"]
    runs = [r for r in table["runs"] if "error" not in r]
    ar = next((r for r in runs if r["mode"] == "ar" and r["compiled"]), None)
    return [{"run": run_name(r),
             "time": "wall" if r["busy_ms_per_iteration"] is None else "device busy",
             "ms_per_iteration": _step_ms(r), "floor_multiple": _step_ms(r) / floor_ms,
             "ar_step_multiple": None if ar is None else _step_ms(r) / _step_ms(ar),
             "host_share": r["host_ms_per_iteration"] / r["ms_per_iteration"],
             "warmup_seconds": r["warmup_seconds"], "targets": targets_of(r)} for r in runs]


def _projected(decoding: str, codes_per_iteration: float, published: bool, timed_as: str,
               ms_per_iteration: float, codes: int) -> dict:
    """One row of the projected image times."""
    return {"decoding": decoding, "codes_per_iteration": codes_per_iteration,
            "published": published, "timed_as": timed_as, "ms_per_iteration": ms_per_iteration,
            "seconds": projected_image_seconds(codes, codes_per_iteration, ms_per_iteration)}


def projections(table: dict) -> dict:
    """Image times projected from measured wall-clock times per iteration: AR (the faster)
    and ``generate()`` at one code per iteration, SJD and SJD-PAC at their published codes
    per iteration, each iteration as long as the faster compiled PAC+VP row's; the speed-up
    against AR."""
    codes = table["floor"]["image_codes"]
    runs = [r for r in table["runs"] if "error" not in r]
    wall = itemgetter("ms_per_iteration")
    ar = min((r for r in runs if r["mode"] == "ar"), key=wall, default=None)
    rows = [] if ar is None else [_projected("AR", 1.0, False, run_name(ar), wall(ar), codes)]
    if "ms_per_code" in table["generate"]:
        rows.append(_projected("transformers generate()", 1.0, False, "generate()",
                               table["generate"]["ms_per_code"], codes))
    pac = min((r for r in runs if r["mode"] == "pac+vp" and r["compiled"]), key=wall,
              default=None)
    if pac is not None:
        rows += [_projected(name, rate, True, run_name(pac), wall(pac), codes)
                 for name, rate in PUBLISHED_CODES_PER_ITERATION.items()]
    ar_seconds = rows[0]["seconds"] if rows and rows[0]["decoding"] == "AR" else None
    for row in rows:
        row["speedup_vs_ar"] = None if ar_seconds is None else ar_seconds / row["seconds"]
    return {"image_codes": codes, "rows": rows}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _run_rows(r: dict) -> list[str]:
    """One mode's row of the runs table, and a warning row for each compiling that failed."""
    name = run_name(r)
    if "error" in r:
        return [f"| {name} | failed: {r['error'][:200]} |"]
    network = r["network"] or {}
    stage_graphs = r["stage_graphs"] or {}
    graphs = "-" if not network else (f"{network['compiled_shapes']} "
                                      f"(+{network['eager_shapes']} eager)")
    graphs += f"; stages {stage_graphs['graphs']}" if stage_graphs else ""
    same = "-"
    if "codes_compared" in r:
        same = (f"same {r['codes_compared']}" if r["first_difference"] is None
                else f"differ from slot {r['first_difference']} of {r['codes_compared']}")
    rows = [f"| {name} | {_ms(r['ms_per_iteration'])} | {_ms(r['host_ms_per_iteration'])} "
            f"| {_ms(r['busy_ms_per_iteration'])} | {r['codes_per_iteration']:.2f} | "
            f"{r['reads_per_iteration']:.2f} | {r['blocking_copies_per_iteration']:.2f} | "
            f"{r['warmup_seconds']:.1f} | {graphs} | {same} |"]
    rows += [f"|  | warning: {failure} |"
             for failure in (network.get("failure"), stage_graphs.get("failure")) if failure]
    if r.get("restarts"):
        rows.append(f"|  | measured after {plural(r['restarts'], 'iteration')} that compiled "
                    "past the warm-up (each started the measured stretches again) |")
    return rows


def format_table(table: dict) -> str:
    """The check's report: the forwards table, the modes table and each mode's speed."""
    lines = [f"model: {table['model']} (built in {table['build_seconds']:.1f} s)", "",
             "| forward | cache | host ms | device busy ms |", "| --- | --- | ---: | ---: |"]
    lines += [f"| {f['nodes']} | {f['cache']} ({f['cached_codes']} codes) | {_ms(f['host_ms'])} | "
              f"{_ms(f['busy_ms'])} |" for f in table["forwards"]]
    runs = [r for r in table["runs"] if "error" not in r]
    if table["runs"]:
        lines += ["", "| mode | ms / iteration | host ms | device busy ms | codes / iteration | "
                      "reads | blocking copies | s to first measured | graphs | codes as eager |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in table["runs"]:
        lines += _run_rows(r)
    ar = {run_name(r).removeprefix("ar "): r["ms_per_iteration"] for r in runs
          if r["mode"] == "ar"}
    if ar:
        baseline = min(ar.values())
        named = ", ".join(f"{ms:.2f} {name}" for name, ms in ar.items())
        lines += ["", f"plain autoregression ms per code: {named}; codes per second against "
                      f"the faster ({baseline:.2f} ms):"]
        for r in runs:
            per_code = r["ms_per_iteration"] / max(r["codes_per_iteration"], 1e-9)
            lines.append(f"  {run_name(r)}: {baseline / per_code:.2f}x")
    if table["peak_memory_gib"] is not None:
        lines.append(f"peak memory: {table['peak_memory_gib']:.1f} GiB")
    lines += format_floor(table) + format_generate(table) + format_projected(table)
    if "draw_check" in table:
        lines += ["", draw_check.describe(table["draw_check"])]
    return "\n".join(lines)


def _gb(count: int) -> str:
    """Bytes in GB (MB below one GB: the toy model's)."""
    return f"{count / 1e9:,.2f} GB" if count >= 1e9 else f"{count / 1e6:,.2f} MB"


def format_floor(table: dict) -> list[str]:
    """The bandwidth and the floor, then every run against them, with the targets beside."""
    if "floor" not in table:
        return []
    f = table["floor"]
    lines = ["", f"memory-bandwidth floor: a copy of {f['copy_bytes'] / 2**20:,.0f} MiB moved "
                 f"{f['bandwidth_gb_s']:,.1f} GB/s (read + written, the fastest of "
                 f"{COPY_REPEATS}); a step reads {_gb(f['weight_bytes'])} of weights and "
                 f"{_gb(f['cache_bytes'])} of KV cache at the mean fill over the image "
                 f"({f['cached_positions']:,} positions: each context's prompt and half the "
                 f"image's {f['image_codes']:,} codes, conditional and unconditional rows) = "
                 f"{_gb(f['step_bytes'])}: floor {f['floor_ms']:.3f} ms per step",
             f"(the session's attention reads its whole cache, {f['capacity_positions']:,} "
             f"positions: {_gb(f['capacity_step_bytes'])}, {f['capacity_floor_ms']:.3f} ms)"]
    rows = table.get("against_floor", [])
    if rows:
        clock = ("device busy" if all(r["time"] == "device busy" for r in rows)
                 else "wall (no device busy time here)")
        lines += ["", f"| mode | {clock} ms / iteration | x floor | x compiled AR step | "
                      "host / wall | s to first measured | targets for the next GPU run |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
        lines += [f"| {r['run']} | {r['ms_per_iteration']:.3f} | {r['floor_multiple']:.2f}x | "
                  f"{_times(r['ar_step_multiple'])} | {r['host_share']:.0%} | "
                  f"{r['warmup_seconds']:.1f} | {'; '.join(r['targets']) or '-'} |" for r in rows]
        lines.append("AR commits one code per iteration: its rows are per code. Targets are "
                     "goals, not results; the modes are timed near the image's start, below the "
                     "mean fill the floor counts.")
    return lines


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def format_generate(table: dict) -> list[str]:
    """transformers' ``generate()``: its time per code, and that against the floor."""
    timed = table.get("generate")
    if timed is None:
        return []
    name = ("transformers generate() (its own guidance, a second forward per token; the stock "
            "forward masks the image tokens, so it draws text tokens)")
    if "error" in timed:
        return ["", f"{name}: failed: {timed['error'][:200]}"]
    return ["", f"{name}: {timed['ms_per_code']:.2f} ms per code (wall; {timed['new_tokens']} "
                f"tokens after the prompt, the prefill taken out), "
                f"{timed['ms_per_code'] / table['floor']['floor_ms']:.2f}x the floor"]


def format_projected(table: dict) -> list[str]:
    """The projected image times, marked as projected."""
    projected = table.get("projected")
    if not projected or not projected["rows"]:
        return []
    lines = ["", f"projected image time, not measured (768 px, {projected['image_codes']:,} "
                 "codes; codes per iteration as published for Lumina-mGPT 7B at 768 px, times "
                 "per iteration measured here, wall-clock; prefill and image decoding not "
                 "counted):",
             "| decoding | codes / iteration | ms / iteration | timed as | projected s / image | "
             "speed-up vs AR |",
             "| --- | ---: | ---: | --- | ---: | ---: |"]
    for r in projected["rows"]:
        rate = f"{r['codes_per_iteration']:.2f}" + (" (published)" if r["published"] else "")
        lines.append(f"| {r['decoding']} | {rate} | {r['ms_per_iteration']:.2f} | "
                     f"{r['timed_as']} | {r['seconds']:.1f} | {_times(r['speedup_vs_ar'])} |")
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line's options."""
    parser = argparse.ArgumentParser(prog="python -m sjd_core.tools.gpu_check",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="toy width on the CPU (a smoke test)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="iterations before measuring, compiling included (default 12 real, "
                             "2 tiny)")
    parser.add_argument("--iterations", type=int, default=None,
                        help="measured iterations per mode (default 48 real, 4 tiny)")
    parser.add_argument("--counted", type=int, default=None,
                        help="iterations per mode counting reads and blocking copies (default 8 "
                             "real, 2 tiny)")
    parser.add_argument("--progress", action="store_true",
                        help="print the table so far to stderr after every step")
    parser.add_argument("--profiled", type=int, default=None,
                        help="iterations per mode under the profiler (default 8 real, 1 tiny)")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats of each forward")
    parser.add_argument("--json", default=None, help="also write the table to this JSON file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Measure and print the table; exit code 2 without CUDA unless ``--tiny``."""
    args = parse_args(argv)
    if args.tiny:
        device, dtype, size = torch.device("cpu"), torch.float32, TINY
        torch.set_num_threads(1)  # toy sizes gain nothing from threads; leave the other cores be
    else:
        if not torch.cuda.is_available():
            print("No CUDA device: run with --tiny for the CPU smoke test.", file=sys.stderr)
            return 2
        device, dtype, size = torch.device("cuda"), torch.bfloat16, REAL

    def show(table: dict) -> None:  # every step as soon as it is measured, for a long run
        if args.json:
            with open(args.json, "w", encoding="utf-8") as handle:
                json.dump(table, handle, indent=1)
        if args.progress:
            print(format_table(table), "\n", file=sys.stderr, flush=True)

    table = measure(size, device, dtype, args.warmup or (2 if args.tiny else 12),
                    args.iterations or (4 if args.tiny else 48),
                    args.counted or (2 if args.tiny else 8),
                    args.profiled or (1 if args.tiny else 8),
                    args.repeats or (2 if args.tiny else 10), show)
    print(format_table(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
