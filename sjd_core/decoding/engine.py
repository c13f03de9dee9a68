"""The decoding loop: draft -> feed -> verify -> commit -> advance, one iteration at a time.

One loop serves every mode. Each iteration a plan (:mod:`.planner`) picks the shape to feed:
window 1 is plain autoregression, which takes a lean step (one node, the target sampled, nothing
drafted or verified); a longer window, with or without a proactive-drafting tree, takes the
speculative step, whose device stages are :mod:`.stages` (AC, PD, VP and relaxed acceptance
change only how drafts are made, :mod:`.drafting`, and tested, :mod:`.verify`). A fixed mode's
plan always picks its own shape; ``auto`` picks the shape that should commit the most codes per second, from what it measured in
the iterations before (so the choice never depends on the iteration's own draws, and every
lossless shape, chosen this way, stays exact).

Per iteration the loop reads at most one small tensor back from the device: the number of slots
each row has committed (plain autoregression needs none: it commits one slot per row). Rows have
their own random streams (seed + row) and commit their own number of slots per iteration; all rows
feed the same node shape. When an image is finished its row leaves the batch (``retain``), so the
rows still decoding no longer pay for it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from ..messages import plural, quote
from ..transfer import host_to_device
from ..models.protocol import DecodingSession, GenerationRequest, ImageTokenModel, MemoryShape
from ..compiled import CompiledStages, compile_stages
from .drafting import Canvas, DraftTree, WindowState
from .guidance import SlotGuidance
from .planner import Plan, describe_shape, largest_shape, make_plan
from .sampling import IterationUniforms, RowRandom
from .settings import AccelerationSettings, SamplingSettings, require
from .stages import Outcome, autoregressive, conclude, draft
from .trace import Trace, TraceRecorder
from .verify import acceptance_rule


@dataclass
class IterationReport:
    """Progress after one iteration, for progress bars, previews and interruption."""

    iteration: int
    committed: list[int]  # slots committed so far, per image of the batch
    accepted: list[int]  # slots committed by this iteration, per image
    total: int  # slots per image
    codes: torch.Tensor  # (B, total) on the model's device; row b is valid up to committed[b]
    shape: str  # what this iteration fed, e.g. "AR", "chain 8", "tree 4x3 + chain 16"
    compiling: bool = False  # sent before the iteration: it runs a shape that may compile first


@dataclass
class GenerationResult:
    """Generated code grids (B, H, W) on the CPU and the trace of how they were made."""

    codes: torch.Tensor
    trace: Trace


def _check_arguments(request: GenerationRequest, seed: int) -> None:
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63 - 2**16:
        raise ValueError(f"seed={quote(seed)} is not allowed: seed must be an integer in [0, 2**63 - 65536).")
    batch = request.batch_size
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise ValueError(f"batch_size={quote(batch)} is not allowed: batch_size must be an "
                         "integer >= 1.")
    for name in ("prompt", "negative_prompt"):
        if not isinstance(getattr(request, name), str):
            raise ValueError(f"{name}={quote(getattr(request, name))} is not allowed: {name} must "
                             "be a string.")


class _Decoder:
    """The state of one generation: committed codes, drafts, random streams, the session.

    Tensors hold the rows still decoding; ``rows`` maps them to the images of the batch.
    ``codes`` and the trace keep every image (row-major flat indices ``row * stride + slot``,
    where column ``slots`` of each row absorbs writes past the grid).
    """

    def __init__(self, model: ImageTokenModel, session: DecodingSession, sampling: SamplingSettings,
                 acceleration: AccelerationSettings, seed: int, device: torch.device,
                 count_vp_rises: bool = False,
                 compiled_stages: CompiledStages | None = None) -> None:
        batch = session.batch_size
        self.session, self.sampling, self.acceleration = session, sampling, acceleration
        self.height, self.width = session.grid_height, session.grid_width
        self.slots, self.vocab = self.height * self.width, model.codebook_size
        self.stride = self.slots + 1
        self.device = device
        self.rows = list(range(batch))
        self.row_start = torch.arange(batch, device=device) * self.stride
        self.random = RowRandom([seed + row for row in range(batch)], device)
        self.recorder = TraceRecorder(batch, self.slots, device)
        self.codes = torch.zeros(batch * self.stride, dtype=torch.long, device=device)
        self.grids = self.codes.view(batch, self.stride)[:, :self.slots]  # every image's codes
        self.committed = torch.zeros(batch, dtype=torch.long, device=device)
        self.done = [0] * batch  # host copy of ``committed``
        self.anchor = torch.zeros(batch, dtype=torch.long, device=device)
        self.rule = acceptance_rule(acceleration, None if acceleration.lossless
                                    else model.codebook_embeddings().to(device))
        self.guidance = SlotGuidance(sampling, self.height, self.width, device)
        self.state: WindowState | None = None  # drafts; None after plain autoregressive steps
        # per column, the target of the last committed slot (+ a column that absorbs the rest)
        self.column_targets = (torch.zeros(batch, self.width + 1, self.vocab, device=device)
                               if acceleration.init == "above_target" else None)
        self.iteration = 0
        self.siblings = (0, 0)  # PD candidates 2..K tested and passed in the last iteration
        self.count_vp_rises = count_vp_rises and acceleration.verification_prediction
        self.compiled_stages = compiled_stages

    # ------------------------------------------------------------------ steps
    def autoregressive_step(self) -> list[int]:
        """One node per row, its target sampled (:func:`.stages.autoregressive`): plain
        autoregression."""
        uniforms = self.random.uniform(1)
        cond, uncond = self.session.advance(self.anchor, self.done, self.recorder.clock.mark)
        drawn = self._stage_runner((1, ()))(
            autoregressive, cond, uncond, self.sampling, self.guidance.at(self.committed),
            uniforms, self.committed, self.row_start, self.codes, self.column_targets,
            self.width)
        self.recorder.committed_slots(self.iteration, drawn.written, drawn.peak)
        self.committed, self.anchor = drawn.committed, drawn.token
        self.state = None
        self.done = [d + 1 for d in self.done]
        self.siblings = (0, 0)
        return [1] * len(self.rows)

    def speculative_step(self, tree: DraftTree) -> list[int]:
        """Draft the window as ``tree``, feed it, then verify it, commit the accepted path and
        advance the window in one call (the stages of :mod:`.stages`), keep the trace and the
        accepted path's cache, and read the committed counts back once.

        The drafts held are those of the window fed now: where ``auto`` feeds a shorter window
        than the iteration before, the drafts past it are dropped (keeping them would cost every
        iteration a shift and a redraft of slots it does not feed); a longer one starts its new
        offsets undrafted."""
        self._fit_window(tree.window)
        numbers = IterationUniforms.take(self.random, tree.size, tree.branching, tree.window,
                                         tree.tree_levels, self.vocab)
        stage = self._stage_runner((tree.window, tree.profile))
        drafts = stage(draft, self.state, tree, self._canvas(), self.acceleration.init, numbers)
        cond, uncond = self.session.forward(drafts.tokens, drafts.slots, tree.host_ancestors,
                                            self.done, self.recorder.clock.mark)
        outcome = stage(conclude, tree, cond, uncond, self.sampling,
                        self.guidance.after(drafts.slots), drafts, self.state, numbers, self.rule,
                        self.acceleration.adaptive_shape, self.committed, self.row_start,
                        self.codes, self.column_targets, self.slots, self.width,
                        self.acceleration)
        self._record(outcome)
        self.session.keep(outcome.kept, stage)
        self.state, self.committed, self.anchor = outcome.state, outcome.committed, outcome.anchor
        return self._read_committed(outcome.read)

    def _stage_runner(self, shape: tuple[int, tuple[int, ...]]) -> Callable:
        """Runs a stage of :mod:`.stages` on its arguments: compiled where the stages are
        (``compile_stages``; per tree ``shape``, (window, profile), with the batch's rows), as
        it is otherwise."""
        if self.compiled_stages is None:
            return lambda function, *args: function(*args)
        rows = len(self.rows)
        return lambda function, *args: self.compiled_stages(function, shape, rows, *args)

    def _fit_window(self, window: int) -> None:
        """A window state of ``window`` offsets: empty after plain autoregressive steps, cut or
        extended (new offsets undrafted) when the window changed."""
        if self.state is None:
            self.state = WindowState.empty(len(self.rows), window, self.vocab, self.device,
                                           self.acceleration.verification_prediction)
        elif self.state.tokens.shape[1] != window:
            self.state = self.state.resized(window)

    def _record(self, outcome: Outcome) -> None:
        """The trace's records of the iteration (and VP's bet, where counted, on the window the
        drafts came from)."""
        made, verdict = outcome.made, outcome.verdict
        self.recorder.entered_window(self.iteration, made.entered)
        self.recorder.committed_slots(self.iteration, made.writes, outcome.path_peaks,
                                      verdict.kinds, verdict.probability, made.sources)
        if self.count_vp_rises:
            self._count_rises(verdict.tokens, made.committing)

    def _read_committed(self, read: torch.Tensor) -> list[int]:
        """The iteration's one read (:attr:`.stages.Outcome.read`): the committed counts, and
        PD's sibling counts where it made them; returns the slots each row gained."""
        previous, host = self.done, read.tolist()
        rows = len(previous)
        self.done = host[:rows]
        self.siblings = (host[rows], host[rows + 1]) if len(host) > rows else (0, 0)
        return [now - before for before, now in zip(previous, self.done)]

    def _count_rises(self, committed: torch.Tensor, valid: torch.Tensor) -> None:
        """VP's bet, checked: for the slots committed now that had a history, whether the
        committed code was one whose probability rose ``vp_rises`` times in a row, whether any
        code had, and whether the likeliest such code is the committed one."""
        fed = committed.shape[1]
        rises = self.state.vp_rises[:, :fed] >= self.acceleration.vp_rises
        counted = valid & self.state.vp_known[:, :fed]
        rose = rises.gather(-1, committed[..., None]).squeeze(-1)
        # probabilities are >= 0, so the largest is -1 only where no code rose
        likeliest = torch.where(rises, self.state.vp_last[:, :fed], -1.0).max(-1)
        self.recorder.count_rises(counted, rose, likeliest.values >= 0,
                                  likeliest.indices == committed)

    def _canvas(self) -> Canvas:
        """What the init rules may look at: the committed codes and the columns' targets."""
        return Canvas(self.codes, self.row_start, self.committed, self.anchor, self.width,
                      self.slots, self.column_targets)

    # ------------------------------------------------------------------ batch
    def drop_finished(self) -> None:
        """Let finished images leave the batch (the session, the streams, the state)."""
        going_on = [i for i, done in enumerate(self.done) if done < self.slots]
        if len(going_on) == len(self.rows):
            return
        if not going_on:
            self.rows = []
            return
        index = host_to_device({"rows": np.asarray(going_on)}, self.device)["rows"]
        self.session.retain(going_on)
        self.random.retain(going_on, index)
        self.rows = [self.rows[i] for i in going_on]
        self.done = [self.done[i] for i in going_on]
        self.row_start, self.committed, self.anchor = (
            self.row_start[index], self.committed[index], self.anchor[index])
        if self.column_targets is not None:
            self.column_targets = self.column_targets[index]
        if self.state is not None:
            self.state = self.state.rows(index)

    def report(self, accepted: list[int], shape: str, compiling: bool = False
               ) -> IterationReport:
        batch = self.recorder.batch
        committed, gained = [self.slots] * batch, [0] * batch
        for i, row in enumerate(self.rows):
            committed[row], gained[row] = self.done[i], accepted[i]
        return IterationReport(self.iteration, committed, gained, self.slots, self.grids, shape,
                               compiling)


FALLBACK_MEMORY = 16 * 2**30  # bytes assumed free where the device cannot say


PROMPT_POSITIONS = 256  # cache positions counted for the prompt and its template (not more)


def decoding_bytes(batch: int, nodes: int, window: int, vocab: int, guided: bool,
                   history: bool, positions: int = 0, shape: MemoryShape | None = None) -> int:
    """Estimated bytes one generation allocates beyond the weights, at its largest iteration.

    The engine's own float32 tensors per row: the logits of every fed node over the codebook
    (twice with guidance) and about four tensors of that size while the target is made and
    verified, plus the window's draft distributions (four of them with VP's history). With the
    model's ``shape`` and the session's ``positions`` (prompt, image, row ends and fed nodes),
    per sequence (two per image with guidance): the KV cache, the attention mask and scores of
    the fed nodes over every position, and the network's activations for the fed nodes.
    """
    per_row = 4 * (nodes * vocab * (6 if guided else 5) + window * vocab * (4 if history else 1))
    if shape is not None:
        sequences = 2 if guided else 1
        attention = nodes * positions * (1 + 2 * shape.heads)  # mask, scores and weights
        activations = nodes * (4 * shape.hidden + 3 * shape.intermediate)
        per_row += sequences * (shape.cache_bytes(positions)
                                + shape.dtype_bytes * (attention + activations))
    return batch * per_row


def memory_budget(device: object) -> int:
    """Free bytes on ``device``: CUDA's free memory, the machine's available memory for the CPU,
    or ``FALLBACK_MEMORY`` where neither can be read."""
    try:
        device = torch.device(device)
        if device.type == "cuda":
            return int(torch.cuda.mem_get_info(device)[0])
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError, RuntimeError):
        return FALLBACK_MEMORY


def check_batch(model: ImageTokenModel, request: GenerationRequest, sampling: SamplingSettings,
                acceleration: AccelerationSettings) -> None:
    """Refuse a batch whose generation cannot fit in the free memory of the model's device
    (CUDA's free memory, or the machine's available memory), before anything is allocated.

    Counts what :func:`decoding_bytes` estimates at the largest shape ``acceleration`` feeds,
    with the KV cache when the model carries a ``memory_shape``. ``generate`` calls it first;
    tools that do other work with the same batch (a benchmark's baseline) call it before that.
    """
    acceleration = acceleration.for_codebook(model.codebook_size)
    nodes = largest_shape(acceleration)
    height, width = model.grid_for(request.resolution)
    positions = PROMPT_POSITIONS + height * (width + 1) + 2 * nodes
    guided = sampling.guidance != 1.0
    need = decoding_bytes(request.batch_size, nodes, acceleration.window, model.codebook_size,
                          guided, acceleration.verification_prediction, positions,
                          getattr(model, "memory_shape", None))
    free = memory_budget(model.device)
    require(need <= free, "batch_size", request.batch_size,
             f"small enough for the generation to fit: it would take about {need / 2**30:,.1f} "
             f"GiB ({plural(nodes, 'node')} and a window of {acceleration.window} over "
             f"{model.codebook_size} codes per image, {height}x{width} codes"
             f"{', guided' if guided else ''}), and {free / 2**30:,.1f} GiB are free; draw fewer "
             "images per run, or lower the window or pd_candidates")


@torch.inference_mode()
def generate(model: ImageTokenModel, request: GenerationRequest, sampling: SamplingSettings,
             acceleration: AccelerationSettings, seed: int,
             on_iteration: Callable[[IterationReport], None] | None = None,
             count_vp_rises: bool = False) -> GenerationResult:
    """Generate ``request.batch_size`` code grids; row b uses random seed ``seed + b``.

    Each row draws from its own random stream, so row b follows the same distribution as seed
    ``seed + b`` generated alone, with the same codes wherever the batched and single forwards
    give equal logits; they may differ by about 1e-5, so on a long image a draw can flip and
    the rest of that row differ, in every mode.

    ``on_iteration`` is called after every iteration and may raise to stop (the exception
    propagates; the model itself is left usable). ``count_vp_rises`` also counts, with VP, how
    well its rises predicted the committed codes (the trace's ``vp_rises``: a dozen operations
    per iteration, for the reference benchmark). Runs in inference mode (no autograd and no
    version counts, which makes each small tensor operation cheaper). Before the prefill it
    refuses (ValueError) a bad seed, batch size or prompt type, more PD candidates than the
    codebook has codes in a fixed mode (``auto`` tries fewer instead), and a batch whose
    decoding state would not fit in the device's memory.
    """
    _check_arguments(request, seed)
    acceleration = acceleration.for_codebook(model.codebook_size)
    check_batch(model, request, sampling, acceleration)
    device = torch.device(model.device)
    marks: list = []  # the recorder's clock, once the decoder exists
    max_nodes = largest_shape(acceleration)
    session = model.start(replace(request, guidance=sampling.guidance, max_nodes=max_nodes))
    network = session.compile_network() if acceleration.compiles_on(device.type) else None
    stages = compile_stages(device) if acceleration.compile_stages else None
    compiled = {name: c for name, c in (("compile", network), ("compile_stages", stages))
                if c is not None}
    plan: Plan = make_plan(acceleration, model, request, sampling, device,
                           lambda i: marks[0].seconds_between(4 * i, 4 * i + 3),
                           session.grid_height * session.grid_width)
    decoder = _Decoder(model, session, sampling, acceleration, seed, device, count_vp_rises,
                       stages)
    marks.append(decoder.recorder.clock)
    if on_iteration is not None:  # compiling takes seconds: the progress says so before
        def announce() -> None:
            on_iteration(decoder.report([0] * len(decoder.rows), "compiling", compiling=True))
        for runner in compiled.values():
            runner.on_first_call = announce
    while decoder.rows:
        tree = plan.choose()
        warm = decoder.state is not None
        compilations = sum(c.compilations for c in compiled.values())
        decoder.recorder.clock.mark()
        accepted = (decoder.autoregressive_step() if tree.window == 1
                    else decoder.speculative_step(tree))
        decoder.recorder.clock.mark()
        plan.observe(tree, decoder.rows, accepted, warm, decoder.siblings,
                     timed=sum(c.compilations for c in compiled.values()) == compilations)
        shape = describe_shape(tree)
        decoder.recorder.iteration_done(decoder.rows, accepted, shape)
        decoder.iteration += 1
        report = None if on_iteration is None else decoder.report(accepted, shape)
        decoder.drop_finished()
        if report is not None:
            on_iteration(report)

    meta = {"mode": plan.mode_name, "lossless": acceleration.lossless,
            "window": acceleration.window, "tree_nodes": max_nodes, "seed": seed,
            "family": getattr(model, "family", "?"), "codebook_size": decoder.vocab,
            "acceleration": acceleration.__dict__.copy(), "sampling": sampling.__dict__.copy(),
            "warnings": [str(w) for w in getattr(session, "warnings", ())] + plan.warnings,
            "unconditional": bool(getattr(session, "unconditional", False))}
    for name, compiling in compiled.items():
        meta[name] = compiling.report()
        meta["warnings"] += [meta[name]["failure"]] if meta[name]["failure"] else []
    meta.update(plan.notes())
    trace = decoder.recorder.finish((decoder.height, decoder.width), meta)
    return GenerationResult(decoder.grids.reshape(-1, decoder.height, decoder.width).cpu(), trace)
