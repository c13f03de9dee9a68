"""The nodes called directly, without a ComfyUI server: behaviour and every bad input a user can give."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from PIL import Image

from tests.pack import REPO, import_pack

pack = import_pack()
from sjd_pack.nodes import comfy_bridge  # noqa: E402
from sjd_pack.nodes.handles import LoadedModel  # noqa: E402
from sjd_pack.nodes.loader import REFERENCE  # noqa: E402
from sjd_pack.nodes.generation import CHART_POINTS  # noqa: E402
from sjd_pack.nodes.handles import AccelerationOptions, SamplingChoice  # noqa: E402
from sjd_pack.nodes.widgets import OPTION_GROUPS, acceleration_option_fields  # noqa: E402
from sjd_pack.nodes.widgets import OWN_WINDOW, default_mode  # noqa: E402
from sjd_pack.sjd_core.decoding.settings import (DEFAULT_PRESET, PRESETS,  # noqa: E402
                                                 AccelerationSettings, SamplingSettings)
from sjd_pack.sjd_core.models.protocol import SamplingDefaults  # noqa: E402
from sjd_pack.sjd_core.models.registry import (offered_recipes,  # noqa: E402
                                               offered_resolutions, resolutions_on_disk)
from sjd_pack.sjd_core.models.synthetic import SyntheticModel  # noqa: E402

Loader = pack.NODE_CLASS_MAPPINGS["SJDModelLoader"]
Sampler = pack.NODE_CLASS_MAPPINGS["SJDSamplerV2"]
OldOptions = pack.NODE_CLASS_MAPPINGS["SJDAccelerationOptions"]
OPTION_NODES = ("SJDDraftingOptions", "SJDLossyAcceptance", "SJDSpeedOptions")
SamplingOptions = pack.NODE_CLASS_MAPPINGS["SJDSamplingOptions"]
LegacySampler = pack.NODE_CLASS_MAPPINGS["SJDSampler"]
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


def option_node(key: str, upstream: AccelerationOptions | None = None, **changes):
    """The object one SJD option node sends with these widget values (the rest at defaults)."""
    cls = pack.NODE_CLASS_MAPPINGS[key]
    return cls().options(acceleration=upstream, **(widget_defaults(cls) | changes))[0]


def acceleration(**changes):
    """The object the three SJD option nodes, chained, send with these widget values."""
    chain = None
    for key in OPTION_NODES:
        chain = option_node(key, chain, **{name: value for name, value in changes.items()
                                           if name in OPTION_GROUPS[key]})
    return chain


def old_acceleration(**changes):
    """The object the old all-in-one SJD Acceleration Options node sends."""
    return OldOptions().options(**(widget_defaults(OldOptions) | changes))[0]


def sampling(**changes):
    return SamplingOptions().options(**(widget_defaults(SamplingOptions) | changes))[0]


# ---------------------------------------------------------------- the pack as ComfyUI sees it

@pytest.mark.slow
def test_pack_imports_without_comfyui():
    code = (f"import sys, importlib.util as u; s = u.spec_from_file_location('p', {str(REPO / '__init__.py')!r}, "
            f"submodule_search_locations=[{str(REPO)!r}]); m = u.module_from_spec(s); "
            "sys.modules['p'] = m; s.loader.exec_module(m); "
            "print(sorted(m.NODE_CLASS_MAPPINGS), m.WEB_DIRECTORY, "
            "[k for k in ('comfy', 'folder_paths', 'server') if k in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["['SJDAccelerationOptions',", "'SJDDecode',",
                                  "'SJDDiagnostics',", "'SJDDraftingOptions',",
                                  "'SJDLossyAcceptance',", "'SJDModelLoader',", "'SJDSampler',",
                                  "'SJDSamplerV2',", "'SJDSamplingOptions',",
                                  "'SJDSpeedOptions']", "./web", "[]"]
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


def test_sampler_has_few_widgets_and_modes_come_from_the_presets():
    inputs = Sampler.INPUT_TYPES()
    assert list(inputs["required"]) == ["model", "prompt", "negative_prompt", "resolution",
                                        "batch_size", "seed", "mode", "window"]
    assert len(inputs["required"]) <= 10
    assert inputs["required"]["mode"][0] == [name.upper() for name in PRESETS]
    assert inputs["required"]["mode"][0][0] == "AUTO"
    assert inputs["required"]["mode"][1]["default"] == DEFAULT_PRESET.upper() == "AUTO"
    window = inputs["required"]["window"][1]
    assert window["default"] == window["min"] == 0  # 0: each mode's own window
    assert "AUTO 32" in window["tooltip"] and "PAC+VP 16" in window["tooltip"]
    assert "AUTO" in inputs["required"]["mode"][1]["tooltip"]
    assert inputs["required"]["seed"][1]["control_after_generate"] is True
    assert {name: spec[0] for name, spec in inputs["optional"].items()} == {
        "acceleration": "SJD_ACCELERATION", "sampling": "SJD_SAMPLING",
        "drafting": "SJD_ACCELERATION", "lossy": "SJD_ACCELERATION", "speed": "SJD_ACCELERATION"}


def test_every_size_a_family_offers_is_a_resolution_choice(tmp_path):
    choices = Sampler.INPUT_TYPES()["required"]["resolution"][0]
    assert choices[0] == "default" and len(choices) == len(set(choices))
    assert choices == LegacySampler.INPUT_TYPES()["required"]["resolution"][0]
    assert choices[1:] == [f"{w}x{h}" for w, h in offered_resolutions()]
    configs = {f"Lumina-mGPT-7B-{size}": {"model_type": "chameleon", "vocab_size": 65536,
                                          "z_loss_weight": 1e-5} for size in (512, 768, 1024)}
    configs["Lumina-mGPT-2.0"] = {"model_type": "chameleon", "vocab_size": 172032}
    for name, config in configs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        family, sizes = resolutions_on_disk(tmp_path / name)
        assert len(sizes) > 40 and family.startswith("lumina"), (name, family, len(sizes))
        missing = [f"{w}x{h}" for w, h in sizes if f"{w}x{h}" not in choices]
        assert not missing, (name, missing)
    assert {"1024x256", "992x256", "832x624", "384x384"} <= set(choices)


def test_option_nodes_follow_the_settings_dataclasses_and_mark_lossy_knobs():
    fields = list(AccelerationSettings.__dataclass_fields__)
    # compile_stages, not measured on a GPU yet, is for the tools; window sits on the sampler
    assert acceleration_option_fields() == [name for name in fields
                                            if name not in ("window", "compile_stages")]
    groups = {key: list(pack.NODE_CLASS_MAPPINGS[key].INPUT_TYPES()["required"])
              for key in OPTION_NODES}
    assert sorted(sum(groups.values(), [])) == sorted(acceleration_option_fields())
    assert all(len(names) <= 9 for names in groups.values()), groups
    inputs = {name: spec for key in OPTION_NODES
              for name, spec in pack.NODE_CLASS_MAPPINGS[key].INPUT_TYPES()["required"].items()}
    lossy = groups["SJDLossyAcceptance"]
    assert lossy == [n for n in inputs if n == "relaxed" or n.startswith(("lantern_", "gsd_"))]
    assert "Lossy" in pack.NODE_DISPLAY_NAME_MAPPINGS["SJDLossyAcceptance"]
    assert all(inputs[n][1]["tooltip"].startswith("LOSSY") for n in lossy)
    assert not any("LOSSY" in spec[1]["tooltip"] for n, spec in inputs.items() if n not in lossy)
    for switch in ("adaptive_continuation", "proactive_drafting", "verification_prediction",
                   "adaptive_shape"):
        assert inputs[switch][0] == ["as mode", "on", "off"]
    assert inputs["proactive_drafting"][1]["tooltip"].endswith(
        "'as mode' follows the sampler's mode (on in AUTO, PAC, PAC+VP).")
    assert inputs["init"][0] == ["uniform", "left", "above", "above_target"]
    for rule in ("above", "above_target"):
        assert rule in inputs["init"][1]["tooltip"]
    assert "codes per second on this machine" in inputs["adaptive_shape"][1]["tooltip"]
    # the option nodes at their defaults change nothing of a preset, LANTERN's k and delta included
    assert acceleration().settings("pac", None) == AccelerationSettings.preset("pac")
    assert old_acceleration().settings("pac", None) == AccelerationSettings.preset("pac")
    sampling_inputs = SamplingOptions.INPUT_TYPES()
    assert [*sampling_inputs["required"], *sampling_inputs["optional"]] == [
        "recipe", *SamplingSettings.__dataclass_fields__]
    # a prompt saved before the guidance schedule existed still gives a constant scale
    assert list(sampling_inputs["optional"]) == ["guidance_schedule"]
    (choice,) = SamplingOptions().options("custom", guidance=5.0, temperature=1.0, top_k=0,
                                          top_p=1.0)
    assert choice.custom.guidance_schedule == "constant" and choice.custom.guidance == 5.0


def test_compile_is_an_optional_choice_on_for_cuda_that_saved_toggles_still_set():
    (kind, options), = OldOptions.INPUT_TYPES()["optional"].values()
    assert list(OldOptions.INPUT_TYPES()["optional"]) == ["compile"]
    assert (kind, options["default"]) == (["on CUDA", "on", "off"], "on CUDA")
    speed = pack.NODE_CLASS_MAPPINGS["SJDSpeedOptions"].INPUT_TYPES()["required"]["compile"]
    assert speed == (kind, options)  # the old node shows the new node's widget
    assert "CUDA graphs" in options["tooltip"] and "Lossless" in options["tooltip"]
    assert old_acceleration().settings("auto", None).compile is None  # saved before it existed
    for value, setting in (("on CUDA", None), ("on", True), ("off", False), (True, True),
                           (False, False)):  # True / False: saved while it was a toggle
        assert OldOptions.VALIDATE_INPUTS(compile=value) is True
        assert old_acceleration(compile=value).settings("ar", None) == (
            AccelerationSettings.preset("ar", compile=setting))
    assert acceleration(compile="off").settings("ar", None).compile is False
    assert OldOptions.VALIDATE_INPUTS(compile="always") == (
        "compile='always' is not allowed: compile must be one of ['on CUDA', 'on', 'off'] ("
        "'on CUDA': compiled on CUDA only).")
    default = AccelerationSettings()
    assert default.compiles_on("cuda") and not default.compiles_on("cpu")
    assert AccelerationSettings(compile=True).compiles_on("cpu")
    assert not AccelerationSettings(compile=False).compiles_on("cuda")


def test_lantern_knobs_can_stay_scaled_to_the_codebook():
    inputs = pack.NODE_CLASS_MAPPINGS["SJDLossyAcceptance"].INPUT_TYPES()["required"]
    neighbours, delta = inputs["lantern_neighbours"], inputs["lantern_delta"]
    assert (neighbours[0], neighbours[1]["default"], neighbours[1]["min"]) == ("INT", 0, 0)
    assert (delta[0], delta[1]["default"], delta[1]["min"]) == ("FLOAT", -1.0, -1.0)
    assert "0 = scaled to the model's codebook" in neighbours[1]["tooltip"]
    assert "Negative = scaled to the model's codebook" in delta[1]["tooltip"]
    scaled = acceleration(relaxed="lantern").settings("sjd", 8)
    assert scaled.lantern_neighbours is None and scaled.lantern_delta is None
    chosen = acceleration(relaxed="lantern", lantern_neighbours=5, lantern_delta=0.0)
    assert (chosen.settings("sjd", 8).lantern_neighbours, chosen.settings("sjd", 8).lantern_delta
            ) == (5, 0.0)
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


def test_loader_missing_model_says_where_to_put_it(tmp_path, monkeypatch, caplog):
    missing = tmp_path / "not-there"
    monkeypatch.setenv("SJD_MODELS_DIR", str(missing))
    with pytest.raises(FileNotFoundError) as error:
        Loader().load("Lumina-mGPT-7B-768", "auto")
    message = str(error.value)
    for part in ("model='Lumina-mGPT-7B-768'", "extra_model_paths.yaml", "README",
                 "'reference (embedded)'"):
        assert part in message
    # the folders looked in close the message: on the node's one line, or in the console log
    assert f"{missing} (missing)" in message + caplog.text
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


def test_loader_refuses_unknown_weights():
    with pytest.raises(ValueError, match=r"weights='int2' is not allowed.*'auto', 'bf16'.*'int4'"):
        Loader().load(REFERENCE, "int2")


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


@pytest.mark.parametrize("prompt", ["\U0001f98a!", "!!!", "\u978b", "\u2605 \u2192"])
def test_reference_sampler_refuses_a_prompt_that_names_nothing(reference, prompt):
    """Emoji, punctuation, another script, symbols: no class named, refused with the class list."""
    with pytest.raises(ValueError) as error:
        sample(reference[0], prompt=prompt, mode="AR")
    assert f"prompt={prompt!r} names no known class" in str(error.value)
    assert "sneaker" in str(error.value)


def test_reference_sampler_labels_the_empty_prompt_unconditional(reference):
    _, _, line = sample(reference[0], prompt="", mode="AR")
    assert "unconditional (empty prompt)" in line and "WARNING" not in line
    _, _, named = sample(reference[0], prompt="a bag", mode="AR")
    assert "unconditional" not in named


# ---------------------------------------------------------------- sampler, decode, diagnostics

def test_sample_decode_diagnose(synthetic):
    codes, trace, line = sample(synthetic, prompt="a synthetic prompt", seed=3, mode="PAC+VP")
    assert codes.codes.shape == (1, *GRID) and codes.codes.dtype == torch.long
    assert trace.run.mode == "SJD+AC+PD+VP" and trace.run.resolution == (GRID[1], GRID[0])
    summary = trace.trace.summary()
    assert line.startswith("SJD+AC+PD+VP:") and f"{summary['nfe']:.0f} forward passes" in line
    (images,) = Decode().decode(codes)
    assert images.shape == (1, *GRID, 3) and images.dtype == torch.float32
    assert 0 <= float(images.min()) and float(images.max()) <= 1
    (large,) = Decode().decode(codes, "8")
    assert large.shape == (1, GRID[0] * 8, GRID[1] * 8, 3)
    assert torch.equal(large[:, ::8, ::8], images) and torch.equal(large[:, 7::8, 7::8], images)
    out = Diagnostics().diagnose(trace, 0.5, images)
    commit, waited, probability, histogram, text, rules = out["result"]
    assert commit.shape == waited.shape == probability.shape
    assert rules.shape[0] == 1 and rules.shape[-1] == 3 and float(rules.std()) > 0
    assert commit.shape[0] == 1 and commit.shape[2] == 256 and commit.shape[1] > 256 + 40
    assert histogram.shape[0] == 1 and histogram.shape[-1] == 3
    assert out["ui"]["images"] == []  # nowhere to show previews outside ComfyUI
    assert f"NFE {summary['nfe']:.1f}" in text and "step compression" in text
    assert "connect an AR run's trace" in text
    # commit_iteration grows along the raster: the first slot is committed no later than the last
    maps = trace.trace.slot_maps()["commit_iteration"][0]
    assert maps[0, 0] <= maps[-1, -1] and float(commit.std()) > 0


@pytest.mark.parametrize("mode", [m.upper() for m in PRESETS if m != "auto"])
def test_same_seed_same_codes_and_batch_rows_follow_their_seeds(synthetic, mode):
    first = sample(synthetic, prompt="p", seed=5, mode=mode)[0].codes
    assert torch.equal(first, sample(synthetic, prompt="p", seed=5, mode=mode)[0].codes)
    batch = sample(synthetic, prompt="p", seed=5, batch_size=2, mode=mode)[0].codes
    assert torch.equal(batch[:1], first)
    assert torch.equal(batch[1:], sample(synthetic, prompt="p", seed=6, mode=mode)[0].codes)


def test_auto_runs_by_default_with_its_own_longest_window(synthetic):
    _, trace, line = sample(synthetic, prompt="p", seed=5)
    assert trace.run.mode.startswith("AUTO") and line.startswith("AUTO")
    assert trace.trace.meta["window"] == AccelerationSettings.preset("auto").window == 32
    assert trace.trace.summary()["slots_per_image"] == GRID[0] * GRID[1]
    _, chosen, _ = sample(synthetic, prompt="p", seed=5, window=8)
    assert chosen.trace.meta["window"] == 8


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_runs_as_its_settings_say(synthetic, preset):
    expected = AccelerationSettings.preset(preset)
    if expected.window > 1:
        expected = AccelerationSettings.preset(preset, window=8)
    _, trace, line = sample(synthetic, mode=preset.upper(), window=8)
    assert trace.run.mode == expected.mode_name and line.startswith(expected.mode_name)
    _, own, _ = sample(synthetic, mode=preset.upper(), window=0)
    assert own.trace.meta["window"] == AccelerationSettings.preset(preset).window


def test_settings_travel_as_objects(synthetic):
    options = acceleration(adaptive_continuation="off", proactive_drafting="off",
                           verification_prediction="on", relaxed="lantern")
    assert options.overrides["verification_prediction"] is True
    assert options.overrides["adaptive_continuation"] is False
    _, trace, line = sample(synthetic, mode="PAC", window=8, acceleration=options)
    assert trace.run.mode == "SJD+VP+LANTERN" and "(LOSSY)" in line
    as_mode = acceleration()
    assert not {"adaptive_continuation", "proactive_drafting", "verification_prediction"} & set(
        as_mode.overrides)
    _, trace, _ = sample(synthetic, mode="SJD", window=8, acceleration=as_mode)
    assert trace.run.mode == "SJD"
    greedy = sampling(top_k=1)
    assert greedy.recipe == "custom" and greedy.custom.top_k == 1 and greedy.custom.guidance == 3.0
    first = sample(synthetic, prompt="p", seed=1, sampling=greedy)[0].codes
    assert torch.equal(first, sample(synthetic, prompt="p", seed=2, sampling=greedy)[0].codes)


@pytest.mark.slow
def test_without_sampling_options_the_family_recipe_is_used(reference):
    loaded = reference[0]
    recipe = loaded.model.defaults
    explicit = sampling(guidance=recipe.guidance, temperature=recipe.temperature,
                        top_k=recipe.top_k, top_p=recipe.top_p)
    plain = sample(loaded, prompt="bag", seed=4, mode="PAC+VP")[0].codes
    for same in (explicit, sampling(recipe="family recipe"), sampling(recipe="trained")):
        assert torch.equal(plain, sample(loaded, prompt="bag", seed=4, mode="PAC+VP",
                                         sampling=same)[0].codes)


@pytest.fixture(scope="module")
def two_recipes() -> LoadedModel:
    """A synthetic model with two official recipes: the default and a greedy one."""
    torch.manual_seed(0)
    model = SyntheticModel(codebook_size=16, grid=GRID, sharpness=3.0)
    model.recipes = {"sampled": SamplingDefaults(guidance=3.0, temperature=1.0, top_k=0,
                                                 source="test"),
                     "greedy": SamplingDefaults(guidance=1.0, temperature=1.0, top_k=1,
                                                source="test")}
    model.defaults = model.recipes["sampled"]
    return LoadedModel(model, None, "two recipes", torch.float32)


def test_sampling_options_pick_an_official_recipe_by_name(two_recipes):
    choices = SamplingOptions.INPUT_TYPES()["required"]["recipe"]
    assert choices[0] == ["family recipe", *offered_recipes(), "custom"]
    assert choices[1]["default"] == "custom"
    for name in ("inference solver", "gradio demo", "official", "FID evaluation", "trained"):
        assert name in choices[0]
    greedy = sampling(recipe="greedy", temperature=0.0)  # the four numbers are not used
    assert greedy == SamplingChoice("greedy")
    runs = [sample(two_recipes, prompt="p", seed=seed, mode="SJD", sampling=greedy)
            for seed in (1, 2)]
    assert runs[0][1].trace.meta["sampling"] == {"guidance": 1.0, "temperature": 1.0,
                                                 "top_k": 1, "top_p": 1.0,
                                                 "guidance_schedule": "constant"}
    assert torch.equal(runs[0][0].codes, runs[1][0].codes)  # greedy: the seed does not matter
    default = sample(two_recipes, prompt="p", seed=1, mode="SJD",
                     sampling=sampling(recipe="family recipe"))[1]
    assert default.trace.meta["sampling"]["guidance"] == 3.0
    assert default.trace.meta["sampling"]["top_k"] == 0


def test_a_recipe_the_model_does_not_have_is_named_with_the_models_recipes(two_recipes):
    with pytest.raises(ValueError) as error:
        sample(two_recipes, prompt="p", sampling=sampling(recipe="gradio demo"))
    message = str(error.value)
    for part in ("SJD Sampler: recipe='gradio demo' is not a recipe of the synthetic model "
                 "'two recipes'", "'sampled', 'greedy'", "'family recipe'", "'custom'"):
        assert part in message, message


@pytest.mark.parametrize("changes, expected", [
    (dict(mode="AR", acceleration=dict(relaxed="lantern")),
     ["SJD Sampler: mode=AR", "relaxed='lantern'", "speculative mode such as AUTO, SJD"]),
    (dict(mode="AR", acceleration=dict(adaptive_shape="on")),
     ["SJD Sampler: mode=AR", "adaptive_shape=True", "speculative mode"]),
    (dict(mode="PAC", window=4, acceleration=dict(pd_depth=6)), ["pd_depth=6", "window (4)"]),
    (dict(mode="SJD", window=1, acceleration=dict(verification_prediction="on")),
     ["verification_prediction=True", "raise window"]),
    (dict(resolution="768x768"), ["resolution=768x768", "synthetic", "pick one of 8x8"]),
    (dict(resolution="huge"), ["resolution='huge'", "WIDTHxHEIGHT"]),
    (dict(mode="turbo"), ["mode='turbo'", "'AUTO'", "PAC+VP"]),
    (dict(batch_size=0), ["batch_size=0", ">= 1"]),
])
def test_sampler_bad_inputs_say_what_to_do(synthetic, changes, expected):
    if "acceleration" in changes:
        changes["acceleration"] = acceleration(**changes["acceleration"])
    with pytest.raises(ValueError) as error:
        sample(synthetic, **changes)
    message = str(error.value)
    assert message.startswith("SJD Sampler:")
    for part in expected:
        assert part in message, message


@pytest.mark.parametrize("changes, expected", [
    (dict(top_p=0.0), ["SJD Sampling Options:", "top_p=0.0", "(0, 1]"]),
    (dict(temperature=0.0), ["SJD Sampling Options:", "temperature=0.0", "top_k=1"]),
])
def test_sampling_options_report_bad_values_on_their_own_node(changes, expected):
    with pytest.raises(ValueError) as error:
        sampling(**changes)
    for part in expected:
        assert part in str(error.value)


@pytest.mark.slow
def test_ui_payload_is_bounded_and_the_trace_goes_through_the_output():
    torch.manual_seed(0)
    big = LoadedModel(SyntheticModel(codebook_size=8, grid=(90, 90), width=16, sharpness=6.0),
                      None, "synthetic 90x90", torch.float32)
    values = widget_defaults(Sampler) | dict(prompt="p", batch_size=4, mode="SJD", window=4)
    out = Sampler().sample(big, **values, unique_id="3")
    ui = out["ui"]
    assert set(ui) == {"sjd_summary", "sjd_accepted", "sjd_text"}
    iterations = ui["sjd_summary"][0]["iterations"]
    assert iterations > CHART_POINTS and len(ui["sjd_accepted"]) == CHART_POINTS
    trace = out["result"][1].trace
    assert trace.slot_maps()["commit_iteration"].shape == (4, 90, 90)
    assert len(json.dumps(ui)) < 8_000 < len(trace.to_json()) // 100
    # the series keeps the mean: total codes / steps, within rounding
    assert abs(sum(ui["sjd_accepted"]) / CHART_POINTS
               - sum(trace.accepted_lengths()) / 4 / iterations) < 0.1


OLD_WIDGETS = dict(prompt="p", negative_prompt="", resolution="default", batch_size=1, seed=5,
                   sampling="family recipe", guidance=3.0, temperature=1.0, top_k=0, top_p=1.0,
                   mode="custom", window=8, init="uniform", adaptive_continuation=False,
                   proactive_drafting=False, verification_prediction=True, vp_rises=3,
                   vp_top_k=50, vp_decay=0.5, relaxed="none", lantern_neighbours=1000,
                   lantern_delta=0.1, gsd_rank_radius=7, gsd_prob_tolerance=0.15,
                   gsd_embedding_tolerance=0.5, pd_candidates=4, pd_depth=3)


def test_old_all_in_one_sampler_still_runs_and_matches_the_new_one(synthetic):
    assert LegacySampler.DEPRECATED is True
    assert list(LegacySampler.INPUT_TYPES()["required"]) == [
        "model", "prompt", "negative_prompt", "resolution", "batch_size", "seed", "sampling",
        "guidance", "temperature", "top_k", "top_p", "mode", "window", "init",
        "adaptive_continuation", "proactive_drafting", "pd_candidates", "pd_depth",
        "verification_prediction", "vp_rises", "vp_top_k", "vp_decay", "relaxed",
        "lantern_neighbours", "lantern_delta", "gsd_rank_radius", "gsd_prob_tolerance",
        "gsd_embedding_tolerance"]  # the saved order of widget values
    old = LegacySampler().sample(synthetic, unique_id="1", **OLD_WIDGETS)["result"]
    new = sample(synthetic, prompt="p", seed=5, mode="SJD", window=8,
                 acceleration=acceleration(verification_prediction="on"))
    assert old[1].run.mode == new[1].run.mode == "SJD+VP"
    assert torch.equal(old[0].codes, new[0].codes)
    with pytest.raises(ValueError, match=r"SJD Sampler \(all options, old\): mode=AR.*SJD, PAC"):
        LegacySampler().sample(synthetic, **(OLD_WIDGETS | dict(mode="AR", relaxed="gsd")))
    with pytest.raises(ValueError, match="sampling='best'"):
        LegacySampler().sample(synthetic, **(OLD_WIDGETS | dict(sampling="best")))


def test_option_nodes_chain_or_take_inputs_of_their_own_alike(synthetic):
    drafting = option_node("SJDDraftingOptions", verification_prediction="on", vp_rises=2)
    speed = option_node("SJDSpeedOptions", shape_cost="passes")
    chain = option_node("SJDSpeedOptions", drafting, shape_cost="passes")
    assert chain == drafting.merged(speed) == AccelerationOptions(
        drafting.overrides | speed.overrides)
    chained = sample(synthetic, prompt="p", seed=2, mode="PAC", window=8, acceleration=chain)
    separate = sample(synthetic, prompt="p", seed=2, mode="PAC", window=8, drafting=drafting,
                      speed=speed)
    assert chained[1].run.mode == separate[1].run.mode == "SJD+AC+PD+VP"
    assert torch.equal(chained[0].codes, separate[0].codes)
    with pytest.raises(ValueError) as error:
        option_node("SJDDraftingOptions", drafting, vp_rises=5)
    assert str(error.value) == ("SJD Drafting Options: acceleration: vp_rises is set twice, to 2 "
                                "and to 5, by two SJD option nodes: set it on one of them only.")
    with pytest.raises(ValueError) as error:
        sample(synthetic, acceleration=option_node("SJDDraftingOptions", vp_rises=5),
               drafting=drafting)
    assert str(error.value).startswith("SJD Sampler: drafting: vp_rises is set twice, to 5 and")


OLD_OPTIONS = Path(__file__).parent / "old_workflows" / "acceleration_options_non_default.json"


def test_a_saved_acceleration_options_node_keeps_its_settings(synthetic):
    """A workflow saved with the all-in-one options node: every widget off its default, the same
    settings as the three new nodes given the same values, and the same run."""
    assert OldOptions.DEPRECATED is True
    graph = json.loads(OLD_OPTIONS.read_text())
    (node,) = [n for n in graph["nodes"] if n["type"] == "SJDAccelerationOptions"]
    saved = saved_widgets(node)
    assert list(saved) == acceleration_option_fields()  # the saved order of widget values
    defaults = widget_defaults(OldOptions) | {"compile": "on CUDA"}
    assert all(saved[name] != defaults[name] for name in saved), saved
    old = OldOptions().options(**saved)[0]
    assert old == acceleration(**saved)
    assert old.settings("sjd", 8) == AccelerationSettings.preset(
        "sjd", window=8, init="left", adaptive_continuation=True, proactive_drafting=False,
        pd_candidates=2, pd_depth=2, verification_prediction=True, vp_rises=2, vp_top_k=20,
        vp_decay=0.25, relaxed="lantern", lantern_neighbours=5, lantern_delta=0.05,
        gsd_rank_radius=4, gsd_prob_tolerance=0.2, gsd_embedding_tolerance=0.4,
        adaptive_shape=False, adaptive_tree=True, shape_cost="passes", compile=False)
    ran = sample(synthetic, prompt="p", seed=3, mode="SJD", window=8, acceleration=old)
    groups = {key.removeprefix("SJD").removesuffix("Options").removesuffix("Acceptance").lower():
              option_node(key, **{n: saved[n] for n in OPTION_GROUPS[key]})
              for key in OPTION_NODES}
    again = sample(synthetic, prompt="p", seed=3, mode="SJD", window=8, **groups)
    assert ran[1].run.mode == again[1].run.mode == "SJD+AC+VP+LANTERN"
    assert torch.equal(ran[0].codes, again[0].codes)


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


def test_decode_refuses_an_upscale_it_does_not_offer(synthetic):
    codes = sample(synthetic, prompt="p")[0]
    with pytest.raises(ValueError, match=r"SJD Decode: upscale='3' is not allowed.*'1', '2', '4', '8'"):
        Decode().decode(codes, "3")


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

TEMPLATES = REPO / "workflows"  # one of the folder names ComfyUI's template browser reads
TEXT_TO_IMAGE = "SJD text to image (reference)"
AR_VS_AUTO = "SJD AR vs AUTO (reference)"
FAMILY_TEMPLATES = ("SJD Lumina-mGPT text to image", "SJD Lumina-mGPT 2.0 text to image",
                    "SJD Emu3 text to image", "SJD Janus-Pro text to image",
                    "SJD LlamaGen class to image")
UNSAFE_IN_FILE_NAMES = set('<>:"/\\|?*#%&')


def widget_names(cls: type) -> list[str]:
    """The names behind a saved node's widget values, in order (seed has its control after it)."""
    names = []
    for section in ("required", "optional"):
        for name, spec in cls.INPUT_TYPES().get(section, {}).items():
            if isinstance(spec[0], list) or spec[0] in ("INT", "FLOAT", "STRING", "BOOLEAN"):
                names.append(name)
                if spec[1].get("control_after_generate"):
                    names.append("control_after_generate")
    return names


def saved_widgets(node: dict) -> dict:
    return dict(zip(widget_names(pack.NODE_CLASS_MAPPINGS[node["type"]]), node["widgets_values"]))


def test_templates_have_human_titles_thumbnails_and_the_new_sampler():
    files = sorted(TEMPLATES.glob("*.json"))
    assert sorted(f.stem for f in files) == sorted([TEXT_TO_IMAGE, AR_VS_AUTO, *FAMILY_TEMPLATES])
    for path in files:
        # The current template browser shows a custom node's template under its file name, with
        # the .jpg of the same name as its thumbnail.
        assert path.stem.startswith("SJD ") and not set(path.stem) & UNSAFE_IN_FILE_NAMES
        assert len(path.stem) <= 34, f"{path.stem!r}: the template card cuts titles this long"
        thumbnail = path.with_suffix(".jpg")
        with Image.open(thumbnail) as picture:
            assert picture.format == "JPEG" and min(picture.size) >= 256, path.name
        graph = json.loads(path.read_text())
        ids = {n["id"] for n in graph["nodes"]}
        for link_id, origin, _, target, _, kind in graph["links"]:
            assert origin in ids and target in ids, path.name
        types = {n["type"] for n in graph["nodes"]}
        assert types <= set(pack.NODE_CLASS_MAPPINGS) | {"SaveImage", "Note"}, path.name
        hidden = {key for key, cls in pack.NODE_CLASS_MAPPINGS.items()
                  if getattr(cls, "DEPRECATED", False)}
        assert hidden == {"SJDSampler", "SJDAccelerationOptions"}
        assert not types & hidden, f"{path.name} uses an old node: {types & hidden}"
        for node in graph["nodes"]:
            if node["type"] in pack.NODE_CLASS_MAPPINGS:
                names = widget_names(pack.NODE_CLASS_MAPPINGS[node["type"]])
                assert len(node["widgets_values"]) == len(names), (path.name, node["type"])


def test_family_templates_show_the_speed_options_at_their_defaults():
    for name in FAMILY_TEMPLATES:
        graph = json.loads((TEMPLATES / f"{name}.json").read_text())
        (speed,) = [n for n in graph["nodes"] if n["type"] == "SJDSpeedOptions"]
        assert saved_widgets(speed) == widget_defaults(pack.NODE_CLASS_MAPPINGS["SJDSpeedOptions"])
        (sampler,) = [n for n in graph["nodes"] if n["type"] == "SJDSamplerV2"]
        (link,) = [link for link in graph["links"] if link[1] == speed["id"]]
        assert (link[3], sampler["inputs"][link[4]]["name"]) == (sampler["id"], "speed")


def test_template_category_is_named_after_the_pack():
    from comfyui_harness import PACK_DIR_NAME

    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    locale = json.loads((REPO / "locales" / "en" / "main.json").read_text())
    assert meta["project"]["name"] == PACK_DIR_NAME  # the folder a registry install creates
    assert locale["templateWorkflows"]["category"] == {
        PACK_DIR_NAME: meta["tool"]["comfy"]["DisplayName"]}


def test_reference_templates_use_the_embedded_model_the_default_mode_and_upscale_8():
    def nodes(name, kind):
        graph = json.loads((TEMPLATES / f"{name}.json").read_text())
        return [saved_widgets(n) for n in graph["nodes"] if n["type"] == kind]

    for name in (TEXT_TO_IMAGE, AR_VS_AUTO):
        assert [n["model"] for n in nodes(name, "SJDModelLoader")] == [REFERENCE]
        assert {n["upscale"] for n in nodes(name, "SJDDecode")} == {"8"}
    (single,) = nodes(TEXT_TO_IMAGE, "SJDSamplerV2")
    assert single["mode"] == default_mode() == "AUTO"
    assert single["window"] == OWN_WINDOW  # the mode's own window: 32 for AUTO
    assert nodes(TEXT_TO_IMAGE, "SJDAccelerationOptions") == []  # the mode alone decides
    pair = nodes(AR_VS_AUTO, "SJDSamplerV2")
    assert sorted(s["mode"] for s in pair) == ["AR", "AUTO"]
    assert {s["window"] for s in pair} == {OWN_WINDOW}
    assert pair[0]["seed"] == pair[1]["seed"] and pair[0]["prompt"] == pair[1]["prompt"]


def test_saved_workflows_keep_their_old_nodes_layout():
    counts = {"SJDSampler": 28, "SJDAccelerationOptions": 19}
    seen = set()
    for path in sorted((Path(__file__).parent / "old_workflows").glob("*.json")):
        graph = json.loads(path.read_text())
        for node in graph["nodes"]:
            if node["type"] in counts:
                seen.add(node["type"])
                names = widget_names(pack.NODE_CLASS_MAPPINGS[node["type"]])
                assert len(node["widgets_values"]) == len(names) == counts[node["type"]]
    assert seen == set(counts)


def test_models_folder_comes_from_the_environment_outside_comfyui(tmp_path, monkeypatch):
    monkeypatch.setenv("SJD_MODELS_DIR", os.pathsep.join([str(tmp_path / "a"), str(tmp_path / "b")]))
    assert comfy_bridge.models_folders() == [str(tmp_path / "a"), str(tmp_path / "b")]
    for available, kind in ((False, "cpu"), (True, "cuda")):  # outside ComfyUI: CUDA if present
        monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
        assert comfy_bridge.torch_device().type == kind
