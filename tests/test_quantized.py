"""int8 / int4 weight-only models (torchao) on tiny checkpoints, through the same loader.

Tolerances: logits are compared with the float32 model, as the largest difference over the
largest logit. int8 (per-channel scales) stays within 0.1. int4 stays within 0.5: these random
tiny models quantise in groups of 32 to 64 weights with no structure to preserve, far coarser
than a trained checkpoint's 128-wide groups, so only a loose bound holds for them. Exactness of
the decoding modes is then checked on the quantised model itself: speculative decoding draws from
the quantised model's distribution, whatever that is.
"""

import builtins

import pytest
import torch

from sjd_core.models.protocol import GenerationRequest
from sjd_core.models.registry import load_model
from sjd_core.models.weights import stored_bytes
from tests import family_checks as fc
from tests.tiny_checkpoints import write_llamagen, write_lumina2

pytest.importorskip("torchao", reason="the quantization extra (torchao) is not installed")

CODES = [5, 17, 63, 0, 22, 9, 41, 30, 2, 11, 58, 7, 36, 19, 50, 3]
TOLERANCE = {"int8": 0.1, "int4": 0.5}


@pytest.fixture(scope="module")
def llamagen_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return write_llamagen(tmp_path_factory.mktemp("quantized") / "c2i", "c2i")


@pytest.fixture(scope="module")
def models(llamagen_dir):
    """The same tiny LlamaGen in float32, bfloat16, and int8 / int4 (computing in bfloat16)."""
    return {"fp32": load_model(llamagen_dir, weights="fp32"), "bf16": load_model(llamagen_dir, weights="bf16"),
            "int8": load_model(llamagen_dir, weights="int8", dtype=torch.bfloat16),
            "int4": load_model(llamagen_dir, weights="int4", dtype=torch.bfloat16)}


def window_logits(model) -> torch.Tensor:
    session = model.start(GenerationRequest(prompt="hen"))
    n = len(CODES)
    out, _ = session.forward(torch.tensor([[0] + CODES[:-1]]), torch.arange(-1, n - 1)[None], fc.chain(n), [0])
    return out[0]


def test_linear_layers_hold_quantised_weights(models):
    import torchao.prototype.quantization.int4 as int4
    from torchao.quantization import Int8Tensor

    layer = models["int8"].model.model.layers[0]
    assert isinstance(layer.mlp.down_proj.weight, Int8Tensor)
    assert isinstance(models["int4"].model.model.layers[1].self_attn.q_proj.weight, int4.Int4OpaqueTensor)
    for name in ("int8", "int4"):  # the output head and the conditioning stay in bfloat16
        assert type(models[name].model.lm_head.weight) is torch.nn.Parameter
        assert models[name].model.lm_head.weight.dtype == torch.bfloat16


def test_weight_memory_shrinks(models):
    """Measured bytes of the transformer layers (linear weights, scales, norms) against bfloat16."""
    size = {name: stored_bytes(models[name].model.model.layers) for name in ("bf16", "int8", "int4")}
    print(f"\nlayer bytes: bf16 {size['bf16']}, int8 {size['int8']} "
          f"({size['bf16'] / size['int8']:.2f}x smaller), int4 {size['int4']} "
          f"({size['bf16'] / size['int4']:.2f}x smaller)")
    assert size["bf16"] / size["int8"] >= 1.8
    assert size["bf16"] / size["int4"] >= 3.0


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_logits_stay_close_to_the_unquantised_model(models, weights):
    reference = window_logits(models["fp32"])
    quantised = window_logits(models[weights])
    error = float((quantised - reference).abs().max() / reference.abs().max())
    print(f"\n{weights}: largest logit error / largest logit = {error:.4f} "
          f"(tolerance {TOLERANCE[weights]})")
    assert 0.0 < error <= TOLERANCE[weights]


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_every_lossless_mode_gives_ar_codes_on_the_quantised_model(llamagen_dir, weights):
    """Computing in float32 (the CPU default), so that a window and single steps round alike."""
    model = load_model(llamagen_dir, weights=weights)
    assert model.dtype == torch.float32
    fc.check_greedy_modes_agree(model, GenerationRequest(prompt="hen", batch_size=2), guidance=4.0)


def test_device_map_loads_quantised_layers_and_disk_is_refused(llamagen_dir, models):
    placement = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "cpu",
                 "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu", "cond_embedder": "cpu"}
    placed = load_model(llamagen_dir, weights="int8", dtype=torch.bfloat16, device_map=placement)
    assert placed.model.hf_device_map["model.layers.1"] == "cpu"
    torch.testing.assert_close(window_logits(placed), window_logits(models["int8"]))
    with pytest.raises(ValueError, match="cannot be offloaded to disk"):
        load_model(llamagen_dir, weights="int4", device_map=placement | {"model.layers.1": "disk"})


def test_lumina2_loads_quantised(tmp_path):
    model = load_model(write_lumina2(tmp_path / "Lumina-mGPT-2.0"), weights="int8")
    from torchao.quantization import Int8Tensor

    assert isinstance(model.model.model.layers[0].mlp.gate_proj.weight, Int8Tensor)
    assert model.decode(torch.zeros(1, 2, 2, dtype=torch.long)).shape == (1, 4, 4, 3)


def test_bad_weights_values_are_refused(llamagen_dir, monkeypatch):
    with pytest.raises(ValueError, match=r"weights='int3' is not allowed: use one of \('bf16', 'fp16', 'fp32', 'int8', 'int4'\)"):
        load_model(llamagen_dir, weights="int3")
    with pytest.raises(ValueError, match="weights='bf16' and dtype=torch.float32 disagree"):
        load_model(llamagen_dir, weights="bf16", dtype=torch.float32)
    real_import = builtins.__import__

    def without_torchao(name, *args, **kwargs):
        if name == "torchao" or name.startswith("torchao."):
            raise ImportError("No module named 'torchao'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without_torchao)
    with pytest.raises(ImportError, match=r"needs the torchao library.*sjd-autoregressive\[quantization\]"):
        load_model(llamagen_dir, weights="int8")
