"""Lumina-mGPT and Anole: Chameleon-architecture models on stock ``ChameleonForConditionalGeneration``.

Layout of a generated image (token names from the checkpoint's ``vocabulary_map``):

* Lumina-mGPT: ``<racm3:break>`` (image start, id 8197), the size tokens ``<reserved{8800+h}>``
  and ``<reserved{8800+w}>`` (ids 8804 + h, 8804 + w; h, w in units of 32 px), then each row of
  codes followed by ``<reserved08799>`` (row end, id 8803), then ``<eoss>`` (image end, 8196).
  The prompt is BOS + ``"Generate an image of {W}x{H} according to the following prompt:\\n{p}"``
  + ``<reserved08706>`` (end of turn, 8710). Guidance runs a separate unconditional context that
  starts at the image-start token (no text). Recipes: see :data:`LUMINA_RECIPES`. Resolutions:
  the sizes the official demo offers for the checkpoint's trained size (:func:`lumina_resolutions`).
* Anole: BOS + prompt + end of turn + image start, then 32 x 32 codes with no size or row-end
  tokens; unconditional context: BOS + image start. Recipe (Chameleon's image options, as in
  Anole's own inference code): guidance 3.0, temperature 0.7, top-p 0.9.

A code ``k`` is the token whose ``IMGIMG...`` name spells ``k`` (id ``k + 4`` in the released
vocabulary). The stock ``forward`` masks every image-token logit, so the session calls the
backbone ``model.model`` and ``lm_head`` itself. Lumina-mGPT stores its q/k layer-norm weights
per model-parallel shard, ``(model_parallel_size, head_dim)``; they are expanded per head on load.

The VQGAN decoder is not part of these checkpoints: ``vqgan.yaml`` and ``vqgan.ckpt`` from Meta's
Chameleon release are looked for in the places listed in ``VQGAN_PLACES``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from ..files import describe_entry, is_regular_file
from ..messages import quote
from .family_common import (check_codes, check_prompt_length, encode, load_config, load_tokenizer,
                            read_json, to_images)
from .hf_session import Context, DecoderParts, HFSession
from .weights import (input_device, load_transformers_model, quantization_config, resolve_device_dtype,
                      safetensors_files)
from .protocol import GenerationRequest, MemoryShape, SamplingDefaults
from .vqgan import VQGANDecoder, load_vqgan_decoder

__all__ = ["ChameleonImageModel", "TokenLayout", "VQGAN_PLACES", "find_vqgan", "synthetic_vocabulary",
           "lumina_resolutions", "resolutions_on_disk", "LUMINA", "ANOLE"]

LUMINA, ANOLE = "lumina-mgpt", "anole"
PIXELS_PER_CODE = 16
SIZE_UNIT = 32  # Lumina's size tokens count 32-pixel units
LUMINA_TRAINED_SIZES = (768, 512, 1024)  # the released checkpoints; the first is assumed when unnamed
MAX_ASPECT_RATIO = 4.0  # the official demo's limit on width / height and height / width
ANOLE_SIZE = 512
CHAMELEON_VOCAB_SIZE = 65536  # text, VQGAN codes and special tokens of Chameleon, Anole, Lumina-mGPT

LUMINA_RECIPES = {
    "inference solver": SamplingDefaults(
        guidance=3.0, temperature=1.0, top_k=2000,
        source="Lumina-mGPT lumina_mgpt/inference_solver.py, create_logits_processor defaults"),
    "README example": SamplingDefaults(
        guidance=4.0, temperature=1.0, top_k=2000,
        source="Lumina-mGPT README.md, image generation example"),
    "gradio demo": SamplingDefaults(
        guidance=3.0, temperature=1.0, top_k=4000,
        source="Lumina-mGPT lumina_mgpt/demos/demo_image_generation.py, slider defaults"),
}
ANOLE_RECIPES = {
    "anole inference": SamplingDefaults(
        guidance=3.0, temperature=0.7, top_k=0, top_p=0.9,
        source="Anole's inference code (Chameleon's image sampling options)"),
}


def lumina_resolutions(trained: int, unit: int = SIZE_UNIT) -> list[tuple[int, int]]:
    """(width, height) sizes the official demo offers for a checkpoint trained at ``trained`` px.

    The trained square comes first, then every size of ``unit``-pixel blocks the demo lists: for
    block widths from the widest down, the block heights from where the next wider width stopped
    up to the most that fit in the trained square's block count, keeping aspect ratios up to 4:1.
    """
    blocks = (trained // unit) ** 2
    found: list[tuple[int, int]] = []
    for columns in range(blocks, 0, -1):
        for rows in range(max(1, blocks // (columns + 1)), blocks // columns + 1):
            if max(columns, rows) <= MAX_ASPECT_RATIO * min(columns, rows):
                found.append((columns * unit, rows * unit))
    return [(trained, trained)] + [size for size in found if size != (trained, trained)]
PROMPT_TEMPLATE = "Generate an image of {w}x{h} according to the following prompt:\n{prompt}"

# Where the decoder weights may live, relative to the model folder, in the order searched:
# inside the model folder; Meta's Chameleon download (``tokenizer/``); a shared folder next to the
# models; Lumina-mGPT's README (``ckpts/chameleon/tokenizer``) and code (``ckpts/image_tokenizer``).
VQGAN_PLACES = (".", "tokenizer", "../chameleon_vqgan", "../ckpts/chameleon/tokenizer",
                "../ckpts/image_tokenizer/chameleon")


def synthetic_vocabulary(codes: int = 8192, size: int = 8804 + 2048 // SIZE_UNIT + 1) -> dict[str, int]:
    """Token names of ids ``0..size-1`` in the released layout, for randomly initialised models.

    ``<s> <pad> </s> <unk>``, then ``codes`` ``IMGIMG`` image tokens from id 4 (a name spells its
    code with the letters A-J for the digits 0-9, then ``Z``), placeholders up to 8195,
    ``<eoss>`` (8196), ``<racm3:break>`` (8197), and ``<reserved{id - 4:05d}>`` after that.
    """
    names = ["<s>", "<pad>", "</s>", "<unk>"]
    names += ["IMGIMG" + "".join(chr(ord("A") + int(d)) for d in str(k)) + "Z" for k in range(codes)]
    names += [f"<unused{i}>" for i in range(4 + codes, 8196)]
    names += ["<eoss>", "<racm3:break>"]
    names += [f"<reserved{i - 4:05d}>" for i in range(8198, size)]
    return {name: i for i, name in enumerate(names)}


def find_vqgan(folder: Path) -> tuple[Path, Path]:
    """(vqgan.yaml, vqgan.ckpt) from the first place in ``VQGAN_PLACES`` that holds both."""
    places = [Path(os.path.realpath(folder / p)) for p in VQGAN_PLACES]
    for place in places:
        if is_regular_file(place / "vqgan.yaml") and is_regular_file(place / "vqgan.ckpt"):
            return place / "vqgan.yaml", place / "vqgan.ckpt"
    found = [f"{quote(str(place / name))} is {kind}" for place in places
             for name in ("vqgan.yaml", "vqgan.ckpt")
             if (kind := describe_entry(place / name)) != "missing"]
    raise FileNotFoundError(
        "The Chameleon VQGAN decoder is missing: vqgan.yaml and vqgan.ckpt (from Meta's Chameleon "
        "release, folder tokenizer/) must sit together, as regular files, in one of:\n"
        + "\n".join(f"  - {p}" for p in places)
        + ("\nFound instead: " + "; ".join(found) if found else "")
        + f"\nThe simplest is to copy both files into {folder}.")


def read_config(folder: Path) -> dict:
    """``folder/config.json`` as a dict ({} when it is missing, unreadable or not a regular
    file: detection then matches no family, and the loader says what is wrong with it)."""
    try:
        return read_json(folder / "config.json")
    except ValueError:
        return {}


def is_chameleon(folder: Path) -> bool:
    """A folder whose config.json has ``model_type`` 'chameleon'."""
    return folder.is_dir() and read_config(folder).get("model_type") == "chameleon"


def extends_vocabulary(folder: Path) -> bool:
    """A Chameleon config with more than Chameleon's 65,536 tokens: Lumina-mGPT 2.0's vocabulary,
    which puts its MoVQGAN codes after a larger text vocabulary."""
    vocab_size = read_config(folder).get("vocab_size")
    return (is_chameleon(folder) and isinstance(vocab_size, int)
            and vocab_size > CHAMELEON_VOCAB_SIZE)


def _is_lumina(folder: Path) -> bool:
    """Lumina-mGPT configs come from its training class (z-loss weight, XLLMX architecture)."""
    cfg = read_config(folder)
    listed = cfg.get("architectures")
    archs = " ".join(a for a in listed if isinstance(a, str)) if isinstance(listed, list) else ""
    return (is_chameleon(folder) and ("z_loss_weight" in cfg or "XLLMX" in archs)
            and not extends_vocabulary(folder))


def per_head_norms(num_heads: int, num_kv_heads: int):
    """Checkpoint converter: expand (shards, head_dim) q/k-norm tensors to (heads, head_dim)."""
    def convert(key: str, value: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        heads = num_heads if ".q_norm." in key else num_kv_heads if ".k_norm." in key else None
        if heads is not None and value.dim() == 2 and value.shape[0] != heads:
            if heads % value.shape[0]:
                raise ValueError(f"{key} has {value.shape[0]} shards, which do not divide {heads} heads.")
            value = value.repeat_interleave(heads // value.shape[0], dim=0)
        yield key, value
    return convert


@dataclass(frozen=True)
class TokenLayout:
    """The token ids a family's prompts and images use, read from its vocabulary.

    With ``size_ids`` (Lumina-mGPT 1 and 2) the prompt follows the size template and the
    unconditional context is the image prefix alone; without (Anole) it is BOS + image start.
    """

    code_ids: torch.Tensor  # (codebook,) token id of each code
    image_start: int
    image_end: int
    end_of_turn: int
    row_end: int | None
    size_ids: dict[int, int]  # 32-pixel units -> size token id
    bos: int | None = None  # None: the model config's bos_token_id
    pixels_per_code: int = PIXELS_PER_CODE

    @classmethod
    def read(cls, vocab: dict[str, int], family: str, resolutions: list[tuple[int, int]]) -> "TokenLayout":
        """Checks every name Lumina-mGPT or Anole needs (before any weights load)."""
        from transformers.models.chameleon.modeling_chameleon import ChameleonImageVocabularyMapping

        bpe2img = ChameleonImageVocabularyMapping(vocab).bpe2img
        if not bpe2img:
            raise ValueError(f"config.json's vocabulary_map has no IMGIMG image tokens: not a {family} checkpoint.")
        ids = torch.empty(len(bpe2img), dtype=torch.long)
        ids[torch.tensor(list(bpe2img.values()))] = torch.tensor(list(bpe2img.keys()))

        def token(name: str) -> int:
            if name not in vocab:
                raise ValueError(f"config.json's vocabulary_map lacks {quote(name)}, which {family} needs.")
            return int(vocab[name])

        lumina = family == LUMINA
        return cls(code_ids=ids, image_start=token("<racm3:break>"), image_end=token("<eoss>"),
                   end_of_turn=token("<reserved08706>"),
                   row_end=token("<reserved08799>") if lumina else None,
                   size_ids={n: token(f"<reserved{8800 + n:05d}>")
                             for n in sorted({side // SIZE_UNIT for size in resolutions for side in size})}
                   if lumina else {})


class ChameleonImageModel:
    """A Chameleon-architecture family behind the :class:`~sjd_core.models.protocol.ImageTokenModel`
    protocol: Lumina-mGPT, Anole, and (with a MoVQGAN decoder) Lumina-mGPT 2.0.

    vqgan: the image decoder, codes (B, H, W) -> pixels in [-1, 1], with its codebook in
        ``quantize.embedding`` (a :class:`VQGANDecoder` or a MoVQGAN decoder).
    """

    def __init__(self, family: str, model, tokenizer, vqgan: nn.Module,
                 resolutions: list[tuple[int, int]], layout: TokenLayout,
                 recipes: dict[str, SamplingDefaults] | None = None) -> None:
        self.family = family
        self.model = model
        self.tokenizer = tokenizer
        self.vqgan = vqgan
        self._resolutions = list(resolutions)
        self._pixels_per_code = layout.pixels_per_code
        self.codebook_size = len(layout.code_ids)
        self.device = input_device(model)
        self.memory_shape = MemoryShape.of_config(model.config, next(model.parameters()).dtype)
        self.code_ids = layout.code_ids.to(self.device)
        ids = layout.code_ids
        self._contiguous = bool((ids == ids[0] + torch.arange(len(ids))).all())
        self.bos_id = int(model.config.bos_token_id if layout.bos is None else layout.bos)
        self.image_start_id, self.image_end_id = layout.image_start, layout.image_end
        self.end_of_turn_id, self.row_end_id = layout.end_of_turn, layout.row_end
        self._size_ids = layout.size_ids
        self.recipes = recipes or (LUMINA_RECIPES if family == LUMINA else ANOLE_RECIPES)
        self.defaults = next(iter(self.recipes.values()))

    # ----------------------------------------------------------------------------- layout
    def supported_resolutions(self) -> list[tuple[int, int]]:
        """The official sizes, the checkpoint's trained square first."""
        return list(self._resolutions)

    def grid_for(self, resolution: tuple[int, int] | None) -> tuple[int, int]:
        width, height = resolution if resolution is not None else self.supported_resolutions()[0]
        if (width, height) not in self.supported_resolutions():
            listing = ", ".join(f"{w}x{h}" for w, h in self.supported_resolutions())
            raise ValueError(f"resolution={width}x{height} is not supported by {self.family}: use one of "
                             f"{listing} (width x height, in pixels).")
        return height // self._pixels_per_code, width // self._pixels_per_code

    def codebook_embeddings(self) -> torch.Tensor:
        """The VQ codebook vectors (the same codebook the image decoder reads)."""
        return self.vqgan.quantize.embedding.weight.detach().float()

    # ----------------------------------------------------------------------------- prompts
    def prompt_ids(self, prompt: str, resolution: tuple[int, int]) -> list[int]:
        """The conditional context: prompt template, then the image-start (and size) tokens."""
        width, height = resolution
        if self._size_ids:
            text = PROMPT_TEMPLATE.format(w=width, h=height, prompt=prompt)
            return [self.bos_id] + encode(self.tokenizer, text) + [self.end_of_turn_id] + self.image_prefix(resolution)
        return [self.bos_id] + encode(self.tokenizer, prompt) + [self.end_of_turn_id] + self.image_prefix(resolution)

    def unconditional_ids(self, resolution: tuple[int, int]) -> list[int]:
        """The unconditional context: the image prefix alone (Lumina-mGPT), after BOS (Anole)."""
        prefix = self.image_prefix(resolution)
        return prefix if self._size_ids else [self.bos_id] + prefix

    def image_prefix(self, resolution: tuple[int, int]) -> list[int]:
        """Image start, then (Lumina) the height and width tokens; also the unconditional context."""
        width, height = resolution
        if self._size_ids:
            return [self.image_start_id, self._size_ids[height // SIZE_UNIT], self._size_ids[width // SIZE_UNIT]]
        return [self.image_start_id]

    def parts(self) -> DecoderParts:
        """The Chameleon pieces of the shared session."""
        embed = self.model.model.embed_tokens
        head = self.model.lm_head
        ids = self.code_ids
        first = int(ids[0])

        def code_logits(hidden: torch.Tensor) -> torch.Tensor:
            if self._contiguous and isinstance(head, torch.nn.Linear):
                # only the codebook's rows of the head: the rest of the vocabulary is never used
                weight = head.weight[first:first + self.codebook_size]
                bias = None if head.bias is None else head.bias[first:first + self.codebook_size]
                return torch.nn.functional.linear(hidden, weight, bias)
            logits = head(hidden)
            if self._contiguous:
                return logits[..., first:first + self.codebook_size]
            return logits.index_select(-1, ids if ids.device == logits.device else ids.to(logits.device))

        def embed_codes(codes: torch.Tensor) -> torch.Tensor:
            return embed(ids[codes if codes.device == ids.device else codes.to(ids.device)])

        return DecoderParts(
            backbone=self.model.model, embed_tokens=embed, embed_codes=embed_codes,
            code_logits=code_logits, row_end_id=self.row_end_id, device=self.device,
            dtype=self.model.dtype)

    def start(self, request: GenerationRequest) -> HFSession:
        """Tokenise and prefill the conditional (and, with guidance, unconditional) contexts.

        ``request.extra["prompts"]`` (a list of ``batch_size`` strings) gives each row its own
        prompt; otherwise every row uses ``request.prompt``.
        """
        grid = self.grid_for(request.resolution)
        resolution = (grid[1] * self._pixels_per_code, grid[0] * self._pixels_per_code)
        prompts = request.extra.get("prompts", [request.prompt] * request.batch_size)
        if (not isinstance(prompts, (list, tuple)) or len(prompts) != request.batch_size
                or not all(isinstance(p, str) for p in prompts)):
            raise ValueError(f"extra['prompts']={quote(prompts)} is not allowed: it must be a list of "
                             f"{request.batch_size} strings, one per batch row.")
        cond_ids = [self.prompt_ids(p, resolution) for p in prompts]
        names = ([f"prompt[{i}]" for i in range(len(prompts))] if "prompts" in request.extra
                 else ["prompt"] * len(prompts))
        checked = list(zip(names, cond_ids))
        uncond_ids = None
        if request.guidance != 1.0:
            negative = request.negative_prompt.strip()
            uncond_ids = self.prompt_ids(negative, resolution) if negative else self.unconditional_ids(resolution)
            checked.append(("negative_prompt", uncond_ids))
        image_tokens = grid[0] * grid[1] + (grid[0] if self.row_end_id is not None else 0) + 1
        for name, ids in checked:
            check_prompt_length(self.family, name, len(ids), image_tokens,
                                int(self.model.config.max_position_embeddings))
        uncond = None if uncond_ids is None else [Context(ids=torch.tensor(uncond_ids))] * request.batch_size
        return HFSession(self.parts(), [Context(ids=torch.tensor(ids)) for ids in cond_ids], uncond, grid,
                         request.max_nodes)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """(B, H, W) codes -> (B, pixels per code x (H, W), 3) float images in [0, 1] on the CPU."""
        check_codes(self.family, codes, self.codebook_size)
        dev = self.vqgan.post_quant_conv.weight.device
        pixels = self.vqgan(codes.to(dev))
        return to_images(pixels, [0.5, 0.5, 0.5], [0.5, 0.5, 0.5])


def trained_size(folder: Path) -> int:
    """Lumina-mGPT checkpoints are named after their training size (``Lumina-mGPT-7B-768``)."""
    found = [int(m) for m in re.findall(r"(?<!\d)(512|768|1024)(?!\d)", folder.name)]
    return found[-1] if found else LUMINA_TRAINED_SIZES[0]


def resolutions_on_disk(folder: Path) -> list[tuple[int, int]]:
    """The sizes a Lumina-mGPT or Anole folder supports, from its name alone (no weights read)."""
    return lumina_resolutions(trained_size(folder)) if _is_lumina(folder) else [(ANOLE_SIZE, ANOLE_SIZE)]


def build(folder: Path, device=None, dtype=None, device_map=None, family: str | None = None,
          weights: str | None = None) -> ChameleonImageModel:
    """Load a Lumina-mGPT or Anole folder (checks tokenizer, decoder and weights before loading)."""
    from transformers import ChameleonConfig, ChameleonForConditionalGeneration

    family = family or (LUMINA if _is_lumina(folder) else ANOLE)
    dev, dtype = resolve_device_dtype(device, dtype, weights)
    quantization = quantization_config(weights, dev, keep=("vqmodel",))
    config = load_config(ChameleonConfig, folder, family)
    resolutions = lumina_resolutions(trained_size(folder)) if family == LUMINA else [(ANOLE_SIZE, ANOLE_SIZE)]
    layout = TokenLayout.read(config.vocabulary_map or {}, family, resolutions)
    tokenizer = load_tokenizer(folder, family)
    yaml_file, ckpt_file = find_vqgan(folder)
    files = safetensors_files(folder)
    vqgan = load_vqgan_decoder(yaml_file, ckpt_file, torch.device("cpu"))
    convert = per_head_norms(config.num_attention_heads, config.num_key_value_heads)
    model = load_transformers_model(ChameleonForConditionalGeneration, config, files, dev, dtype,
                                    device_map=device_map, convert=convert, quantization=quantization)
    vqgan = vqgan.to(input_device(model))
    return ChameleonImageModel(family, model, tokenizer, vqgan, resolutions, layout)


_EXPECTS = ("config.json (model_type 'chameleon'{}), model.safetensors or shards + "
            "model.safetensors.index.json, tokenizer.json, and vqgan.yaml + vqgan.ckpt")
EXPECTS_LUMINA = _EXPECTS.format(" with Lumina-mGPT's z_loss_weight")
EXPECTS_ANOLE = _EXPECTS.format("")


def detect_lumina(folder: Path) -> bool:
    """True for a Lumina-mGPT checkpoint folder."""
    return _is_lumina(folder)


def detect_anole(folder: Path) -> bool:
    """True for a Chameleon checkpoint that is not Lumina-mGPT 1 or 2 (Anole)."""
    return is_chameleon(folder) and not _is_lumina(folder) and not extends_vocabulary(folder)


def build_lumina(folder: Path, **options) -> ChameleonImageModel:
    """The loader's entry point for Lumina-mGPT."""
    return build(folder, family=LUMINA, **options)


def build_anole(folder: Path, **options) -> ChameleonImageModel:
    """The loader's entry point for Anole."""
    return build(folder, family=ANOLE, **options)
