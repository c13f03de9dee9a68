"""Lumina-mGPT and Anole adapters on tiny checkpoints written in the real layout (fp32, CPU)."""

import pytest
import torch

from sjd_core.decoding.settings import SamplingSettings
from sjd_core.models.chameleon import VQGAN_PLACES
from sjd_core.models.registry import load_model
from sjd_core.models.protocol import DecodingSession, GenerationRequest, ImageTokenModel
from tests import family_checks as fc
from tests.tiny_checkpoints import (CHAMELEON_CODES, cached_copy, chameleon_reference, write_anole,
                                    write_lumina, write_vqgan)

torch.set_num_threads(1)
WIDTH = 32  # codes per row at 512 px


@pytest.fixture(scope="module")
def lumina_dir(tmp_path_factory):
    return cached_copy(write_lumina, tmp_path_factory.mktemp("models") / "Lumina-mGPT-7B-512")


@pytest.fixture(scope="module")
def anole_dir(tmp_path_factory):
    return cached_copy(write_anole, tmp_path_factory.mktemp("models") / "Anole-7b-v0.1-hf")


@pytest.fixture(scope="module")
def lumina(lumina_dir):
    return load_model(lumina_dir)


@pytest.fixture(scope="module")
def anole(anole_dir):
    return load_model(anole_dir)


@pytest.fixture(scope="module")
def reference(lumina_dir):
    return chameleon_reference(lumina_dir)


@pytest.mark.parametrize("family", ["lumina", "anole"])
def test_punctuation_and_emoji_are_read_as_a_prompt(family, request):
    model = request.getfixturevalue(family)
    fc.check_text_without_letters_is_read_as_a_prompt(model, GenerationRequest(prompt="a fox"))


def chain(t: int) -> torch.Tensor:
    return torch.tril(torch.ones(t, t, dtype=torch.bool))


def image_tokens(codes: list[int], row_end: int | None) -> list[int]:
    out = []
    for i, c in enumerate(codes):
        out.append(c + 4)
        if row_end is not None and i % WIDTH == WIDTH - 1:
            out.append(row_end)
    return out


@torch.no_grad()
def reference_logits(ref, context: list[int], codes: list[int], row_end: int | None = 8803) -> torch.Tensor:
    """Code logits after the slot -1 token and after each code, from one plain causal forward."""
    ids = context + image_tokens(codes, row_end)
    hidden = ref.model(input_ids=torch.tensor([ids])).last_hidden_state
    logits = ref.lm_head(hidden)[0, :, 4:4 + CHAMELEON_CODES]
    outs, pos = [len(context) - 1], len(context) - 1
    for i in range(len(codes)):
        pos += 1 + (row_end is not None and i % WIDTH == WIDTH - 1)
        outs.append(pos)
    return logits[outs]


CODES = torch.randint(0, CHAMELEON_CODES, (80,), generator=torch.Generator().manual_seed(3)).tolist()


# ----------------------------------------------------------------------------- recipe
def test_lumina_prompt_and_structural_tokens(lumina):
    assert isinstance(lumina, ImageTokenModel)
    assert isinstance(lumina.start(GenerationRequest(prompt="x")), DecodingSession)
    ids = lumina.prompt_ids("a red fox", (512, 512))
    assert ids[0] == 0  # BOS
    assert ids[-4:] == [8710, 8197, 8804 + 16, 8804 + 16]  # end of turn, image start, h, w
    text = lumina.tokenizer.decode(ids[1:-4])
    assert text == "Generate an image of 512x512 according to the following prompt:\na red fox"
    assert lumina.image_prefix((512, 512)) == [8197, 8820, 8820]
    assert lumina.image_prefix((1024, 768)) == [8197, 8804 + 24, 8804 + 32]  # (w, h): h first
    assert lumina.row_end_id == 8803 and lumina.image_end_id == 8196
    assert torch.equal(lumina.code_ids.cpu(), torch.arange(CHAMELEON_CODES) + 4)  # code = id - 4
    assert lumina.defaults.guidance == 3.0 and lumina.defaults.top_k == 2000
    assert lumina.defaults.temperature == 1.0
    recipes = {name: (r.guidance, r.top_k, r.temperature) for name, r in lumina.recipes.items()}
    assert recipes == {"inference solver": (3.0, 2000, 1.0), "README example": (4.0, 2000, 1.0),
                       "gradio demo": (3.0, 4000, 1.0)}
    assert lumina.defaults is next(iter(lumina.recipes.values()))
    assert all("Lumina-mGPT" in r.source for r in lumina.recipes.values())
    assert lumina.supported_resolutions()[0] == (512, 512)  # the checkpoint's trained size first
    assert lumina.grid_for((1024, 256)) == (16, 64)
    assert lumina.image_prefix((1024, 256)) == [8197, 8804 + 8, 8804 + 32]


# The output of generate_crop_size_list((512 // 32) ** 2, 32) from Alpha-VLLM/Lumina-mGPT,
# lumina_mgpt/data/item_processor.py: the resolution choices of lumina_mgpt/demos/
# demo_image_generation.py for --target_size 512 (run on the official function).
OFFICIAL_512 = (
    "1024x256 992x256 960x256 928x256 896x256 896x288 864x288 832x288 800x288 800x320 768x320 "
    "736x320 736x352 704x352 672x352 672x384 640x384 608x384 608x416 576x416 576x448 544x448 "
    "544x480 512x480 512x512 480x512 480x544 448x544 448x576 416x576 416x608 384x608 384x640 "
    "384x672 352x672 352x704 352x736 320x736 320x768 320x800 288x800 288x832 288x864 288x896 "
    "256x896 256x928 256x960 256x992 256x1024").split()


def test_lumina_offers_the_official_demo_resolutions(lumina):
    from sjd_core.models.chameleon import lumina_resolutions

    offered = [f"{w}x{h}" for w, h in lumina.supported_resolutions()]
    assert offered == ["512x512"] + [size for size in OFFICIAL_512 if size != "512x512"]
    # counts of the official lists at the other trained sizes (73 and 97 entries), square first
    for trained, count, widest in ((768, 73, (1536, 384)), (1024, 97, (2048, 512))):
        sizes = lumina_resolutions(trained)
        assert len(sizes) == count and sizes[0] == (trained, trained) and sizes[1] == widest
        assert len(set(sizes)) == count


def test_anole_prompt_and_layout(anole):
    ids = anole.prompt_ids("a red fox", (512, 512))
    assert ids[0] == 0 and ids[-1] == 8197
    assert anole.tokenizer.decode(ids[1:-2]) == "a red fox"
    assert anole.image_prefix((512, 512)) == [8197]
    assert ids[-2:] == [8710, 8197]  # end of turn, image start (Anole's inference code)
    assert anole.unconditional_ids((512, 512)) == [0, 8197]
    assert anole.row_end_id is None
    assert anole.supported_resolutions() == [(512, 512)]
    assert anole.grid_for(None) == (32, 32)


def test_unsupported_resolution_lists_supported(lumina, anole):
    with pytest.raises(ValueError, match=r"640x480 .*use one of 512x512, 1024x256, 992x256, .* 256x1024 "):
        lumina.grid_for((640, 480))
    with pytest.raises(ValueError, match=r"768x768 is not supported by lumina-mgpt"):
        lumina.grid_for((768, 768))  # another checkpoint's trained size
    with pytest.raises(ValueError, match=r"768x768 .*use one of 512x512"):
        anole.start(GenerationRequest(prompt="x", resolution=(768, 768)))


# ----------------------------------------------------------------------------- session exactness
@torch.no_grad()
def test_window_equals_stepwise_across_row_ends(lumina, reference):
    context = lumina.prompt_ids("a fox", (512, 512))
    ref = reference_logits(reference, context, CODES[:40])
    session = lumina.start(GenerationRequest(prompt="a fox"))
    slots = torch.arange(-1, 40)[None]  # crosses the row end after slot 31
    cond, uncond = session.forward(torch.tensor([[0] + CODES[:40]]), slots, chain(41), [0])
    assert uncond is None
    torch.testing.assert_close(cond[0], ref, atol=1e-4, rtol=1e-4)
    step = lumina.start(GenerationRequest(prompt="a fox"))
    one = torch.ones(1, 1, dtype=torch.bool)
    outs = []
    for s in range(-1, 40):
        out, _ = step.forward(torch.tensor([[0 if s < 0 else CODES[s]]]), torch.tensor([[s]]), chain(1), [s + 1])
        step.keep(one)
        outs.append(out[0, 0])
    torch.testing.assert_close(torch.stack(outs), cond[0], atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_tree_equals_branches_and_keep_continue(lumina, reference):
    context = lumina.prompt_ids("a fox", (512, 512))
    session = lumina.start(GenerationRequest(prompt="a fox"))
    prefix = CODES[:30]
    session.forward(torch.tensor([[0] + prefix]), torch.arange(-1, 30)[None], chain(31), [0])
    session.keep(torch.ones(1, 31, dtype=torch.bool))
    # slot 30: candidates a/b; slot 31 (ends the row): children; slot 32 after the row end
    a, b, x, y, z = 7, 9, 11, 13, 15
    codes = torch.tensor([[a, b, x, y, z]])
    slots = torch.tensor([[30, 30, 31, 31, 32]])
    anc = torch.eye(5, dtype=torch.bool)
    anc[2, 0] = anc[3, 1] = anc[4, 3] = anc[4, 1] = True
    tree, _ = session.forward(codes, slots, anc, [31])
    for node, branch in {0: [a], 1: [b], 2: [a, x], 3: [b, y], 4: [b, y, z]}.items():
        want = reference_logits(reference, context, prefix + branch)[-1]
        torch.testing.assert_close(tree[0, node], want, atol=1e-4, rtol=1e-4)
    session.keep(torch.tensor([[False, True, False, True, True]]))  # accept b, y, z
    out, _ = session.forward(torch.tensor([[CODES[33], CODES[34]]]), torch.tensor([[33, 34]]), chain(2), [34])
    want = reference_logits(reference, context, prefix + [b, y, z] + CODES[33:35])[-2:]
    torch.testing.assert_close(out[0], want, atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_anole_window_tree_and_keep(anole, anole_dir):
    ref = chameleon_reference(anole_dir)
    context = anole.prompt_ids("a fox", (512, 512))
    session = anole.start(GenerationRequest(prompt="a fox", guidance=3.0))
    cond, uncond = session.forward(torch.tensor([[0] + CODES[:40]]), torch.arange(-1, 40)[None], chain(41), [0])
    torch.testing.assert_close(cond[0], reference_logits(ref, context, CODES[:40], None), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(uncond[0], reference_logits(ref, [0, 8197], CODES[:40], None), atol=1e-4, rtol=1e-4)
    session.keep(torch.arange(41)[None] < 31)  # slots -1..29 kept
    anc = torch.eye(4, dtype=torch.bool)
    anc[2, 0] = anc[3, 1] = True  # two branches of two codes from slot 30
    tree, _ = session.forward(torch.tensor([[3, 4, 5, 6]]), torch.tensor([[30, 30, 31, 31]]), anc, [31])
    for node, branch in {0: [3], 1: [4], 2: [3, 5], 3: [4, 6]}.items():
        want = reference_logits(ref, context, CODES[:30] + branch, None)[-1]
        torch.testing.assert_close(tree[0, node], want, atol=1e-4, rtol=1e-4)


@torch.no_grad()
def test_guidance_batch_equals_separate_forwards(lumina, reference):
    session = lumina.start(GenerationRequest(prompt="a fox", guidance=3.0, batch_size=2))
    codes = torch.tensor([[0] + CODES[:35], [0] + CODES[35:70]])
    cond, uncond = session.forward(codes, torch.arange(-1, 35).expand(2, -1), chain(36), [0, 0])
    context = lumina.prompt_ids("a fox", (512, 512))
    for row in range(2):
        c = codes[row, 1:].tolist()
        torch.testing.assert_close(cond[row], reference_logits(reference, context, c), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(uncond[row], reference_logits(reference, [8197, 8820, 8820], c),
                                   atol=1e-4, rtol=1e-4)


def test_retained_rows_and_a_thrown_away_probe(lumina):
    request = GenerationRequest(prompt="a fox", guidance=3.0, batch_size=3)
    fc.check_retain_and_probe(lumina, request, CODES, width=36)  # windows cross the row end after slot 31


@torch.no_grad()
def test_one_prompt_per_row(lumina, reference):
    prompts = ["a fox", "a watercolor painting of a lighthouse at dusk"]
    session = lumina.start(GenerationRequest(prompt="", batch_size=2, extra={"prompts": prompts}))
    cond, _ = session.forward(torch.tensor([[0, 7], [0, 7]]), torch.tensor([[-1, 0], [-1, 0]]), chain(2), [0, 0])
    for row, prompt in enumerate(prompts):
        want = reference_logits(reference, lumina.prompt_ids(prompt, (512, 512)), [7])
        torch.testing.assert_close(cond[row], want, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match=r"extra\['prompts'\]=.*list of 2 strings"):
        lumina.start(GenerationRequest(prompt="", batch_size=2, extra={"prompts": ["one"]}))


def test_negative_prompt_replaces_unconditional_text(lumina):
    session = lumina.start(GenerationRequest(prompt="a fox", negative_prompt="blurry", guidance=2.0))
    assert session.guided
    # the unconditional row's slot -1 position: its context minus the last token
    assert int(session.layout.start[1]) == len(lumina.prompt_ids("blurry", (512, 512))) - 1


# ----------------------------------------------------------------------------- engine
GREEDY_SLOTS = 2 * WIDTH + 8  # two row ends crossed


@pytest.mark.slow
def test_greedy_codes_identical_to_ar(lumina):
    """Every lossless mode (family_checks.LOSSLESS_MODES) matches AR on the first rows."""
    forwards = fc.check_greedy_modes_agree(lumina, GenerationRequest(prompt="a red fox"), 3.0,
                                           slots=GREEDY_SLOTS)
    assert forwards["ar"] == GREEDY_SLOTS
    assert forwards["pac+vp"] < forwards["ar"]


LONG_SLOTS = 12 * WIDTH  # 384 codes, twelve row ends


@pytest.mark.slow
def test_batch_rows_keep_their_streams_and_the_distribution_on_a_long_image(lumina):
    """Each row of a batch draws with seed + b's stream from the model's own logits: its codes
    agree with that seed alone until a ~1e-5 logit difference flips a draw, if one does."""
    sampling = SamplingSettings(guidance=3.0, temperature=1.0, top_k=0, top_p=1.0)
    request = GenerationRequest(prompt="a red fox", batch_size=2)
    rows = fc.check_batch_rows_follow_their_streams(lumina, request, sampling, seed=5,
                                                    slots=LONG_SLOTS, agreeing=2 * WIDTH)
    print(f"\nfirst differing slot and largest logit difference before it, per row: {rows}")


def test_anole_batch_greedy_identical_to_ar(anole):
    request = GenerationRequest(prompt="a red fox", batch_size=2)
    forwards = fc.check_greedy_modes_agree(anole, request, 1.0, slots=GREEDY_SLOTS)
    assert forwards["sjd"] < forwards["ar"]


def test_decode_shape_and_range(lumina):
    codes = torch.randint(0, CHAMELEON_CODES, (2, 32, 32))
    images = lumina.decode(codes)
    # the tiny VQGAN has two levels (one 2x upsample); the real one has five (16x)
    assert images.shape == (2, 64, 64, 3) and images.dtype == torch.float32
    assert float(images.min()) >= 0.0 and float(images.max()) <= 1.0
    assert float(images.std()) > 0.0
    with pytest.raises(ValueError, match="codes must lie in"):
        lumina.decode(torch.full((1, 32, 32), CHAMELEON_CODES))
    emb = lumina.codebook_embeddings()
    assert emb.shape == (CHAMELEON_CODES, 8)


# ----------------------------------------------------------------------------- bad input
def test_missing_vqgan_names_file_and_places(tmp_path):
    folder = write_lumina(tmp_path / "Lumina-mGPT-7B-768", vqgan_inside=False)
    with pytest.raises(FileNotFoundError) as err:
        load_model(folder)
    message = str(err.value)
    assert "vqgan.yaml and vqgan.ckpt" in message
    for place in VQGAN_PLACES:
        assert str((folder / place).resolve()) in message
    write_vqgan(tmp_path / "ckpts" / "chameleon" / "tokenizer")  # Lumina-mGPT's documented place
    assert load_model(folder).family == "lumina-mgpt"


def test_vqgan_checkpoint_with_code_is_refused(tmp_path, lumina_dir):
    import shutil

    folder = tmp_path / "Lumina-mGPT-7B-512"
    shutil.copytree(lumina_dir, folder)
    torch.save({"state_dict": _Executable()}, folder / "vqgan.ckpt")  # would run code if unpickled
    with pytest.raises(ValueError, match="weights-only"):
        load_model(folder)


class _Executable:
    def __reduce__(self):
        return (print, ("this must never run",))


def test_tokenizer_missing(tmp_path, anole_dir):
    import shutil

    folder = tmp_path / "anole"
    shutil.copytree(anole_dir, folder)
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer_config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no tokenizer"):
        load_model(folder)


def test_release_vqgan_config_decodes_16_pixels_per_code():
    from sjd_core.models.vqgan import VQGANConfig, VQGANDecoder

    with torch.device("meta"):  # shapes only: the release config (five levels, 8192 x 256 codebook)
        decoder = VQGANDecoder(VQGANConfig())
        pixels = decoder(torch.zeros(1, 3, 5, dtype=torch.long))
    assert pixels.shape == (1, 3, 48, 80)
    names = set(decoder.state_dict())
    assert {"decoder.up.4.upsample.conv.weight", "decoder.up.0.block.2.conv2.weight",
            "decoder.mid.attn_1.proj_out.weight", "post_quant_conv.weight"} <= names
    assert "decoder.up.0.upsample.conv.weight" not in names  # the finest level does not upsample


def test_vocabulary_without_a_needed_token_is_refused_before_loading(tmp_path, lumina_dir, monkeypatch):
    import json
    import shutil

    import sjd_core.models.chameleon as chameleon

    folder = tmp_path / lumina_dir.name
    shutil.copytree(lumina_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    del config["vocabulary_map"]["<reserved08799>"]
    (folder / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(chameleon, "load_transformers_model",
                        lambda *a, **k: pytest.fail("weights loaded before the vocabulary was checked"))
    with pytest.raises(ValueError, match="lacks '<reserved08799>'"):
        load_model(folder)
