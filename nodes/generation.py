"""One sampler run inside ComfyUI: checks, the engine call, live progress, previews, Cancel.

Shared by the SJD Sampler and the old all-in-one sampler, which differ only in how their widgets
become settings objects; both declare what to draw with ``prompting_inputs``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from PIL import Image

from ..sjd_core.messages import quote
from ..sjd_core.decoding.engine import IterationReport, generate
from ..sjd_core.decoding.settings import AccelerationSettings, SamplingSettings
from ..sjd_core.decoding.trace import summary_text
from ..sjd_core.models.protocol import GenerationRequest
from ..sjd_core.models.registry import offered_resolutions
from . import comfy_bridge
from .node_messages import one_line
from .handles import MODEL_TYPE, LoadedModel, RunInfo, SamplerCodes, SamplerTrace
from .widgets import BATCH_TOOLTIP

PROGRESS_EVENT = "sjd.progress"
PREVIEW_SECONDS = 0.5  # the least time between two live previews
# The least time between two chart messages: at most 4 a second (one message per step slowed a
# short run queued from the page several times over); the last step is always sent.
MESSAGE_SECONDS = 0.25
CHART_POINTS = 240  # the most values of the accepted-per-step series sent to the browser
# Every size a released checkpoint of any family draws, so that ComfyUI accepts each of them; the
# browser narrows the list to the connected model's sizes, and the loaded model decides at run
# time (naming its own list when a size is not among them).
RESOLUTIONS = ("default", *(f"{width}x{height}" for width, height in offered_resolutions()))


@dataclass(frozen=True)
class Prompting:
    """What one run draws: the widgets every sampler has besides its settings."""

    prompt: str
    negative_prompt: str
    resolution: str
    batch_size: int
    seed: int


def prompting_inputs() -> dict[str, tuple]:
    """What to draw: the model and the widgets every sampler has besides its settings."""
    return {
        "model": (MODEL_TYPE, {"tooltip": "A model from SJD Model Loader."}),
        "prompt": ("STRING", {
            "multiline": True, "default": "sneaker",
            "tooltip": "What to draw. The embedded reference model takes a Fashion-MNIST "
                       "class name (t-shirt, trouser, pullover, dress, coat, sandal, "
                       "shirt, sneaker, bag, ankle boot)."}),
        "negative_prompt": ("STRING", {
            "multiline": True, "default": "",
            "tooltip": "What to steer away from with guidance; empty uses the family's "
                       "unconditional context. Ignored when guidance is 1.0."}),
        "resolution": (list(RESOLUTIONS), {
            "default": "default",
            "tooltip": "Image size in pixels (width x height). 'default' is the family's "
                       "own size; the Loader's info output lists every size the loaded "
                       "model supports."}),
        "batch_size": ("INT", {"default": 1, "min": 1, "max": 64, "tooltip": BATCH_TOOLTIP}),
        "seed": ("INT", {"default": 0, "min": 0, "max": 2**53 - 1,
                         "control_after_generate": True,
                         "tooltip": "Random seed; the same seed and settings give the "
                                    "same image. Lossless modes draw from the same "
                                    "distribution but not the same sample per seed. "
                                    "AUTO picks its steps from measured speed, so a seed "
                                    "may give another (equally likely) image from run "
                                    "to run: use a fixed mode to repeat one exactly."}),
    }


def parse_resolution(value: str, node: str) -> tuple[int, int] | None:
    """``'WxH'`` -> (W, H); ``'default'`` -> None (the family's default)."""
    if value == "default":
        return None
    try:
        width, height = (int(part) for part in value.lower().split("x"))
    except ValueError:
        raise ValueError(f"{node}: resolution={quote(value)} is not allowed: write WIDTHxHEIGHT in "
                         "pixels (e.g. 768x768) or 'default'.") from None
    return width, height


def check_resolution(resolution: str | None, node: str) -> bool | str:
    """The samplers' VALIDATE_INPUTS for ``resolution``: True for 'default' or a size some family
    draws (the loaded model decides at run time), else the pack's message, which ComfyUI shows on
    the node before anything runs (it then skips its own list check of that input). None (the
    input comes from another node) is left to the run."""
    if resolution is None or resolution in RESOLUTIONS:
        return True
    return one_line(
        f"{node}: resolution={quote(resolution)} is not a size any SJD model draws (a workflow "
        "from an older version or another machine?): pick 'default' (the model's own size) or "
        "one of the sizes the list offers, which are the connected model's (the Loader's info "
        "output names them too).")


def downsampled(values: list[float], points: int = CHART_POINTS) -> list[float]:
    """At most ``points`` values: consecutive runs of ``values`` replaced by their means."""
    if len(values) <= points:
        return [round(v, 3) for v in values]
    edges = [round(i * len(values) / points) for i in range(points + 1)]
    return [round(sum(values[a:b]) / (b - a), 3) for a, b in zip(edges, edges[1:])]


def run_sampler(model: LoadedModel, asked: Prompting, acceleration: AccelerationSettings,
                sampling: SamplingSettings, node: str, node_id: str | None) -> dict:
    """Validate the request, run the engine with progress, previews and interrupts; returns the
    node's ``{"ui": ..., "result": (codes, trace, summary)}``.

    The UI part holds only the summary and the chart's series (at most ``CHART_POINTS`` values):
    the full trace travels through the TRACE output, not through ``/history``.
    """
    adapter = model.model
    size = parse_resolution(asked.resolution, node)
    supported = adapter.supported_resolutions()
    if size is not None and size not in [tuple(r) for r in supported]:
        listing = ", ".join(f"{w}x{h}" for w, h in supported)
        raise ValueError(f"{node}: resolution={asked.resolution} is not supported by the "
                         f"{adapter.family} model '{model.name}': pick one of {listing} or "
                         "'default'.")
    size = size or tuple(supported[0])
    if not isinstance(asked.batch_size, int) or asked.batch_size < 1:
        raise ValueError(f"{node}: batch_size={quote(asked.batch_size)} is not allowed: it must be an "
                         "integer >= 1.")
    request = GenerationRequest(prompt=asked.prompt, negative_prompt=asked.negative_prompt,
                                resolution=size, batch_size=asked.batch_size,
                                guidance=sampling.guidance)
    comfy_bridge.load_to_device(model.patcher)
    watcher = LiveProgress(adapter, adapter.grid_for(size), asked.batch_size, node_id,
                           acceleration.mode_name)
    watcher.start(size)
    with torch.inference_mode():
        try:
            result = generate(adapter, request, sampling=sampling, acceleration=acceleration,
                              seed=asked.seed, on_iteration=watcher.on_iteration)
        except ValueError as error:
            raise ValueError(f"{node}: {error}") from error
        finally:
            watcher.flush()  # steps not sent yet (a failed or cancelled run): the chart has all
    summary = result.trace.summary()
    run = RunInfo(run_id=summary["run_id"], model_name=model.name, family=adapter.family,
                  prompt=asked.prompt, negative_prompt=asked.negative_prompt, resolution=size,
                  batch_size=asked.batch_size, seed=asked.seed, mode=acceleration.mode_name)
    line = summary_text(summary)
    return {
        "ui": {"sjd_summary": [summary], "sjd_accepted": downsampled(watcher.accepted),
               "sjd_text": [one_line(line)]},  # the node's line; the output keeps it all
        "result": (SamplerCodes(result.codes, model, run), SamplerTrace(result.trace, run), line),
    }


class LiveProgress:
    """Progress bar, live preview, browser messages and Cancel, fed by the engine every iteration.

    Cancel is checked every iteration. The browser hears at most one chart message every
    ``MESSAGE_SECONDS`` (with every step since the previous one, so the chart still counts each
    step once) and one progress bar update every ``comfy_bridge.UPDATE_SECONDS`` (a preview, at
    most every ``PREVIEW_SECONDS``, travels with one); the last step always reaches both.
    """

    def __init__(self, adapter: object, grid: tuple[int, int], batch: int, node_id: str | None,
                 mode: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.adapter = adapter
        self.grid = grid
        self.batch = batch
        self.node_id = node_id
        self.mode = mode
        self.clock = clock
        self.accepted: list[float] = []  # mean over rows still decoding, per iteration
        self.bar: comfy_bridge.Progress | None = None
        self.messages = comfy_bridge.Throttle(MESSAGE_SECONDS, clock)
        self.sent = 0  # how many of ``accepted`` the browser has
        self.last: IterationReport | None = None
        self.preview_rows = 0
        self.preview_time: float | None = None
        self.previews, self.preview_size = comfy_bridge.preview_options()

    def start(self, pixels: tuple[int, int]) -> None:
        """The run begins: the bar starts empty and, where previews are shown, the previous run's
        preview gives way to a blank image of this run's ``pixels`` (width, height), so that a
        run that fails shows no image from an earlier one."""
        self.bar = comfy_bridge.Progress(self.grid[0] * self.grid[1] * self.batch,
                                         clock=self.clock, preview_size=self.preview_size)
        self.bar.update(0, (lambda: Image.new("RGB", pixels)) if self.previews else None)

    def on_iteration(self, report: IterationReport) -> None:
        comfy_bridge.check_interrupted()
        if report.compiling:  # before a step that may compile for seconds: the node says so
            self._send(report, compiling=True)
            return
        total = report.total * self.batch
        if self.bar is None:
            self.bar = comfy_bridge.Progress(total, clock=self.clock,
                                             preview_size=self.preview_size)
        active = [a for a in report.accepted if a > 0]
        self.accepted.append(sum(active) / len(active) if active else 0.0)
        self.last = report
        finished = all(c >= report.total for c in report.committed)
        self.bar.update(sum(report.committed), lambda: self._preview(report))
        if self.messages.ready(final=finished):
            self._send(report)

    def flush(self) -> None:
        """Send the steps the browser has not heard of yet, if any (the run stopped early)."""
        if self.last is not None and self.sent < len(self.accepted):
            self._send(self.last)

    def _send(self, report: IterationReport, compiling: bool = False) -> None:
        """One chart message: the mean accepted length of every step since the previous message
        (oldest first; ``iteration`` is the last one's), the latest committed counts, and
        whether a new shape is compiling now."""
        steps = [round(a, 3) for a in self.accepted[self.sent:]]
        self.sent = len(self.accepted)
        comfy_bridge.send(PROGRESS_EVENT, {
            "node": self.node_id, "iteration": report.iteration, "steps": steps,
            "committed": report.committed, "total": report.total, "mode": self.mode,
            "compiling": compiling})

    def _preview(self, report: IterationReport) -> Image.Image | None:
        """The first image's finished code rows, decoded, at most every PREVIEW_SECONDS; nothing
        (and nothing decoded) when previews are off."""
        if not self.previews:
            return None
        width = self.grid[1]
        rows = report.committed[0] // width
        now = self.clock()
        finished = report.committed[0] >= report.total
        recent = self.preview_time is not None and now - self.preview_time < PREVIEW_SECONDS
        if rows <= self.preview_rows or (recent and not finished):
            return None
        self.preview_rows, self.preview_time = rows, now
        grid = report.codes[:1].reshape(1, *self.grid).clone()
        grid[:, rows:] = 0  # not drawn yet: any valid code will do, those rows are blanked below
        image = self.adapter.decode(grid)[0]
        image[image.shape[0] * rows // self.grid[0]:] = 0
        return Image.fromarray((image.clamp(0, 1) * 255).byte().cpu().numpy())
