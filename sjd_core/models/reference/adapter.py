"""The embedded reference model behind the adapter protocol.

A stock transformers ``LlamaForCausalLM`` over the sequence ``[class token, c_0 .. c_255]``: the
class token is the slot -1 token (the context), the 256 codes of a 16x16 grid follow in raster
order with no structural tokens. It runs through the shared :class:`HFSession` like the real
families; only the vocabulary layout (codes first, then 10 class tokens, then the null class used
as the unconditional context) and the decoder (a codebook of 2x2 patches) are its own.

Prompts map to classes by the rule of :mod:`.prompts`. ``GenerationRequest.extra`` may hold
``{"prompts": [...]}``, one prompt per batch row, instead of one prompt for all rows.
The negative prompt, when given, names the class of the unconditional context (default: null).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from ..hf_session import Context, DecoderParts, HFSession
from ..weights import (input_device, load_transformers_model, quantization_config, resolve_device_dtype,
                       safetensors_files)
from ..protocol import GenerationRequest, MemoryShape, SamplingDefaults
from . import codebook as cb
from ...files import json_field, read_json_object
from ...messages import quote
from .prompts import ClassVocabulary

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
DESCRIPTION = "reference.json"
FAMILY = "reference"
RECIPE = "trained"  # the name of the model's one recipe
EXPECTS = ("a folder like sjd_core/models/reference/weights: reference.json (family "
           "'reference'), config.json, model.safetensors, codebook.safetensors")


def is_reference_folder(path: Path | str) -> bool:
    """True when ``path`` holds a reference model (its ``reference.json`` names the family)."""
    try:
        return read_json_object(Path(path) / DESCRIPTION).get("family") == FAMILY
    except (FileNotFoundError, ValueError):
        return False


def read_description(folder: Path | str) -> dict:
    """``reference.json`` of ``folder`` with every field the model reads checked for its type;
    ValueError naming the file and the field."""
    file = Path(folder) / DESCRIPTION
    meta, source = read_json_object(file), f"file {quote(str(file))}"
    for name, kind in (("classes", "str list"), ("synonyms", "object"), ("defaults", "object")):
        json_field(meta, name, source, kind)
    for name in ("codebook_size", "class_token_offset", "null_class_token", "patch"):
        json_field(meta, name, source, "int", minimum=1)
    json_field(meta, "grid", source, "int list", minimum=1, length=2)
    for name in meta["synonyms"]:
        json_field(meta["synonyms"], name, f"{source}: field 'synonyms'", "str list")
    defaults, where = meta["defaults"], f"{source}: field 'defaults'"
    for name in ("guidance", "temperature", "top_p"):
        json_field(defaults, name, where, "number")
    json_field(defaults, "top_k", where, "int", minimum=0)
    unknown = sorted(set(defaults) - {"guidance", "temperature", "top_k", "top_p"})
    if unknown:
        raise ValueError(f"{where} has the unknown fields {quote(unknown)}: it may hold guidance, "
                         "temperature, top_k and top_p.")
    return meta


class ReferenceModel:
    """Fashion-MNIST class-conditional image model (32x32 pixels, 16x16 codes, 512 codes)."""

    family = FAMILY

    def __init__(self, folder: Path | str = WEIGHTS_DIR, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None, device_map: str | dict | None = None,
                 weights: str | None = None) -> None:
        """Load a reference model folder with the loader's shared rules (device, dtype, device_map,
        weights)."""
        folder = Path(folder)
        missing = [name for name in (DESCRIPTION, "config.json", "model.safetensors",
                                     "codebook.safetensors") if not (folder / name).is_file()]
        if missing:
            raise FileNotFoundError(
                f"{folder} is not a complete reference model folder: missing {', '.join(missing)}. "
                "Retrain it with `python -m sjd_core.tools.reference.train --out FOLDER`.")
        meta = read_description(folder)
        device, dtype = resolve_device_dtype(device, dtype, weights)
        self.folder = folder
        self.dtype = dtype
        self._describe(meta)
        config = LlamaConfig.from_pretrained(str(folder), local_files_only=True)
        self.network = load_transformers_model(LlamaForCausalLM, config, safetensors_files(folder),
                                               device, dtype, device_map,
                                               quantization=quantization_config(weights, device))
        self.device = input_device(self.network)
        self.memory_shape = MemoryShape.of_config(config, dtype)
        self.codebook = load_file(str(folder / "codebook.safetensors"))["codebook"].float()
        if self.codebook.shape[0] != self.codebook_size:
            raise ValueError(f"{folder}: codebook.safetensors has {self.codebook.shape[0]} codes, "
                             f"{DESCRIPTION} says {self.codebook_size}.")
        code_head = self.network.lm_head.weight[: self.codebook_size]
        embed = self.network.model.embed_tokens
        self.parts = DecoderParts(
            backbone=self.network.model,
            embed_tokens=embed,
            embed_codes=embed,  # codes are token ids 0..codebook_size-1
            code_logits=lambda hidden: torch.nn.functional.linear(hidden, code_head),
            row_end_id=None,
            device=self.device,
            dtype=dtype,
        )

    def _describe(self, meta: dict) -> None:
        """Classes, codebook, token ids, grid and recipe, from the folder's description."""
        self.classes = ClassVocabulary(meta["classes"], meta["synonyms"])
        self.codebook_size = int(meta["codebook_size"])
        self.class_offset = int(meta["class_token_offset"])
        self.null_token = int(meta["null_class_token"])
        self.grid = (int(meta["grid"][0]), int(meta["grid"][1]))
        self.pixels = (self.grid[1] * int(meta["patch"]), self.grid[0] * int(meta["patch"]))
        self.recipes = {RECIPE: SamplingDefaults(
            **meta["defaults"], source="the reference model's own recipe (reference.json, written by "
                                       "sjd_core.tools.reference.train)")}
        self.defaults = self.recipes[RECIPE]

    def supported_resolutions(self) -> list[tuple[int, int]]:
        """Only the training size, 32x32 pixels."""
        return [self.pixels]

    def grid_for(self, resolution: tuple[int, int] | None) -> tuple[int, int]:
        """(16, 16) for 32x32 pixels (or None); anything else is a ValueError."""
        if resolution is not None and tuple(resolution) != self.pixels:
            raise ValueError(f"resolution={quote(resolution)} is not allowed: the reference model draws "
                             f"only {self.pixels[0]}x{self.pixels[1]} pixels (width, height).")
        return self.grid

    def codebook_embeddings(self) -> torch.Tensor:
        """(512, 4) pixel values of each code's 2x2 patch (what a code looks like), on the model's device."""
        return self.codebook.to(self.device)

    def class_of(self, prompt: str, input_name: str = "prompt") -> int | None:
        """Class index of a prompt (None = unconditional); ValueError listing the names."""
        return self.classes.resolve(prompt, input_name)

    def _token(self, index: int | None) -> torch.Tensor:
        return torch.tensor([self.null_token if index is None else self.class_offset + index])

    def start(self, request: GenerationRequest) -> HFSession:
        """One-token contexts: the class token (cond) and the null or negative class (uncond)."""
        self.grid_for(request.resolution)
        batch = request.batch_size
        if not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch_size={quote(batch)} is not allowed: it must be an integer >= 1.")
        prompts = request.extra.get("prompts", [request.prompt] * batch)
        if not isinstance(prompts, (list, tuple)) or len(prompts) != batch:
            raise ValueError(f"extra['prompts']={quote(prompts)} is not allowed: it must be a list of "
                             f"batch_size={batch} prompts, one per image.")
        names = ([f"prompt[{i}]" for i in range(batch)] if "prompts" in request.extra
                 else ["prompt"] * batch)
        classes = [self.class_of(p, name) for p, name in zip(prompts, names)]
        cond = [Context(ids=self._token(index)) for index in classes]
        uncond = None
        if request.guidance != 1.0:
            negative = self.class_of(request.negative_prompt, "negative_prompt")
            uncond = [Context(ids=self._token(negative)) for _ in range(batch)]
        session = HFSession(self.parts, cond, uncond, self.grid, request.max_nodes)
        session.unconditional = all(index is None for index in classes)
        return session

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """(B, 16, 16) codes -> (B, 32, 32, 3) grey images in [0, 1] (garment light on dark)."""
        if codes.ndim != 3 or tuple(codes.shape[1:]) != self.grid:
            raise ValueError(f"codes of shape {tuple(codes.shape)} are not allowed: the reference "
                             f"model decodes (B, {self.grid[0]}, {self.grid[1]}) code grids.")
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= self.codebook_size):
            raise ValueError(f"codes must lie in [0, {self.codebook_size}); got values in "
                             f"[{int(codes.min())}, {int(codes.max())}].")
        grey = cb.decode(codes.cpu(), self.codebook)
        return grey[..., None].expand(-1, -1, -1, 3).contiguous().float()


def resolutions_on_disk(path: Path) -> list[tuple[int, int]]:
    """The one size a reference model folder draws, from ``reference.json`` (no weights read)."""
    meta = read_description(path)
    return [(int(meta["grid"][1]) * int(meta["patch"]), int(meta["grid"][0]) * int(meta["patch"]))]


def build(path: Path, device: torch.device | str | None = None, dtype: torch.dtype | None = None,
          device_map: str | dict | None = None, weights: str | None = None) -> ReferenceModel:
    """The loader's entry point for the ``reference`` family."""
    return ReferenceModel(path, device=device, dtype=dtype, device_map=device_map, weights=weights)
