"""LlamaGen on a stock LlamaForCausalLM, proven against LlamaGen's GPT written from its equations.

The reference below is written in this test from the published model description (RMSNorm
pre-norm blocks, SwiGLU feed-forward, causal attention with rotary pairs (2j, 2j+1) turned by 2D
angles, the conditioning positions' rotation table being all zeros), with the checkpoint's own
fused ``wqkv`` weight and complex-number rotation; it shares no code with the adapter.
"""

import dataclasses
import math
import shutil

import pytest
import torch

from tests import family_checks as fc
from sjd_core.models import llamagen, llamagen_modules
from sjd_core.models.llamagen_checkpoint import (build_gpt, infer_spec,
                                                 read_state_dict, shapes_of, _main)
from sjd_core.models.registry import load_model
from sjd_core.models.protocol import GenerationRequest
from sjd_core.decoding.engine import generate
from sjd_core.decoding.settings import AccelerationSettings, SamplingSettings
from sjd_core.decoding.trace import summary_text
from tests.tiny_checkpoints import llamagen_gpt_state, write_llamagen

GRID = (4, 4)
CODES = [5, 17, 63, 0, 22, 9, 41, 30, 2, 11, 58, 7, 36, 19, 50, 3]
HEADS = 4


# ----------------------------------------------------------------------------- the reference
def reference_forward(state: dict, n_head: int, cond: torch.Tensor, codes: list[int], grid: int,
                      cond_valid: torch.Tensor | None = None, base: float = 10000.0) -> torch.Tensor:
    """LlamaGen GPT logits (float64) for conditioning embeddings ``cond`` (T, dim) then ``codes``.

    ``cond_valid`` (T,) marks conditioning tokens that may be attended (LlamaGen's caption mask;
    every token still attends to itself).
    """
    s = {k: v.double() for k, v in state.items()}
    dim = s["tok_embeddings.weight"].shape[1]
    hd = dim // n_head
    n_kv = (s["layers.0.attention.wqkv.weight"].shape[0] - dim) // (2 * hd)
    t_cond = cond.shape[0]
    x = torch.cat([cond.double(), s["tok_embeddings.weight"][torch.tensor(codes, dtype=torch.long)]])
    n = x.shape[0]

    # rotation of pair j at each position: image slot k = (r, c) turns the first half of the pairs
    # by r * f_j and the second half by c * f_j, f_j = base^(-2j / (hd / 2)); conditioning: zero
    half = hd // 2
    freqs = torch.tensor([base ** (-(2 * j) / half) for j in range(half // 2)], dtype=torch.float64)
    angles = torch.zeros(n, half, dtype=torch.float64)
    for p in range(t_cond, n):
        r, c = divmod(p - t_cond, grid)
        angles[p] = torch.cat([r * freqs, c * freqs])
    rotation = torch.polar(torch.ones_like(angles), angles)
    rotation[:t_cond] = 0

    visible = torch.tril(torch.ones(n, n, dtype=torch.bool))
    if cond_valid is not None:
        keys = torch.ones(n, dtype=torch.bool)
        keys[:t_cond] = cond_valid
        visible &= keys[None, :]
        visible |= torch.eye(n, dtype=torch.bool)

    def rms(v, w):
        return v / torch.sqrt((v * v).mean(-1, keepdim=True) + 1e-5) * w

    def rotate(t):  # (n, heads, hd): consecutive pairs as complex numbers
        z = torch.view_as_complex(t.reshape(n, t.shape[1], half, 2).contiguous())
        return torch.view_as_real(z * rotation[:, None, :]).reshape(t.shape)

    layers = len({k.split(".")[1] for k in s if k.startswith("layers.")})
    for i in range(layers):
        p = f"layers.{i}."
        y = rms(x, s[p + "attention_norm.weight"])
        q, k, v = (y @ s[p + "attention.wqkv.weight"].T).split([dim, n_kv * hd, n_kv * hd], -1)
        q, k, v = q.reshape(n, n_head, hd), k.reshape(n, n_kv, hd), v.reshape(n, n_kv, hd)
        q, k = rotate(q), rotate(k)
        k, v = k.repeat_interleave(n_head // n_kv, 1), v.repeat_interleave(n_head // n_kv, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
        weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        attended = torch.einsum("hqk,khd->qhd", weights, v).reshape(n, dim)
        x = x + attended @ s[p + "attention.wo.weight"].T
        z = rms(x, s[p + "ffn_norm.weight"])
        gate = torch.nn.functional.silu(z @ s[p + "feed_forward.w1.weight"].T)
        x = x + (gate * (z @ s[p + "feed_forward.w3.weight"].T)) @ s[p + "feed_forward.w2.weight"].T
    return rms(x, s["norm.weight"]) @ s["output.weight"].T


def caption_projection(state, captions):
    h = captions.double() @ state["cls_embedding.cap_proj.fc1.weight"].double().T
    h = torch.nn.functional.gelu(h, approximate="tanh")
    return h @ state["cls_embedding.cap_proj.fc2.weight"].double().T


def gpt_state(folder, kind):
    return read_state_dict(folder / f"{kind}_tiny_8.pt")


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def c2i_folder(tmp_path_factory):
    return write_llamagen(tmp_path_factory.mktemp("llamagen") / "c2i", "c2i")


@pytest.fixture(scope="module")
def t2i_folder(tmp_path_factory):
    return write_llamagen(tmp_path_factory.mktemp("llamagen") / "t2i", "t2i")


@pytest.fixture(scope="module")
def c2i(c2i_folder):
    torch.set_num_threads(1)
    return load_model(c2i_folder)


@pytest.fixture(scope="module")
def t2i(t2i_folder):
    return load_model(t2i_folder)


CLASS = 8  # "hen" in the tiny class list
CAPTION = torch.randn(5, 16, generator=torch.Generator().manual_seed(1))  # 5 valid T5 tokens


def c2i_reference(model, folder):
    state = gpt_state(folder, "c2i")
    table = state["cls_embedding.embedding_table.weight"]

    def reference(codes, row):
        label = CLASS if row == "cond" else model.spec.num_classes
        logits = reference_forward(state, HEADS, table[label][None], codes, GRID[1])
        return logits[fc.output_positions(1, len(codes), GRID[1], False)].float()

    return reference


def t2i_reference(model, folder, caption=CAPTION):
    """LlamaGen's own t2i layout: 8 caption slots, left-padded, padding masked; null caption alike."""
    state = gpt_state(folder, "t2i")
    slots, valid = model.spec.cond_tokens, caption.shape[0]
    mask = torch.arange(slots) >= slots - valid
    padded = torch.cat([torch.zeros(slots - valid, caption.shape[1]), caption])
    conds = {"cond": caption_projection(state, padded),
             "uncond": caption_projection(state, state["cls_embedding.uncond_embedding"])}

    def reference(codes, row):
        logits = reference_forward(state, HEADS, conds[row], codes, GRID[1], cond_valid=mask)
        return logits[fc.output_positions(slots, len(codes), GRID[1], False)].float()

    return reference


def c2i_request(guidance=1.0, batch=1):
    return GenerationRequest(prompt="hen", guidance=guidance, batch_size=batch)


def t2i_request(guidance=1.0, batch=1):
    return GenerationRequest(prompt="", guidance=guidance, batch_size=batch,
                             extra={"caption_embeddings": CAPTION})


# ----------------------------------------------------------------------------- the conversion
def test_full_forward_matches_the_reference_including_grouped_kv_heads():
    for kv in (HEADS, 2):
        state = llamagen_gpt_state("c2i", n_head=HEADS, n_kv_head=kv, seed=3)
        spec = infer_spec(shapes_of(state), 8, HEADS)
        model = build_gpt(list(state.items()), spec, GRID[1], torch.device("cpu"), torch.float32)
        cond = state["cls_embedding.embedding_table.weight"][2][None]
        x = torch.cat([cond, model.model.embed_tokens(torch.tensor(CODES))])
        with torch.no_grad():
            hidden = model.model(inputs_embeds=x[None], position_ids=torch.arange(17)[None]).last_hidden_state
            logits = model.lm_head(hidden)[0]
        torch.testing.assert_close(logits.double(), reference_forward(state, HEADS, cond, CODES, GRID[1]),
                                   atol=1e-4, rtol=1e-4)


def test_published_sizes_are_inferred_from_tensor_shapes():
    """GPT-L (c2i, 384 px) and GPT-3B (t2i) from their tensor shapes alone, as the .pt files give them."""
    def shapes(dim, layers, ffn, cond):
        out = {"tok_embeddings.weight": (16384, dim), "output.weight": (16384, dim), "norm.weight": (dim,)}
        for i in range(layers):
            out[f"layers.{i}.attention.wqkv.weight"] = (3 * dim, dim)
            out[f"layers.{i}.feed_forward.w1.weight"] = (ffn, dim)
        return out | cond

    large = infer_spec(shapes(1024, 24, 2816, {"cls_embedding.embedding_table.weight": (1001, 1024)}), 384)
    assert (large.kind, large.n_layer, large.n_head, large.n_kv_head, large.head_dim) == ("c2i", 24, 16, 16, 64)
    assert (large.num_classes, large.cond_tokens, large.intermediate) == (1000, 1, 2816)
    three_b = infer_spec(shapes(3200, 24, 8704, {"cls_embedding.cap_proj.fc1.weight": (3200, 2048),
                                                 "cls_embedding.uncond_embedding": (120, 2048)}), 512)
    assert (three_b.kind, three_b.n_head, three_b.head_dim, three_b.cond_tokens, three_b.caption_dim) == (
        "t2i", 32, 100, 120, 2048)
    table = llamagen_modules.LlamaGenRotary(grid_size=24, head_dim=64, cond_tokens=1)
    assert table.cos_table.shape == (1 + 24 * 24, 64)
    assert float(table.cos_table[0].abs().max()) == 0.0 and float(table.cos_table[1].min()) == 1.0


def test_c2i_recipe(c2i):
    assert c2i.spec.kind == "c2i" and c2i.supported_resolutions() == [(8, 8)]
    assert (c2i.defaults.guidance, c2i.defaults.top_k, c2i.defaults.temperature) == (4.0, 2000, 1.0)
    assert list(c2i.recipes) == ["sample script"]  # the tiny width is no published size
    assert "sample_c2i.py" in c2i.defaults.source
    # a published size also gets GETTING_STARTED.md's FID setting (GPT-XL: cfg 1.75, no top-k)
    xl = llamagen.llamagen_recipes(dataclasses.replace(c2i.spec, dim=1280))
    assert list(xl) == ["sample script", "FID evaluation"]
    assert (xl["FID evaluation"].guidance, xl["FID evaluation"].top_k) == (1.75, 0)
    assert c2i.class_index("hen") == 8 and c2i.class_index("Goldfish") == 1
    assert c2i.class_index("Tinca tinca") == 0 and c2i.class_index(" 3 ") == 3
    with pytest.raises(ValueError, match="class index '10' is out of range"):
        c2i.class_index("10")
    with pytest.raises(ValueError, match="nor a class name"):
        c2i.class_index("zebra")


def test_t2i_recipe(t2i):
    assert t2i.spec.kind == "t2i" and t2i.spec.cond_tokens == 8 and t2i.spec.caption_dim == 16
    assert (t2i.defaults.guidance, t2i.defaults.top_k, t2i.defaults.temperature) == (7.5, 1000, 1.0)


@pytest.mark.parametrize("kind", ["c2i", "t2i"])
def test_window_tree_keep_and_guidance_match_the_reference(kind, c2i, t2i, c2i_folder, t2i_folder):
    model = c2i if kind == "c2i" else t2i
    reference = (c2i_reference(c2i, c2i_folder) if kind == "c2i" else t2i_reference(t2i, t2i_folder))
    req = c2i_request if kind == "c2i" else t2i_request
    fc.check_window_equals_stepwise(model, req(), reference, CODES[:11])
    fc.check_tree_equals_branches(model, req(), reference, CODES, start=2)
    fc.check_keep_path_then_continue(model, req(), reference, CODES)
    fc.check_batched_guidance(model, req(4.0, batch=2), reference, [CODES[:9], CODES[7:]])
    fc.check_retain_and_probe(model, req(4.0, batch=3), CODES)


def test_per_image_captions_of_different_lengths(t2i, t2i_folder):
    """Two captions (5 and 3 valid tokens) in one batch: each row matches its own reference."""
    valid = [CAPTION, CAPTION[:3] * 2]
    captions = torch.zeros(2, 6, 16)
    captions[0, :5], captions[1, :3] = valid
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0]], dtype=torch.bool)
    req = GenerationRequest(prompt="", guidance=7.5, batch_size=2,
                            extra={"caption_embeddings": captions, "caption_mask": mask})
    session = t2i.start(req)
    cond, uncond = session.forward(torch.tensor([[0] + CODES[:5]] * 2), torch.arange(-1, 5).expand(2, 6),
                                   fc.chain(6), [0, 0])
    for b, caption in enumerate(valid):
        ref = t2i_reference(t2i, t2i_folder, caption)
        torch.testing.assert_close(cond[b], ref(CODES[:6], "cond")[:6], **fc.TOL)
        torch.testing.assert_close(uncond[b], ref(CODES[:6], "uncond")[:6], **fc.TOL)


@pytest.mark.parametrize("kind", ["c2i", "t2i"])
def test_greedy_codes_identical_in_every_lossless_mode(kind, c2i, t2i):
    model, req = (c2i, c2i_request) if kind == "c2i" else (t2i, t2i_request)
    forwards = fc.check_greedy_modes_agree(model, req(batch=2), guidance=4.0)
    assert forwards["ar"] == 16
    fc.check_relaxed_modes_run(model, req(), guidance=4.0)


def reference_vq_decode(state: dict, codes: torch.Tensor) -> torch.Tensor:
    """LlamaGen's VQ decoder from its architecture: L2-normalised codebook lookup, post-quant conv,
    a middle (resnet, attention, resnet), then per level resnets (+ attention at the lowest
    resolution) and a nearest 2x upsample + conv, GroupNorm(32) / swish / conv out."""
    F = torch.nn.functional

    def conv(x, name):
        w = state[name + ".weight"]
        return F.conv2d(x, w, state[name + ".bias"], padding=w.shape[-1] // 2)

    def norm(x, name):
        return F.group_norm(x, 32, state[name + ".weight"], state[name + ".bias"], eps=1e-6)

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
        weights = torch.softmax(q.transpose(1, 2) @ k / math.sqrt(c), dim=-1)  # (b, query, key)
        return x + conv((v @ weights.transpose(1, 2)).reshape(b, c, hgt, wid), name + ".proj_out")

    x = F.normalize(state["quantize.embedding.weight"][codes], dim=-1).permute(0, 3, 1, 2)
    x = conv(conv(x, "post_quant_conv"), "decoder.conv_in")
    x = attention(resnet(x, "decoder.mid.0"), "decoder.mid.1")
    x = resnet(x, "decoder.mid.2")
    levels = sorted({int(k.split(".")[2]) for k in state if k.startswith("decoder.conv_blocks.")})
    for n in levels:
        block = f"decoder.conv_blocks.{n}"
        blocks = sorted({int(k.split(".")[4]) for k in state if k.startswith(block + ".res.")})
        for j in blocks:
            x = resnet(x, f"{block}.res.{j}")
            if f"{block}.attn.{j}.norm.weight" in state:
                x = attention(x, f"{block}.attn.{j}")
        if f"{block}.upsample.conv.weight" in state:
            x = conv(F.interpolate(x, scale_factor=2.0, mode="nearest"), f"{block}.upsample.conv")
    return conv(swish(norm(x, "decoder.norm_out")), "decoder.conv_out")


def test_vq_in_janus_vqvae_decodes_like_llamagens_decoder(c2i, c2i_folder):
    state = read_state_dict(c2i_folder / "vq_ds16_c2i.pt")
    codes = torch.randint(0, 64, (2, 4, 4), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ours = c2i.vq.decode(codes.flatten(1))
        reference = reference_vq_decode(state, codes)
    assert ours.shape == reference.shape == (2, 3, 8, 8)
    torch.testing.assert_close(ours, reference, atol=1e-4, rtol=1e-4)


def test_decode_through_janus_vq(c2i):
    fc.check_decode(c2i, GRID, (8, 8))
    with pytest.raises(ValueError, match=r"resolution=256x256 is not supported by LlamaGen \(c2i, trained at 8 px\)"):
        c2i.start(GenerationRequest(prompt="1", resolution=(256, 256)))


def test_loads_from_the_gpt_file_path(c2i, c2i_folder):
    by_file = load_model(c2i_folder / "c2i_tiny_8.pt")
    assert by_file.spec == c2i.spec
    torch.testing.assert_close(by_file.model.lm_head.weight, c2i.model.lm_head.weight)


def test_safetensors_conversion_loads_the_same_model(c2i, c2i_folder, tmp_path):
    out = tmp_path / "converted"
    _main([str(c2i_folder / "c2i_tiny_8.pt"), str(c2i_folder / "vq_ds16_c2i.pt"), str(out)])
    assert sorted(p.name for p in out.iterdir()) == ["imagenet_classes.txt", "llamagen.json",
                                                     "model.safetensors", "vq.safetensors"]
    converted = load_model(out)
    for name, tensor in c2i.model.state_dict().items():
        torch.testing.assert_close(converted.model.state_dict()[name], tensor, atol=0, rtol=0)
    codes = torch.tensor([CODES]).reshape(1, 4, 4)
    torch.testing.assert_close(converted.decode(codes), c2i.decode(codes))


def test_layer_offloaded_to_disk_from_pt_and_from_safetensors(c2i, c2i_folder, tmp_path):
    out = tmp_path / "converted"
    _main([str(c2i_folder / "c2i_tiny_8.pt"), str(c2i_folder / "vq_ds16_c2i.pt"), str(out)])
    placement = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                 "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu", "cond_embedder": "disk"}
    for folder in (c2i_folder, out):
        fc.check_offloaded_model_agrees(c2i, load_model(folder, device_map=placement), c2i_request(), 4.0)


@pytest.fixture(scope="module")
def t2i_with_t5(t2i_folder, tmp_path_factory):
    """A t2i folder with a tiny T5 encoder in flan-t5-xl/ (words w0..w297, </s> 298 closing every
    caption as FLAN-T5's tokenizer does)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import T5Config, T5EncoderModel

    folder = tmp_path_factory.mktemp("llamagen") / "t2i"
    shutil.copytree(t2i_folder, folder)
    t5_dir = folder / "flan-t5-xl"
    torch.manual_seed(0)
    T5EncoderModel(T5Config(vocab_size=300, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2)
                   ).save_pretrained(str(t5_dir))
    words = {f"w{i}": i for i in range(298)} | {"</s>": 298, "<unk>": 299}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 298)])
    tok.save(str(t5_dir / "tokenizer.json"))
    (t5_dir / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>"}')
    return folder


def test_caption_features_from_a_local_t5_encoder(t2i_with_t5):
    from transformers import T5EncoderModel

    model = load_model(t2i_with_t5)
    features = model.caption_features(GenerationRequest(prompt="w5 w7 w11", batch_size=1))[0]
    t5 = T5EncoderModel.from_pretrained(str(t2i_with_t5 / "flan-t5-xl"))
    with torch.no_grad():
        expected = t5(input_ids=torch.tensor([[5, 7, 11, 298]])).last_hidden_state[0]
    torch.testing.assert_close(features, expected)
    # the official caption cleaning runs first: case, HTML and a URL do not reach T5
    shouted = model.caption_features(GenerationRequest(prompt="<b>W5 W7</b> W11 https://x.com/a", batch_size=1))[0]
    torch.testing.assert_close(shouted, expected)
    session = model.start(GenerationRequest(prompt="w5 w7 w11", guidance=7.5))
    assert session.guided


@pytest.mark.parametrize("prompt", [" ... ", "***", "#@&~"])
def test_a_prompt_the_caption_cleaning_empties_is_refused_before_t5_loads(t2i_with_t5, prompt):
    model = load_model(t2i_with_t5)
    sampling, settings = SamplingSettings(guidance=7.5), AccelerationSettings.preset("sjd")
    with pytest.raises(ValueError, match="is empty after LlamaGen's caption cleaning"):
        generate(model, GenerationRequest(prompt=prompt), sampling, settings, seed=2)
    assert model._t5 is None  # refused before the encoder was loaded
    empty = generate(model, GenerationRequest(prompt=""), sampling, settings, seed=2)
    assert empty.trace.summary()["unconditional"]
    assert ", unconditional (empty prompt):" in summary_text(empty.trace.summary())
    worded = generate(model, GenerationRequest(prompt="w5 w7!"), sampling, settings, seed=2)
    assert not worded.trace.summary()["unconditional"]
    assert "unconditional" not in summary_text(worded.trace.summary())


# ----------------------------------------------------------------------------- bad inputs
def test_bad_inputs_are_refused(c2i_folder, t2i, tmp_path):
    import os

    class Payload:
        def __reduce__(self):
            return (os.system, ("echo this must never run",))

    evil = tmp_path / "evil"
    shutil.copytree(c2i_folder, evil)
    state = gpt_state(c2i_folder, "c2i")
    torch.save({"model": state, "hook": Payload()}, evil / "c2i_tiny_8.pt")
    with pytest.raises(ValueError, match="holds Python objects other than tensors.*refused"):
        load_model(evil)

    truncated = tmp_path / "truncated"
    shutil.copytree(c2i_folder, truncated)
    gpt = truncated / "c2i_tiny_8.pt"
    gpt.write_bytes(gpt.read_bytes()[:4096])
    with pytest.raises(ValueError, match="truncated or damaged"):
        load_model(truncated)

    partial = tmp_path / "partial"
    shutil.copytree(c2i_folder, partial)
    torch.save({k: v for k, v in state.items() if k != "layers.1.feed_forward.w2.weight"}, partial / "c2i_tiny_8.pt")
    with pytest.raises(ValueError, match="incomplete"):
        load_model(partial)

    no_vq = tmp_path / "no-vq"
    shutil.copytree(c2i_folder, no_vq)
    (no_vq / "vq_ds16_c2i.pt").unlink()
    with pytest.raises(FileNotFoundError, match="No LlamaGen VQ tokenizer"):
        load_model(no_vq)

    unsized = tmp_path / "unsized"
    shutil.copytree(c2i_folder, unsized)
    (unsized / "c2i_tiny_8.pt").rename(unsized / "c2i_tiny.pt")
    with pytest.raises(ValueError, match="trained at is not in its name"):
        load_model(unsized)

    with pytest.raises(ValueError, match="needs FLAN-T5-XL caption features"):
        t2i.start(GenerationRequest(prompt="a cat"))
    with pytest.raises(ValueError, match=r"caption_embeddings has shape \(5, 7\)"):
        t2i.start(GenerationRequest(prompt="", extra={"caption_embeddings": torch.zeros(5, 7)}))

    assert llamagen.detect(c2i_folder / "c2i_tiny_8.pt") and not llamagen.detect(tmp_path / "nothing")
