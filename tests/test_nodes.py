"""The nodes called directly, without a ComfyUI server: behaviour and every bad input a user can give."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent


def _import_pack():
    """The repository imported as one package, the way ComfyUI imports a custom node folder."""
    name = "sjd_pack"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "__init__.py",
                                                      submodule_search_locations=[str(REPO)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


pack = _import_pack()
from sjd_pack.nodes import comfy_bridge  # noqa: E402
from sjd_pack.nodes.handles import LoadedModel  # noqa: E402
from sjd_pack.nodes.loader import REFERENCE  # noqa: E402
from sjd_pack.nodes.sampler import acceleration_settings  # noqa: E402
from sjd_pack.sjd_core.models.synthetic import SyntheticModel  # noqa: E402

Loader = pack.NODE_CLASS_MAPPINGS["SJDModelLoader"]
Sampler = pack.NODE_CLASS_MAPPINGS["SJDSampler"]
Decode = pack.NODE_CLASS_MAPPINGS["SJDDecode"]
Diagnostics = pack.NODE_CLASS_MAPPINGS["SJDDiagnostics"]
GRID = (8, 8)


def widget_defaults(cls: type) -> dict:
    """Every widget input of a node at its default value (what a freshly added node holds)."""
    values = {}
    for name, spec in cls.INPUT_TYPES()["required"].items():
        if isinstance(spec[0], list):
            values[name] = spec[1].get("default", spec[0][0])
        elif spec[0] in ("INT", "FLOAT", "STRING", "BOOLEAN"):
            values[name] = spec[1]["default"]
    return values


@pytest.fixture(scope="module")
def synthetic() -> LoadedModel:
    torch.manual_seed(0)
    return LoadedModel(SyntheticModel(codebook_size=16, grid=GRID, sharpness=3.0), None,
                       "synthetic", torch.float32)


def sample(model: LoadedModel, **changes):
    values = widget_defaults(Sampler) | changes
    return Sampler().sample(model, **values, unique_id="7")["result"]


# ---------------------------------------------------------------- the pack as ComfyUI sees it

def test_pack_imports_without_comfyui():
    code = (f"import sys, importlib.util as u; s = u.spec_from_file_location('p', {str(REPO / '__init__.py')!r}, "
            f"submodule_search_locations=[{str(REPO)!r}]); m = u.module_from_spec(s); "
            "sys.modules['p'] = m; s.loader.exec_module(m); "
            "print(sorted(m.NODE_CLASS_MAPPINGS), m.WEB_DIRECTORY, "
            "[k for k in ('comfy', 'folder_paths', 'server') if k in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["['SJDDecode',", "'SJDDiagnostics',", "'SJDModelLoader',",
                                  "'SJDSampler']", "./web", "[]"]
    assert (REPO / "web" / "js" / "sjd_progress.js").is_file()


@pytest.mark.parametrize("name", sorted(pack.NODE_CLASS_MAPPINGS))
def test_every_node_documents_itself(name):
    cls = pack.NODE_CLASS_MAPPINGS[name]
    assert len(cls.DESCRIPTION) > 40 and cls.CATEGORY == "sampling/SJD"
    assert callable(getattr(cls(), cls.FUNCTION))
    assert len(cls.OUTPUT_TOOLTIPS) == len(cls.RETURN_TYPES) == len(cls.RETURN_NAMES)
    for section in ("required", "optional"):
        for input_name, spec in cls.INPUT_TYPES().get(section, {}).items():
            assert spec[1].get("tooltip"), f"{name}.{input_name} has no tooltip"
    page = REPO / "web" / "docs" / f"{name}.md"
    assert page.read_text().startswith(f"# {pack.NODE_DISPLAY_NAME_MAPPINGS[name]}")


def test_lossy_settings_say_so_and_seed_has_control_after_generate():
    inputs = Sampler.INPUT_TYPES()["required"]
    lossy = [n for n in inputs if n == "relaxed" or n.startswith(("lantern_", "gsd_"))]
    assert len(lossy) == 6
    assert all("LOSSY" in inputs[n][1]["tooltip"] for n in lossy)
    assert not any("LOSSY" in spec[1].get("tooltip", "") for n, spec in inputs.items()
                   if n not in lossy)
    assert inputs["seed"][1]["control_after_generate"] is True
    assert inputs["mode"][0] == ["PAC+VP", "PAC", "SJD", "AR", "custom"]


def test_install_metadata():
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    comfy = meta["tool"]["comfy"]
    assert re.fullmatch(r"[a-z0-9][a-z0-9-]*", comfy["PublisherId"]), comfy["PublisherId"]
    assert comfy["DisplayName"].strip() == comfy["DisplayName"] and len(comfy["DisplayName"]) > 5
    assert comfy["Icon"].startswith("https://") and comfy["Icon"].endswith("/main/web/icon.png")
    assert (REPO / "web" / "icon.png").is_file()
    assert comfy["includes"] and all((REPO / path).is_dir() for path in comfy["includes"])
    assert re.fullmatch(r">=\d+(\.\d+)*", comfy["requires-comfyui"]), comfy["requires-comfyui"]
    assert "web" not in comfy  # WEB_DIRECTORY is set: both would load the JS twice
    deps = meta["project"]["dependencies"]
    requirements = [line.split("#")[0].strip() for line in
                    (REPO / "requirements.txt").read_text().splitlines()]
    for dep in deps + [r for r in requirements if r]:
        assert not dep.lower().startswith(("torch", "git+")) and "==" not in dep, dep
    assert any(c.startswith("Operating System") for c in meta["project"]["classifiers"])
    assert any("GPU" in c for c in meta["project"]["classifiers"])


# ---------------------------------------------------------------- loader

def test_loader_lists_reference_first_then_the_models_folders(tmp_path, monkeypatch):
    (tmp_path / "Emu3-Gen-hf").mkdir()
    (tmp_path / "c2i_L_384.pt").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("not a model")
    monkeypatch.setenv("SJD_MODELS_DIR", str(tmp_path))
    choices = Loader.INPUT_TYPES()["required"]["model"][0]
    assert choices == [REFERENCE, "c2i_L_384.pt", "Emu3-Gen-hf"]


def test_loader_missing_model_says_where_to_put_it(tmp_path, monkeypatch):
    missing = tmp_path / "not-there"
    monkeypatch.setenv("SJD_MODELS_DIR", str(missing))
    with pytest.raises(FileNotFoundError) as error:
        Loader().load("Lumina-mGPT-7B-768", "auto")
    message = str(error.value)
    for part in ("model='Lumina-mGPT-7B-768'", f"{missing} (missing)", "extra_model_paths.yaml",
                 "README", "'reference (embedded)'"):
        assert part in message
    assert Loader.VALIDATE_INPUTS("Lumina-mGPT-7B-768") == message
    assert Loader.VALIDATE_INPUTS(REFERENCE) is True


def test_loader_refuses_a_folder_that_is_no_checkpoint(tmp_path, monkeypatch):
    (tmp_path / "my-download").mkdir()
    (tmp_path / "my-download" / "README.md").write_text("half a download")
    monkeypatch.setenv("SJD_MODELS_DIR", str(tmp_path))
    with pytest.raises(ValueError) as error:
        Loader().load("my-download", "auto")
    assert "model='my-download'" in str(error.value)
    assert "not a checkpoint of a known model family" in str(error.value)
    assert "emu3" in str(error.value)  # lists what each family expects on disk


def test_loader_refuses_unknown_dtype():
    with pytest.raises(ValueError, match=r"dtype='int8' is not allowed.*'auto', 'bf16'"):
        Loader().load(REFERENCE, "int8")


@pytest.fixture(scope="module")
def reference() -> tuple[LoadedModel, str]:
    return Loader().load(REFERENCE, "auto")


def test_loader_loads_the_embedded_reference_model(reference):
    loaded, info = reference
    assert loaded.family == "reference" and loaded.dtype == torch.float32
    assert loaded.patcher is None  # no ComfyUI here, nothing to manage it
    assert "32x32" in info and "family reference" in info


def test_reference_sampler_refuses_a_prompt_it_cannot_draw(reference):
    with pytest.raises(ValueError) as error:
        sample(reference[0], prompt="a red sports car")
    message = str(error.value)
    assert message.startswith("SJD Sampler:") and "prompt" in message and "sneaker" in message
    with pytest.raises(ValueError, match="resolution=768x768 is not supported by the reference"):
        sample(reference[0], prompt="sneaker", resolution="768x768")


# ---------------------------------------------------------------- sampler, decode, diagnostics

def test_sample_decode_diagnose(synthetic):
    codes, trace, line = sample(synthetic, prompt="a synthetic prompt", seed=3)
    assert codes.codes.shape == (1, *GRID) and codes.codes.dtype == torch.long
    assert trace.run.mode == "SJD+AC+PD+VP" and trace.run.resolution == (GRID[1], GRID[0])
    summary = trace.trace.summary()
    assert line.startswith("SJD+AC+PD+VP:") and f"{summary['nfe']:.0f} forward passes" in line
    (images,) = Decode().decode(codes)
    assert images.shape == (1, *GRID, 3) and images.dtype == torch.float32
    assert 0 <= float(images.min()) and float(images.max()) <= 1
    out = Diagnostics().diagnose(trace, 0.5, images)
    commit, waited, probability, histogram, text = out["result"]
    assert commit.shape == waited.shape == probability.shape == (1, 256, 256, 3)
    assert histogram.shape[0] == 1 and histogram.shape[-1] == 3
    assert out["ui"]["images"] == []  # nowhere to show previews outside ComfyUI
    assert f"NFE {summary['nfe']:.1f}" in text and "step compression" in text
    assert "connect an AR run's trace" in text
    # commit_iteration grows along the raster: the first slot is committed no later than the last
    maps = trace.trace.slot_maps()["commit_iteration"][0]
    assert maps[0, 0] <= maps[-1, -1] and float(commit.std()) > 0


def test_same_seed_same_codes_and_batch_rows_follow_their_seeds(synthetic):
    first = sample(synthetic, prompt="p", seed=5)[0].codes
    assert torch.equal(first, sample(synthetic, prompt="p", seed=5)[0].codes)
    batch = sample(synthetic, prompt="p", seed=5, batch_size=2)[0].codes
    assert torch.equal(batch[:1], first)
    assert torch.equal(batch[1:], sample(synthetic, prompt="p", seed=6)[0].codes)


@pytest.mark.parametrize("mode, name", [("AR", "AR"), ("SJD", "SJD"), ("PAC", "SJD+AC+PD"),
                                        ("PAC+VP", "SJD+AC+PD+VP")])
def test_presets(mode, name):
    values = widget_defaults(Sampler)
    settings = acceleration_settings(mode, *[values[k] for k in (
        "window", "init", "adaptive_continuation", "proactive_drafting", "pd_candidates",
        "pd_depth", "verification_prediction", "vp_rises", "vp_top_k", "vp_decay", "relaxed",
        "lantern_neighbours", "lantern_delta", "gsd_rank_radius", "gsd_prob_tolerance",
        "gsd_embedding_tolerance")])
    assert settings.mode_name == name
    assert settings.window == (1 if mode == "AR" else values["window"])


def test_custom_mode_uses_the_toggles(synthetic):
    _, trace, line = sample(synthetic, mode="custom", adaptive_continuation=False,
                            proactive_drafting=False, verification_prediction=True,
                            relaxed="lantern", window=8)
    assert trace.run.mode == "SJD+VP+LANTERN" and "(LOSSY)" in line


@pytest.mark.parametrize("changes, expected", [
    (dict(mode="AR", relaxed="lantern"), ["mode=AR", "relaxed='lantern'", "SJD, PAC, PAC+VP"]),
    (dict(mode="custom", window=1), ["mode=custom", "adaptive_continuation", "raise window"]),
    (dict(mode="PAC", window=4, pd_depth=6), ["pd_depth=6", "window (4)"]),
    (dict(resolution="768x768"), ["resolution=768x768", "synthetic", "pick one of 8x8"]),
    (dict(sampling="custom", top_p=0.0), ["top_p=0.0", "(0, 1]"]),
    (dict(sampling="custom", temperature=0.0), ["temperature=0.0", "top_k=1"]),
    (dict(mode="turbo"), ["mode='turbo'", "PAC+VP"]),
    (dict(batch_size=0), ["batch_size=0", ">= 1"]),
])
def test_sampler_bad_inputs_say_what_to_do(synthetic, changes, expected):
    with pytest.raises(ValueError) as error:
        sample(synthetic, **changes)
    message = str(error.value)
    assert message.startswith("SJD Sampler:")
    for part in expected:
        assert part in message, message


def test_cancel_stops_within_one_step_and_the_model_still_works(synthetic, monkeypatch):
    class Cancelled(Exception):
        pass

    steps = []

    def interrupt_after_two() -> None:
        steps.append(1)
        if len(steps) > 2:
            raise Cancelled

    monkeypatch.setattr(comfy_bridge, "check_interrupted", interrupt_after_two)
    with pytest.raises(Cancelled):
        sample(synthetic, mode="AR", seed=1)
    assert len(steps) == 3  # stopped at the first check after the cancel
    monkeypatch.undo()
    codes, trace, _ = sample(synthetic, mode="AR", seed=1)
    assert trace.trace.summary()["nfe"] == GRID[0] * GRID[1]


def test_diagnostics_measures_speed_up_against_an_ar_baseline(synthetic):
    _, ar, _ = sample(synthetic, prompt="same", seed=9, mode="AR")
    codes, fast, _ = sample(synthetic, prompt="same", seed=9)
    text = Diagnostics().diagnose(fast, 1.0, baseline_trace=ar)["result"][4]
    nfe = (ar.trace.summary()["nfe"], fast.trace.summary()["nfe"])
    assert "speed-up over AR" in text and "measured" in text
    assert f"{nfe[0] / nfe[1]:.2f}x fewer forward passes" in text


def test_diagnostics_refuses_a_trace_or_image_from_another_run(synthetic):
    codes, trace, _ = sample(synthetic, prompt="cat", seed=1)
    _, other_prompt, _ = sample(synthetic, prompt="dog", seed=1, mode="AR")
    with pytest.raises(ValueError) as error:
        Diagnostics().diagnose(trace, 0.5, baseline_trace=other_prompt)
    assert "baseline_trace comes from another request" in str(error.value)
    assert "'dog'" in str(error.value) and "or disconnect" in str(error.value)
    with pytest.raises(ValueError, match="are the same run"):
        Diagnostics().diagnose(trace, 0.5, baseline_trace=trace)
    (images,) = Decode().decode(codes)
    two = torch.cat([images, images])
    with pytest.raises(ValueError) as error:
        Diagnostics().diagnose(trace, 0.5, image=two)
    assert "does not belong to this trace" in str(error.value)
    assert "SJD Decode made from the codes of the same SJD Sampler" in str(error.value)
    wide = torch.zeros(1, 8, 16, 3)
    with pytest.raises(ValueError, match="16x8 px"):
        Diagnostics().diagnose(trace, 0.5, image=wide)


# ---------------------------------------------------------------- example workflows

def test_workflows_are_ui_graphs_of_known_nodes():
    folder = REPO / "workflows"  # one of the folder names ComfyUI's template browser reads
    files = sorted(folder.glob("*.json"))
    assert len(files) == 6
    for path in files:
        graph = json.loads(path.read_text())
        ids = {n["id"] for n in graph["nodes"]}
        for link_id, origin, _, target, _, kind in graph["links"]:
            assert origin in ids and target in ids, path.name
        types = {n["type"] for n in graph["nodes"]}
        assert types <= set(pack.NODE_CLASS_MAPPINGS) | {"SaveImage", "Note"}, path.name
        for node in graph["nodes"]:
            if node["type"] == "SJDSampler":
                widgets = [n for n, s in Sampler.INPUT_TYPES()["required"].items()
                           if n != "model"]
                assert len(node["widgets_values"]) == len(widgets) + 1  # + seed control


def test_reference_workflows_use_the_embedded_model_and_the_advertised_modes():
    def samplers(name):
        graph = json.loads((REPO / "workflows" / name).read_text())
        loaders = [n for n in graph["nodes"] if n["type"] == "SJDModelLoader"]
        assert [n["widgets_values"][0] for n in loaders] == [REFERENCE]
        names = [n for n, s in Sampler.INPUT_TYPES()["required"].items() if n != "model"]
        names.insert(names.index("seed") + 1, "control_after_generate")
        return [dict(zip(names, n["widgets_values"])) for n in graph["nodes"]
                if n["type"] == "SJDSampler"]

    (single,) = samplers("sjd_text_to_image_reference.json")
    assert single["mode"] == "PAC+VP" and single["relaxed"] == "none"
    pair = samplers("sjd_ar_vs_pac_vp_reference.json")
    assert sorted(s["mode"] for s in pair) == ["AR", "PAC+VP"]
    assert pair[0]["seed"] == pair[1]["seed"] and pair[0]["prompt"] == pair[1]["prompt"]


def test_models_folder_comes_from_the_environment_outside_comfyui(tmp_path, monkeypatch):
    monkeypatch.setenv("SJD_MODELS_DIR", os.pathsep.join([str(tmp_path / "a"), str(tmp_path / "b")]))
    assert comfy_bridge.models_folders() == [str(tmp_path / "a"), str(tmp_path / "b")]
    for available, kind in ((False, "cpu"), (True, "cuda")):  # outside ComfyUI: CUDA if present
        monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
        assert comfy_bridge.torch_device().type == kind
