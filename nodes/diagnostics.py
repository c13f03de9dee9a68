"""SJD Diagnostics: where and how fast drafts were accepted, as heatmaps, a histogram and a summary."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from ..sjd_core.messages import quote
from ..sjd_core.decoding.trace import summary_text
from ..sjd_core.tools.figures import (UNITS, heatmap, histogram_figure, labelled_panel, rule_legend,
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
                   "which rule made the guess tested for each code.")
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
                               "batch and seed: gives the measured speed-up."}),
            },
        }

    def diagnose(self, trace: SamplerTrace, blend: float, image: torch.Tensor | None = None,
                 baseline_trace: SamplerTrace | None = None) -> dict:
        """Heatmaps (blended over ``image`` if given), histogram and summary of one run."""
        if not 0.0 <= blend <= 1.0:
            raise ValueError(f"{NODE}: blend={quote(blend)} is not allowed: it must lie in [0, 1].")
        maps = trace.trace.slot_maps()
        batch, height, width = maps["commit_iteration"].shape
        if image is not None:
            _check_image(image, batch, height, width, trace)
        summary = trace.trace.summary()
        text = describe(summary, trace, baseline_trace)
        panels = [_panels(maps[key], key, title, image, blend) for key, title in MAPS]
        histogram = histogram_figure(summary["accepted_length_histogram"], summary["mode"])
        rules = _rule_panels(maps["draft_source"], image, blend)
        tensors = [torch.from_numpy(np.stack([_floats(p) for p in rows])) for rows in panels]
        tensors.append(torch.from_numpy(_floats(histogram)[None]))
        rule_tensor = torch.from_numpy(np.stack([_floats(p) for p in rules]))
        ui_images = comfy_bridge.save_previews([rows[0] for rows in panels] + [histogram, rules[0]],
                                               "sjd_diagnostics")
        return {"ui": {"images": ui_images, "sjd_text": [text]},
                "result": (*tensors, text, rule_tensor)}


def _check_image(image: torch.Tensor, batch: int, height: int, width: int,
                 trace: SamplerTrace) -> None:
    """The image must be the run's own decoded batch: the same count, and a pixel size that is
    a whole number of pixels per code, the same across and down (the decoder's own scale, or a
    whole-number enlargement of it)."""
    if image.ndim != 4 or image.shape[-1] not in (3, 4):
        raise ValueError(f"{NODE}: image of shape {tuple(image.shape)} is not an IMAGE batch "
                         "(batch, height, width, channels).")
    count, pixel_h, pixel_w = image.shape[:3]
    fits = pixel_h % height == 0 and pixel_w % width == 0 and pixel_h // height == pixel_w // width
    if count != batch or not fits:
        run_w, run_h = trace.run.resolution
        raise ValueError(
            f"{NODE}: image ({count} image(s) of {pixel_w}x{pixel_h} px) does not belong to this "
            f"trace ({batch} image(s) of {width}x{height} codes, drawn at {run_w}x{run_h} px: "
            f"{trace.run.describe()}); its pixel size must be the same whole number of pixels "
            "per code across and down. Connect the IMAGE that SJD Decode made from the codes of "
            "the same SJD Sampler.")


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


def _panels(values: np.ndarray, key: str, title: str, image: torch.Tensor | None,
            blend: float) -> list[Image.Image]:
    """One labelled panel (title, map, colour bar with unit, grey legend) per batch row; the
    colour range is shared by the batch."""
    span = value_range(values)
    return [labelled_panel(row, title, span, UNITS[key]) for row in _draw_map(values, image, blend)]


def _rule_panels(sources: np.ndarray, image: torch.Tensor | None, blend: float) -> list[Image.Image]:
    """The draft-rule map of each batch row, over the image when given, with the legend of the
    rules that occur in the batch."""
    rgb = _draw_map(sources, image, blend, paint=rule_map)
    legend = rule_legend(max(rgb.shape[2], 160), sources)
    return [labelled_panel(row, "draft rule", None, None, legend) for row in rgb]


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
