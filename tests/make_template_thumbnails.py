"""Write the template browser's thumbnails, ``workflows/<template>.jpg``.

The reference-model templates are run in a real ComfyUI (tests/comfyui_harness.py) and their
thumbnail is what they drew: the saved image, or for the AR vs AUTO template both images side
by side, labelled. The family templates need checkpoints that cannot be shipped, so theirs is a
labelled card: the family, what the template does, and where the checkpoint goes.

    python3 tests/make_template_thumbnails.py
"""

from __future__ import annotations

import io
import json
import sys
import urllib.parse
from pathlib import Path

from PIL import Image, ImageDraw

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from comfyui_harness import REPO, ComfyServer, ui_to_api  # noqa: E402
from sjd_core.figures import font  # noqa: E402

TEMPLATES = REPO / "workflows"
SIZE = 384
BACKGROUND = (27, 27, 27)
TEAL = (33, 145, 140)
# template -> (family, one line on what it draws, where its checkpoint goes)
FAMILY_CARDS = {
    "SJD Lumina-mGPT text to image": ("Lumina-mGPT", "text to image, 512 to 1024 px",
                                      "models/sjd/Lumina-mGPT-7B-768/"),
    "SJD Lumina-mGPT 2.0 text to image": ("Lumina-mGPT 2.0", "text to image, 768 x 768 px",
                                          "models/sjd/Lumina-mGPT-2.0/"),
    "SJD Emu3 text to image": ("Emu3", "text to image, 720 x 720 px", "models/sjd/Emu3-Gen-hf/"),
    "SJD Janus-Pro text to image": ("Janus-Pro", "text to image, 384 x 384 px",
                                    "models/sjd/Janus-Pro-7B/"),
    "SJD LlamaGen class to image": ("LlamaGen", "ImageNet class to image, 384 px",
                                    "models/sjd/LlamaGen-c2i-L-384/"),
}


def family_card(family: str, what: str, folder: str) -> Image.Image:
    """A dark card naming the family, the task, the accelerated mode and the checkpoint folder."""
    card = Image.new("RGB", (SIZE, SIZE), BACKGROUND)
    draw = ImageDraw.Draw(card)
    draw.rectangle([0, 0, SIZE, 10], fill=TEAL)
    title = next(font(size) for size in range(44, 20, -2)
                 if draw.textlength(family, font=font(size)) <= SIZE - 48)  # 24 px margins
    draw.text((24, 60), family, fill=(240, 240, 240), font=title)
    draw.text((24, 130), what, fill=(200, 200, 200), font=font(20))
    draw.text((24, 165), "AUTO: lossless, fewer forward passes", fill=TEAL, font=font(18))
    draw.text((24, 270), "needs the checkpoint in", fill=(170, 170, 170), font=font(16))
    draw.text((24, 295), folder, fill=(230, 230, 230), font=font(16))
    return card


def saved_images(server: ComfyServer, name: str) -> dict[str, Image.Image]:
    """Run a template; returns each Save Image node's picture by its filename prefix."""
    graph = json.loads((TEMPLATES / f"{name}.json").read_text())
    prompt = ui_to_api(graph, server.get("/object_info"))
    entry = server.wait(server.queue(prompt))
    if entry["status"]["status_str"] != "success":
        raise RuntimeError(f"{name} failed: {json.dumps(entry['status'])[-2000:]}")
    pictures = {}
    for node_id, node in prompt.items():
        if node["class_type"] == "SaveImage":
            image = entry["outputs"][node_id]["images"][0]
            data = server.get_bytes(f"/view?{urllib.parse.urlencode(image)}")
            pictures[node["inputs"]["filename_prefix"]] = Image.open(io.BytesIO(data)).convert("RGB")
    return pictures


def side_by_side(left: Image.Image, right: Image.Image, labels: tuple[str, str]) -> Image.Image:
    """Two pictures next to each other on one square card, each with its label above it."""
    card = Image.new("RGB", (SIZE, SIZE), BACKGROUND)
    draw = ImageDraw.Draw(card)
    side = SIZE // 2 - 12
    for index, (picture, label) in enumerate(zip((left, right), labels)):
        x = 8 + index * (side + 8)
        draw.text((x, 92), label, fill=(230, 230, 230), font=font(20))
        card.paste(picture.resize((side, side), Image.NEAREST), (x, 122))
    return card


def main() -> None:
    with ComfyServer() as server:
        single = saved_images(server, "SJD text to image (reference)")
        only = next(iter(single.values()))
        only.resize((SIZE, SIZE), Image.NEAREST).save(
            TEMPLATES / "SJD text to image (reference).jpg", quality=92)
        pair = saved_images(server, "SJD AR vs AUTO (reference)")
        side_by_side(pair["sjd_ar"], pair["sjd_auto"], ("AR", "AUTO")).save(
            TEMPLATES / "SJD AR vs AUTO (reference).jpg", quality=92)
    for name, card in FAMILY_CARDS.items():
        family_card(*card).save(TEMPLATES / f"{name}.jpg", quality=92)
    print("\n".join(sorted(str(p) for p in TEMPLATES.glob("*.jpg"))))


if __name__ == "__main__":
    main()
