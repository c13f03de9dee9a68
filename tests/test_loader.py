"""The loader: family detection, checkpoint checks before loading, dtypes, device_map errors."""

import shutil

import pytest
import torch

import sjd_core.models.chameleon as chameleon
from sjd_core.models.registry import FAMILIES, load_model
from sjd_core.models.weights import resolve_device_dtype
from tests.tiny_checkpoints import cached_copy, write_lumina

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def lumina_dir(tmp_path_factory):
    return cached_copy(write_lumina, tmp_path_factory.mktemp("models") / "Lumina-mGPT-7B-512")


@pytest.fixture
def copy(tmp_path, lumina_dir):
    folder = tmp_path / lumina_dir.name
    shutil.copytree(lumina_dir, folder)
    return folder


@pytest.fixture
def no_model_built(monkeypatch):
    """Fails the test if the weights start loading (the checks must come first)."""
    def refuse(*args, **kwargs):
        raise AssertionError("weights were being loaded before the checkpoint was checked")
    monkeypatch.setattr(chameleon, "load_transformers_model", refuse)


def test_unknown_folder_lists_families(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "bert"}')
    with pytest.raises(ValueError) as err:
        load_model(tmp_path)
    message = str(err.value)
    for family in FAMILIES:
        assert f"{family.name}: {family.expects}" in message
    assert "lumina-mgpt" in message and "vqgan.ckpt" in message


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nowhere")


def test_config_without_weights(copy, no_model_built):
    for f in list(copy.glob("model*.safetensors*")):
        f.unlink()
    with pytest.raises(FileNotFoundError, match="No weights in .*model.safetensors"):
        load_model(copy)


def test_truncated_shard_is_refused_before_loading(copy, no_model_built):
    shard = sorted(copy.glob("model-*.safetensors"))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    with pytest.raises(ValueError, match=f"{shard.name}.* damaged or truncated"):
        load_model(copy)


def test_missing_shard_is_named(copy, no_model_built):
    shard = sorted(copy.glob("model-*.safetensors"))[2]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        load_model(copy)


def test_weights_that_do_not_match_the_config(copy):
    import json

    config = json.loads((copy / "config.json").read_text())
    config["intermediate_size"] = 48
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="config does not match the weights"):
        load_model(copy)


def test_dtypes(lumina_dir):
    assert resolve_device_dtype("cpu", None) == (torch.device("cpu"), torch.float32)
    assert resolve_device_dtype("cuda", None)[1] == torch.bfloat16
    with pytest.raises(ValueError, match="dtype=torch.int64"):
        resolve_device_dtype("cpu", torch.int64)
    model = load_model(lumina_dir, dtype=torch.bfloat16)
    assert {p.dtype for p in model.model.parameters()} == {torch.bfloat16}
    assert not any(p.is_meta for p in model.model.parameters())
    from sjd_core.models.protocol import GenerationRequest

    session = model.start(GenerationRequest(prompt="a fox", guidance=2.0))
    cond, uncond = session.forward(torch.tensor([[0, 5]]), torch.tensor([[-1, 0]]),
                                   torch.tril(torch.ones(2, 2, dtype=torch.bool)), [0])
    assert cond.dtype == torch.float32 and torch.isfinite(cond).all() and torch.isfinite(uncond).all()


def test_bad_device_map(lumina_dir):
    with pytest.raises(ValueError, match="device_map='everywhere' is not allowed"):
        load_model(lumina_dir, device_map="everywhere")
    with pytest.raises(ValueError, match="does not place parameter"):
        load_model(lumina_dir, device_map={"model.layers": "cpu"})
