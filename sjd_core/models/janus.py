"""Janus-Pro (``deepseek-community/Janus-Pro-1B`` / ``-7B``) on transformers' ``JanusForConditionalGeneration``.

Recipe (Janus's official image-generation example and transformers' ``generate``):

- prompt: BOS + ``"<|User|>: {prompt}\\n\\n<|Assistant|>:"`` + begin-of-image; 576 codes (24 x 24,
  384 px; the only size the VQ decodes), no row or end tokens;
- image codes bypass the text vocabulary: embedded with
  ``model.prepare_embeddings_for_image_generation`` and scored with ``model.model.generation_head``;
- guidance: the unconditional row is the same prompt with every token but BOS and
  begin-of-image replaced by the pad token; cfg 5, temperature 1, no top-k;
- the pad and begin-of-image ids come from ``generation_config.json`` (``pad_token_id``,
  ``boi_token_id``, as transformers' conversion writes them), else from the tokenizer;
- decode: ``model.decode_image_tokens``, unnormalised with the image processor's mean and std.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..files import json_field
from ..messages import quote
from .family_common import (check_codes, check_prompt_length, config_model_type, encode,
                            image_norm, load_config, load_tokenizer, pick_grid, read_json,
                            to_images)
from .hf_session import Context, DecoderParts, HFSession
from .weights import (input_device, load_transformers_model, quantization_config, resolve_device_dtype,
                      safetensors_files)
from .protocol import GenerationRequest, MemoryShape, SamplingDefaults

PROMPT_TEMPLATE = "<|User|>: {prompt}\n\n<|Assistant|>:"
IMAGE_START_TOKEN = "<begin_of_image>"
PAD_TOKEN = "<｜▁pad▁｜>"


class JanusModel:
    """Janus-Pro behind the adapter protocol (see the module docstring for the recipe)."""

    family = "janus"
    recipes = {"official example": SamplingDefaults(
        guidance=5.0, temperature=1.0, top_k=0,
        source="deepseek-ai/Janus generation_inference.py defaults (cfg_weight 5, temperature 1)")}
    defaults = recipes["official example"]

    def __init__(self, model, tokenizer, bos_id: int, image_start_id: int, pad_id: int,
                 image_mean: list[float] | None = None, image_std: list[float] | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.bos_id, self.image_start_id, self.pad_id = bos_id, image_start_id, pad_id
        self.device = input_device(model)
        self.dtype = next(model.parameters()).dtype
        self.memory_shape = MemoryShape.of_config(model.config, next(model.parameters()).dtype)
        vq = model.model.vqmodel
        self.codebook_size = int(vq.config.num_embeddings)
        side = int(vq.config.num_patches)
        pixels = side * 2 ** (len(vq.config.channel_multiplier) - 1)
        self._grids = {(pixels, pixels): (side, side)}
        self.image_mean = image_mean or [0.5, 0.5, 0.5]
        self.image_std = image_std or [0.5, 0.5, 0.5]

    def supported_resolutions(self) -> list[tuple[int, int]]:
        return list(self._grids)

    def grid_for(self, resolution: tuple[int, int] | None) -> tuple[int, int]:
        return pick_grid("Janus-Pro", resolution, self._grids)

    def codebook_embeddings(self) -> torch.Tensor:
        """The VQ codebook as its decoder sees it (L2-normalised rows)."""
        weight = self.model.model.vqmodel.quantize.embedding.weight.detach().float()
        return torch.nn.functional.normalize(weight, dim=-1)

    def prompt_ids(self, text: str) -> list[int]:
        """BOS + the chat template + begin-of-image."""
        return [self.bos_id] + encode(self.tokenizer, PROMPT_TEMPLATE.format(prompt=text)) + [self.image_start_id]

    def unconditional_ids(self, ids: list[int]) -> list[int]:
        """The recipe's unconditional row: every token but BOS and begin-of-image padded."""
        return [t if t in (self.bos_id, self.image_start_id) else self.pad_id for t in ids]

    def parts(self) -> DecoderParts:
        backbone = self.model.model.language_model
        return DecoderParts(
            backbone=backbone, embed_tokens=backbone.get_input_embeddings(),
            embed_codes=self.model.prepare_embeddings_for_image_generation,
            code_logits=self.model.model.generation_head, row_end_id=None,
            device=self.device, dtype=self.dtype)

    def start(self, request: GenerationRequest) -> HFSession:
        grid = self.grid_for(request.resolution)
        ids = self.prompt_ids(request.prompt)
        check_prompt_length("Janus-Pro", "prompt", len(ids), grid[0] * grid[1],
                            int(self.model.config.text_config.max_position_embeddings))
        cond = [Context(ids=torch.tensor(ids))] * request.batch_size
        uncond = None
        if request.guidance != 1.0:
            uncond = [Context(ids=torch.tensor(self.unconditional_ids(ids)))] * request.batch_size
        return HFSession(self.parts(), cond, uncond, grid, request.max_nodes)

    @torch.no_grad()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        check_codes("Janus-Pro", codes, self.codebook_size)
        side = next(iter(self._grids.values()))
        if tuple(codes.shape[1:]) != side:
            raise ValueError(f"Janus-Pro decodes only {side[0]}x{side[1]} code grids, got "
                             f"{tuple(codes.shape[1:])}.")
        vq = self.model.model.vqmodel
        pixels = vq.decode(codes.flatten(1).to(next(vq.parameters()).device))
        return to_images(pixels, self.image_mean, self.image_std)


def detect(path: Path) -> bool:
    """A Janus folder: ``config.json`` with ``model_type`` ``janus``."""
    return config_model_type(path) == "janus"


def _token_id(tokenizer, token: str, where: str) -> int:
    token_id = tokenizer.convert_tokens_to_ids(token)
    if token_id is None or token_id == tokenizer.unk_token_id:
        raise ValueError(f"Janus-Pro tokenizer lacks {quote(token)} and {where} does not name its id.")
    return int(token_id)


def resolutions_on_disk(path: Path) -> list[tuple[int, int]]:
    """The one size a Janus-Pro folder draws, from config.json alone (no weights read)."""
    from transformers import JanusConfig

    vq = JanusConfig.from_pretrained(str(path), local_files_only=True).vq_config
    pixels = int(vq.num_patches) * 2 ** (len(vq.channel_multiplier) - 1)
    return [(pixels, pixels)]


def build(path: Path, device=None, dtype=None, device_map=None, weights: str | None = None) -> JanusModel:
    """Load a Janus-Pro folder (config, safetensors, tokenizer, generation and processor configs)."""
    from transformers import JanusConfig, JanusForConditionalGeneration

    device, dtype = resolve_device_dtype(device, dtype, weights)
    quantization = quantization_config(weights, device, keep=("vqmodel", "generation_head"))
    config = load_config(JanusConfig, path, "Janus-Pro")  # first: the tokenizer reads config.json too
    tokenizer = load_tokenizer(path, "Janus-Pro")
    generation = read_json(path / "generation_config.json")
    where = str(path / "generation_config.json")
    image_start_id, pad_id = (json_field(generation, name, f"file {quote(where)}", "int", minimum=0,
                                         default=None) or _token_id(tokenizer, token, where)
                              for name, token in (("boi_token_id", IMAGE_START_TOKEN),
                                                  ("pad_token_id", PAD_TOKEN)))
    bos_id = config.text_config.bos_token_id
    if bos_id is None:
        bos_id = tokenizer.bos_token_id
    files = safetensors_files(path)
    model = load_transformers_model(JanusForConditionalGeneration, config, files, device, dtype, device_map,
                                    quantization=quantization)
    mean, std = image_norm(path)
    return JanusModel(model, tokenizer, int(bos_id), int(image_start_id), int(pad_id), mean, std)


EXPECTS = ("a folder like deepseek-community/Janus-Pro-1B: config.json (model_type janus), "
           "model*.safetensors, generation_config.json, tokenizer.json, tokenizer_config.json")
