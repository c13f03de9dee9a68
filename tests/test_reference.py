"""The embedded reference model: training script (tiny), loading, prompts, decoding, exactness."""

from pathlib import Path

import numpy as np
import pytest
import torch

from sjd_core.decoding.engine import generate
from sjd_core.models.registry import load_model
from sjd_core.models.protocol import GenerationRequest
from sjd_core.models.reference import WEIGHTS_DIR, ReferenceModel
from sjd_core.models.reference import codebook as cb
from sjd_core.tools.reference import train
from sjd_core.tools.reference.data import INSTALL_HINT, load_split
from sjd_core.tools.reference.probe import QualityProbe, energy_test, frechet_distance, real_floor
from sjd_core.models.reference.prompts import CLASS_NAMES, SYNONYMS, ClassVocabulary
from sjd_core.decoding.settings import AccelerationSettings, SamplingSettings
from tests import family_checks as fc

TINY = ["--tiny", "--steps", "4", "--batch", "4"]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny_reference")
    train.main(TINY + ["--out", str(out)])
    return out


@pytest.fixture(scope="module")
def shipped() -> ReferenceModel:
    return load_model(WEIGHTS_DIR, device="cpu")


@pytest.mark.slow
def test_tiny_training_writes_a_loadable_checkpoint_reproducibly(tiny_folder, tmp_path):
    names = {p.name for p in tiny_folder.iterdir()}
    assert {"config.json", "model.safetensors", "codebook.safetensors", "reference.json",
            "classifier.safetensors"} <= names
    model = load_model(tiny_folder, device="cpu")
    assert isinstance(model, ReferenceModel) and model.codebook_size == 16
    assert model.grid_for(None) == (16, 16)
    # same seed, same bytes; another seed, other weights
    again = train.main(TINY + ["--parts", "codebook,model", "--out", str(tmp_path / "a")])
    assert (again / "model.safetensors").read_bytes() == (tiny_folder / "model.safetensors").read_bytes()
    other = train.main(TINY + ["--parts", "codebook,model", "--seed", "1", "--out", str(tmp_path / "b")])
    assert (other / "model.safetensors").read_bytes() != (tiny_folder / "model.safetensors").read_bytes()


def test_training_arguments_are_checked(capsys):
    with pytest.raises(SystemExit):
        train.main(["--parts", "model,vae"])
    assert "--parts='model,vae' is not allowed" in capsys.readouterr().err


def test_missing_dataset_says_how_to_install(tmp_path):
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist"):
        load_split("train", tmp_path)
    assert "dataset-fashion-mnist" in INSTALL_HINT


def test_shipped_model_loads_through_the_loader(shipped):
    assert shipped.family == "reference"
    assert shipped.grid_for(None) == (16, 16) and shipped.grid_for((32, 32)) == (16, 16)
    assert shipped.supported_resolutions() == [(32, 32)]
    assert tuple(shipped.codebook_embeddings().shape) == (512, 4)
    size = sum(p.stat().st_size for p in Path(WEIGHTS_DIR).iterdir())
    assert size <= 20 * 2**20
    with pytest.raises(ValueError, match=r"resolution=\(64, 64\) is not allowed.*32x32"):
        shipped.grid_for((64, 64))


def test_prompt_mapping_rule():
    vocab = ClassVocabulary(CLASS_NAMES, {k: list(v) for k, v in SYNONYMS.items()})
    assert vocab.resolve("sneaker") == CLASS_NAMES.index("sneaker")
    assert vocab.resolve("  A red T-Shirt! ") == CLASS_NAMES.index("t-shirt")
    assert vocab.resolve("shirt") == CLASS_NAMES.index("shirt")
    assert vocab.resolve("Ankle Boots") == CLASS_NAMES.index("ankle boot")
    assert vocab.resolve("a leather handbag") == CLASS_NAMES.index("bag")
    assert vocab.resolve("") is None
    with pytest.raises(ValueError, match=r"prompt='cat' names no known class.*sneaker"):
        vocab.resolve("cat")
    with pytest.raises(ValueError, match=r"names several classes \(coat, bag\)"):
        vocab.resolve("a coat and a bag")


def test_prompts_in_requests_are_checked(shipped):
    with pytest.raises(ValueError, match="negative_prompt='spaceship'"):
        shipped.start(GenerationRequest(prompt="bag", negative_prompt="spaceship", guidance=2.0))
    with pytest.raises(ValueError, match=r"prompt\[1\]='nothing'"):
        shipped.start(GenerationRequest(prompt="", batch_size=2, extra={"prompts": ["bag", "nothing"]}))
    with pytest.raises(ValueError, match="batch_size=2 prompts"):
        shipped.start(GenerationRequest(prompt="", batch_size=2, extra={"prompts": ["bag"]}))


def test_decode_shape_range_and_errors(shipped):
    codes = torch.randint(0, 512, (3, 16, 16), generator=torch.Generator().manual_seed(0))
    images = shipped.decode(codes)
    assert images.shape == (3, 32, 32, 3) and images.dtype == torch.float32
    assert 0.0 <= images.min() and images.max() <= 1.0
    # the tokenizer reads decoded images back to the same codes
    assert torch.equal(cb.encode(images[..., 0], shipped.codebook), codes)
    with pytest.raises(ValueError, match=r"codes of shape \(3, 8, 8\)"):
        shipped.decode(codes[:, :8, :8])
    with pytest.raises(ValueError, match=r"codes must lie in \[0, 512\)"):
        shipped.decode(codes + 600)


GREEDY_REQUEST = GenerationRequest(prompt="", batch_size=2, extra={"prompts": ["trouser", "bag"]})
GREEDY_SLOTS = 5 * 16  # the first five rows of the 16 x 16 grid, where the garments start


@pytest.mark.slow
def test_greedy_codes_equal_ar_in_lossless_modes(shipped):
    with torch.inference_mode():
        forwards = fc.check_greedy_modes_agree(shipped, GREEDY_REQUEST, 2.0, slots=GREEDY_SLOTS)
        ar, _ = fc.first_codes(shipped, GREEDY_REQUEST, SamplingSettings(guidance=2.0, top_k=1),
                               AccelerationSettings.preset("ar"), GREEDY_SLOTS)
    assert forwards["pac+vp"] < forwards["ar"] == GREEDY_SLOTS
    assert not torch.equal(ar[0], ar[1])  # each row follows its own prompt


def test_probe_statistics():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(60, 4)), rng.normal(size=(60, 4))
    shifted = rng.normal(size=(60, 4)) + 0.8
    assert abs(frechet_distance(a.mean(0), np.cov(a, rowvar=False), a.mean(0), np.cov(a, rowvar=False))) < 1e-6
    assert energy_test(a, b, permutations=200)[1] > 0.05
    assert energy_test(a, shifted, permutations=200)[1] < 0.01


@pytest.mark.slow
def test_shipped_probe_reads_generated_images(shipped):
    probe = QualityProbe(WEIGHTS_DIR)
    with torch.inference_mode():
        result = generate(shipped, GenerationRequest(prompt="bag", batch_size=4),
                          SamplingSettings(guidance=2.0), AccelerationSettings.preset("pac+vp"), seed=0)
    scores = probe.evaluate(shipped.decode(result.codes), [CLASS_NAMES.index("bag")] * 4)
    assert 0.0 <= scores["accuracy"] <= 1.0 and scores["feature_distance"] > 0
    assert 0 < real_floor(probe, 50) < 100
