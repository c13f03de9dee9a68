"""``GET /sjd/resolutions`` in a real ComfyUI server (the harness of comfyui_harness.py).

The checkpoints here are config files only: the route must answer from them, without weights.
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
import urllib.parse
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from comfyui_harness import ComfyServer  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    models = tmp_path_factory.mktemp("sjd-models")
    lumina = models / "Lumina-mGPT-7B-512"
    lumina.mkdir()
    (lumina / "config.json").write_text(json.dumps(
        {"model_type": "chameleon", "vocab_size": 65536, "z_loss_weight": 1e-5}))
    lumina2 = models / "Lumina-mGPT-2.0"
    lumina2.mkdir()
    (lumina2 / "config.json").write_text(json.dumps({"model_type": "chameleon", "vocab_size": 172032}))
    (models / "half-a-download").mkdir()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SJD_MODELS_DIR", str(models))
        with ComfyServer() as running:
            yield running


def ask(server: ComfyServer, model: str | None) -> tuple[int, dict]:
    query = "" if model is None else "?" + urllib.parse.urlencode({"model": model})
    try:
        with urllib.request.urlopen(f"{server.url}/sjd/resolutions{query}", timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.mark.slow
def test_sizes_of_each_checkpoint_from_its_config(server):
    status, body = ask(server, "Lumina-mGPT-7B-512")
    assert status == 200 and body["family"] == "lumina-mgpt"
    assert body["resolutions"][:3] == ["512x512", "1024x256", "992x256"] and len(body["resolutions"]) == 49
    status, body = ask(server, "Lumina-mGPT-2.0")
    assert status == 200 and body["family"] == "lumina-mgpt-2"
    assert body["resolutions"][0] == "768x768" and len(body["resolutions"]) == 73
    assert ask(server, "reference (embedded)") == (200, {"model": "reference (embedded)", "family": "reference",
                                                          "resolutions": ["32x32"]})


def test_unknown_and_unusable_choices_say_why(server):
    status, body = ask(server, "not-there")
    assert status == 200 and body["resolutions"] is None  # not installed: no failed request
    assert "model='not-there' was not found" in body["error"]
    status, body = ask(server, "half-a-download")
    assert status == 422 and "not a checkpoint of a known model family" in body["error"]
    status, body = ask(server, None)
    assert status == 400 and "query parameter 'model' is missing" in body["error"]


def test_the_narrowing_script_is_served(server):
    assert any(s.endswith("/js/sjd_resolutions.js") for s in server.get("/extensions"))
