"""Tiny randomly initialised checkpoints written to disk in each family's real layout.

Every family has its own ``write_<family>(folder)`` function below, in its own section; they share
the generic writers at the top (sharded safetensors with an index, a byte-level BPE tokenizer made
with the ``tokenizers`` library). The files are what a user downloads (config.json, weight shards,
tokenizer files, decoder files), only with tiny dimensions, so tests load them through the same
``load_model`` as real checkpoints.
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file


# =============================================================================== shared writers
def write_safetensors_shards(state: dict[str, torch.Tensor], folder: Path, shards: int = 3) -> list[Path]:
    """``model-0000i-of-0000n.safetensors`` files plus ``model.safetensors.index.json``."""
    folder.mkdir(parents=True, exist_ok=True)
    keys = sorted(state)
    names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    weight_map, files = {}, []
    for i, name in enumerate(names):
        part = {k: state[k].contiguous() for k in keys[i::shards]}
        save_file(part, str(folder / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
        files.append(folder / name)
    total = sum(t.numel() * t.element_size() for t in state.values())
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return files


def write_bpe_tokenizer(folder: Path, special_tokens: list[str], corpus: list[str], vocab_size: int,
                        bos: str, eos: str, pad: str, unk: str) -> dict[str, int]:
    """A byte-level BPE tokenizer whose first ids are ``special_tokens`` in order; returns its vocab."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
        "pad_token": pad, "unk_token": unk, "model_max_length": 4096}, indent=1))
    return tok.get_vocab()


_WRITTEN: dict[tuple, Path] = {}


def cached_copy(writer: Callable[..., Path], folder: Path, **kwargs) -> Path:
    """``writer(folder, **kwargs)``, but written once per test process and copied after that."""
    key = (writer.__name__, folder.name, tuple(sorted(kwargs.items())))
    if key not in _WRITTEN:
        store = Path(tempfile.mkdtemp(prefix="sjd-tiny-"))
        atexit.register(shutil.rmtree, store, True)
        _WRITTEN[key] = writer(store / folder.name, **kwargs)
    shutil.copytree(_WRITTEN[key], folder)
    return folder


CORPUS = ["Generate an image of 512x512 according to the following prompt:\n",
          "a red fox in the snow, a watercolor painting of a lighthouse at dusk",
          "an astronaut riding a horse, photo, masterpiece, film grained, best quality."]


# =============================================================================== Chameleon family
# Lumina-mGPT and Anole share the Chameleon vocabulary layout: ids 4.. are IMGIMG image tokens,
# 8196 <eoss>, 8197 <racm3:break>, then <reserved{id - 4:05d}> names (8710 end of turn, 8803 row
# end, 8804 + n size tokens, n up to 64 for the 2048-pixel side the 1024 checkpoint's demo offers). The tiny vocabulary keeps those ids but only CHAMELEON_CODES image
# tokens, so the engine runs fast on a CPU.
CHAMELEON_CODES = 512
CHAMELEON_TOP_ID = 8804 + 2048 // 32  # the largest size token
CHAMELEON_VOCAB = 9300


def chameleon_special_tokens() -> list[str]:
    """Names of ids 0..CHAMELEON_TOP_ID, in id order."""
    from sjd_core.models.chameleon import synthetic_vocabulary

    return list(synthetic_vocabulary(CHAMELEON_CODES, CHAMELEON_TOP_ID + 1))


def write_vqgan(folder: Path, codes: int = CHAMELEON_CODES, seed: int = 0) -> None:
    """A tiny ``vqgan.yaml`` + ``vqgan.ckpt`` pair in the layout of Meta's Chameleon release."""
    import yaml

    from sjd_core.models.vqgan import VQGANConfig, VQGANDecoder

    cfg = VQGANConfig(n_embed=codes, embed_dim=8, z_channels=8, ch=32, ch_mult=(1, 2),
                      num_res_blocks=1, attn_resolutions=(16,), resolution=32)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vqgan.yaml").write_text(yaml.safe_dump({"model": {
        "target": "taming.models.vqgan.VQModel",
        "params": {"n_embed": cfg.n_embed, "embed_dim": cfg.embed_dim, "ddconfig": {
            "double_z": False, "z_channels": cfg.z_channels, "resolution": cfg.resolution,
            "in_channels": 3, "out_ch": 3, "ch": cfg.ch, "ch_mult": list(cfg.ch_mult),
            "num_res_blocks": cfg.num_res_blocks, "attn_resolutions": list(cfg.attn_resolutions),
            "dropout": 0.0}}}}))
    torch.manual_seed(seed)
    state = dict(VQGANDecoder(cfg).state_dict())
    state["encoder.conv_in.weight"] = torch.randn(cfg.ch, 3, 3, 3)  # the encoder rides along
    torch.save({"state_dict": state, "global_step": 0}, folder / "vqgan.ckpt")


def _chameleon_model(seed: int, model_parallel_size: int):
    from transformers import ChameleonConfig, ChameleonForConditionalGeneration

    vocab = {name: i for i, name in enumerate(chameleon_special_tokens())}
    config = ChameleonConfig(
        vocab_size=CHAMELEON_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=4096,
        vocabulary_map=vocab, bos_token_id=0, eos_token_id=2, pad_token_id=1,
        model_parallel_size=model_parallel_size, initializer_range=0.5,
        vq_config={"embed_dim": 8, "num_embeddings": CHAMELEON_CODES, "latent_channels": 8,
                   "base_channels": 32, "channel_multiplier": [1, 2], "num_res_blocks": 1,
                   "attn_resolutions": [], "resolution": 32})
    torch.manual_seed(seed)
    return ChameleonForConditionalGeneration(config).eval()


def _write_chameleon(folder: Path, lumina: bool, seed: int) -> Path:
    mp = 2 if lumina else 1
    model = _chameleon_model(seed, mp)
    vocab = write_bpe_tokenizer(folder, chameleon_special_tokens(), CORPUS, CHAMELEON_VOCAB,
                                "<s>", "</s>", "<pad>", "<unk>")
    model.config.vocabulary_map = vocab
    state = model.state_dict()
    if lumina:  # Lumina-mGPT stores one q/k-norm row per model-parallel shard
        heads = model.config.num_attention_heads
        for key in [k for k in state if ".q_norm." in k or ".k_norm." in k]:
            state[key] = state[key][:: heads // mp].clone()
    if "lm_head.weight" in state and state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr():
        state["lm_head.weight"] = state["lm_head.weight"].clone()
    write_safetensors_shards(state, folder)
    config = model.config.to_dict()
    if lumina:
        config["architectures"] = ["ChameleonXLLMXForConditionalGeneration"]
        config["z_loss_weight"] = 1e-5
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def chameleon_reference(folder: Path):
    """The stock transformers model with the weights of a tiny Chameleon folder (per-head norms)."""
    from transformers import ChameleonConfig, ChameleonForConditionalGeneration
    from safetensors.torch import load_file

    config = ChameleonConfig.from_pretrained(str(folder))
    model = ChameleonForConditionalGeneration(config).eval()
    state = {}
    for f in sorted(folder.glob("model-*.safetensors")):
        state.update(load_file(str(f)))
    heads = config.num_attention_heads
    for key in [k for k in state if ".q_norm." in k or ".k_norm." in k]:
        state[key] = state[key].repeat_interleave(heads // state[key].shape[0], dim=0)
    model.load_state_dict(state)
    return model


def write_lumina(folder: Path, seed: int = 0, vqgan_inside: bool = True) -> Path:
    """A tiny Lumina-mGPT folder (with per-shard q/k norms) and its VQGAN files."""
    _write_chameleon(folder, lumina=True, seed=seed)
    if vqgan_inside:
        write_vqgan(folder)
    return folder


def write_anole(folder: Path, seed: int = 1) -> Path:
    """A tiny Anole folder (stock Chameleon layout) with its VQGAN files."""
    _write_chameleon(folder, lumina=False, seed=seed)
    write_vqgan(folder)
    return folder


# =============================================================================== Emu3, Janus-Pro, LlamaGen
def write_sparse_bpe_tokenizer(folder: Path, special: dict[str, int], config: dict) -> None:
    """A byte-level BPE tokenizer (every byte a token, ids 0..255) with special tokens at given ids.

    Unlike :func:`write_bpe_tokenizer`, the special and image tokens keep their real (sparse) ids,
    so the tests check the ids the real checkpoints use."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update(special)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", **config}, indent=1))


def _sharpen_head(weight: torch.Tensor, factor: float) -> None:
    """Scale an output head so random logits have clear maxima (greedy decoding is well defined)."""
    with torch.no_grad():
        weight.mul_(factor)


EMU3_CODES = 64
EMU3_SPECIAL = {"<|endoftext|>": 151643, "<|extra_200|>": 151846, "<|extra_201|>": 151847,
                "<|extra_203|>": 151849, "<|extra_204|>": 151850, "<|image start|>": 151851,
                "<|image end|>": 151852, "<|image token|>": 151853}


def write_emu3(folder: Path, seed: int = 0, image_area: int = 64) -> Path:
    """Tiny Emu3-Gen in the ``BAAI/Emu3-Gen-hf`` layout, with the real token ids.

    Sharded bf16 safetensors + index, config with ``vocabulary_map``, a byte-level tokenizer whose
    special and visual tokens sit at their real ids (code k = 151854 + k), preprocessor and
    processor configs (``image_area`` 64 px^2 -> a 4x4 code grid at 1:1 with the 2x VQ).
    """
    from transformers import Emu3Config, Emu3ForConditionalGeneration

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    special = dict(EMU3_SPECIAL)
    special.update({f"<|visual token {k:06d}|>": 151854 + k for k in range(EMU3_CODES)})
    torch.manual_seed(seed)
    config = Emu3Config(
        text_config=dict(vocab_size=151854 + EMU3_CODES, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512),
        vq_config=dict(codebook_size=EMU3_CODES, embed_dim=4, latent_channels=4, base_channels=32,
                       channel_multiplier=[1, 2], num_res_blocks=1, attn_resolutions=[1],
                       hidden_size=64, num_attention_heads=1),
        vocabulary_map=special)
    model = Emu3ForConditionalGeneration(config).eval()
    _sharpen_head(model.lm_head.weight, 30.0)
    model.to(torch.bfloat16).save_pretrained(str(folder), max_shard_size="4MB")
    write_sparse_bpe_tokenizer(folder, special, {"bos_token": "<|extra_203|>", "eos_token": "<|extra_204|>",
                                          "pad_token": "<|endoftext|>"})
    (folder / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "Emu3ImageProcessor", "image_mean": [0.5, 0.5, 0.5],
         "image_std": [0.5, 0.5, 0.5], "spatial_factor": 8}))
    (folder / "processor_config.json").write_text(json.dumps(
        {"processor_class": "Emu3Processor", "image_area": image_area}))
    return folder


JANUS_CODES = 64
JANUS_SPECIAL = {"<｜begin▁of▁sentence｜>": 100000, "<｜end▁of▁sentence｜>": 100001,
                 "<｜▁pad▁｜>": 100015, "<begin_of_image>": 100016, "<end_of_image>": 100017,
                 "<image_placeholder>": 100581}


def write_janus(folder: Path, seed: int = 0) -> Path:
    """Tiny Janus-Pro in the ``deepseek-community/Janus-Pro-1B`` layout, with the real token ids.

    ``model.safetensors`` (bf16), config (vision 64 px / 16 px patches -> a 4x4 grid, VQ 2x ->
    8 px images), ``generation_config.json`` with ``pad_token_id`` / ``boi_token_id`` as the
    conversion script writes them, tokenizer, preprocessor config.
    """
    from transformers import JanusConfig, JanusForConditionalGeneration

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = JanusConfig(
        text_config=dict(model_type="llama", vocab_size=102400, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=256, bos_token_id=100000, eos_token_id=100001,
                         pad_token_id=100001),
        vision_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=64,
                           patch_size=16, projection_dim=32, depth=1, mlp_ratio=2.0),
        vq_config=dict(embed_dim=8, num_embeddings=JANUS_CODES, latent_channels=32, base_channels=32,
                       channel_multiplier=[1, 2], num_res_blocks=1, projection_dim=32,
                       image_token_embed_dim=32, num_hidden_layers=2))
    model = JanusForConditionalGeneration(config).eval()
    _sharpen_head(model.model.generation_head.vision_head.weight, 300.0)
    model.generation_config.pad_token_id = JANUS_SPECIAL["<｜▁pad▁｜>"]
    model.generation_config.boi_token_id = JANUS_SPECIAL["<begin_of_image>"]
    model.generation_config.guidance_scale = 5
    model.to(torch.bfloat16).save_pretrained(str(folder))
    write_sparse_bpe_tokenizer(folder, JANUS_SPECIAL, {
        "bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>",
        "pad_token": "<｜end▁of▁sentence｜>"})
    (folder / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "JanusImageProcessor", "image_mean": [0.5, 0.5, 0.5],
         "image_std": [0.5, 0.5, 0.5]}))
    return folder


def llamagen_vq_state(base: int = 32, mult: tuple[int, ...] = (1, 2), z: int = 32, codes: int = 64,
                      code_dim: int = 8, res_blocks: int = 2, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors named and shaped as LlamaGen's ``VQModel`` state dict (from its published layout)."""
    g = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}

    def conv(name, cin, cout, k):
        sd[name + ".weight"] = torch.randn(cout, cin, k, k, generator=g) / (cin * k * k) ** 0.5
        sd[name + ".bias"] = 0.01 * torch.randn(cout, generator=g)

    def norm(name, c):
        sd[name + ".weight"] = 1 + 0.1 * torch.randn(c, generator=g)
        sd[name + ".bias"] = 0.1 * torch.randn(c, generator=g)

    def res(name, cin, cout):
        norm(name + ".norm1", cin)
        conv(name + ".conv1", cin, cout, 3)
        norm(name + ".norm2", cout)
        conv(name + ".conv2", cout, cout, 3)
        if cin != cout:
            conv(name + ".nin_shortcut", cin, cout, 1)

    def attn(name, c):
        norm(name + ".norm", c)
        for part in ("q", "k", "v", "proj_out"):
            conv(f"{name}.{part}", c, c, 1)

    last = len(mult) - 1
    conv("encoder.conv_in", 3, base, 3)
    c = base
    for i, m in enumerate(mult):
        for j in range(res_blocks):
            res(f"encoder.conv_blocks.{i}.res.{j}", c, base * m)
            c = base * m
            if i == last:
                attn(f"encoder.conv_blocks.{i}.attn.{j}", c)
        if i != last:
            conv(f"encoder.conv_blocks.{i}.downsample.conv", c, c, 3)
    for coder in ("encoder", "decoder"):
        mid = base * mult[-1]
        res(f"{coder}.mid.0", mid, mid)
        attn(f"{coder}.mid.1", mid)
        res(f"{coder}.mid.2", mid, mid)
    norm("encoder.norm_out", c)
    conv("encoder.conv_out", c, z, 3)
    c = base * mult[-1]
    conv("decoder.conv_in", z, c, 3)
    for n, i in enumerate(reversed(range(len(mult)))):
        for j in range(res_blocks + 1):
            res(f"decoder.conv_blocks.{n}.res.{j}", c, base * mult[i])
            c = base * mult[i]
            if i == last:
                attn(f"decoder.conv_blocks.{n}.attn.{j}", c)
        if i != 0:
            conv(f"decoder.conv_blocks.{n}.upsample.conv", c, c, 3)
    norm("decoder.norm_out", c)
    conv("decoder.conv_out", c, 3, 3)
    conv("quant_conv", z, code_dim, 1)
    conv("post_quant_conv", code_dim, z, 1)
    sd["quantize.embedding.weight"] = torch.randn(codes, code_dim, generator=g)
    sd["quantize.codebook_used"] = torch.zeros(65536)
    return sd


def llamagen_gpt_state(kind: str = "c2i", dim: int = 64, n_layer: int = 2, n_head: int = 4,
                       n_kv_head: int | None = None, vocab: int = 64, num_classes: int = 10,
                       caption_dim: int = 16, cond_tokens: int = 8, seed: int = 0
                       ) -> dict[str, torch.Tensor]:
    """Random tensors named and shaped as LlamaGen's GPT ``Transformer`` state dict."""
    g = torch.Generator().manual_seed(seed)
    n_kv_head = n_kv_head or n_head
    head_dim = dim // n_head
    hidden = int(2 * 4 * dim / 3)
    hidden = hidden + (-hidden) % 256  # LlamaGen's find_multiple(hidden, 256)

    def w(*shape, scale=1.0):
        return scale * torch.randn(*shape, generator=g) / shape[-1] ** 0.5

    sd = {"tok_embeddings.weight": torch.randn(vocab, dim, generator=g),
          "norm.weight": 1 + 0.1 * torch.randn(dim, generator=g),
          "output.weight": w(vocab, dim, scale=8.0)}
    for i in range(n_layer):
        p = f"layers.{i}."
        sd[p + "attention.wqkv.weight"] = w((n_head + 2 * n_kv_head) * head_dim, dim, scale=2.0)
        sd[p + "attention.wo.weight"] = w(dim, dim)
        sd[p + "feed_forward.w1.weight"] = w(hidden, dim)
        sd[p + "feed_forward.w3.weight"] = w(hidden, dim)
        sd[p + "feed_forward.w2.weight"] = w(dim, hidden)
        sd[p + "attention_norm.weight"] = 1 + 0.1 * torch.randn(dim, generator=g)
        sd[p + "ffn_norm.weight"] = 1 + 0.1 * torch.randn(dim, generator=g)
    if kind == "c2i":
        sd["cls_embedding.embedding_table.weight"] = torch.randn(num_classes + 1, dim, generator=g)
    else:
        sd["cls_embedding.cap_proj.fc1.weight"] = w(dim, caption_dim)
        sd["cls_embedding.cap_proj.fc2.weight"] = w(dim, dim)
        sd["cls_embedding.uncond_embedding"] = torch.randn(cond_tokens, caption_dim, generator=g) / caption_dim ** 0.5
    return sd


def write_llamagen(folder: Path, kind: str = "c2i", image_size: int = 8, seed: int = 0,
                        n_head: int = 4, class_names: bool = True) -> Path:
    """Tiny LlamaGen in its release layout: ``{kind}_tiny_{size}.pt`` + ``vq_ds16_{kind}.pt``.

    The GPT pickle holds ``{"model": state, "args": Namespace}`` like LlamaGen's training script;
    the VQ pickle is a bare state dict. ``llamagen.json`` gives the head count (the tiny width is
    not a published size); ``imagenet_classes.txt`` names the ten classes when ``class_names``.
    """
    import argparse

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    gpt = llamagen_gpt_state(kind, n_head=n_head, seed=seed)
    torch.save({"model": gpt, "args": argparse.Namespace(gpt_model="GPT-tiny", image_size=image_size)},
                folder / f"{kind}_tiny_{image_size}.pt")
    torch.save(llamagen_vq_state(seed=seed + 1), folder / f"vq_ds16_{kind}.pt")
    (folder / "llamagen.json").write_text(json.dumps({"n_head": n_head}))
    if class_names and kind == "c2i":
        names = ["tench, Tinca tinca", "goldfish, Carassius auratus", "great white shark", "tiger shark",
                 "hammerhead", "electric ray", "stingray", "cock", "hen", "ostrich, Struthio camelus"]
        (folder / "imagenet_classes.txt").write_text("\n".join(names) + "\n")
    return folder


# =============================================================================== Lumina-mGPT 2.0
# The ids the official code names: BOS/EOS <|endoftext|> 151643 (the tokenizer has no BOS token, so
# prompts start with its EOS), <racm3:break> 151665, <eoss> 151666, <reserved08796..08799> 151667..
# 151670, codes from 155000. The end-of-turn and size tokens are looked up by name there; their ids
# here (151671, 151700 + n) are made up.
LUMINA2_CODES = 64
LUMINA2_CODE_OFFSET = 155000
LUMINA2_SPECIAL = {"<|endoftext|>": 151643, "<racm3:break>": 151665, "<eoss>": 151666,
                   "<reserved08796>": 151667, "<reserved08797>": 151668, "<reserved08798>": 151669,
                   "<reserved08799>": 151670, "<reserved08706>": 151671}
LUMINA2_SPECIAL.update({f"<reserved{8800 + n:05d}>": 151700 + n for n in range(1, 49)})


def movqgan_state(ch: int = 32, mult: tuple[int, ...] = (1, 2), res_blocks: int = 1, codes: int = 64,
                  embed_dim: int = 4, z: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors named and shaped as a MoVQGAN ``MOVQ`` state dict (from its published layout:
    spatial norms conditioned on the 4-wide code vectors, attention at the coarsest level), with
    a few encoder tensors riding along as in the release."""
    g = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}

    def conv(name, cin, cout, k):
        sd[name + ".weight"] = torch.randn(cout, cin, k, k, generator=g) / (cin * k * k) ** 0.5
        sd[name + ".bias"] = 0.05 * torch.randn(cout, generator=g)

    def norm(name, c):  # SpatialNorm: GroupNorm + 1x1 convs from the code vectors
        sd[name + ".norm_layer.weight"] = 1 + 0.1 * torch.randn(c, generator=g)
        sd[name + ".norm_layer.bias"] = 0.1 * torch.randn(c, generator=g)
        conv(name + ".conv_y", embed_dim, c, 1)
        conv(name + ".conv_b", embed_dim, c, 1)

    def res(name, cin, cout):
        norm(name + ".norm1", cin)
        conv(name + ".conv1", cin, cout, 3)
        norm(name + ".norm2", cout)
        conv(name + ".conv2", cout, cout, 3)
        if cin != cout:
            conv(name + ".nin_shortcut", cin, cout, 1)

    def attn(name, c):
        norm(name + ".norm", c)
        for part in ("q", "k", "v", "proj_out"):
            conv(f"{name}.{part}", c, c, 1)

    top = ch * mult[-1]
    conv("decoder.conv_in", z, top, 3)
    res("decoder.mid.block_1", top, top)
    attn("decoder.mid.attn_1", top)
    res("decoder.mid.block_2", top, top)
    c = top
    for level in reversed(range(len(mult))):
        for j in range(res_blocks + 1):
            res(f"decoder.up.{level}.block.{j}", c, ch * mult[level])
            c = ch * mult[level]
            if level == len(mult) - 1:
                attn(f"decoder.up.{level}.attn.{j}", c)
        if level != 0:
            conv(f"decoder.up.{level}.upsample.conv", c, c, 3)
    norm("decoder.norm_out", c)
    conv("decoder.conv_out", c, 3, 3)
    conv("post_quant_conv", embed_dim, z, 1)
    sd["quantize.embedding.weight"] = torch.randn(codes, embed_dim, generator=g)
    conv("encoder.conv_in", 3, ch, 3)
    conv("quant_conv", z, embed_dim, 1)
    return sd


def write_lumina2(folder: Path, seed: int = 0, decoder_inside: bool = True) -> Path:
    """Tiny Lumina-mGPT 2.0: sharded bf16 safetensors with per-shard q/k norms and the stock VQ
    encoder's tensors, a config whose ``vocabulary_map`` names the codes ``<MOVQGAN_k>``, a
    byte-level tokenizer with the special tokens at the ids above, and ``movqgan_270M.ckpt``."""
    from transformers import ChameleonConfig, ChameleonForConditionalGeneration

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    special = dict(LUMINA2_SPECIAL)
    special.update({f"<MOVQGAN_{k:05d}>": LUMINA2_CODE_OFFSET + k for k in range(LUMINA2_CODES)})
    config = ChameleonConfig(
        vocab_size=LUMINA2_CODE_OFFSET + LUMINA2_CODES, hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=16384,
        vocabulary_map=special, bos_token_id=151643, eos_token_id=151666, pad_token_id=151643,
        model_parallel_size=2, initializer_range=0.5,
        vq_config={"embed_dim": 4, "num_embeddings": LUMINA2_CODES, "latent_channels": 4,
                   "base_channels": 32, "channel_multiplier": [1, 2], "num_res_blocks": 1,
                   "attn_resolutions": [], "resolution": 32})
    torch.manual_seed(seed)
    model = ChameleonForConditionalGeneration(config).eval()
    state = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in model.state_dict().items()}
    heads = config.num_attention_heads
    for key in [k for k in state if ".q_norm." in k or ".k_norm." in k]:
        state[key] = state[key][:: heads // 2].clone()  # one row per model-parallel shard
    state["lm_head.weight"] = state["lm_head.weight"].clone()
    write_safetensors_shards(state, folder, shards=4)
    saved = config.to_dict()
    saved["architectures"] = ["ChameleonXLLMXForConditionalGeneration"]
    saved["z_loss_weight"] = 1e-5
    (folder / "config.json").write_text(json.dumps(saved, indent=1))
    write_sparse_bpe_tokenizer(folder, special, {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"})
    if decoder_inside:
        torch.save(movqgan_state(seed=seed + 1), folder / "movqgan_270M.ckpt")
    return folder


def lumina2_reference(folder: Path):
    """The stock transformers model with the weights of a tiny Lumina-mGPT 2.0 folder, in float32."""
    from safetensors.torch import load_file
    from transformers import ChameleonConfig, ChameleonForConditionalGeneration

    config = ChameleonConfig.from_pretrained(str(folder))
    model = ChameleonForConditionalGeneration(config).eval()
    state = {}
    for f in sorted(folder.glob("model-*.safetensors")):
        state.update({k: v.float() for k, v in load_file(str(f)).items()})
    heads = config.num_attention_heads
    for key in [k for k in state if ".q_norm." in k or ".k_norm." in k]:
        state[key] = state[key].repeat_interleave(heads // state[key].shape[0], dim=0)
    model.load_state_dict(state)
    return model
