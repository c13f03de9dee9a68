"""SJD Sampler: draws code grids with plain or speculative Jacobi decoding, with live progress."""

from __future__ import annotations

import time

import torch
from PIL import Image

from ..sjd_core.decoding.engine import IterationReport, generate
from ..sjd_core.decoding.settings import INIT_RULES, RELAXED_RULES, AccelerationSettings, SamplingSettings
from ..sjd_core.decoding.trace import summary_text
from ..sjd_core.models.protocol import GenerationRequest
from . import comfy_bridge
from .handles import CODES_TYPE, MODEL_TYPE, TRACE_TYPE, LoadedModel, RunInfo, SamplerCodes, \
    SamplerTrace

NODE = "SJD Sampler"
MODES = {"PAC+VP": "pac+vp", "PAC": "pac", "SJD": "sjd", "AR": "ar", "custom": None}
DEFAULT_MODE = "PAC+VP"
SAMPLING_CHOICES = ("family recipe", "custom")
# Sizes the families draw (reference; LlamaGen; Janus-Pro; Lumina-mGPT and Anole; Emu3 at its
# default 720x720 area in its seven aspect ratios). The loaded model decides at run time and names
# its own list when a size is not among them.
RESOLUTIONS = ("default", "32x32", "256x256", "384x384", "512x512", "768x768", "1024x1024",
               "720x720", "832x624", "624x832", "960x544", "544x960", "880x584", "584x880")
PROGRESS_EVENT = "sjd.progress"
DONE_EVENT = "sjd.done"
PREVIEW_SECONDS = 0.5  # the least time between two live previews
LOSSY = ("LOSSY: with relaxed acceptance the image no longer follows the model's exact "
         "distribution. ")


def _int(default: int, low: int, high: int, tooltip: str, step: int = 1) -> tuple:
    return ("INT", {"default": default, "min": low, "max": high, "step": step, "tooltip": tooltip})


def _float(default: float, low: float, high: float, step: float, tooltip: str) -> tuple:
    return ("FLOAT", {"default": default, "min": low, "max": high, "step": step,
                      "tooltip": tooltip})


def _bool(default: bool, tooltip: str) -> tuple:
    return ("BOOLEAN", {"default": default, "tooltip": tooltip})


def parse_resolution(value: str) -> tuple[int, int] | None:
    """``'WxH'`` -> (W, H); ``'default'`` -> None (the family's default)."""
    if value == "default":
        return None
    try:
        width, height = (int(part) for part in value.lower().split("x"))
    except ValueError:
        raise ValueError(f"{NODE}: resolution={value!r} is not allowed: write WIDTHxHEIGHT in "
                         "pixels (e.g. 768x768) or 'default'.") from None
    return width, height


def acceleration_settings(mode: str, window: int, init: str, adaptive_continuation: bool,
                          proactive_drafting: bool, pd_candidates: int, pd_depth: int,
                          verification_prediction: bool, vp_rises: int, vp_top_k: int,
                          vp_decay: float, relaxed: str, lantern_neighbours: int,
                          lantern_delta: float, gsd_rank_radius: int, gsd_prob_tolerance: float,
                          gsd_embedding_tolerance: float) -> AccelerationSettings:
    """The engine's settings for a mode preset (or ``custom``) and the node's widgets.

    A preset fixes which of AC / PD / VP are on (and ``AR`` fixes window=1); ``custom`` takes the
    toggles as they are. Every other widget applies in every mode.
    """
    if mode not in MODES:
        raise ValueError(f"{NODE}: mode={mode!r} is not allowed: pick one of {list(MODES)}.")
    shared = dict(init=init, pd_candidates=pd_candidates, pd_depth=pd_depth,
                  vp_rises=vp_rises, vp_top_k=vp_top_k, vp_decay=vp_decay, relaxed=relaxed,
                  lantern_neighbours=lantern_neighbours, lantern_delta=lantern_delta,
                  gsd_rank_radius=gsd_rank_radius, gsd_prob_tolerance=gsd_prob_tolerance,
                  gsd_embedding_tolerance=gsd_embedding_tolerance)
    try:
        if MODES[mode] is None:
            return AccelerationSettings(window=window, adaptive_continuation=adaptive_continuation,
                                        proactive_drafting=proactive_drafting,
                                        verification_prediction=verification_prediction, **shared)
        if MODES[mode] != "ar":
            shared["window"] = window
        return AccelerationSettings.preset(MODES[mode], **shared)
    except ValueError as error:
        hint = (" (mode AR decodes one slot per step: relaxed acceptance and drafting options "
                "need SJD, PAC, PAC+VP or custom with window > 1)" if MODES[mode] == "ar" else "")
        raise ValueError(f"{NODE}: mode={mode}: {error}{hint}") from error


class SJDSampler:
    """Generates code grids for a prompt with exact (or, if asked, relaxed) speculative decoding."""

    DESCRIPTION = ("Draws images as code grids with speculative Jacobi decoding: each step guesses "
                   "a window of codes and keeps those that pass an exact acceptance test, so the "
                   "result follows the model's own distribution while taking far fewer forward "
                   "passes than plain autoregression (AR). The progress bar counts committed "
                   "codes; the chart on the node shows codes accepted per step.")
    CATEGORY = "sampling/SJD"
    FUNCTION = "sample"
    RETURN_TYPES = (CODES_TYPE, TRACE_TYPE, "STRING")
    RETURN_NAMES = ("codes", "trace", "summary")
    OUTPUT_TOOLTIPS = (
        "The code grids; connect to SJD Decode for the images.",
        "What happened at every step and slot; connect to SJD Diagnostics.",
        "One line: mode, forward passes (NFE), step compression and time.",
    )

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        return {
            "required": {
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
                "batch_size": _int(1, 1, 64, "Images drawn together; image b uses seed + b, so "
                                             "a batch equals the same images made one by one."),
                "seed": ("INT", {"default": 0, "min": 0, "max": 2**53 - 1,
                                 "control_after_generate": True,
                                 "tooltip": "Random seed; the same seed and settings give the "
                                            "same image. Lossless modes draw from the same "
                                            "distribution but not the same sample per seed."}),
                "sampling": (list(SAMPLING_CHOICES), {
                    "default": "family recipe",
                    "tooltip": "'family recipe' uses the model's official guidance, temperature, "
                               "top-k and top-p (see the Loader's info); 'custom' uses the four "
                               "inputs below."}),
                "guidance": _float(3.0, 0.0, 30.0, 0.1,
                                   "Classifier-free guidance scale (custom sampling only); 1.0 "
                                   "turns guidance off and skips the unconditional pass."),
                "temperature": _float(1.0, 0.01, 5.0, 0.01,
                                      "Softmax temperature (custom sampling only); lower is "
                                      "more conservative."),
                "top_k": _int(0, 0, 1_000_000, "Keep the k most likely codes (custom sampling "
                                               "only); 0 = off, 1 = greedy."),
                "top_p": _float(1.0, 0.01, 1.0, 0.01,
                                "Nucleus sampling mass (custom sampling only); 1.0 = off."),
                "mode": (list(MODES), {
                    "default": DEFAULT_MODE,
                    "tooltip": "AR: plain autoregression, one code per forward pass. SJD: "
                               "speculative Jacobi decoding. PAC: SJD with adaptive continuation "
                               "and proactive drafting. PAC+VP: PAC with verification "
                               "prediction. All four are lossless. custom: use the AC / PD / VP "
                               "toggles below."}),
                "window": _int(16, 1, 256, "Codes guessed and checked per forward pass (not used "
                                           "by AR); 1 is plain autoregression."),
                "init": (list(INIT_RULES), {
                    "default": "uniform",
                    "tooltip": "How codes entering the window are first guessed: uniform random "
                               "codes, or left = repeat the code to the left."}),
                "adaptive_continuation": _bool(True, "AC (custom mode only): after a rejection, "
                                                     "keep later guesses that still fit. "
                                                     "Lossless."),
                "proactive_drafting": _bool(True, "PD (custom mode only): try K alternatives "
                                                  "for the first D-1 window slots as a tree. "
                                                  "Lossless."),
                "pd_candidates": _int(4, 1, 16, "K: alternatives per slot in the PD tree."),
                "pd_depth": _int(3, 1, 16, "D: depth of the PD tree, counting the root; at most "
                                           "the window."),
                "verification_prediction": _bool(True, "VP (custom mode only): guess codes whose "
                                                       "probability kept rising. Lossless."),
                "vp_rises": _int(3, 1, 64, "N: rises in a row that make VP prefer a code."),
                "vp_top_k": _int(50, 1, 100_000, "VP considers only the k most likely codes."),
                "vp_decay": _float(0.5, 0.0, 0.99, 0.01,
                                   "Weight of the past in VP's running average (0 = only the "
                                   "latest step)."),
                "relaxed": (list(RELAXED_RULES), {
                    "default": "none",
                    "tooltip": "none = exact acceptance (lossless). " + LOSSY + "lantern accepts "
                               "guesses close to the target in the codebook; gsd accepts guesses "
                               "near the top of the target's ranking. Faster, slightly different "
                               "images."}),
                "lantern_neighbours": _int(1000, 1, 1_000_000,
                                           LOSSY + "LANTERN k: codebook neighbours whose "
                                                   "probability mass a guess may borrow."),
                "lantern_delta": _float(0.1, 0.0, 1.0, 0.01,
                                        LOSSY + "LANTERN delta: the most probability mass (total "
                                                "variation) a guess may borrow."),
                "gsd_rank_radius": _int(7, 0, 100_000, LOSSY + "GSD: a guess within this many "
                                                               "ranks of the top may pass."),
                "gsd_prob_tolerance": _float(0.15, 0.0, 10.0, 0.01,
                                             LOSSY + "GSD: how much less likely than the target's "
                                                     "choice a guess may be."),
                "gsd_embedding_tolerance": _float(0.5, 0.0, 100.0, 0.01,
                                                  LOSSY + "GSD: how far (codebook embedding "
                                                          "distance) a guess may lie."),
            },
            "hidden": {"unique_id": "UNIQUE_ID"},
        }

    def sample(self, model: LoadedModel, prompt: str, negative_prompt: str, resolution: str,
               batch_size: int, seed: int, sampling: str, guidance: float, temperature: float,
               top_k: int, top_p: float, mode: str, window: int, init: str,
               adaptive_continuation: bool, proactive_drafting: bool, pd_candidates: int,
               pd_depth: int, verification_prediction: bool, vp_rises: int, vp_top_k: int,
               vp_decay: float, relaxed: str, lantern_neighbours: int, lantern_delta: float,
               gsd_rank_radius: int, gsd_prob_tolerance: float, gsd_embedding_tolerance: float,
               unique_id: str | None = None) -> dict:
        """Validate everything, then run the engine with progress, previews and interrupts."""
        adapter = model.model
        acceleration = acceleration_settings(
            mode, window, init, adaptive_continuation, proactive_drafting, pd_candidates,
            pd_depth, verification_prediction, vp_rises, vp_top_k, vp_decay, relaxed,
            lantern_neighbours, lantern_delta, gsd_rank_radius, gsd_prob_tolerance,
            gsd_embedding_tolerance)
        sampling_settings = _sampling_settings(adapter, sampling, guidance, temperature, top_k,
                                               top_p)
        size = parse_resolution(resolution)
        supported = adapter.supported_resolutions()
        if size is not None and size not in [tuple(r) for r in supported]:
            listing = ", ".join(f"{w}x{h}" for w, h in supported)
            raise ValueError(f"{NODE}: resolution={resolution} is not supported by the "
                             f"{adapter.family} model '{model.name}': pick one of {listing} or "
                             "'default'.")
        size = size or tuple(supported[0])
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"{NODE}: batch_size={batch_size!r} is not allowed: it must be an "
                             "integer >= 1.")
        request = GenerationRequest(prompt=prompt, negative_prompt=negative_prompt,
                                    resolution=size, batch_size=batch_size,
                                    guidance=sampling_settings.guidance)
        comfy_bridge.load_to_device(model.patcher)
        watcher = _LiveProgress(adapter, adapter.grid_for(size), batch_size, unique_id,
                                acceleration.mode_name)
        with torch.inference_mode():
            try:
                result = generate(adapter, request, sampling=sampling_settings,
                                  acceleration=acceleration, seed=seed,
                                  on_iteration=watcher.on_iteration)
            except ValueError as error:
                raise ValueError(f"{NODE}: {error}") from error
        summary = result.trace.summary()
        run = RunInfo(run_id=summary["run_id"], model_name=model.name,
                      family=adapter.family, prompt=prompt, negative_prompt=negative_prompt,
                      resolution=size, batch_size=batch_size, seed=seed,
                      mode=acceleration.mode_name)
        line = summary_text(summary)
        comfy_bridge.send(DONE_EVENT, {"node": unique_id, "summary": summary,
                                       "accepted": watcher.accepted, "text": line})
        return {
            # The whole trace goes into ComfyUI's history too, for scripts that read /history.
            "ui": {"sjd_summary": [summary], "sjd_accepted": watcher.accepted,
                   "sjd_text": [line], "sjd_trace": [result.trace.to_json()]},
            "result": (SamplerCodes(result.codes, model, run), SamplerTrace(result.trace, run),
                       line),
        }


def _sampling_settings(adapter: object, sampling: str, guidance: float, temperature: float,
                       top_k: int, top_p: float) -> SamplingSettings:
    if sampling not in SAMPLING_CHOICES:
        raise ValueError(f"{NODE}: sampling={sampling!r} is not allowed: pick one of "
                         f"{list(SAMPLING_CHOICES)}.")
    if sampling == "family recipe":
        d = adapter.defaults
        guidance, temperature, top_k, top_p = d.guidance, d.temperature, d.top_k, d.top_p
    try:
        return SamplingSettings(guidance=guidance, temperature=temperature, top_k=top_k,
                                top_p=top_p)
    except ValueError as error:
        raise ValueError(f"{NODE}: {error}") from error


class _LiveProgress:
    """Progress bar, live preview, browser messages and Cancel, fed by the engine every iteration."""

    def __init__(self, adapter: object, grid: tuple[int, int], batch: int, node_id: str | None,
                 mode: str) -> None:
        self.adapter = adapter
        self.grid = grid
        self.batch = batch
        self.node_id = node_id
        self.mode = mode
        self.accepted: list[float] = []  # mean over rows still decoding, per iteration
        self.bar: comfy_bridge.Progress | None = None
        self.preview_rows = 0
        self.preview_time = 0.0

    def on_iteration(self, report: IterationReport) -> None:
        comfy_bridge.check_interrupted()
        total = report.total * self.batch
        if self.bar is None:
            self.bar = comfy_bridge.Progress(total)
        active = [a for a in report.accepted if a > 0]
        self.accepted.append(sum(active) / len(active) if active else 0.0)
        self.bar.update(sum(report.committed), self._preview(report))
        comfy_bridge.send(PROGRESS_EVENT, {
            "node": self.node_id, "iteration": report.iteration, "accepted": report.accepted,
            "committed": report.committed, "total": report.total, "mode": self.mode})

    def _preview(self, report: IterationReport) -> Image.Image | None:
        """The first image's finished code rows, decoded, at most every PREVIEW_SECONDS."""
        if not comfy_bridge.in_comfyui():
            return None
        width = self.grid[1]
        rows = report.committed[0] // width
        now = time.monotonic()
        finished = report.committed[0] >= report.total
        if rows <= self.preview_rows or (now - self.preview_time < PREVIEW_SECONDS and not finished):
            return None
        self.preview_rows, self.preview_time = rows, now
        grid = report.codes[:1].reshape(1, *self.grid).clone()
        grid[:, rows:] = 0  # not drawn yet: any valid code will do, those rows are blanked below
        image = self.adapter.decode(grid)[0]
        image[image.shape[0] * rows // self.grid[0]:] = 0
        return Image.fromarray((image.clamp(0, 1) * 255).byte().cpu().numpy())
