"""Emu3-Gen adapter on a tiny random checkpoint in the BAAI/Emu3-Gen-hf layout, loaded by load_model."""

import shutil

import pytest
import torch
import torch.nn.functional as F

from tests import family_checks as fc
from sjd_core.models import emu3
from sjd_core.models.registry import load_model
from sjd_core.models.protocol import GenerationRequest
from tests.tiny_checkpoints import write_emu3

GRID = (4, 4)  # 1:1 at the tiny checkpoint's image area: 4 rows of 4 codes (+ row ends)
CODES = [5, 17, 63, 0, 22, 9, 41, 30, 2, 11, 58, 7, 36, 19, 50, 3]
NEGATIVE = "blurry"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_emu3(tmp_path_factory.mktemp("emu3") / "Emu3-Gen-hf")


@pytest.fixture(scope="module")
def model(folder):
    torch.set_num_threads(1)
    return load_model(folder)


def request(guidance: float = 1.0, batch: int = 1) -> GenerationRequest:
    return GenerationRequest(prompt="a cat", negative_prompt=NEGATIVE, guidance=guidance, batch_size=batch)


def make_reference(model):
    """Code logits of one plain forward over BOS..marker, codes, end-of-line after every row."""
    text_model, head = model.model.model.text_model, model.model.lm_head.weight
    offset, size, eol = model.code_offset, model.codebook_size, model.row_end_id
    prompts = {"cond": model.prompt_ids("a cat" + emu3.POSITIVE_SUFFIX, GRID),
               "uncond": model.prompt_ids(NEGATIVE, GRID)}

    @torch.no_grad()
    def reference(codes, row):
        ids = list(prompts[row])
        for i, code in enumerate(codes):
            ids.append(offset + code)
            if i % GRID[1] == GRID[1] - 1:
                ids.append(eol)
        hidden = text_model(input_ids=torch.tensor([ids])).last_hidden_state[0]
        logits = F.linear(hidden, head[offset:offset + size])
        return logits[fc.output_positions(len(prompts[row]), len(codes), GRID[1], True)]

    return reference


def test_prompt_and_structural_tokens_follow_the_recipe(model):
    # MODELS.md: code k = id 151854 + k; the real ids of BOS, image start, marker, end-of-line
    assert model.code_offset == 151854 and model.codebook_size == 64
    assert (model.bos_id, model.image_start_id, model.image_marker_id, model.row_end_id) == (
        151849, 151851, 151853, 151846)
    ids = model.prompt_ids("a cat" + emu3.POSITIVE_SUFFIX, GRID)
    text = model.tokenizer.decode(ids[1:-5])
    assert ids[0] == 151849 and text == "a cat masterpiece, film grained, best quality."
    assert ids[-5:] == [151851] + model.tokenizer("4*4", add_special_tokens=False)["input_ids"] + [151853]
    assert model.defaults.guidance == 3.0 and model.defaults.top_k == 2048 and model.defaults.temperature == 1.0
    assert model.defaults is next(iter(model.recipes.values())) and "Emu3" in model.defaults.source
    # the session's code embedding is the text embedding of id 151854 + k
    parts = model.parts()
    torch.testing.assert_close(parts.embed_codes(torch.tensor([3])),
                               model.model.model.text_model.embed_tokens(torch.tensor([151857])))


def test_negative_prompt_defaults_to_the_official_one(model, monkeypatch):
    seen = []
    monkeypatch.setattr(emu3, "HFSession", lambda parts, cond, uncond, grid, max_nodes:
                        seen.append((cond, uncond)))
    model.start(GenerationRequest(prompt="a cat", guidance=3.0))
    cond, uncond = seen[0]
    assert uncond[0].ids.tolist() == model.prompt_ids(emu3.NEGATIVE_PROMPT, GRID)
    assert cond[0].ids.tolist() == model.prompt_ids("a cat" + emu3.POSITIVE_SUFFIX, GRID)


def test_punctuation_and_emoji_are_read_as_a_prompt(model):
    fc.check_text_without_letters_is_read_as_a_prompt(model, request())


def test_window_equals_stepwise_across_row_ends(model):
    fc.check_window_equals_stepwise(model, request(), make_reference(model), CODES[:11])


def test_tree_equals_each_branch(model):
    fc.check_tree_equals_branches(model, request(), make_reference(model), CODES, start=2)


def test_keep_path_then_continue_equals_fresh_forward(model):
    fc.check_keep_path_then_continue(model, request(), make_reference(model), CODES)


def test_batched_guidance_equals_separate_forwards(model):
    fc.check_batched_guidance(model, request(3.0, batch=2), make_reference(model), [CODES[:9], CODES[7:]])


def test_retained_rows_and_a_thrown_away_probe(model):
    fc.check_retain_and_probe(model, request(3.0, batch=3), CODES)


def test_greedy_codes_identical_in_every_lossless_mode(model):
    forwards = fc.check_greedy_modes_agree(model, request(batch=2), guidance=3.0)
    assert forwards["ar"] == 16


def test_relaxed_modes_run_on_the_codebook(model):
    fc.check_relaxed_modes_run(model, request(), guidance=3.0)


def test_layer_offloaded_to_disk_gives_the_same_codes(folder, model):
    placement = {"model.text_model.embed_tokens": "cpu", "model.text_model.layers.0": "cpu",
                 "model.text_model.layers.1": "disk", "model.text_model.norm": "cpu",
                 "model.text_model.rotary_emb": "cpu", "model.vqmodel": "cpu", "lm_head": "disk"}
    fc.check_offloaded_model_agrees(model, load_model(folder, device_map=placement), request(), 3.0)


def test_resolutions_and_decode(model):
    assert model.supported_resolutions()[0] == (8, 8)
    assert model.grid_for((10, 6)) == (3, 5)  # 16:9 at the tiny area
    fc.check_decode(model, GRID, (8, 8))
    fc.check_decode(model, (3, 5), (10, 6))
    with pytest.raises(ValueError, match=r"resolution=720x720 is not supported by Emu3: use one of 8x8"):
        model.start(GenerationRequest(prompt="x", resolution=(720, 720)))
    with pytest.raises(ValueError, match=r"codes must lie in \[0, 64\)"):
        model.decode(torch.full((1, 4, 4), 64))


def test_real_size_layout():
    """Emu3-Gen's real configuration (built on the meta device): ids, grids and resolutions."""
    from transformers import Emu3Config, Emu3ForConditionalGeneration

    vocabulary = {f"<|visual token {k:06d}|>": 151854 + k for k in range(32768)}
    vocabulary.update({"<|extra_200|>": 151846, "<|image start|>": 151851, "<|image token|>": 151853})
    with torch.device("meta"):
        real = Emu3ForConditionalGeneration(Emu3Config(vocabulary_map=vocabulary))
    adapter = emu3.Emu3Model(real, tokenizer=None)
    assert (adapter.code_offset, adapter.codebook_size, adapter.pixels_per_code) == (151854, 32768, 8)
    assert adapter.grid_for(None) == (90, 90)
    assert adapter.supported_resolutions() == [(720, 720), (832, 624), (624, 832), (960, 544), (544, 960),
                                               (880, 584), (584, 880)]


def test_bad_checkpoints_are_refused_before_loading(folder, tmp_path):
    broken = tmp_path / "no-tokenizer"
    shutil.copytree(folder, broken)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (broken / name).unlink()
    with pytest.raises(FileNotFoundError, match="has no tokenizer"):
        load_model(broken)

    truncated = tmp_path / "truncated"
    shutil.copytree(folder, truncated)
    shard = sorted(truncated.glob("model-*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(ValueError, match="damaged or truncated"):
        load_model(truncated)

    no_weights = tmp_path / "config-only"
    no_weights.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(folder / name, no_weights / name)
    with pytest.raises(FileNotFoundError, match="No weights"):
        load_model(no_weights)
