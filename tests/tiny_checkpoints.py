"""Tiny randomly initialised checkpoints written to disk in each family's real layout.

Every family has its own ``write_<family>(folder)`` function below, in its own section; they share
the generic writers at the top (sharded safetensors with an index, a byte-level BPE tokenizer made
with the ``tokenizers`` library). The files are what a user downloads (config.json, weight shards,
tokenizer files, decoder files), only with tiny dimensions, so tests load them through the same
``load_model`` as real checkpoints.
"""

from __future__ import annotations

import json
from pathlib import Path

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


CORPUS = ["Generate an image of 512x512 according to the following prompt:\n",
          "a red fox in the snow, a watercolor painting of a lighthouse at dusk",
          "an astronaut riding a horse, photo, masterpiece, film grained, best quality."]


# =============================================================================== Chameleon family
# Lumina-mGPT and Anole share the Chameleon vocabulary layout: ids 4.. are IMGIMG image tokens,
# 8196 <eoss>, 8197 <racm3:break>, then <reserved{id - 4:05d}> names (8710 end of turn, 8803 row
# end, 8804 + n size tokens). The tiny vocabulary keeps those ids but only CHAMELEON_CODES image
# tokens, so the engine runs fast on a CPU.
CHAMELEON_CODES = 512
CHAMELEON_TOP_ID = 8804 + 1024 // 32  # the largest size token
CHAMELEON_VOCAB = 9300


def _img_name(code: int) -> str:
    return "IMGIMG" + "".join(chr(ord("A") + int(d)) for d in str(code)) + "Z"


def chameleon_special_tokens() -> list[str]:
    """Names of ids 0..CHAMELEON_TOP_ID, in id order."""
    names = ["<s>", "<pad>", "</s>", "<unk>"]
    names += [_img_name(k) for k in range(CHAMELEON_CODES)]
    names += [f"<unused{i}>" for i in range(4 + CHAMELEON_CODES, 8196)]
    names += ["<eoss>", "<racm3:break>"]
    names += [f"<reserved{i - 4:05d}>" for i in range(8198, CHAMELEON_TOP_ID + 1)]
    return names


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
