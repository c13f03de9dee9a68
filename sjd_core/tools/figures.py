"""Per-slot acceptance heatmaps as pictures (numpy + pillow), for the demo and the diagnostics node.

Input is :meth:`sjd_core.decoding.trace.Trace.slot_maps`: numpy arrays (B, H, W) per quantity. A map
becomes an RGB array by a perceptual colour ramp (dark blue = low, yellow = high), each slot drawn
as a ``cell`` x ``cell`` square; slots without a value (no draft was tested) are grey.
:func:`labelled_panel` gives a map its title, a colour bar with the quantity's unit and the legend
for grey; :func:`acceptance_figure` puts the image and three such panels side by side: *commit
iteration* (the forward pass that committed each slot), *committed together* (how many slots that
forward pass committed: bright bands are long accepted drafts) and *acceptance probability* (the
verifier's probability of keeping the committed draft), and *draft rule* (which rule made the
draft that was tested for each slot, one colour per rule with a legend: :func:`rule_map`).
:func:`histogram_figure` draws the accepted-length histogram with labelled axes.
"""

from __future__ import annotations

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from ..messages import quote
from ..decoding.drafting import DRAFT_SOURCES, NO_DRAFT

# Stops of a blue-green-yellow ramp that stays readable in grey and for common colour blindness.
_RAMP = np.array([[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]],
                 dtype=np.float32) / 255.0

PANELS: tuple[tuple[str, str], ...] = (
    ("commit_iteration", "commit iteration"),
    ("committed_together", "committed together"),
    ("acceptance_probability", "acceptance probability"),
)
# The unit each map's colour bar names.
UNITS = {
    "commit_iteration": "forward pass (step number)",
    "iterations_in_window": "steps waited in the window",
    "committed_together": "codes committed by that step",
    "acceptance_probability": "probability (0 to 1)",
}
# One colour per draft rule (DRAFT_SOURCES), told apart also in grey; no draft stays grey.
RULE_COLOURS = np.array([[128, 128, 128], [230, 159, 0], [86, 180, 233], [0, 158, 115],
                         [240, 228, 66], [0, 114, 178], [213, 94, 0], [204, 121, 167],
                         [40, 40, 40], [140, 80, 30]], dtype=np.float32) / 255.0
GREY = (128, 128, 128)
GREY_LEGEND = "no draft tested"
TEXT = (20, 20, 20)


def committed_together(commit_iteration: np.ndarray) -> np.ndarray:
    """(B, H, W): for each slot, how many slots of its image the same iteration committed."""
    flat = np.asarray(commit_iteration, dtype=np.int64).reshape(len(commit_iteration), -1)
    counts = np.stack([np.bincount(row - row.min(), minlength=1)[row - row.min()] for row in flat])
    return counts.reshape(np.shape(commit_iteration))


def colourise(values: np.ndarray, vmin: float | None = None, vmax: float | None = None) -> np.ndarray:
    """Map values to RGB floats in [0, 1] (shape + (3,)); NaN becomes mid grey."""
    values = np.asarray(values, dtype=np.float64)
    finite = np.isfinite(values)
    low = float(np.min(values[finite])) if vmin is None and finite.any() else (vmin or 0.0)
    high = float(np.max(values[finite])) if vmax is None and finite.any() else (vmax if vmax is not None else 1.0)
    scaled = np.clip((values - low) / (high - low if high > low else 1.0), 0.0, 1.0)
    position = np.where(finite, scaled, 0.0) * (len(_RAMP) - 1)
    index = np.minimum(position.astype(np.int64), len(_RAMP) - 2)
    frac = (position - index)[..., None]
    rgb = _RAMP[index] * (1 - frac) + _RAMP[index + 1] * frac
    return np.where(finite[..., None], rgb, 0.5).astype(np.float32)


def heatmap(values: np.ndarray, cell: int = 16, vmin: float | None = None,
            vmax: float | None = None) -> np.ndarray:
    """(B, H, W) values -> (B, H*cell, W*cell, 3) float32 RGB, one square per slot.

    The colour range is shared by the whole batch, so rows can be compared.
    """
    if np.ndim(values) != 3:
        raise ValueError(f"heatmap expects (B, H, W) values; got shape {np.shape(values)}.")
    if not isinstance(cell, int) or cell < 1:
        raise ValueError(f"cell={quote(cell)} is not allowed: it must be an integer >= 1 (pixels per slot).")
    rgb = colourise(values, vmin, vmax)
    return rgb.repeat(cell, axis=1).repeat(cell, axis=2)


def _to_pil(rgb: np.ndarray) -> Image.Image:
    return Image.fromarray((np.clip(rgb, 0, 1) * 255 + 0.5).astype(np.uint8))


def font(size: int) -> ImageFont.ImageFont:
    """Pillow's bundled font at ``size`` pixels (a scalable one when FreeType is available)."""
    try:
        return ImageFont.load_default(size=size)
    except (TypeError, OSError):  # Pillow before 10.1, or built without FreeType
        return ImageFont.load_default()


def _text_size(size: int) -> int:
    return max(10, min(16, size // 20))


def value_range(values: np.ndarray) -> tuple[float, float] | None:
    """(min, max) of the finite values, or None when there are none."""
    finite = np.asarray(values, dtype=np.float64)
    finite = finite[np.isfinite(finite)]
    return (float(finite.min()), float(finite.max())) if finite.size else None


def _number(value: float) -> str:
    return f"{value:.0f}" if float(value).is_integer() else f"{value:.2f}"


def colour_bar(width: int, span: tuple[float, float] | None, unit: str) -> Image.Image:
    """A strip under a map: the ramp from its lowest to its highest value, both numbers, the
    unit, and a grey swatch saying grey means no draft was tested."""
    size = _text_size(width)
    face = font(size)
    line = size + 4
    strip = Image.new("RGB", (width, 3 * line + 12), (255, 255, 255))
    draw = ImageDraw.Draw(strip)
    swatch = line
    bar_left, bar_right = 2, width - 2
    ramp = colourise(np.linspace(0.0, 1.0, max(bar_right - bar_left, 2))[None, :])
    bar = _to_pil(np.repeat(ramp, 10, axis=0))
    strip.paste(bar, (bar_left, 2))
    low, high = ("-", "-") if span is None else (_number(span[0]), _number(span[1]))
    draw.text((bar_left, 14), low, fill=TEXT, font=face)
    draw.text((bar_right - draw.textlength(high, font=face), 14), high, fill=TEXT, font=face)
    draw.text((bar_left, 14 + line), unit, fill=TEXT, font=face)
    top = 14 + 2 * line
    draw.rectangle([bar_left, top + 1, bar_left + swatch - 4, top + swatch - 3], fill=GREY,
                   outline=TEXT)
    draw.text((bar_left + swatch + 2, top), f"grey: {GREY_LEGEND}", fill=TEXT, font=face)
    return strip


def rule_map(sources: np.ndarray, cell: int = 16) -> np.ndarray:
    """(B, H, W) draft-rule codes (``DRAFT_SOURCES``) -> (B, H*cell, W*cell, 3) float32 RGB, one
    colour per rule (:data:`RULE_COLOURS`)."""
    codes = np.clip(np.asarray(sources, dtype=np.int64), 0, len(RULE_COLOURS) - 1)
    return RULE_COLOURS[codes].repeat(cell, axis=1).repeat(cell, axis=2)


def rule_legend(width: int, sources: np.ndarray) -> Image.Image:
    """A strip under a draft-rule map: a swatch and the name of every rule that occurs in it."""
    present = [code for code in DRAFT_SOURCES if (np.asarray(sources) == code).any()]
    size = _text_size(width)
    face = font(size)
    line = size + 4
    rows = max(len(present), 1)
    strip = Image.new("RGB", (width, rows * line + 12), (255, 255, 255))
    draw = ImageDraw.Draw(strip)
    for row, code in enumerate(present):
        top = 4 + row * line
        colour = tuple(int(c * 255 + 0.5) for c in RULE_COLOURS[code])
        draw.rectangle([2, top + 1, line - 2, top + line - 3], fill=colour, outline=TEXT)
        name = GREY_LEGEND if code == NO_DRAFT else DRAFT_SOURCES[code]
        draw.text((line + 2, top), name, fill=TEXT, font=face)
    return strip


def labelled_panel(picture: np.ndarray | Image.Image, title: str,
                   span: tuple[float, float] | None, unit: str | None,
                   legend: Image.Image | None = None) -> Image.Image:
    """A map picture with its title above and :func:`colour_bar` below (``unit=None``: a picture
    that is no map, with blank space where the bar would be, so panels line up); ``legend``
    replaces the colour bar (a map of categories, :func:`rule_legend`)."""
    tile = picture if isinstance(picture, Image.Image) else _to_pil(picture)
    width = max(tile.width, 160)
    face = font(_text_size(width) + 1)
    title_height = _text_size(width) + 8
    bar = legend if legend is not None else colour_bar(width, span, unit or "")
    canvas = Image.new("RGB", (width, title_height + tile.height + bar.height), (255, 255, 255))
    ImageDraw.Draw(canvas).text((2, 2), title, fill=TEXT, font=face)
    canvas.paste(tile, ((width - tile.width) // 2, title_height))
    if unit is not None or legend is not None:
        canvas.paste(bar, (0, title_height + tile.height))
    return canvas


def acceptance_figure(slot_maps: dict[str, np.ndarray], image: np.ndarray | None = None,
                      row: int = 0, cell: int = 16) -> Image.Image:
    """One picture for batch row ``row``: the image (if given), then the maps of :data:`PANELS`,
    each with its title, colour bar, unit and grey legend, and the draft-rule map with its legend
    when ``slot_maps`` holds ``draft_source``.

    ``image`` is (height, width, 3) floats in [0, 1] (one row of the decoded batch); it is scaled
    with nearest-neighbour to the heatmaps' size.
    """
    missing = [key for key, _ in PANELS if key not in slot_maps and key != "committed_together"]
    if missing:
        raise ValueError(f"slot_maps lacks {missing}; it must come from Trace.slot_maps().")
    first = np.asarray(slot_maps[PANELS[0][0]])
    if not 0 <= row < first.shape[0]:
        raise ValueError(f"row={row} is not allowed: the trace holds rows 0..{first.shape[0] - 1}.")
    size = (first.shape[2] * cell, first.shape[1] * cell)  # (width, height) in pixels
    tiles: list[Image.Image] = []
    maps = dict(slot_maps, committed_together=committed_together(slot_maps["commit_iteration"]))
    for key, title in PANELS:
        values = np.asarray(maps[key], dtype=np.float64)[row:row + 1]
        tiles.append(labelled_panel(heatmap(values, cell)[0], title, value_range(values),
                                    UNITS[key]))
    if "draft_source" in slot_maps:
        sources = np.asarray(slot_maps["draft_source"])[row:row + 1]
        picture = rule_map(sources, cell)[0]
        tiles.append(labelled_panel(picture, "draft rule", None, None,
                                    rule_legend(max(picture.shape[1], 160), sources)))
    if image is not None:
        picture = _to_pil(np.asarray(image)).resize(size, Image.NEAREST)
        tiles.insert(0, labelled_panel(picture, "image", None, None))
    margin = 8
    canvas = Image.new("RGB", (margin + sum(tile.width + margin for tile in tiles),
                               max(tile.height for tile in tiles) + 2 * margin), (255, 255, 255))
    x = margin
    for tile in tiles:
        canvas.paste(tile, (x, margin))
        x += tile.width + margin
    return canvas


def histogram_figure(counts: list[int], mode: str, size: tuple[int, int] = (480, 300)) -> Image.Image:
    """A bar chart of how many steps accepted 1, 2, ... codes, with both axes labelled."""
    canvas = Image.new("RGB", size, (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    face = font(13)
    small = font(11)
    left, right, top, bottom = 56, size[0] - 12, 30, size[1] - 44
    draw.text((left, 6), f"codes accepted per step ({mode})", fill=TEXT, font=face)
    peak = max(counts) if counts and max(counts) > 0 else 1
    bar = (right - left) / max(len(counts), 1)
    label_every = max(1, -(-len(counts) // 16))
    for index, count in enumerate(counts):
        x0 = left + index * bar
        y0 = bottom - (bottom - top) * count / peak
        draw.rectangle([x0 + 1, y0, x0 + max(bar - 2, 1), bottom], fill=(33, 145, 140))
        if (index + 1) % label_every == 0 or index == 0:
            label = str(index + 1)
            draw.text((x0 + bar / 2 - draw.textlength(label, font=small) / 2, bottom + 4), label,
                      fill=TEXT, font=small)
    draw.line([left, bottom, right, bottom], fill=TEXT)
    draw.line([left, top, left, bottom], fill=TEXT)
    for value in (0, peak):
        y = bottom - (bottom - top) * value / peak
        label = str(value)
        draw.line([left - 4, y, left, y], fill=TEXT)
        draw.text((left - 6 - draw.textlength(label, font=small), y - 6), label, fill=TEXT,
                  font=small)
    x_label = "codes accepted in one step"
    draw.text(((left + right - draw.textlength(x_label, font=face)) / 2, size[1] - 20), x_label,
              fill=TEXT, font=face)
    y_label = Image.new("RGB", (bottom - top, 16), (255, 255, 255))
    ImageDraw.Draw(y_label).text((0, 0), "number of steps", fill=TEXT, font=face)
    canvas.paste(y_label.rotate(90, expand=True), (4, top))
    return canvas


def image_grid(images: np.ndarray, columns: int, scale: int = 1, gap: int = 2) -> Image.Image:
    """(N, H, W, 3) floats in [0, 1] -> one picture, ``columns`` per row, nearest-neighbour scaled."""
    images = np.asarray(images)
    if images.ndim != 4 or images.shape[-1] != 3 or len(images) == 0:
        raise ValueError(f"image_grid expects (N, H, W, 3) images with N >= 1; got {images.shape}.")
    if not isinstance(columns, int) or columns < 1 or not isinstance(scale, int) or scale < 1:
        raise ValueError(f"columns={quote(columns)} and scale={quote(scale)} must be integers >= 1.")
    count, height, width = images.shape[:3]
    columns = min(columns, count)
    rows = -(-count // columns)
    cell_w, cell_h = width * scale, height * scale
    canvas = Image.new("RGB", (columns * cell_w + (columns + 1) * gap,
                               rows * cell_h + (rows + 1) * gap), (255, 255, 255))
    for index, image in enumerate(images):
        row, column = divmod(index, columns)
        tile = _to_pil(image).resize((cell_w, cell_h), Image.NEAREST)
        canvas.paste(tile, (gap + column * (cell_w + gap), gap + row * (cell_h + gap)))
    return canvas
