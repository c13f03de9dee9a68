"""Lumina-mGPT 2.0 (``Alpha-VLLM/Lumina-mGPT-2.0``) on stock ``ChameleonForConditionalGeneration``.

What the official repository's text-to-image path does (``generate_examples/generate.py``,
``inference_solver.py``, ``data/item_processor.py``, ``data/convertsation.py``), and so this
adapter:

* prompt: BOS + ``"Generate an image of {W}x{H} according to the following prompt:\\n{prompt}"``
  + ``<reserved08706>`` (end of turn). BOS is the tokenizer's BOS token, or its EOS token when it
  has none (the repository's tokenizer wrapper does the same).
* image: ``<racm3:break>`` (image start), ``<reserved{8800 + H/32:05d}>``,
  ``<reserved{8800 + W/32:05d}>``, then H/8 rows of W/8 codes, each row followed by
  ``<reserved08799>`` (row end), then ``<eoss>`` (image end). The size tokens are fed here (the
  official sampler lets the model write them; the prompt asks for the same size).
* codes: MoVQGAN index k is the vocabulary entry ``155000 + k`` (``get_image_token``); the
  vocabulary names them ``<MOVQGAN...>`` (the repository's ``get_image_tokens``). The adapter takes
  the ``<MOVQGAN`` entries from the checkpoint's vocabulary when it names them, else the official
  offset, and checks either against the decoder's codebook before any weights load.
* only codes are sampled: the session computes logits for the code entries alone (the official
  sampler suppresses every other token and forces the row and image ends); row ends are fed.
* guidance 4.0 against a separate context that starts at the image-start token, top-k 4096,
  temperature 1.0 (README and ``scripts/sample.sh``), with the official guidance schedule
  (``guidance_schedule="lumina-mgpt-2"``, the recipe's default): the guidance processor of
  ``inference_solver.py`` (``LLMImageStartTriggeredUnbatchedClassifierFreeGuidanceLogitsProcessor``)
  keeps a scale of exactly 1 off, raises any other scale below 4 to 4, and lowers one above 4
  towards 4 code by code, reaching 4 within about 30 (guidance 5) to 95 (guidance 30) codes. At
  every token after the image start it sets ``scale = max(4, scale * (1 - n / L))``, where ``n``
  counts the tokens after the image start (the two size tokens, the codes and the row ends: the
  code at raster index ``k``, in rows of ``W/8`` codes, has ``n = 2 + k + k // (W/8)``; the
  update also runs at the row ends) and ``L = (H/16)(W/16)`` (twice the size tokens' H/32 and
  W/32: a quarter of the codes).
  The scale depends only on the position, so every mode stays exact. At the recipe's 4.0 it is 4
  everywhere; it differs from a constant scale only for another guidance (custom settings with
  this schedule, or the demo's ``--guidance``). ``guidance_schedule="constant"`` keeps the
  scale the user sets at every code. See ``sjd_core/decoding/guidance.py``. (The repository's
  ``--speculative_jacobi`` path, ``jacobi_utils_static.py``, instead guides at a constant scale
  and adds a top-n-sigma filter; the pack follows the default path.)
* sizes: the crop sizes of its data pipeline at the trained 768 px (``generate_crop_size_list`` in
  ``item_processor.py``, which crops every training image to one of them), 768 x 768 first.
* weights: Lumina-mGPT's per-model-parallel-shard q/k norms, expanded per head on load; the VQ
  encoder of the stock class is not built (nothing encodes images here).
* decoder: SBER-MoVQGAN 270M, ``movqgan_270M.ckpt`` (read weights-only) or its safetensors
  conversion, looked for in :data:`MOVQGAN_PLACES`; see :mod:`.movqgan`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Iterator

import torch

from ..files import describe_entry, is_regular_file
from ..messages import quote
from .chameleon import (ChameleonImageModel, TokenLayout, extends_vocabulary, lumina_resolutions,
                        per_head_norms)
from .family_common import load_tokenizer
from .movqgan import load_movqgan_decoder
from .protocol import SamplingDefaults
from .weights import (input_device, load_transformers_model, quantization_config, resolve_device_dtype,
                      safetensors_files)

__all__ = ["FAMILY", "RECIPES", "MOVQGAN_FILES", "MOVQGAN_PLACES", "read_layout", "find_decoder",
           "detect", "build", "resolutions_on_disk", "EXPECTS"]

FAMILY = "lumina-mgpt-2"
TRAINED_SIZE = 768
PIXELS_PER_CODE = 8
CODE_NAME_PREFIX = "<MOVQGAN"
OFFICIAL_CODE_OFFSET = 155000  # inference_solver.py / item_processor.py: token = code + 155000
GUIDANCE_SCHEDULE = "lumina-mgpt-2"  # the official schedule: sjd_core/decoding/guidance.py
RECIPES = {
    "official": SamplingDefaults(
        guidance=4.0, temperature=1.0, top_k=4096, guidance_schedule=GUIDANCE_SCHEDULE,
        source="Lumina-mGPT-2.0 README.md and lumina_mgpt/scripts/sample.sh "
               "(--cfg 4.0 --top_k 4096 --temperature 1.0); guidance schedule of "
               "lumina_mgpt/inference_solver.py"),
}
MOVQGAN_FILES = ("movqgan_270M.safetensors", "movqgan_270M.ckpt")
# Where the decoder may live, relative to the model folder, in the order searched: inside the
# model folder; the repository's layout (lumina_mgpt/movqgan/270M/); a shared folder beside it.
MOVQGAN_PLACES = (".", "movqgan/270M", "movqgan", "../movqgan/270M", "../movqgan")


def find_decoder(folder: Path) -> Path:
    """The first MoVQGAN file of :data:`MOVQGAN_FILES` in the first place that has one (a regular
    file; a place or file that is a symbolic-link loop or a FIFO is passed over and named)."""
    places = [Path(os.path.realpath(folder / p)) for p in MOVQGAN_PLACES]
    for place in places:
        for name in MOVQGAN_FILES:
            if is_regular_file(place / name):
                return place / name
    found = [f"{quote(str(place / name))} is {kind}" for place in places for name in MOVQGAN_FILES
             if (kind := describe_entry(place / name)) != "missing"]
    raise FileNotFoundError(
        "The MoVQGAN decoder of Lumina-mGPT 2.0 is missing: movqgan_270M.ckpt (from the Hugging "
        "Face repository ai-forever/MoVQGAN) or its safetensors conversion must be in one of:\n"
        + "\n".join(f"  - {p}" for p in places)
        + ("\nFound instead: " + "; ".join(found) if found else "")
        + f"\nThe simplest is to copy it into {folder}.")


def read_layout(vocab: dict[str, int], bos: int | None, vocab_size: int, codebook: int,
                resolutions: list[tuple[int, int]]) -> TokenLayout:
    """The token ids of prompts and images, each checked against the vocabulary.

    vocab: name -> id (the tokenizer's vocabulary together with config.json's ``vocabulary_map``).
    codebook: the MoVQGAN decoder's number of codes.
    """
    def token(name: str) -> int:
        if name not in vocab:
            raise ValueError(f"The vocabulary lacks {quote(name)}, which {FAMILY} needs: the tokenizer files "
                             "do not belong to a Lumina-mGPT 2.0 checkpoint.")
        return int(vocab[name])

    named = sorted(int(i) for name, i in vocab.items() if name.startswith(CODE_NAME_PREFIX))
    first = named[0] if named else OFFICIAL_CODE_OFFSET
    if named and named != list(range(first, first + len(named))):
        raise ValueError(f"The vocabulary's {CODE_NAME_PREFIX}...> code tokens are not consecutive ids.")
    if named and len(named) != codebook:
        raise ValueError(f"The vocabulary names {len(named)} {CODE_NAME_PREFIX}...> code tokens, the "
                         f"MoVQGAN decoder has {codebook} codes: they do not belong together.")
    if first + codebook > vocab_size:
        raise ValueError(f"config.json's vocab_size {vocab_size} cannot hold {codebook} codes from id "
                         f"{first}: not a Lumina-mGPT 2.0 checkpoint, or the wrong MoVQGAN decoder.")
    units = sorted({side // 32 for size in resolutions for side in size})
    layout = TokenLayout(
        code_ids=torch.arange(first, first + codebook), image_start=token("<racm3:break>"),
        image_end=token("<eoss>"), end_of_turn=token("<reserved08706>"), row_end=token("<reserved08799>"),
        size_ids={n: token(f"<reserved{8800 + n:05d}>") for n in units}, bos=bos,
        pixels_per_code=PIXELS_PER_CODE)
    structural = {layout.image_start, layout.image_end, layout.end_of_turn, layout.row_end,
                  *layout.size_ids.values()}
    clashing = sorted(i for i in structural if first <= i < first + codebook)
    if clashing:
        raise ValueError(f"Structural tokens {clashing} fall among the code ids {first}..{first + codebook - 1}.")
    return layout


Converter = Callable[[str, torch.Tensor], Iterator[tuple[str, torch.Tensor]]]


def _without_vq_encoder(convert: Converter) -> Converter:
    """Drop the stock class's VQ encoder tensors (the encoder is not built) and expand q/k norms."""
    def run(key: str, value: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        if not key.startswith("model.vqmodel."):
            yield from convert(key, value)
    return run


def _drop_vq_encoder(model: torch.nn.Module) -> None:
    model.model.vqmodel = None


def build(folder: Path, device=None, dtype=None, device_map=None, weights: str | None = None) -> ChameleonImageModel:
    """Load a Lumina-mGPT 2.0 folder (tokens, decoder and weight files checked before loading)."""
    from transformers import ChameleonConfig, ChameleonForConditionalGeneration

    dev, dtype = resolve_device_dtype(device, dtype, weights)
    quantization = quantization_config(weights, dev)
    config = ChameleonConfig.from_pretrained(str(folder), local_files_only=True)
    config.vocabulary_map = dict(config.vocabulary_map or {})
    tokenizer = load_tokenizer(folder, FAMILY)
    decoder_file = find_decoder(folder)
    files = safetensors_files(folder)
    decoder = load_movqgan_decoder(decoder_file, torch.device("cpu"))
    vocab = {**config.vocabulary_map, **tokenizer.get_vocab()}
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if bos is None:
        raise ValueError(f"The tokenizer in {quote(str(folder))} names neither a BOS nor an EOS token; "
                         f"{FAMILY} prompts start with one.")
    resolutions = lumina_resolutions(TRAINED_SIZE)
    layout = read_layout(vocab, int(bos), config.vocab_size, decoder.config.n_embed, resolutions)
    convert = _without_vq_encoder(per_head_norms(config.num_attention_heads, config.num_key_value_heads))
    model = load_transformers_model(ChameleonForConditionalGeneration, config, files, dev, dtype,
                                    device_map=device_map, convert=convert, prepare=_drop_vq_encoder,
                                    quantization=quantization)
    decoder = decoder.to(input_device(model))
    return ChameleonImageModel(FAMILY, model, tokenizer, decoder, resolutions, layout, RECIPES)


def detect(folder: Path) -> bool:
    """A Chameleon checkpoint whose vocabulary extends past Chameleon's (Lumina-mGPT 2.0)."""
    return extends_vocabulary(folder)


def resolutions_on_disk(folder: Path) -> list[tuple[int, int]]:
    """The sizes a Lumina-mGPT 2.0 folder supports (no file read: they follow the release)."""
    return lumina_resolutions(TRAINED_SIZE)


EXPECTS = ("config.json (model_type 'chameleon', vocab_size above 65536), the model-0000N-of-0000M "
           "shards + model.safetensors.index.json, tokenizer.json, and movqgan_270M.ckpt (or "
           "movqgan_270M.safetensors)")
