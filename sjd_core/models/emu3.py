"""Emu3-Gen (``BAAI/Emu3-Gen-hf``) on transformers' stock ``Emu3ForConditionalGeneration``.

Recipe (Emu3's official image-generation example):

- prompt: BOS + prompt + ``" masterpiece, film grained, best quality."`` + image start +
  ``"{H}*{W}"`` (the code grid, as text) + the image-token marker; the model then draws H rows of
  (W codes + end-of-line ``<|extra_200|>``) and three end tokens (end of frame, end of image,
  end of text), which the engine never needs: the image is complete after its last code;
- guidance: an unconditional row with the official negative prompt (or the request's negative
  prompt) in the same template, cfg 3.0, top-k 2048, temperature 1.0;
- grid: area ``image_area`` pixels (720 x 720 by default, or ``image_area`` from the checkpoint's
  ``processor_config.json``) at the aspect ratios below, 8 pixels per code for the real VQ;
- code k is token ``<|visual token k|>`` (id 151854 + k in the real vocabulary), read from the
  config's ``vocabulary_map``;
- decode: ``model.model.vqmodel.decode`` on the (B, H, W) grid, unnormalised with the image
  processor's mean and std.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from ..files import json_field
from ..messages import quote
from .family_common import (check_codes, check_prompt_length, config_model_type, encode,
                            image_norm, load_config, load_tokenizer, pick_grid, read_json,
                            to_images)
from .hf_session import Context, DecoderParts, HFSession
from .weights import (input_device, load_transformers_model, quantization_config, resolve_device_dtype,
                      safetensors_files)
from .protocol import GenerationRequest, MemoryShape, SamplingDefaults

POSITIVE_SUFFIX = " masterpiece, film grained, best quality."
NEGATIVE_PROMPT = ("lowres, bad anatomy, bad hands, text, error, missing fingers, extra digit, fewer "
                   "digits, cropped, worst quality, low quality, normal quality, jpeg artifacts, "
                   "signature, watermark, username, blurry.")
DEFAULT_IMAGE_AREA = 720 * 720
ASPECT_RATIOS = ((1, 1), (4, 3), (3, 4), (16, 9), (9, 16), (3, 2), (2, 3))  # width : height
ROW_END_TOKEN = "<|extra_200|>"
IMAGE_START_TOKEN = "<|image start|>"
IMAGE_MARKER_TOKEN = "<|image token|>"
VISUAL_PREFIX = "<|visual token "


def grid_for_ratio(width: int, height: int, area: int, pixels_per_code: int) -> tuple[int, int]:
    """(rows, columns) of codes for an aspect ratio at a pixel area (Emu3's own rounding)."""
    scale = (area / (width * height)) ** 0.5
    return int(round(height * scale / pixels_per_code)), int(round(width * scale / pixels_per_code))


def size_grids(area: int, pixels_per_code: int) -> dict[tuple[int, int], tuple[int, int]]:
    """(width, height) -> (rows, columns) for each of Emu3's aspect ratios at ``area``, 1:1 first."""
    grids: dict[tuple[int, int], tuple[int, int]] = {}
    for w, h in ASPECT_RATIOS:
        rows, cols = grid_for_ratio(w, h, area, pixels_per_code)
        grids.setdefault((cols * pixels_per_code, rows * pixels_per_code), (rows, cols))
    return grids


def image_area(path: Path) -> int:
    """Pixels per image the checkpoint draws at (``processor_config.json``'s ``image_area``)."""
    file = path / "processor_config.json"
    return json_field(read_json(file), "image_area", f"file {quote(str(file))}", "int", minimum=1,
                      default=DEFAULT_IMAGE_AREA)


def resolutions_on_disk(path: Path) -> list[tuple[int, int]]:
    """The sizes an Emu3 folder supports, from its config files alone (no weights read)."""
    from transformers import Emu3Config

    config = Emu3Config.from_pretrained(str(path), local_files_only=True)
    area = image_area(path)
    return list(size_grids(area, 2 ** (len(config.vq_config.channel_multiplier) - 1)))


def visual_code_ids(vocabulary_map: dict[str, int]) -> torch.Tensor:
    """Token id of each code, in code order, from ``<|visual token NNNNNN|>`` entries."""
    entries = sorted((int(name[len(VISUAL_PREFIX):-2]), token) for name, token in vocabulary_map.items()
                     if name.startswith(VISUAL_PREFIX))
    if not entries or [k for k, _ in entries] != list(range(len(entries))):
        raise ValueError("Emu3 config's vocabulary_map must list <|visual token 000000|> ... without gaps.")
    return torch.tensor([token for _, token in entries])


class Emu3Model:
    """Emu3-Gen behind the adapter protocol (see the module docstring for the recipe)."""

    family = "emu3"
    recipes = {"official example": SamplingDefaults(
        guidance=3.0, temperature=1.0, top_k=2048,
        source="BAAI/Emu3 README, image generation example (classifier-free guidance 3.0, top-k 2048)")}
    defaults = recipes["official example"]

    def __init__(self, model, tokenizer, image_area: int = DEFAULT_IMAGE_AREA,
                 image_mean: list[float] | None = None, image_std: list[float] | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.device = input_device(model)
        self.dtype = next(model.parameters()).dtype
        self.memory_shape = MemoryShape.of_config(model.config, next(model.parameters()).dtype)
        vocab = model.config.vocabulary_map
        ids = visual_code_ids(vocab)
        if not torch.equal(ids, ids[0] + torch.arange(len(ids))):
            raise ValueError("Emu3 visual token ids must be consecutive (code k = first id + k).")
        self.code_offset = int(ids[0])
        self.codebook_size = len(ids)
        missing = [t for t in (ROW_END_TOKEN, IMAGE_START_TOKEN, IMAGE_MARKER_TOKEN) if t not in vocab]
        if missing:
            raise ValueError(f"Emu3 config's vocabulary_map lacks the structural tokens {missing}.")
        self.row_end_id = vocab[ROW_END_TOKEN]
        self.image_start_id = vocab[IMAGE_START_TOKEN]
        self.image_marker_id = vocab[IMAGE_MARKER_TOKEN]
        self.bos_id = model.config.text_config.bos_token_id
        self.image_mean = image_mean or [0.5, 0.5, 0.5]
        self.image_std = image_std or [0.5, 0.5, 0.5]
        vq = model.model.vqmodel
        self.pixels_per_code = int(vq.spatial_scale_factor)
        self._grids = size_grids(image_area, self.pixels_per_code)

    # ------------------------------------------------------------------ layout
    def supported_resolutions(self) -> list[tuple[int, int]]:
        return list(self._grids)

    def grid_for(self, resolution: tuple[int, int] | None) -> tuple[int, int]:
        return pick_grid("Emu3", resolution, self._grids)

    def codebook_embeddings(self) -> torch.Tensor:
        return self.model.model.vqmodel.quantize.embedding.weight.detach().float()

    # ------------------------------------------------------------------ prompting
    def prompt_ids(self, text: str, grid: tuple[int, int]) -> list[int]:
        """BOS + text + image start + "H*W" + image-token marker (the whole context)."""
        rows, cols = grid
        return ([self.bos_id] + encode(self.tokenizer, text) + [self.image_start_id]
                + encode(self.tokenizer, f"{rows}*{cols}") + [self.image_marker_id])

    def parts(self) -> DecoderParts:
        text_model, lm_head = self.model.model.text_model, self.model.lm_head
        start, end = self.code_offset, self.code_offset + self.codebook_size

        def code_logits(hidden: torch.Tensor) -> torch.Tensor:
            if lm_head.weight.is_meta:  # offloaded by a device_map: only the module's hook loads it
                return lm_head(hidden)[..., start:end]
            return F.linear(hidden, lm_head.weight[start:end])  # just the codebook's rows of the head

        return DecoderParts(
            backbone=text_model, embed_tokens=text_model.embed_tokens,
            embed_codes=lambda codes: text_model.embed_tokens(codes + start),
            code_logits=code_logits,
            row_end_id=self.row_end_id, device=self.device, dtype=self.dtype)

    def start(self, request: GenerationRequest) -> HFSession:
        grid = self.grid_for(request.resolution)
        ids = self.prompt_ids(request.prompt + POSITIVE_SUFFIX, grid)
        rows = {"prompt": ids}
        if request.guidance != 1.0:
            rows["negative_prompt"] = self.prompt_ids(request.negative_prompt or NEGATIVE_PROMPT, grid)
        image_tokens = grid[0] * (grid[1] + 1) + 3  # codes, row ends, the three end tokens
        context = int(self.model.config.text_config.max_position_embeddings)
        for name, row in rows.items():
            check_prompt_length("Emu3", name, len(row), image_tokens, context)
        uncond = None
        if "negative_prompt" in rows:
            uncond = [Context(ids=torch.tensor(rows["negative_prompt"]))] * request.batch_size
        return HFSession(self.parts(), [Context(ids=torch.tensor(ids))] * request.batch_size, uncond, grid,
                         request.max_nodes)

    # ------------------------------------------------------------------ decoding
    @torch.no_grad()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        check_codes("Emu3", codes, self.codebook_size)
        vq = self.model.model.vqmodel
        pixels = vq.decode(codes.to(next(vq.parameters()).device))
        return to_images(pixels, self.image_mean, self.image_std)


def checkpoint_key(key: str, tensor: torch.Tensor):
    """Emu3-Gen-hf's stored names (``text_model.model.*``, ``text_model.lm_head``, ``vqmodel.*``)
    -> the module names of ``Emu3ForConditionalGeneration``; names already in that form pass."""
    if key.startswith("text_model.lm_head."):
        key = key[len("text_model."):]
    elif key.startswith("text_model.model."):
        key = "model.text_model." + key[len("text_model.model."):]
    elif key.startswith("vqmodel."):
        key = "model." + key
    yield key, tensor


def detect(path: Path) -> bool:
    """An Emu3 folder: ``config.json`` with ``model_type`` ``emu3``."""
    return config_model_type(path) == "emu3"


def build(path: Path, device=None, dtype=None, device_map=None, weights: str | None = None) -> Emu3Model:
    """Load an Emu3-Gen folder (config, sharded safetensors, tokenizer, processor configs)."""
    from transformers import Emu3Config, Emu3ForConditionalGeneration

    device, dtype = resolve_device_dtype(device, dtype, weights)
    quantization = quantization_config(weights, device, keep=("vqmodel",))
    config = load_config(Emu3Config, path, "Emu3")  # first: the tokenizer reads config.json too
    tokenizer = load_tokenizer(path, "Emu3")
    files = safetensors_files(path)
    area = image_area(path)
    model = load_transformers_model(Emu3ForConditionalGeneration, config, files, device, dtype,
                                    device_map, convert=checkpoint_key, quantization=quantization)
    mean, std = image_norm(path)
    return Emu3Model(model, tokenizer, area, mean, std)


EXPECTS = ("a folder like BAAI/Emu3-Gen-hf: config.json (model_type emu3), model-*.safetensors "
           "+ model.safetensors.index.json, tokenizer.json, tokenizer_config.json")
