"""Live previews follow ComfyUI's own options, in the real ComfyUIs the CI runs.

ComfyUI's samplers show previews by ``--preview-method`` (``none``: none at all) at most
``--preview-size`` pixels on a side (ComfyUI 0.3.75; the 2024 ComfyUI has no such option and
previews at 512). The pack's sampler must do the same, show the reference model's pixel art with
sharp pixels, and begin every run with a blank preview, so that a run that fails shows no image
of the run before it.
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from comfyui_current import CurrentComfyServer  # noqa: E402
from comfyui_harness import REPO, ComfyServer, Listener, ui_to_api  # noqa: E402

TEMPLATE = REPO / "workflows" / "SJD text to image (reference).json"
# ComfyUI's binary websocket messages that carry a preview: the image alone (both ComfyUIs), and
# the image after a JSON header (0.3.75, beside the first, for the newer frontends).
PREVIEW_IMAGE, PREVIEW_IMAGE_WITH_METADATA = 1, 4


def previews_of(listener: Listener) -> list[np.ndarray]:
    """The preview images the browser received (of one kind, where a ComfyUI sends both), as
    grey pixel arrays."""
    kinds: dict[int, list[bytes]] = {PREVIEW_IMAGE: [], PREVIEW_IMAGE_WITH_METADATA: []}
    for frame in listener.frames:
        kind, data = int.from_bytes(frame[:4], "big"), frame[4:]
        if kind == PREVIEW_IMAGE:
            kinds[kind].append(data[4:])  # after the image type
        elif kind == PREVIEW_IMAGE_WITH_METADATA:
            kinds[kind].append(data[4 + int.from_bytes(data[:4], "big"):])  # after the header
    images = kinds[PREVIEW_IMAGE_WITH_METADATA] or kinds[PREVIEW_IMAGE]
    return [np.asarray(Image.open(io.BytesIO(image)).convert("L")) for image in images]


def run_template(server: ComfyServer, **changes: object) -> tuple[dict, list[np.ndarray]]:
    """The text-to-image template queued over the API (sampler inputs changed by ``changes``);
    returns its history entry and the previews it sent."""
    prompt = ui_to_api(json.loads(TEMPLATE.read_text()), server.get("/object_info"))
    sampler = next(n for n, node in prompt.items() if node["class_type"] == "SJDSamplerV2")
    prompt[sampler]["inputs"].update(changes)
    with Listener(server) as listener:
        prompt_id = server.queue(prompt)
        entry = server.wait(prompt_id, 300)
        listener.wait_for_end(prompt_id)
    return entry, previews_of(listener)


def blocky(image: np.ndarray, block: int) -> bool:
    """Whether ``image`` is made of flat ``block`` x ``block`` squares (JPEG's noise allowed)."""
    height, width = image.shape
    tiles = image[: height // block * block, : width // block * block].astype(float)
    tiles = tiles.reshape(height // block, block, width // block, block)
    inner = tiles[:, 2:-2, :, 2:-2]  # JPEG smears the edges of each square a little
    return float(np.abs(inner - inner.mean(axis=(1, 3), keepdims=True)).max()) < 24


def server_with(*options: str, current: bool = True) -> ComfyServer:
    server = CurrentComfyServer(use_newest_frontend=False) if current else ComfyServer()
    server.extra_arguments = tuple(server.extra_arguments) + options
    return server


@pytest.mark.parametrize("current, size", [(False, 512), (True, 256)])
def test_previews_are_sized_as_comfyui_says_with_sharp_pixels_and_a_blank_start(current, size):
    options = ("--preview-size", str(size)) if current else ()
    with server_with(*options, current=current) as server:
        entry, previews = run_template(server)
        assert entry["status"]["status_str"] == "success"
        assert len(previews) >= 2, len(previews)
        assert all(p.shape == (size, size) for p in previews), [p.shape for p in previews]
        assert previews[0].max() < 16  # the run starts with a blank image
        last = previews[-1]
        assert last.std() > 10 and blocky(last, size // 32)  # 32 x 32 pixel art, not smoothed
        failed, after_failure = run_template(server, prompt="!!!")
        assert failed["status"]["status_str"] == "error"
        assert len(after_failure) == 1 and after_failure[0].max() < 16  # the old one is gone


def test_preview_method_none_sends_no_preview():
    with server_with("--preview-method", "none") as server:
        entry, previews = run_template(server)
    assert entry["status"]["status_str"] == "success" and previews == []
