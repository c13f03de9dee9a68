"""SJD Diagnostics' sheet: the one picture the node shows (its size and font sizes, read where the
templates show it), the comparison with an AR run with and without ``baseline_image``, the
checks of ``baseline_image``, and the node's outputs, which stay as they were."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from tests.pack import REPO, import_pack

pack = import_pack()
from sjd_pack.nodes import comfy_bridge  # noqa: E402
from sjd_pack.nodes.handles import LoadedModel  # noqa: E402
from sjd_pack.sjd_core.decoding.drafting import DRAFT_SOURCES  # noqa: E402
from sjd_pack.sjd_core.models.synthetic import SyntheticModel  # noqa: E402
from sjd_pack.sjd_core import figures  # noqa: E402
from sjd_pack.sjd_core.figures import (SHEET_BOXES, SHEET_CAPTION,  # noqa: E402
                                             SHEET_SPEED_UP, SHEET_TEXT, SHEET_WIDTH,
                                             SLOWER_COLOUR, SPEED_UP_COLOUR, diagnostics_sheet,
                                             shown_scale)

Sampler = pack.NODE_CLASS_MAPPINGS["SJDSamplerV2"]
Decode = pack.NODE_CLASS_MAPPINGS["SJDDecode"]
Diagnostics = pack.NODE_CLASS_MAPPINGS["SJDDiagnostics"]
GRID = (8, 8)
TEMPLATE_ZOOM = 0.75  # extra.ds.scale of the AR vs AUTO template
READABLE = 10  # px on screen, at 100% zoom
SPEED_UP_READABLE = 12  # px on screen, at the template's zoom


def sample(model: LoadedModel, **changes):
    """A sampler run with every widget at its default but ``changes``."""
    values = {}
    for name, spec in Sampler.INPUT_TYPES()["required"].items():
        if isinstance(spec[0], list):
            values[name] = spec[1].get("default", spec[0][0])
        elif spec[0] in ("INT", "FLOAT", "STRING", "BOOLEAN"):
            values[name] = spec[1]["default"]
    values |= {"prompt": "same", "seed": 9} | changes
    return Sampler().sample(model, **values, unique_id="7")["result"]


@pytest.fixture(scope="module")
def runs():
    """An AUTO run and an AR run of the same request, with their decoded images (8x)."""
    torch.manual_seed(0)
    model = LoadedModel(SyntheticModel(codebook_size=16, grid=GRID, sharpness=3.0), None,
                        "synthetic", torch.float32)
    codes, fast, _ = sample(model)
    ar_codes, ar, _ = sample(model, mode="AR")
    return {"trace": fast, "baseline_trace": ar, "image": Decode().decode(codes, "8")[0],
            "baseline_image": Decode().decode(ar_codes, "8")[0]}


@pytest.fixture
def shown(monkeypatch):
    """What the node shows: each picture it hands to ComfyUI's preview folder."""
    pictures: list[Image.Image] = []

    def save(images, prefix):
        pictures.extend(images)
        return [{"filename": f"{prefix}_{len(pictures)}.png", "subfolder": "", "type": "temp"}
                for _ in images]

    monkeypatch.setattr(comfy_bridge, "save_previews", save)
    return pictures


def ink_rows(picture: Image.Image, box: tuple[int, int, int, int], colours) -> int:
    """How many pixel rows of ``box`` hold a pixel close to one of ``colours`` (text ink)."""
    x, y, width, height = box
    pixels = np.asarray(picture.convert("RGB"), dtype=int)[y:y + height, x:x + width]
    near = np.zeros(pixels.shape[:2], bool)
    for colour in colours:
        near |= np.abs(pixels - np.array(colour)).max(axis=-1) < 40
    return int(near.any(axis=1).sum())


def worst_case_sheet(**changes):
    """A sheet as tall as the node's sheets get for one image: a comparison with both images,
    every draft rule in the legend (each one a line or two), a long histogram."""
    rgb = np.random.default_rng(0).random((256, 256, 3))
    maps = [(title, rgb, (0.0, 63.0), figures.UNITS[key]) for key, title in
            (("commit_iteration", "commit iteration"),
             ("iterations_in_window", "iterations in window"),
             ("acceptance_probability", "acceptance probability"))]
    sources = np.array(sorted(DRAFT_SOURCES)).reshape(1, 2, -1)
    summary = {"mode": "AUTO", "nfe": 64.0, "total_seconds": 6.0, "lossless": True,
               "slots_per_image": 256, "step_compression": 4.0,
               "accepted_length_histogram": list(range(32))}
    baseline = dict(summary, mode="AR", nfe=256.0, total_seconds=15.0, step_compression=1.0)
    arguments = dict(maps=maps, rules=rgb, sources=sources, summary=summary, baseline=baseline,
                     image=rgb, baseline_image=rgb, seed=3) | changes
    return diagnostics_sheet(**arguments)


# ---------------------------------------------------------------- size and fonts

def test_the_sheets_fonts_are_readable_where_the_templates_show_it():
    sheet, boxes = worst_case_sheet()
    assert sheet.width == SHEET_WIDTH
    for name, box in SHEET_BOXES.items():
        scale = shown_scale(box, sheet.size)
        # every label, legend and axis name: >= 10 px on screen at 100% zoom
        assert SHEET_TEXT * scale >= READABLE, (name, scale, sheet.size)
        if name.startswith("AR vs AUTO"):
            # the comparison at the template's own zoom: the speed-up >= 12 px, the forward
            # passes and times >= 10 px
            assert SHEET_SPEED_UP * scale * TEMPLATE_ZOOM >= SPEED_UP_READABLE, (name, scale)
            assert SHEET_CAPTION * scale * TEMPLATE_ZOOM >= READABLE, (name, scale)
    # the arithmetic of figures.py's comment, for the widths the templates give the node
    assert shown_scale(SHEET_BOXES["420 wide, Vue nodes"], sheet.size) == pytest.approx(404 / 600)
    assert SHEET_TEXT * 404 / 600 == pytest.approx(10.77, abs=0.01)
    without_baseline, _ = worst_case_sheet(baseline=None)
    assert without_baseline.height < sheet.height <= 900  # the template's box holds ~800


def test_shown_scale_binds_by_width_or_height_and_never_enlarges():
    assert shown_scale((300, None), (600, 800)) == 0.5
    assert shown_scale((600, 400), (600, 800)) == 0.5
    assert shown_scale((1200, 1600), (600, 800)) == 1.0


def test_the_speed_up_is_drawn_at_its_font_size(runs, shown):
    out = Diagnostics().diagnose(runs["trace"], 0.5, runs["image"],
                                 runs["baseline_trace"], runs["baseline_image"])
    (sheet,) = shown
    layout = out["ui"]["sjd_sheet"][0]
    assert layout["width"] == sheet.width == SHEET_WIDTH and layout["height"] == sheet.height
    assert layout["speed_up_px"] == SHEET_SPEED_UP and layout["text_px"] == SHEET_TEXT
    box = layout["speed_up_box"]
    assert box[3] == figures.line_height(SHEET_SPEED_UP)
    # the digits' ink is about 0.7 em tall: a 44 px line, not a small one
    assert ink_rows(sheet, box, (SPEED_UP_COLOUR, SLOWER_COLOUR)) >= 0.6 * SHEET_SPEED_UP


@pytest.mark.parametrize("scalable", [True, False])
def test_text_is_drawn_at_the_size_asked_with_either_font(monkeypatch, scalable):
    if not scalable:  # Pillow before 10.1 or without FreeType: the bitmap font, scaled up
        monkeypatch.setattr(figures, "scalable_font", lambda size: None)
    canvas = Image.new("RGB", (400, 60), (255, 255, 255))
    figures.draw_text(canvas, (2, 2), "0123456789 Hg", SHEET_TEXT, (0, 0, 0))
    rows = ink_rows(canvas, (0, 0, 400, 60), [(0, 0, 0)])
    assert 0.6 * SHEET_TEXT <= rows <= 1.5 * SHEET_TEXT
    inked = np.asarray(canvas).min(axis=(0, 2)) < 128
    width = int(np.nonzero(inked)[0].max()) - 1
    assert abs(width - figures.text_width("0123456789 Hg", SHEET_TEXT)) <= 0.15 * width
    sheet, _ = worst_case_sheet()  # the whole sheet draws with either font
    assert sheet.width == SHEET_WIDTH


# ---------------------------------------------------------------- the comparison

def test_without_a_baseline_the_sheet_leads_with_the_summary(runs, shown):
    out = Diagnostics().diagnose(runs["trace"], 0.5, runs["image"])
    assert len(out["ui"]["images"]) == len(shown) == 1  # the sheet only
    assert out["ui"]["sjd_sheet"][0]["speed_up_box"] is None
    (sheet,) = shown
    head = (0, 0, sheet.width, 90)
    assert ink_rows(sheet, head, (SPEED_UP_COLOUR, SLOWER_COLOUR)) == 0


def test_the_comparison_shows_both_images_only_with_baseline_image(runs, shown):
    diagnose = Diagnostics().diagnose
    image, baseline_image, other = runs["image"], runs["baseline_image"], 1.0 - runs["image"]
    diagnose(runs["trace"], 0.5, image, runs["baseline_trace"])
    diagnose(runs["trace"], 0.5, other, runs["baseline_trace"])
    diagnose(runs["trace"], 0.5, image, runs["baseline_trace"], baseline_image)
    diagnose(runs["trace"], 0.5, image, runs["baseline_trace"], 1.0 - baseline_image)
    diagnose(runs["trace"], 0.5, other, runs["baseline_trace"], 1.0 - baseline_image)
    numbers, numbers_other, both, other_baseline, other_both = (np.asarray(p, dtype=int)
                                                                 for p in shown)
    head = slice(0, 150)  # the comparison's rows (the maps below are drawn over the image)
    # without baseline_image: numbers only, the run's image is not in the comparison
    assert np.array_equal(numbers[head], numbers_other[head])
    # with it: the images add a row (the 64 px images drawn 2x) above the numbers
    assert both.shape[0] > numbers.shape[0]
    # the baseline image is drawn in the left column, the run's own image in the middle one
    left = figures.SHEET_MARGIN + figures.SHEET_COLUMN
    middle = left + figures.SHEET_GAP
    changed = np.abs(both[head] - other_baseline[head]).max(axis=(0, 2)) > 0
    assert changed[:left].any() and not changed[left:].any()
    changed = np.abs(other_baseline[head] - other_both[head]).max(axis=(0, 2)) > 0
    assert not changed[:middle].any() and changed[middle:middle + figures.SHEET_COLUMN].any()
    assert not changed[middle + figures.SHEET_COLUMN:].any()


def test_the_comparison_numbers_are_the_runs_own(runs):
    fast, ar = runs["trace"].trace.summary(), runs["baseline_trace"].trace.summary()
    lines = [text for text, _, _ in figures._run_lines(ar, "AR (baseline)")]
    assert lines == ["AR (baseline)", f"{ar['nfe']:.0f} forward passes",
                     f"{ar['total_seconds']:.2f} s"]
    block, box = figures.comparison_block(fast, ar)
    assert box[3] == figures.line_height(SHEET_SPEED_UP)
    assert block.width == SHEET_WIDTH - 2 * figures.SHEET_MARGIN


# ---------------------------------------------------------------- baseline_image checks

def test_baseline_image_is_checked_like_image(runs):
    diagnose = Diagnostics().diagnose
    trace, ar, image = runs["trace"], runs["baseline_trace"], runs["baseline_image"]
    with pytest.raises(ValueError) as error:
        diagnose(trace, 0.5, baseline_image=image)
    assert str(error.value).startswith(
        "SJD Diagnostics: baseline_image (1 image(s) of 64x64 px) is connected without "
        "baseline_trace")
    assert "Connect that run's trace as baseline_trace too, or disconnect baseline_image" \
        in str(error.value)
    with pytest.raises(ValueError) as error:
        diagnose(trace, 0.5, baseline_trace=ar, baseline_image=torch.cat([image, image]))
    assert "baseline_image (2 image(s) of 64x64 px) does not belong to baseline_trace " \
           "(1 image(s) of 8x8 codes" in str(error.value)
    assert "mode AR" in str(error.value)  # the run it was checked against
    assert "the AR sampler whose trace is baseline_trace" in str(error.value)
    with pytest.raises(ValueError, match=r"baseline_image \(1 image\(s\) of 16x8 px\) does not"):
        diagnose(trace, 0.5, baseline_trace=ar, baseline_image=torch.zeros(1, 8, 16, 3))
    with pytest.raises(ValueError, match=r"baseline_image of shape \(64, 64, 3\) is not an IMAGE"):
        diagnose(trace, 0.5, baseline_trace=ar, baseline_image=image[0])
    # the decoder's own scale and whole-number enlargements are accepted, with 3 or 4 channels
    diagnose(trace, 0.5, baseline_trace=ar, baseline_image=image[:, ::8, ::8])
    diagnose(trace, 0.5, baseline_trace=ar, baseline_image=torch.cat([image, image[..., :1]], -1))


def test_a_bad_image_is_still_named_image(runs):
    with pytest.raises(ValueError, match=r"SJD Diagnostics: image \(1 image\(s\) of 16x8 px\) "
                                         r"does not belong to this trace"):
        Diagnostics().diagnose(runs["trace"], 0.5, torch.zeros(1, 8, 16, 3),
                               runs["baseline_trace"], runs["baseline_image"])


# ---------------------------------------------------------------- outputs and inputs

def test_outputs_are_unchanged_and_baseline_image_is_optional(runs, shown):
    assert Diagnostics.RETURN_TYPES == ("IMAGE", "IMAGE", "IMAGE", "IMAGE", "STRING", "IMAGE")
    assert Diagnostics.RETURN_NAMES == ("commit_iteration", "iterations_in_window",
                                        "acceptance_probability", "accepted_lengths", "summary",
                                        "draft_rule")
    inputs = Diagnostics.INPUT_TYPES()
    assert list(inputs["required"]) == ["trace", "blend"]  # saved widget values keep their order
    assert list(inputs["optional"]) == ["image", "baseline_trace", "baseline_image"]
    assert inputs["optional"]["baseline_image"][0] == "IMAGE"
    assert "baseline_trace" in inputs["optional"]["baseline_image"][1]["tooltip"]
    alone = Diagnostics().diagnose(runs["trace"], 0.5, runs["image"])["result"]
    compared = Diagnostics().diagnose(runs["trace"], 0.5, runs["image"], runs["baseline_trace"],
                                      runs["baseline_image"])["result"]
    for first, second in zip(alone, compared):
        if isinstance(first, str):
            assert "speed-up over AR" in second and first.splitlines()[0] == second.splitlines()[0]
        else:
            assert first.shape == second.shape and torch.equal(first, second)
    commit = alone[0]
    assert commit.shape[0] == 1 and commit.shape[-1] == 3 and commit.shape[2] >= 256


def widgets(node: dict) -> dict:
    """A saved node's widget values by name (a seed's control follows it)."""
    names = []
    for section in ("required", "optional"):
        for name, spec in pack.NODE_CLASS_MAPPINGS[node["type"]].INPUT_TYPES().get(
                section, {}).items():
            if isinstance(spec[0], list) or spec[0] in ("INT", "FLOAT", "STRING", "BOOLEAN"):
                names.append(name)
                if spec[1].get("control_after_generate"):
                    names.append(f"{name} control")
    return dict(zip(names, node["widgets_values"], strict=True))


def test_ar_vs_auto_template_gives_the_diagnostics_the_ar_image_as_baseline():
    graph = json.loads((REPO / "workflows" / "SJD AR vs AUTO (reference).json").read_text())
    nodes = {n["id"]: n for n in graph["nodes"]}
    links = {link[0]: link for link in graph["links"]}
    samplers = {widgets(n)["mode"]: n for n in nodes.values() if n["type"] == "SJDSamplerV2"}
    (diagnostics,) = [n for n in nodes.values() if n["type"] == "SJDDiagnostics"]
    source = {i["name"]: links[i["link"]][1] for i in diagnostics["inputs"] if i["link"]}
    decoded = {n["id"]: links[n["inputs"][0]["link"]][1] for n in nodes.values()
               if n["type"] == "SJDDecode"}  # decode -> the sampler it decodes
    assert source["trace"] == samplers["AUTO"]["id"]
    assert source["baseline_trace"] == samplers["AR"]["id"]
    assert decoded[source["image"]] == samplers["AUTO"]["id"]
    assert decoded[source["baseline_image"]] == samplers["AR"]["id"]
    ar, auto = widgets(samplers["AR"]), widgets(samplers["AUTO"])
    assert ar["seed"] == auto["seed"] and ar["seed control"] == "fixed" == auto["seed control"]
    # a node wide enough for the sheet at full width, as SHEET_BOXES assumes
    assert diagnostics["size"] == [620, 1190]
