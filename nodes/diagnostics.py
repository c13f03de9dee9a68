"""SJD Diagnostics: where and how fast drafts were accepted, as heatmaps, a histogram and a summary.

The node shows one picture, the sheet of :func:`sjd_core.figures.diagnostics_sheet` (the
comparison with an AR run or the run's summary, the three heatmaps with their colour bars, the
draft-rule map with its legend, the histogram), drawn :data:`~sjd_core.figures.SHEET_WIDTH`
px wide with fonts that stay readable at the width the templates give the node (the arithmetic is
in figures.py, beside SHEET_BOXES). Its outputs are the separate panels, one per batch row.
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from ..sjd_core.messages import quote
from ..sjd_core.decoding.trace import summary_text
from ..sjd_core.figures import (SHEET_SPEED_UP, SHEET_TEXT, UNITS, diagnostics_sheet,
                                     heatmap, histogram_figure, labelled_panel, rule_legend,
                                     rule_map, value_range)
from . import comfy_bridge
from .handles import TRACE_TYPE, SamplerTrace

NODE = "SJD Diagnostics"
MAPS = (("commit_iteration", "commit iteration"),
        ("iterations_in_window", "iterations in window"),
        ("acceptance_probability", "acceptance probability"))
MIN_SIDE = 256  # heatmaps without an image are drawn at least this many pixels wide


class SJDDiagnostics:
    """Shows how a sampler run went: per-slot heatmaps, accepted lengths and a summary."""

    DESCRIPTION = ("Heatmaps of a sampler run: the step at which each code was committed (one "
                   "colour = one forward pass), how many steps each code waited in the window, and "
                   "the acceptance probability of the committed guess; the histogram of codes "
                   "accepted per step; a summary with NFE, step compression and speed-up; and "
                   "which rule made the guess tested for each code. The node shows them on one "
                   "sheet (first image of the batch), led by a comparison when an AR run of the "
                   "same request is connected as baseline_trace: both runs side by side (their "
                   "images too when baseline_image is connected) with forward passes, measured "
                   "times and the measured speed-up. The outputs are the separate panels.")
    CATEGORY = "sampling/SJD"
    FUNCTION = "diagnose"
    OUTPUT_NODE = True
    RETURN_TYPES = ("IMAGE", "IMAGE", "IMAGE", "IMAGE", "STRING", "IMAGE")
    RETURN_NAMES = ("commit_iteration", "iterations_in_window", "acceptance_probability",
                    "accepted_lengths", "summary", "draft_rule")
    OUTPUT_TOOLTIPS = (
        "Step at which each code was committed (dark = early); same colour = same forward pass. "
        "With a colour bar (step numbers).",
        "How many steps each code spent in the window before it was committed. With a colour "
        "bar (steps).",
        "Probability that the committed guess passed its test, with a colour bar (0 to 1); grey: "
        "no guess was tested, as in AR.",
        "Histogram of codes accepted per step (x: codes accepted in one step, y: number of "
        "steps).",
        "NFE, step compression, speed-up and mode, as text.",
        "Which rule made the guess that was tested for each code (uniform, copy of left or "
        "above, drawn from the target above, kept or replaced by AC, drawn by VP, PD sibling), "
        "one colour per rule, with a legend; grey: no guess was tested.",
    )

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        return {
            "required": {
                "trace": (TRACE_TYPE, {"tooltip": "The 'trace' output of an SJD Sampler."}),
                "blend": ("FLOAT", {"default": 0.5, "min": 0.0, "max": 1.0, "step": 0.05,
                                    "tooltip": "How strongly the heatmaps cover the image when "
                                               "an image is connected (1 = heatmap only)."}),
            },
            "optional": {
                "image": ("IMAGE", {"tooltip": "The decoded images of the same run, to draw the "
                                               "heatmaps over."}),
                "baseline_trace": (TRACE_TYPE, {
                    "tooltip": "The trace of an AR run with the same model, prompt, resolution, "
                               "batch and seed: gives the measured speed-up, and the sheet then "
                               "leads with the comparison of both runs."}),
                "baseline_image": ("IMAGE", {
                    "tooltip": "The decoded images of the baseline_trace run (its SJD Decode's "
                               "IMAGE): the comparison then shows both runs' images side by "
                               "side. Needs baseline_trace."}),
            },
        }

    def diagnose(self, trace: SamplerTrace, blend: float, image: torch.Tensor | None = None,
                 baseline_trace: SamplerTrace | None = None,
                 baseline_image: torch.Tensor | None = None) -> dict:
        """Heatmaps (blended over ``image`` if given), histogram and summary of one run, and the
        sheet the node shows (with the comparison when ``baseline_trace`` is given)."""
        if not 0.0 <= blend <= 1.0:
            raise ValueError(f"{NODE}: blend={quote(blend)} is not allowed: it must lie in [0, 1].")
        maps = trace.trace.slot_maps()
        batch, height, width = maps["commit_iteration"].shape
        if image is not None:
            _check_image(image, batch, height, width, trace)
        summary = trace.trace.summary()
        text = describe(summary, trace, baseline_trace)
        baseline = None
        if baseline_image is not None:
            if baseline_trace is None:
                raise ValueError(
                    f"{NODE}: baseline_image ({_images(baseline_image)}) is connected without "
                    "baseline_trace; it is shown only beside the AR run it belongs to. Connect "
                    "that run's trace as baseline_trace too, or disconnect baseline_image.")
            _check_image(baseline_image, *baseline_trace.trace.slot_maps()[
                "commit_iteration"].shape, baseline_trace, "baseline_image")
        if baseline_trace is not None:
            baseline = baseline_trace.trace.summary()
        drawn = {key: _draw_map(maps[key], image, blend) for key, _ in MAPS}
        spans = {key: value_range(maps[key]) for key, _ in MAPS}
        panels = [[labelled_panel(row, title, spans[key], UNITS[key]) for row in drawn[key]]
                  for key, title in MAPS]
        histogram = histogram_figure(summary["accepted_length_histogram"], summary["mode"])
        rule_rgb = _draw_map(maps["draft_source"], image, blend, paint=rule_map)
        legend = rule_legend(max(rule_rgb.shape[2], 160), maps["draft_source"])
        rules = [labelled_panel(row, "draft rule", None, None, legend) for row in rule_rgb]
        sheet, boxes = diagnostics_sheet(
            [(title, drawn[key][0], spans[key], UNITS[key]) for key, title in MAPS], rule_rgb[0],
            maps["draft_source"][:1], summary, baseline, _first(image), _first(baseline_image),
            trace.run.seed, batch)
        tensors = [torch.from_numpy(np.stack([_floats(p) for p in rows])) for rows in panels]
        tensors.append(torch.from_numpy(_floats(histogram)[None]))
        rule_tensor = torch.from_numpy(np.stack([_floats(p) for p in rules]))
        layout = {"width": sheet.width, "height": sheet.height, "text_px": SHEET_TEXT,
                  "speed_up_px": SHEET_SPEED_UP, "speed_up_box": boxes.get("speed_up")}
        return {"ui": {"images": comfy_bridge.save_previews([sheet], "sjd_diagnostics"),
                       "sjd_text": [text], "sjd_sheet": [layout]},
                "result": (*tensors, text, rule_tensor)}


def _images(image: torch.Tensor) -> str:
    """How an IMAGE input reads in a message: count and pixel size, or its shape."""
    if image.ndim == 4:
        return f"{image.shape[0]} image(s) of {image.shape[2]}x{image.shape[1]} px"
    return f"shape {tuple(image.shape)}"


def _first(image: torch.Tensor | None) -> np.ndarray | None:
    """The first image of an IMAGE batch as (h, w, 3) floats in [0, 1], or None."""
    return None if image is None else image[0, ..., :3].float().clamp(0, 1).cpu().numpy()


def _check_image(image: torch.Tensor, batch: int, height: int, width: int,
                 trace: SamplerTrace, name: str = "image") -> None:
    """The image must be the run's own decoded batch: the same count, and a pixel size that is
    a whole number of pixels per code, the same across and down (the decoder's own scale, or a
    whole-number enlargement of it). ``name``: the input (``image`` belongs to ``trace``,
    ``baseline_image`` to ``baseline_trace``)."""
    owner = "this trace" if name == "image" else "baseline_trace"
    sampler = "the same SJD Sampler" if name == "image" else "the AR sampler whose trace is " \
        "baseline_trace"
    if image.ndim != 4 or image.shape[-1] not in (3, 4):
        raise ValueError(f"{NODE}: {name} of shape {tuple(image.shape)} is not an IMAGE batch "
                         "(batch, height, width, channels).")
    count, pixel_h, pixel_w = image.shape[:3]
    fits = pixel_h % height == 0 and pixel_w % width == 0 and pixel_h // height == pixel_w // width
    if count != batch or not fits:
        run_w, run_h = trace.run.resolution
        raise ValueError(
            f"{NODE}: {name} ({_images(image)}) does not belong to {owner} ({batch} image(s) of "
            f"{width}x{height} codes, drawn at {run_w}x{run_h} px: {trace.run.describe()}); its "
            "pixel size must be the same whole number of pixels per code across and down. "
            f"Connect the IMAGE that SJD Decode made from the codes of {sampler}.")


def _draw_map(values: np.ndarray, image: torch.Tensor | None, blend: float,
              paint=heatmap) -> np.ndarray:
    """(B, H, W) slot values -> (B, h, w, 3) float RGB painted by ``paint(values, cell)``, over
    the image (scaled up) when given."""
    batch, height, width = values.shape
    if image is None:
        return paint(values, cell=max(1, -(-MIN_SIDE // max(height, width))))
    pixel_h, pixel_w = image.shape[1:3]
    scale = max(1, -(-MIN_SIDE // max(pixel_h, pixel_w)))  # small images are shown enlarged
    size = (pixel_w * scale, pixel_h * scale)
    rgb = paint(values, cell=max(1, -(-size[1] // height)))
    base = image[..., :3].float().clamp(0, 1).cpu().numpy()
    return np.stack([(blend * _resized(m, size) + (1.0 - blend) * _resized(b, size))
                     for m, b in zip(rgb, base)]).astype(np.float32)


def _floats(picture: Image.Image) -> np.ndarray:
    return np.asarray(picture, dtype=np.float32) / 255.0


def _resized(rgb: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """(h, w, 3) floats in [0, 1] -> (size[1], size[0], 3), nearest neighbour (slots stay sharp)."""
    if rgb.shape[1::-1] == size:
        return rgb
    picture = Image.fromarray((rgb * 255 + 0.5).astype(np.uint8)).resize(size, Image.NEAREST)
    return np.asarray(picture, np.float32) / 255.0


def describe(summary: dict, trace: SamplerTrace, baseline: SamplerTrace | None) -> str:
    """The summary text; with a baseline from the same request, the measured speed-up too."""
    lines = [summary_text(summary),
             f"NFE {summary['nfe']:.1f} for {summary['slots_per_image']} codes per image, "
             f"step compression {summary['step_compression']:.2f}x",
             f"forward {summary['forward_seconds']:.2f} s, drafting/verifying "
             f"{summary['other_seconds']:.2f} s ({summary['other_share']:.0%})"]
    if baseline is None:
        lines.append(f"speed-up over AR: at most {summary['step_compression']:.2f}x (step "
                     "compression); connect an AR run's trace as baseline_trace to measure it")
    else:
        if baseline.run.request_key != trace.run.request_key:
            raise ValueError(
                f"{NODE}: baseline_trace comes from another request ({baseline.run.describe()}) "
                f"than trace ({trace.run.describe()}). Connect the trace of a run with the same "
                "model, prompt, negative prompt, resolution, batch and seed, or disconnect "
                "baseline_trace.")
        if baseline.run.run_id == trace.run.run_id:
            raise ValueError(f"{NODE}: baseline_trace and trace are the same run; connect the "
                             "trace of a second sampler (mode AR) as baseline_trace.")
        base = baseline.trace.summary()
        lines.append(f"speed-up over {base['mode']}: {base['total_seconds'] / max(summary['total_seconds'], 1e-9):.2f}x "
                     f"measured ({base['total_seconds']:.2f} s -> {summary['total_seconds']:.2f} s), "
                     f"{base['nfe'] / max(summary['nfe'], 1e-9):.2f}x fewer forward passes")
    lines.append(f"mode {summary['mode']}, {'lossless' if summary['lossless'] else 'LOSSY'}")
    return "\n".join(lines)
