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
:func:`diagnostics_sheet` puts all of them, for one batch row, on the one picture the SJD
Diagnostics node shows, led by :func:`comparison_block` (both runs and the measured speed-up)
when an AR run of the same request is given. Text is drawn by :func:`draw_text`: Pillow's
bundled scalable font (Pillow >= 10.1 with FreeType), else its bitmap font scaled up.
"""

from __future__ import annotations

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from .messages import quote
from .decoding.drafting import DRAFT_SOURCES, NO_DRAFT

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


def scalable_font(size: int) -> ImageFont.FreeTypeFont | None:
    """Pillow's bundled Aileron font at ``size`` pixels (Pillow >= 10.1 built with FreeType), or
    None where Pillow cannot scale its bundled font (older Pillow: ``load_default`` takes no size;
    Pillow without FreeType)."""
    try:
        return ImageFont.load_default(size=size)
    except (TypeError, OSError, ImportError):
        return None


def _bitmap_font() -> ImageFont.ImageFont:
    """Pillow's fixed bitmap font (11 px per line), which every Pillow has."""
    return getattr(ImageFont, "load_default_imagefont", ImageFont.load_default)()


_BITMAP_LINE = 11  # pixels per line of the bitmap font


def font(size: int) -> ImageFont.ImageFont:
    """Pillow's bundled font at ``size`` pixels (a scalable one when FreeType is available), else
    the fixed bitmap font; :func:`draw_text` scales that one up to ``size`` instead."""
    return scalable_font(size) or _bitmap_font()


def text_width(text: str, size: int) -> float:
    """Width in pixels of ``text`` drawn by :func:`draw_text` at ``size``."""
    face = scalable_font(size)
    measure = ImageDraw.Draw(Image.new("L", (1, 1)))
    if face is not None:
        return measure.textlength(text, font=face)
    return measure.textlength(text, font=_bitmap_font()) * size / _BITMAP_LINE


def draw_text(canvas: Image.Image, xy: tuple[float, float], text: str, size: int,
              fill: tuple[int, int, int] = (20, 20, 20)) -> None:
    """Write ``text`` at ``size`` pixels (the font's em, as CSS font-size counts it) with its top
    left at ``xy``. With Pillow's scalable font this is a plain draw; without one the bitmap
    font's 11 px lines are drawn and scaled by ``size / 11``, blocky but as large as asked."""
    face = scalable_font(size)
    if face is not None:
        ImageDraw.Draw(canvas).text(xy, text, fill=fill, font=face)
        return
    bitmap = _bitmap_font()
    width = max(1, int(ImageDraw.Draw(Image.new("L", (1, 1))).textlength(text, font=bitmap)))
    mask = Image.new("L", (width, _BITMAP_LINE), 0)
    ImageDraw.Draw(mask).text((0, 0), text, fill=255, font=bitmap)
    scale = size / _BITMAP_LINE
    mask = mask.resize((max(1, round(width * scale)), max(1, round(_BITMAP_LINE * scale))),
                       Image.BILINEAR)
    canvas.paste(Image.new("RGB", mask.size, fill), (round(xy[0]), round(xy[1])), mask)


def line_height(size: int) -> int:
    """Pixels from one line of text at ``size`` to the next."""
    return size + 4


def wrap(text: str, size: int, width: float) -> list[str]:
    """``text`` broken at spaces into lines no wider than ``width`` at ``size`` (a word longer
    than the width keeps a line of its own)."""
    lines: list[str] = []
    for word in text.split(" "):
        if lines and text_width(f"{lines[-1]} {word}", size) <= width:
            lines[-1] = f"{lines[-1]} {word}"
        else:
            lines.append(word)
    return lines or [""]


def _text_size(size: int) -> int:
    return max(10, min(16, size // 20))


def value_range(values: np.ndarray) -> tuple[float, float] | None:
    """(min, max) of the finite values, or None when there are none."""
    finite = np.asarray(values, dtype=np.float64)
    finite = finite[np.isfinite(finite)]
    return (float(finite.min()), float(finite.max())) if finite.size else None


def _number(value: float) -> str:
    return f"{value:.0f}" if float(value).is_integer() else f"{value:.2f}"


def colour_bar(width: int, span: tuple[float, float] | None, unit: str,
               text: int | None = None) -> Image.Image:
    """A strip under a map: the ramp from its lowest to its highest value, both numbers, the
    unit, and a grey swatch saying grey means no draft was tested. ``text``: the font size in
    pixels (default: from the width, 10 to 16); a unit or legend wider than the strip wraps."""
    size = text or _text_size(width)
    line = line_height(size)
    bar_left, bar_right = 2, width - 2
    units = wrap(unit, size, bar_right - bar_left)
    legend = wrap(f"grey: {GREY_LEGEND}", size, bar_right - bar_left - line - 2)
    strip = Image.new("RGB", (width, (1 + len(units) + len(legend)) * line + 12), (255, 255, 255))
    draw = ImageDraw.Draw(strip)
    ramp = colourise(np.linspace(0.0, 1.0, max(bar_right - bar_left, 2))[None, :])
    strip.paste(_to_pil(np.repeat(ramp, 10, axis=0)), (bar_left, 2))
    low, high = ("-", "-") if span is None else (_number(span[0]), _number(span[1]))
    draw_text(strip, (bar_left, 14), low, size, TEXT)
    draw_text(strip, (bar_right - text_width(high, size), 14), high, size, TEXT)
    top = 14 + line
    for part in units:
        draw_text(strip, (bar_left, top), part, size, TEXT)
        top += line
    draw.rectangle([bar_left, top + 1, bar_left + line - 4, top + line - 3], fill=GREY,
                   outline=TEXT)
    for part in legend:
        draw_text(strip, (bar_left + line + 2, top), part, size, TEXT)
        top += line
    return strip


def rule_map(sources: np.ndarray, cell: int = 16) -> np.ndarray:
    """(B, H, W) draft-rule codes (``DRAFT_SOURCES``) -> (B, H*cell, W*cell, 3) float32 RGB, one
    colour per rule (:data:`RULE_COLOURS`)."""
    codes = np.clip(np.asarray(sources, dtype=np.int64), 0, len(RULE_COLOURS) - 1)
    return RULE_COLOURS[codes].repeat(cell, axis=1).repeat(cell, axis=2)


def rule_legend(width: int, sources: np.ndarray, text: int | None = None) -> Image.Image:
    """A strip under a draft-rule map: a swatch and the name of every rule that occurs in it.
    ``text``: the font size in pixels (default: from the width); a long name wraps."""
    present = [code for code in DRAFT_SOURCES if (np.asarray(sources) == code).any()]
    size = text or _text_size(width)
    line = line_height(size)
    names = [wrap(GREY_LEGEND if code == NO_DRAFT else DRAFT_SOURCES[code], size,
                  width - line - 4) for code in present]
    strip = Image.new("RGB", (width, max(sum(map(len, names)), 1) * line + 12), (255, 255, 255))
    draw = ImageDraw.Draw(strip)
    top = 4
    for code, lines in zip(present, names):
        colour = tuple(int(c * 255 + 0.5) for c in RULE_COLOURS[code])
        draw.rectangle([2, top + 1, line - 2, top + line - 3], fill=colour, outline=TEXT)
        for part in lines:
            draw_text(strip, (line + 2, top), part, size, TEXT)
            top += line
    return strip


def labelled_panel(picture: np.ndarray | Image.Image, title: str,
                   span: tuple[float, float] | None, unit: str | None,
                   legend: Image.Image | None = None, width: int | None = None,
                   text: int | None = None) -> Image.Image:
    """A map picture with its title above and :func:`colour_bar` below (``unit=None``: a picture
    that is no map, with blank space where the bar would be, so panels line up); ``legend``
    replaces the colour bar (a map of categories, :func:`rule_legend`). ``width``: the panel's
    width (default: the picture's, at least 160); ``text``: the font size of the bar (the title
    is 1 px larger; default: from the width)."""
    tile = picture if isinstance(picture, Image.Image) else _to_pil(picture)
    width = width or max(tile.width, 160)
    size = text or _text_size(width)
    title_height = size + 8
    bar = legend if legend is not None else colour_bar(width, span, unit or "", size)
    canvas = Image.new("RGB", (width, title_height + tile.height + bar.height), (255, 255, 255))
    draw_text(canvas, (2, 2), title, size + 1, TEXT)
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


def histogram_figure(counts: list[int], mode: str, size: tuple[int, int] = (480, 300),
                     text: int = 13) -> Image.Image:
    """A bar chart of how many steps accepted 1, 2, ... codes, with both axes labelled. ``text``:
    the font size of the title and axis names in pixels (the tick numbers are 2 px smaller); a
    title or axis name wider than the chart wraps."""
    canvas = Image.new("RGB", size, (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    small, line = text - 2, line_height(text)
    peak = max(counts) if counts and max(counts) > 0 else 1
    left = max(min(56, size[0] // 5), round(line + 10 + text_width(str(peak), small)))
    right = size[0] - 12
    title = f"codes accepted per step ({mode})"
    title_x = left if text_width(title, text) <= size[0] - left - 4 else 4
    titles = wrap(title, text, size[0] - title_x - 4)
    x_labels = wrap("codes accepted in one step", text, size[0] - 8)
    top = 6 + len(titles) * line + 7
    bottom = size[1] - (small + 8) - len(x_labels) * line - 4
    for index, part in enumerate(titles):
        draw_text(canvas, (title_x, 6 + index * line), part, text, TEXT)
    bar = (right - left) / max(len(counts), 1)
    label_every = max(1, -(-len(counts) // 16))
    label_every = max(label_every, -(-len(counts) * round(text_width("00", small) + 6)
                                     // max(right - left, 1)))
    for index, count in enumerate(counts):
        x0 = left + index * bar
        y0 = bottom - (bottom - top) * count / peak
        draw.rectangle([x0 + 1, y0, x0 + max(bar - 2, 1), bottom], fill=(33, 145, 140))
        if (index + 1) % label_every == 0 or index == 0:
            label = str(index + 1)
            draw_text(canvas, (x0 + bar / 2 - text_width(label, small) / 2, bottom + 4), label,
                      small, TEXT)
    _axes(canvas, (left, top, right, bottom), peak, x_labels, text)
    return canvas


def _axes(canvas: Image.Image, box: tuple[float, float, float, float], peak: int,
          x_labels: list[str], text: int) -> None:
    """The histogram's axes in ``box`` (left, top, right, bottom): lines, the 0 and ``peak``
    ticks, the x axis's name (``x_labels``, its wrapped lines) and the y axis's, turned."""
    left, top, right, bottom = box
    draw = ImageDraw.Draw(canvas)
    small, line = text - 2, line_height(text)
    draw.line([left, bottom, right, bottom], fill=TEXT)
    draw.line([left, top, left, bottom], fill=TEXT)
    for value in (0, peak):
        y = bottom - (bottom - top) * value / peak
        label = str(value)
        draw.line([left - 4, y, left, y], fill=TEXT)
        draw_text(canvas, (left - 6 - text_width(label, small), y - small / 2 - 1), label, small,
                  TEXT)
    for index, part in enumerate(x_labels):  # centred under the axis, kept on the canvas
        width = text_width(part, text)
        x = min(max(4, (left + right - width) / 2), canvas.width - 4 - width)
        draw_text(canvas, (x, bottom + small + 8 + index * line), part, text, TEXT)
    y_text = "number of steps"
    y_label = Image.new("RGB", (max(round(bottom - top), round(text_width(y_text, text))), line),
                        (255, 255, 255))
    draw_text(y_label, ((y_label.width - text_width(y_text, text)) / 2, 0), y_text, text, TEXT)
    y_label = y_label.rotate(90, expand=True)
    canvas.paste(y_label, (4, max(0, round(top + bottom - y_label.height) // 2)))


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


# --------------------------------------------------------------------- the diagnostics sheet
#
# The SJD Diagnostics node shows one picture, this sheet, scaled into a box of the node: ComfyUI's
# classic canvas draws it at min(1, box width / sheet width, box height / sheet height) of its
# size, in a box as wide as the node and as tall as the room left below the widgets; the
# Vue-nodes mode fits it (object-fit: contain) into the node's width less 8 px padding on each
# side and the height the node's layout gives its image. A font of s px in the sheet is s x scale
# x zoom px on screen, so the sheet is drawn for a known width with fonts that stay readable
# after that scaling:
#
#   node 420 wide (the text-to-image templates): scale by width 404 / 600 = 0.673 (Vue) or
#     420 / 600 = 0.70 (classic): SHEET_TEXT 16 px -> 10.8 px on screen at 100% zoom, as long as
#     the box is at least 0.673 x the sheet's height tall (the sheet without a baseline is about
#     600 px tall: a box of 404 px, so a node of about 420 x 700 in the classic canvas).
#   AR vs AUTO template, node 620 x 1190 (SHEET_BOXES, measured after a run in ComfyUI 0.3.75
#     with frontend 1.58): the height binds. For the template's sheet (about 800 px tall) the
#     scale is 541 / 800 = 0.68 (Vue) or 566 / 800 = 0.71 (classic): SHEET_TEXT 16 px -> 10.8 px
#     at 100% zoom; at the template's 75%, SHEET_SPEED_UP 44 px -> 44 x 0.68 x 0.75 = 22 px and
#     SHEET_CAPTION 20 px (forward passes, times) -> 10.1 px.
#
# tests/test_diagnostics.py computes these for drawn sheets.
SHEET_WIDTH = 600  # pixels
SHEET_MARGIN = 10
SHEET_GAP = 8
SHEET_COLUMN = (SHEET_WIDTH - 2 * SHEET_MARGIN - 2 * SHEET_GAP) // 3  # 188: three columns
SHEET_PICTURE = 150  # the tallest a map or an image may be drawn (pixels)
SHEET_TEXT = 16  # colour-bar numbers, units, legends, axis names, notes (titles: 17)
SHEET_CAPTION = 20  # the comparison: mode, forward passes and time of each run
SHEET_SPEED_UP = 44  # the comparison: the measured speed-up
# Box (width, height) in graph units, at 100% zoom, that a node shows its sheet in: by node
# width alone (the height the node's size leaves is the template's business), and as measured
# in the AR vs AUTO template after a run.
SHEET_BOXES = {
    "420 wide, Vue nodes": (404, None),
    "420 wide, classic canvas": (420, None),
    "AR vs AUTO template, Vue nodes": (604, 541),
    "AR vs AUTO template, classic canvas": (620, 566),
}


def shown_scale(box: tuple[int, int | None], sheet: tuple[int, int]) -> float:
    """The scale a node showing ``sheet`` (width, height) in ``box`` (width, height or None for
    room enough) draws it at (never enlarged, as in the classic canvas)."""
    width, height = box
    return min(1.0, width / sheet[0], height / sheet[1] if height else 1.0)


SPEED_UP_COLOUR = (0, 110, 90)
SLOWER_COLOUR = (180, 30, 30)


def fit(picture: np.ndarray | Image.Image, width: int, height: int) -> Image.Image:
    """``picture`` scaled to fit ``width`` x ``height`` with its aspect ratio: enlarged by a whole
    factor (square pixels stay square, nearest neighbour), reduced by area averaging."""
    tile = picture if isinstance(picture, Image.Image) else _to_pil(picture)
    scale = min(width / tile.width, height / tile.height)
    if scale >= 1:
        factor = int(scale)
        return tile.resize((tile.width * factor, tile.height * factor), Image.NEAREST)
    size = (max(1, round(tile.width * scale)), max(1, round(tile.height * scale)))
    return tile.resize(size, Image.BOX)


def _text_block(width: int, lines: list[tuple[str, int, tuple[int, int, int]]]
                ) -> tuple[Image.Image, list[tuple[int, int, int, int]]]:
    """Lines of (text, size, colour), each wrapped to ``width``, one under the other; returns
    the picture and each line's box (x, y, width, height) before wrapping splits it."""
    parts = [(wrap(text, size, width), size, colour) for text, size, colour in lines]
    block = Image.new("RGB", (width, max(1, sum(len(p) * line_height(s) for p, s, _ in parts))),
                      (255, 255, 255))
    boxes, top = [], 0
    for wrapped, size, colour in parts:
        start = top
        for part in wrapped:
            draw_text(block, (0, top), part, size, colour)
            top += line_height(size)
        boxes.append((0, start, round(max(text_width(p, size) for p in wrapped)), top - start))
    return block, boxes


def _placeholder(width: int, height: int, text: str) -> Image.Image:
    """A grey box saying what is missing."""
    box = Image.new("RGB", (width, height), (225, 225, 225))
    note, _ = _text_block(width - 12, [(text, SHEET_TEXT, TEXT)])
    box.paste(Image.eval(note, lambda v: v if v < 255 else 225), (6, 6))
    return box


def _titled(tile: Image.Image, title: str) -> Image.Image:
    """A picture :data:`SHEET_COLUMN` wide with its title above, as a map panel has it."""
    title_height = SHEET_TEXT + 8
    canvas = Image.new("RGB", (SHEET_COLUMN, title_height + SHEET_PICTURE), (255, 255, 255))
    draw_text(canvas, (2, 2), title, SHEET_TEXT + 1, TEXT)
    canvas.paste(tile, ((SHEET_COLUMN - tile.width) // 2, title_height))
    return canvas


def _run_lines(summary: dict, label: str) -> list[tuple[str, int, tuple[int, int, int]]]:
    return [(label, SHEET_CAPTION, TEXT),
            (f"{summary['nfe']:.0f} forward passes", SHEET_CAPTION, TEXT),
            (f"{summary['total_seconds']:.2f} s", SHEET_CAPTION, TEXT)]


def comparison_block(summary: dict, baseline: dict, image: np.ndarray | None = None,
                     baseline_image: np.ndarray | None = None, seed: int | None = None
                     ) -> tuple[Image.Image, tuple[int, int, int, int]]:
    """The head of the sheet when an AR run of the same request is given: both runs side by side
    (their images when ``baseline_image`` is given, else their numbers only), each with its
    forward passes and measured time, and the measured speed-up in large text. ``summary`` and
    ``baseline`` are :meth:`Trace.summary` of the run and of the AR run; the images are (h, w, 3)
    floats in [0, 1] (one batch row). Returns the block and the speed-up line's box."""
    width = SHEET_WIDTH - 2 * SHEET_MARGIN
    block = Image.new("RGB", (width, 2000), (255, 255, 255))
    top = bottom = 0
    for column, (run, picture, label) in enumerate(
            ((baseline, baseline_image, f"{baseline['mode']} (baseline)"),
             (summary, image, summary["mode"]))):
        x, y = column * (SHEET_COLUMN + SHEET_GAP), top
        if baseline_image is not None:
            tile = (fit(picture, SHEET_COLUMN, SHEET_PICTURE) if picture is not None else
                    _placeholder(SHEET_COLUMN, SHEET_COLUMN // 2,
                                 "image not connected: connect this run's decoded IMAGE as image"))
            block.paste(tile, (x + (SHEET_COLUMN - tile.width) // 2, y))
            y += tile.height + 4
        text, _ = _text_block(SHEET_COLUMN, _run_lines(run, label))
        block.paste(text, (x, y))
        bottom = max(bottom, y + text.height)
    speed_up = baseline["total_seconds"] / max(summary["total_seconds"], 1e-9)
    fewer = baseline["nfe"] / max(summary["nfe"], 1e-9)
    lossless = "both lossless" if summary["lossless"] and baseline["lossless"] else \
        f"{summary['mode']} is LOSSY"
    colour = SPEED_UP_COLOUR if speed_up >= 1 else SLOWER_COLOUR
    text, boxes = _text_block(SHEET_COLUMN, [
        (f"same request{f', seed {seed}' if seed is not None else ''}", SHEET_TEXT, TEXT),
        ("speed-up, measured", SHEET_TEXT, TEXT),
        (f"{speed_up:.2f}x", SHEET_SPEED_UP, colour),
        (f"{baseline['total_seconds']:.2f} s -> {summary['total_seconds']:.2f} s", SHEET_TEXT,
         TEXT),
        (f"{fewer:.2f}x fewer forward passes", SHEET_CAPTION, TEXT),
        (lossless, SHEET_TEXT, TEXT)])
    x = 2 * (SHEET_COLUMN + SHEET_GAP)
    block.paste(text, (x, top))
    bottom = max(bottom, top + text.height)
    box = boxes[2]
    return block.crop((0, 0, width, bottom)), (x + box[0], top + box[1], box[2], box[3])


def summary_block(summary: dict) -> Image.Image:
    """The head of the sheet without an AR baseline: forward passes, time and the speed-up that
    the step compression allows at most."""
    width = SHEET_WIDTH - 2 * SHEET_MARGIN
    block, _ = _text_block(width, [
        (f"{summary['mode']}{'' if summary['lossless'] else ' (LOSSY)'}: {summary['nfe']:.0f} "
         f"forward passes for {summary['slots_per_image']} codes, {summary['total_seconds']:.2f} s",
         SHEET_CAPTION, TEXT),
        (f"step compression {summary['step_compression']:.2f}x: at most that much faster than "
         "AR; connect an AR run's trace as baseline_trace to measure the speed-up",
         SHEET_TEXT, TEXT)])
    return block


def _rules_and_histogram(rules: np.ndarray, sources: np.ndarray,
                         summary: dict) -> list[Image.Image]:
    """The sheet's last row: the draft-rule map, its legend beside it, the histogram."""
    rule_panel = _titled(fit(rules, SHEET_COLUMN, SHEET_PICTURE), "draft rule")
    legend = rule_legend(SHEET_COLUMN, sources, SHEET_TEXT)
    legend_panel = Image.new("RGB", (SHEET_COLUMN, rule_panel.height - SHEET_PICTURE
                                     + legend.height), (255, 255, 255))
    legend_panel.paste(legend, (0, rule_panel.height - SHEET_PICTURE - 4))  # beside the map
    histogram = histogram_figure(summary["accepted_length_histogram"], summary["mode"],
                                 (SHEET_COLUMN, max(rule_panel.height, legend_panel.height, 230)),
                                 SHEET_TEXT)
    return [rule_panel, legend_panel, histogram]


def diagnostics_sheet(maps: list[tuple[str, np.ndarray, tuple[float, float] | None, str]],
                      rules: np.ndarray, sources: np.ndarray, summary: dict,
                      baseline: dict | None = None, image: np.ndarray | None = None,
                      baseline_image: np.ndarray | None = None, seed: int | None = None,
                      batch: int = 1) -> tuple[Image.Image, dict[str, tuple[int, int, int, int]]]:
    """Everything the SJD Diagnostics node shows, on one picture :data:`SHEET_WIDTH` wide.

    From the top: the comparison with an AR run (:func:`comparison_block`, when ``baseline`` is
    given) or the run's summary (:func:`summary_block`); the three maps of ``maps`` ((title,
    (h, w, 3) RGB floats, value range, unit) of the first batch row), each with its title and
    colour bar; the draft-rule map ``rules`` with the legend of the rules in ``sources``; the
    accepted-length histogram of ``summary``. Fonts: :data:`SHEET_TEXT` and larger.

    Returns the sheet and the boxes (x, y, width, height in the sheet's pixels) of what a test
    may measure: ``head`` (the comparison or summary) and, when a baseline is given,
    ``speed_up`` (the line of the speed-up, in :data:`SHEET_SPEED_UP` px text).
    """
    boxes: dict[str, tuple[int, int, int, int]] = {}
    inner = SHEET_WIDTH - 2 * SHEET_MARGIN
    if baseline is not None:
        head, speed_up = comparison_block(summary, baseline, image, baseline_image, seed)
    else:
        head, speed_up = summary_block(summary), None
    rows: list[list[Image.Image]] = [[head]]
    if batch > 1:
        rows.append([_text_block(inner, [(f"image 1 of {batch} shown; the node's outputs hold "
                                           f"all {batch}", SHEET_TEXT, TEXT)])[0]])
    rows.append([labelled_panel(fit(rgb, SHEET_COLUMN, SHEET_PICTURE), title, span, unit,
                                width=SHEET_COLUMN, text=SHEET_TEXT)
                 for title, rgb, span, unit in maps])
    rows.append(_rules_and_histogram(rules, sources, summary))
    height = SHEET_MARGIN + sum(max(p.height for p in row) + SHEET_GAP for row in rows) \
        - SHEET_GAP + SHEET_MARGIN
    sheet = Image.new("RGB", (SHEET_WIDTH, height), (255, 255, 255))
    draw = ImageDraw.Draw(sheet)
    top = SHEET_MARGIN
    for index, row in enumerate(rows):
        if index == 1:  # a thin rule under the head
            y = top - SHEET_GAP // 2 - 1
            draw.line([SHEET_MARGIN, y, SHEET_WIDTH - SHEET_MARGIN, y], fill=(200, 200, 200))
        x = SHEET_MARGIN
        for picture in row:
            sheet.paste(picture, (x, top))
            x += picture.width + SHEET_GAP
        if row[0] is head:
            boxes["head"] = (SHEET_MARGIN, top, head.width, head.height)
            if speed_up is not None:
                boxes["speed_up"] = (SHEET_MARGIN + speed_up[0], top + speed_up[1], *speed_up[2:])
        top += max(p.height for p in row) + SHEET_GAP
    return sheet, boxes
