"""A model spread by accelerate's device_map, part of its layers on disk, runs every engine mode.

Disk offload reloads the offloaded layers on every forward, so each run stops after the first
grid row and a few codes of the next (crossing a row end) and compares them with plain
autoregression on the same model loaded whole.
"""

import pytest
import torch

from sjd_core.decoding.engine import generate
from sjd_core.models.registry import load_model
from sjd_core.models.protocol import GenerationRequest
from sjd_core.decoding.settings import AccelerationSettings, SamplingSettings
from tests.tiny_checkpoints import cached_copy, write_lumina

torch.set_num_threads(1)

SPREAD = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
          "model.layers.2": "disk", "model.norm": "cpu", "model.rotary_emb": "cpu",
          "model.vqmodel": "cpu", "lm_head": "cpu"}
GREEDY = SamplingSettings(guidance=3.0, top_k=1)
REQUEST = GenerationRequest(prompt="a lighthouse at dusk", batch_size=1)
PREFIX = 32 + 8  # slots compared: one row and the start of the next


class _Enough(Exception):
    pass


def first_codes(model, preset: str) -> torch.Tensor:
    """The first PREFIX committed codes of a greedy run in ``preset`` mode."""
    seen = {}

    def stop(report):
        if min(report.committed) >= PREFIX:
            seen["codes"] = report.codes[0, :PREFIX].cpu().clone()
            raise _Enough

    with pytest.raises(_Enough):
        generate(model, REQUEST, GREEDY, AccelerationSettings.preset(preset), seed=0, on_iteration=stop)
    return seen["codes"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return cached_copy(write_lumina, tmp_path_factory.mktemp("models") / "Lumina-mGPT-7B-512")


@pytest.fixture(scope="module")
def ar_codes(folder):
    return first_codes(load_model(folder), "ar")


@pytest.fixture(scope="module")
def spread(folder):
    model = load_model(folder, device_map=SPREAD)
    assert model.model.hf_device_map == SPREAD
    offloaded = [n for n, p in model.model.named_parameters() if p.is_meta]
    assert offloaded and all(n.startswith(("model.layers.1.", "model.layers.2.")) for n in offloaded)
    return model


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["ar", "sjd", "pac", "pac+vp"])
def test_disk_offloaded_model_runs_every_mode(spread, ar_codes, preset):
    assert torch.equal(first_codes(spread, preset), ar_codes)


def test_nested_device_map_keys_are_flattened_for_accelerate(folder, ar_codes):
    model = load_model(folder, device_map={"": "cpu", "model.layers.1": "disk"})
    placement = model.model.hf_device_map
    assert placement["model.layers.1"] == "disk" and "" not in placement
    assert set(placement.values()) == {"cpu", "disk"}
    assert torch.equal(first_codes(model, "sjd"), ar_codes)


def test_auto_device_map(folder):
    model = load_model(folder, device_map="auto")
    assert set(model.model.hf_device_map.values()) <= {"cpu", 0, "cuda:0"}
    images = model.decode(torch.zeros(1, 32, 32, dtype=torch.long))
    assert images.shape == (1, 64, 64, 3)
