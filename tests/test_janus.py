"""Janus-Pro adapter on a tiny random checkpoint in the deepseek-community layout, loaded by load_model."""

import shutil

import pytest
import torch

from tests import family_checks as fc
from sjd_core.models import janus
from sjd_core.models.registry import load_model
from sjd_core.models.protocol import GenerationRequest
from tests.tiny_checkpoints import write_janus

GRID = (4, 4)
CODES = [5, 17, 63, 0, 22, 9, 41, 30, 2, 11, 58, 7, 36, 19, 50, 3]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_janus(tmp_path_factory.mktemp("janus") / "Janus-Pro-1B")


@pytest.fixture(scope="module")
def model(folder):
    torch.set_num_threads(1)
    return load_model(folder)


def request(guidance: float = 1.0, batch: int = 1) -> GenerationRequest:
    return GenerationRequest(prompt="a cat", guidance=guidance, batch_size=batch)


def make_reference(model):
    """Generation-head logits of one plain forward: prompt embeddings, then image-code embeddings."""
    lm, head = model.model.model.language_model, model.model.model.generation_head
    ids = model.prompt_ids("a cat")
    prompts = {"cond": ids, "uncond": model.unconditional_ids(ids)}

    @torch.no_grad()
    def reference(codes, row):
        text = lm.get_input_embeddings()(torch.tensor([prompts[row]]))
        image = model.model.prepare_embeddings_for_image_generation(torch.tensor([codes]))
        hidden = lm(inputs_embeds=torch.cat([text, image], dim=1)).last_hidden_state[0]
        return head(hidden)[fc.output_positions(len(prompts[row]), len(codes), GRID[1], False)]

    return reference


def test_prompt_and_guidance_rows_follow_the_recipe(model):
    ids = model.prompt_ids("a cat")
    assert ids[0] == 100000 and ids[-1] == 100016  # BOS, <begin_of_image>
    assert model.tokenizer.decode(ids[1:-1]) == "<|User|>: a cat\n\n<|Assistant|>:"
    assert model.unconditional_ids(ids) == [100000] + [100015] * (len(ids) - 2) + [100016]
    assert model.defaults.guidance == 5.0 and model.defaults.top_k == 0 and model.defaults.temperature == 1.0
    assert model.defaults is next(iter(model.recipes.values())) and "Janus" in model.defaults.source
    assert model.parts().row_end_id is None


def test_punctuation_and_emoji_are_read_as_a_prompt(model):
    fc.check_text_without_letters_is_read_as_a_prompt(model, request())


def test_window_equals_stepwise(model):
    fc.check_window_equals_stepwise(model, request(), make_reference(model), CODES[:11])


def test_tree_equals_each_branch(model):
    fc.check_tree_equals_branches(model, request(), make_reference(model), CODES, start=2)


def test_keep_path_then_continue_equals_fresh_forward(model):
    fc.check_keep_path_then_continue(model, request(), make_reference(model), CODES)


def test_batched_guidance_equals_separate_forwards(model):
    fc.check_batched_guidance(model, request(5.0, batch=2), make_reference(model), [CODES[:9], CODES[7:]])


def test_retained_rows_and_a_thrown_away_probe(model):
    fc.check_retain_and_probe(model, request(5.0, batch=3), CODES)


def test_greedy_codes_identical_in_every_lossless_mode(model):
    forwards = fc.check_greedy_modes_agree(model, request(batch=2), guidance=5.0)
    assert forwards["ar"] == 16


def test_relaxed_modes_run_on_the_codebook(model):
    fc.check_relaxed_modes_run(model, request(), guidance=5.0)


def test_resolution_and_decode(model):
    assert model.supported_resolutions() == [(8, 8)]  # the real checkpoint: [(384, 384)], 24 x 24
    fc.check_decode(model, GRID, (8, 8))
    with pytest.raises(ValueError, match=r"resolution=512x512 is not supported by Janus-Pro: use one of 8x8"):
        model.start(GenerationRequest(prompt="x", resolution=(512, 512)))
    with pytest.raises(ValueError, match="decodes only 4x4"):
        model.decode(torch.zeros(1, 2, 8, dtype=torch.long))


def test_real_size_layout():
    """Janus-Pro's real configuration (built on the meta device): 384 px, 24 x 24 codes of 16384."""
    from transformers import JanusConfig, JanusForConditionalGeneration

    with torch.device("meta"):
        real = JanusForConditionalGeneration(JanusConfig())
    adapter = janus.JanusModel(real, tokenizer=None, bos_id=100000, image_start_id=100016, pad_id=100015)
    assert adapter.supported_resolutions() == [(384, 384)] and adapter.grid_for(None) == (24, 24)
    assert adapter.codebook_size == 16384


def test_bad_checkpoints_are_refused_before_loading(folder, tmp_path):
    broken = tmp_path / "no-tokenizer"
    shutil.copytree(folder, broken)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (broken / name).unlink()
    with pytest.raises(FileNotFoundError, match="has no tokenizer"):
        load_model(broken)

    truncated = tmp_path / "truncated"
    shutil.copytree(folder, truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    with pytest.raises(ValueError, match="damaged or truncated"):
        load_model(truncated)


def test_detects_only_janus_configs(folder, tmp_path):
    assert janus.detect(folder)
    assert not janus.detect(tmp_path)
