"""Lumina-mGPT 2.0 on a tiny checkpoint written in the release layout (fp32, CPU).

The references share no code with the adapter: logits from the stock transformers model run on the
whole sequence of the official recipe, and pixels from a MoVQGAN decoder written below from the
published architecture (``ai-forever/MoVQGAN``, ``movqgan/modules/vqvae/movq_modules.py``).
"""

import json
import math
import shutil

import pytest
import torch

from sjd_core.decoding.guidance import SlotGuidance, lumina_mgpt_2_scales
from sjd_core.decoding.settings import SamplingSettings
from sjd_core.models import lumina2
from sjd_core.models.lumina2 import read_layout
from sjd_core.models.registry import load_model
from sjd_core.models.protocol import GenerationRequest, ImageTokenModel
from tests import family_checks as fc
from tests.tiny_checkpoints import (LUMINA2_CODE_OFFSET, LUMINA2_CODES, LUMINA2_SPECIAL, cached_copy,
                                    lumina2_reference, write_lumina2)

ROW_END, IMAGE_START, IMAGE_END, END_OF_TURN, EOS = 151670, 151665, 151666, 151671, 151643
SMALL = 64  # a trained size with an 8 x 8 code grid, so whole images decode quickly


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    torch.set_num_threads(1)
    return cached_copy(write_lumina2, tmp_path_factory.mktemp("models") / "Lumina-mGPT-2.0")


@pytest.fixture(scope="module")
def model(folder):
    return load_model(folder)


@pytest.fixture(scope="module")
def small(folder):
    """The same checkpoint offered at a 64-pixel trained size (sizes of 64 blocks of 8 codes)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lumina2, "TRAINED_SIZE", SMALL)
        return load_model(folder)


@pytest.fixture(scope="module")
def stock(folder):
    return lumina2_reference(folder)


def image_tokens(codes: list[int], width: int) -> list[int]:
    out = []
    for i, c in enumerate(codes):
        out.append(c + LUMINA2_CODE_OFFSET)
        if i % width == width - 1:
            out.append(ROW_END)
    return out


def make_reference(stock, model, request: GenerationRequest):
    """``reference(codes, row)`` for the family checks: one causal forward of the stock model."""
    resolution = request.resolution or model.supported_resolutions()[0]
    width = model.grid_for(resolution)[1]
    contexts = {"cond": model.prompt_ids(request.prompt, resolution),
                "uncond": model.unconditional_ids(resolution)}

    @torch.no_grad()
    def reference(codes: list[int], row: str) -> torch.Tensor:
        context = contexts[row]
        ids = context + image_tokens(codes, width)
        hidden = stock.model(input_ids=torch.tensor([ids])).last_hidden_state
        logits = stock.lm_head(hidden)[0, :, LUMINA2_CODE_OFFSET:LUMINA2_CODE_OFFSET + LUMINA2_CODES]
        return logits[fc.output_positions(len(context), len(codes), width, True)]

    return reference


CODES = torch.randint(0, LUMINA2_CODES, (120,), generator=torch.Generator().manual_seed(3)).tolist()


# ----------------------------------------------------------------------------- recipe and layout
def test_recipe_prompt_and_structural_tokens(model):
    assert isinstance(model, ImageTokenModel) and model.family == "lumina-mgpt-2"
    assert (model.defaults.guidance, model.defaults.top_k, model.defaults.temperature) == (4.0, 4096, 1.0)
    assert "sample.sh" in model.defaults.source
    assert SamplingSettings.of_recipe(model.defaults) == SamplingSettings(
        guidance=4.0, temperature=1.0, top_k=4096, guidance_schedule="lumina-mgpt-2")
    ids = model.prompt_ids("a red fox", (768, 768))
    assert ids[0] == EOS  # the tokenizer has no BOS token: prompts start with its EOS, as officially
    text = model.tokenizer.decode(ids[1:-4])
    assert text == "Generate an image of 768x768 according to the following prompt:\na red fox"
    assert ids[-4:] == [END_OF_TURN, IMAGE_START, 151700 + 24, 151700 + 24]
    assert model.image_prefix((1536, 384)) == [IMAGE_START, 151700 + 12, 151700 + 48]  # height first
    assert model.unconditional_ids((768, 768)) == [IMAGE_START, 151724, 151724]
    assert model.row_end_id == ROW_END and model.image_end_id == IMAGE_END
    assert torch.equal(model.code_ids.cpu(), LUMINA2_CODE_OFFSET + torch.arange(LUMINA2_CODES))


def test_punctuation_and_emoji_are_read_as_a_prompt(model):
    fc.check_text_without_letters_is_read_as_a_prompt(model, GenerationRequest(prompt="a fox"))


def test_official_resolutions_eight_pixels_per_code(model, folder):
    sizes = model.supported_resolutions()
    assert sizes[0] == (768, 768) and len(sizes) == 73 and (1536, 384) in sizes and (384, 1536) in sizes
    assert lumina2.resolutions_on_disk(folder) == sizes
    assert model.grid_for(None) == (96, 96) and model.grid_for((1536, 384)) == (48, 192)
    with pytest.raises(ValueError, match=r"1024x1024 is not supported by lumina-mgpt-2: use one of 768x768, "):
        model.grid_for((1024, 1024))


def test_only_image_codes_are_scored(model, stock):
    """The session's logits are the stock head's rows of the code tokens and nothing else."""
    hidden = torch.randn(1, 3, 32)
    with torch.no_grad():
        ours = model.parts().code_logits(hidden)
        full = stock.lm_head(hidden)
    assert ours.shape == (1, 3, LUMINA2_CODES)
    torch.testing.assert_close(ours, full[..., LUMINA2_CODE_OFFSET:LUMINA2_CODE_OFFSET + LUMINA2_CODES])


def test_layout_without_code_names_uses_the_official_offset():
    vocab = {k: v for k, v in LUMINA2_SPECIAL.items()}
    layout = read_layout(vocab, EOS, 171384, 16384, [(768, 768)])
    assert int(layout.code_ids[0]) == 155000 and int(layout.code_ids[-1]) == 171383
    with pytest.raises(ValueError, match="cannot hold 16384 codes from id 155000"):
        read_layout(vocab, EOS, 160000, 16384, [(768, 768)])
    named = vocab | {f"<MOVQGAN_{k}>": 155000 + k for k in range(10)}
    with pytest.raises(ValueError, match="names 10 <MOVQGAN...> code tokens, the MoVQGAN decoder has 16384"):
        read_layout(named, EOS, 171384, 16384, [(768, 768)])
    with pytest.raises(ValueError, match="lacks '<reserved08824>'"):
        read_layout({k: v for k, v in vocab.items() if k != "<reserved08824>"}, EOS, 171384, 16384, [(768, 768)])


def test_vocabulary_is_checked_before_any_weights_load(tmp_path, folder, monkeypatch):
    broken = tmp_path / folder.name
    shutil.copytree(folder, broken)
    tokenizer = json.loads((broken / "tokenizer.json").read_text())
    tokenizer["added_tokens"] = [t for t in tokenizer["added_tokens"] if t["content"] != "<reserved08799>"]
    del tokenizer["model"]["vocab"]["<reserved08799>"]
    (broken / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = json.loads((broken / "config.json").read_text())
    del config["vocabulary_map"]["<reserved08799>"]
    (broken / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(lumina2, "load_transformers_model",
                        lambda *a, **k: pytest.fail("weights loaded before the vocabulary was checked"))
    with pytest.raises(ValueError, match="lacks '<reserved08799>'"):
        load_model(broken)


def test_missing_decoder_names_the_places(tmp_path, folder):
    bare = tmp_path / folder.name
    shutil.copytree(folder, bare)
    (bare / "movqgan_270M.ckpt").unlink()
    with pytest.raises(FileNotFoundError) as err:
        load_model(bare)
    for place in lumina2.MOVQGAN_PLACES:
        assert str((bare / place).resolve()) in str(err.value)
    (tmp_path / "movqgan" / "270M").mkdir(parents=True)  # the repository's layout, beside the model
    shutil.copy(folder / "movqgan_270M.ckpt", tmp_path / "movqgan" / "270M" / "movqgan_270M.ckpt")
    assert load_model(bare).family == "lumina-mgpt-2"


def test_q_k_norms_expanded_per_head(model, stock):
    ours = model.model.model.layers[0].self_attn.q_norm.weight
    assert ours.shape == (4, 8)
    torch.testing.assert_close(ours, stock.model.layers[0].self_attn.q_norm.weight)
    torch.testing.assert_close(ours[0], ours[1])  # heads 0 and 1 share model-parallel shard 0
    assert model.model.model.vqmodel is None  # the unused VQ encoder is not built


# ----------------------------------------------------------------------------- guidance schedule
# The official sampler's scale of each code, from lumina_mgpt/inference_solver.py of
# Alpha-VLLM/Lumina-mGPT-2.0 (commit f44a4d7),
# LLMImageStartTriggeredUnbatchedClassifierFreeGuidanceLogitsProcessor.__call__: at every token
# sampled after the image start once n >= 2 tokens follow it (n counts the two size tokens, the
# codes and the row ends), a scale of exactly 1.0 stays off, else
#     scale = max(4.0, scale * (1 - n / (h_latent_dim * w_latent_dim)))
# with h_latent_dim, w_latent_dim = 2 * (H/32), 2 * (W/32) read from the size tokens. The numbers
# were derived from that rule in exact rational arithmetic (code k in rows of w codes is sampled
# at n = 2 + k + k // w), not by this pack's function.
OFFICIAL_SCALES = {  # (guidance, grid height, grid width) -> {code index: scale}
    (1.0, 96, 96): {0: 1.0, 1: 1.0, 9215: 1.0},  # exactly 1: never guided
    (2.0, 96, 96): {0: 4.0, 1: 4.0, 500: 4.0, 9215: 4.0},  # below 4: 4 from the first code on
    (0.0, 96, 96): {0: 4.0, 9215: 4.0},
    (4.0, 96, 96): {0: 4.0, 5: 4.0, 9215: 4.0},
    (7.0, 96, 96): {0: 6.993923611111111, 1: 6.984816939742477, 2: 6.972690521444313,
                    10: 6.7695100563708595, 30: 5.562748981722934, 48: 4.0103192439748305,
                    49: 4.0, 95: 4.0, 96: 4.0, 9215: 4.0},  # 768 x 768 px
    # 384 x 1536 px, rows of 48 codes: the row end after code 47 (n = 50) counts, so code 48
    # (n = 51) is at 4 (it would be 4.0103... were row ends not counted)
    (7.0, 192, 48): {0: 6.993923611111111, 46: 4.1883545467971, 47: 4.099279298189002, 48: 4.0,
                     9215: 4.0},
}


@pytest.mark.parametrize("key", list(OFFICIAL_SCALES), ids=str)
def test_guidance_schedule_equals_the_official_samplers(key):
    guidance, height, width = key
    official = OFFICIAL_SCALES[key]
    scales = lumina_mgpt_2_scales(guidance, height, width)
    assert len(scales) == height * width
    assert {k: scales[k] for k in official} == pytest.approx(official, rel=1e-12, abs=0)
    assert all(a >= b for a, b in zip(scales, scales[1:]))  # it never rises
    # the engine's table: float32 of the same numbers, or the one number of a flat schedule
    settings = SamplingSettings(guidance=guidance, guidance_schedule="lumina-mgpt-2")
    table = SlotGuidance(settings, height, width, torch.device("cpu"))
    slots = torch.tensor([list(official)] * 2)  # two batch rows
    got = table.at(slots)
    if guidance == 7.0:
        want = torch.tensor(list(official.values()), dtype=torch.float32)
        assert got.shape == (2, len(official), 1) and got.dtype == torch.float32
        assert torch.equal(got[..., 0], want.expand(2, -1))
        assert torch.equal(table.after(slots - 1), got)  # a node's output is the next slot's
    else:
        assert got == official[0] and table.after(slots - 1) == official[0]


def test_official_recipe_guides_with_the_schedule_and_constant_stays_constant():
    settings = SamplingSettings.of_recipe(lumina2.RECIPES["official"])
    assert settings.guidance_schedule == "lumina-mgpt-2"
    assert SlotGuidance(settings, 96, 96, torch.device("cpu")).constant == 4.0  # 4 is flat
    for guidance in (2.0, 7.0):
        constant = SlotGuidance(SamplingSettings(guidance=guidance), 96, 96, torch.device("cpu"))
        assert constant.constant == guidance and constant.table is None
    with pytest.raises(ValueError) as error:
        SamplingSettings(guidance=7.0, guidance_schedule="lumina")
    assert str(error.value) == ("guidance_schedule='lumina' is not allowed: guidance_schedule "
                                "must be one of ('constant', 'lumina-mgpt-2').")


# ----------------------------------------------------------------------------- session exactness
def test_window_tree_keep_and_guidance_match_the_stock_model(model, stock):
    request = GenerationRequest(prompt="a red fox")
    reference = make_reference(stock, model, request)
    fc.check_window_equals_stepwise(model, request, reference, CODES[:100])  # crosses a row end
    fc.check_tree_equals_branches(model, request, reference, CODES, start=94)
    fc.check_keep_path_then_continue(model, request, reference, CODES)
    guided = GenerationRequest(prompt="a red fox", guidance=4.0, batch_size=2)
    fc.check_batched_guidance(model, guided, make_reference(stock, model, guided), [CODES[:40], CODES[50:90]])


def test_non_square_size_rows(small, stock):
    request = GenerationRequest(prompt="a fox", resolution=(128, 32))  # 4 x 16 codes
    assert small.grid_for((128, 32)) == (4, 16)
    fc.check_window_equals_stepwise(small, request, make_reference(stock, small, request), CODES[:40])


def test_greedy_codes_identical_in_every_lossless_mode(small):
    request = GenerationRequest(prompt="a red fox", batch_size=2)
    forwards = fc.check_greedy_modes_agree(small, request, guidance=4.0)
    assert forwards["ar"] == 64
    # the official schedule from 30 falls to 4 over the first five codes of this 8 x 8 grid, so
    # a window or tree node given the scale of another slot would change greedy codes
    # (L = 8 * 8 / 4 = 16: the fifth code, n = 6, has 30 * 14/16 * 13/16 * 12/16 * 11/16 * 10/16)
    assert lumina_mgpt_2_scales(30.0, 8, 8)[4:6] == [30 * 14 * 13 * 12 * 11 * 10 / 16**5, 4.0]
    fc.check_greedy_modes_agree(small, request, guidance=30.0, guidance_schedule="lumina-mgpt-2")
    fc.check_relaxed_modes_run(small, GenerationRequest(prompt="a red fox"), guidance=4.0)


# ----------------------------------------------------------------------------- MoVQGAN decoder
def reference_movq_decode(state: dict, codes: torch.Tensor) -> torch.Tensor:
    """MoVQGAN's decoder from its published architecture: codebook lookup ``zq``, post-quant conv,
    conv in, middle (resnet, attention, resnet), levels from the coarsest (resnets, attention at the
    coarsest, nearest 2x upsample + conv), then norm, swish, conv out; every GroupNorm(32, eps 1e-6)
    is followed by ``* conv_y(zq) + conv_b(zq)`` with ``zq`` resized (nearest) to the features."""
    F = torch.nn.functional
    zq = state["quantize.embedding.weight"][codes].permute(0, 3, 1, 2)

    def conv(x, name):
        w = state[name + ".weight"]
        return F.conv2d(x, w, state[name + ".bias"], padding=w.shape[-1] // 2)

    def norm(x, name):
        q = F.interpolate(zq, size=x.shape[-2:], mode="nearest")
        x = F.group_norm(x, 32, state[name + ".norm_layer.weight"], state[name + ".norm_layer.bias"], eps=1e-6)
        return x * conv(q, name + ".conv_y") + conv(q, name + ".conv_b")

    def swish(x):
        return x * torch.sigmoid(x)

    def resnet(x, name):
        h = conv(swish(norm(x, name + ".norm1")), name + ".conv1")
        h = conv(swish(norm(h, name + ".norm2")), name + ".conv2")
        return (conv(x, name + ".nin_shortcut") if name + ".nin_shortcut.weight" in state else x) + h

    def attention(x, name):
        b, c, hgt, wid = x.shape
        h = norm(x, name + ".norm")
        q, k, v = (conv(h, f"{name}.{p}").reshape(b, c, hgt * wid) for p in "qkv")
        weights = torch.softmax(q.transpose(1, 2) @ k / math.sqrt(c), dim=-1)
        return x + conv((v @ weights.transpose(1, 2)).reshape(b, c, hgt, wid), name + ".proj_out")

    x = conv(conv(zq, "post_quant_conv"), "decoder.conv_in")
    x = resnet(attention(resnet(x, "decoder.mid.block_1"), "decoder.mid.attn_1"), "decoder.mid.block_2")
    levels = sorted({int(k.split(".")[2]) for k in state if k.startswith("decoder.up.")}, reverse=True)
    for level in levels:
        block = f"decoder.up.{level}"
        for j in sorted({int(k.split(".")[4]) for k in state if k.startswith(block + ".block.")}):
            x = resnet(x, f"{block}.block.{j}")
            if f"{block}.attn.{j}.q.weight" in state:
                x = attention(x, f"{block}.attn.{j}")
        if f"{block}.upsample.conv.weight" in state:
            x = conv(F.interpolate(x, scale_factor=2.0, mode="nearest"), f"{block}.upsample.conv")
    return conv(swish(norm(x, "decoder.norm_out")), "decoder.conv_out")


def test_decoder_matches_the_published_architecture(small, folder):
    state = torch.load(folder / "movqgan_270M.ckpt", weights_only=True)
    codes = torch.randint(0, LUMINA2_CODES, (2, 4, 6), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ours = small.vqgan(codes)
        reference = reference_movq_decode(state, codes)
    assert ours.shape == reference.shape == (2, 3, 8, 12)  # two levels: 2 pixels per code
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)
    fc.check_decode(small, (8, 8), (16, 16))
    assert small.codebook_embeddings().shape == (LUMINA2_CODES, 4)


def test_release_decoder_shapes_give_eight_pixels_per_code():
    from sjd_core.models.movqgan import MoVQConfig, MoVQDecoder

    with torch.device("meta"):  # the 270M release: 16384 x 4 codebook, channels 256 x (1, 2, 2, 4)
        decoder = MoVQDecoder(MoVQConfig())
        pixels = decoder(torch.zeros(1, 3, 5, dtype=torch.long))
    assert pixels.shape == (1, 3, 24, 40)
    shapes = {k: tuple(v.shape) for k, v in decoder.state_dict().items()}
    assert MoVQConfig.from_shapes(shapes, "release") == MoVQConfig()
    assert shapes["decoder.up.3.attn.2.q.weight"] == (1024, 1024, 1, 1)
    assert "decoder.up.2.attn.0.q.weight" not in shapes and "decoder.up.0.upsample.conv.weight" not in shapes


def test_decoder_checkpoint_is_read_weights_only_and_converts(tmp_path, folder, small):
    from sjd_core.models.movqgan import main

    out = tmp_path / "movqgan_270M.safetensors"
    main([str(folder / "movqgan_270M.ckpt"), str(out)])
    converted = tmp_path / "converted"
    shutil.copytree(folder, converted)
    (converted / "movqgan_270M.ckpt").unlink()
    shutil.copy(out, converted / out.name)
    codes = torch.randint(0, LUMINA2_CODES, (1, 8, 8), generator=torch.Generator().manual_seed(1))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lumina2, "TRAINED_SIZE", SMALL)
        torch.testing.assert_close(load_model(converted).decode(codes), small.decode(codes))

    class Executable:
        def __reduce__(self):
            return (print, ("this must never run",))

    torch.save({"state_dict": Executable()}, converted / "movqgan_270M.ckpt")
    (converted / out.name).unlink()
    with pytest.raises(ValueError, match="weights-only"):
        load_model(converted)
