"""Per-slot acceptance heatmaps as pictures (numpy + pillow), for the demo and the diagnostics node.

Input is :meth:`sjd_core.decoding.trace.Trace.slot_maps`: numpy arrays (B, H, W) per quantity. A map
becomes an RGB array by a perceptual colour ramp (dark blue = low, yellow = high), each slot drawn
as a ``cell`` x ``cell`` square. :func:`acceptance_figure` puts the image and two maps side by
side with titles and value ranges: *commit iteration* (the forward pass that committed each slot),
*committed together* (how many slots that forward pass committed: bright bands are long accepted
drafts) and *acceptance probability* (the verifier's probability of keeping the committed draft).
"""

from __future__ import annotations

import numpy as np
from PIL import Image, ImageDraw

# Stops of a blue-green-yellow ramp that stays readable in grey and for common colour blindness.
_RAMP = np.array([[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]],
                 dtype=np.float32) / 255.0

PANELS: tuple[tuple[str, str], ...] = (
    ("commit_iteration", "commit iteration"),
    ("committed_together", "committed together"),
    ("acceptance_probability", "acceptance probability"),
)


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
        raise ValueError(f"cell={cell!r} is not allowed: it must be an integer >= 1 (pixels per slot).")
    rgb = colourise(values, vmin, vmax)
    return rgb.repeat(cell, axis=1).repeat(cell, axis=2)


def _to_pil(rgb: np.ndarray) -> Image.Image:
    return Image.fromarray((np.clip(rgb, 0, 1) * 255 + 0.5).astype(np.uint8))


def acceptance_figure(slot_maps: dict[str, np.ndarray], image: np.ndarray | None = None,
                      row: int = 0, cell: int = 16) -> Image.Image:
    """One picture for batch row ``row``: the image (if given), then the maps of :data:`PANELS`.

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
    tiles: list[tuple[str, Image.Image]] = []
    if image is not None:
        tiles.append(("image\n", _to_pil(np.asarray(image)).resize(size, Image.NEAREST)))
    maps = dict(slot_maps, committed_together=committed_together(slot_maps["commit_iteration"]))
    for key, title in PANELS:
        values = np.asarray(maps[key], dtype=np.float64)[row:row + 1]
        finite = values[np.isfinite(values)]
        span = f"{finite.min():.3g} .. {finite.max():.3g}" if finite.size else "no values"
        tiles.append((f"{title}\n{span}", _to_pil(heatmap(values, cell)[0])))
    margin, title_height = 8, 28
    canvas = Image.new("RGB", (margin + len(tiles) * (size[0] + margin),
                               title_height + size[1] + 2 * margin), (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    for index, (title, tile) in enumerate(tiles):
        x = margin + index * (size[0] + margin)
        draw.text((x, margin // 2), title, fill=(0, 0, 0))
        canvas.paste(tile, (x, title_height + margin))
    return canvas


def image_grid(images: np.ndarray, columns: int, scale: int = 1, gap: int = 2) -> Image.Image:
    """(N, H, W, 3) floats in [0, 1] -> one picture, ``columns`` per row, nearest-neighbour scaled."""
    images = np.asarray(images)
    if images.ndim != 4 or images.shape[-1] != 3 or len(images) == 0:
        raise ValueError(f"image_grid expects (N, H, W, 3) images with N >= 1; got {images.shape}.")
    if not isinstance(columns, int) or columns < 1 or not isinstance(scale, int) or scale < 1:
        raise ValueError(f"columns={columns!r} and scale={scale!r} must be integers >= 1.")
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
