"""Small helpers the transformers-based family adapters share (Emu3, Janus-Pro, LlamaGen)."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def read_json(file: Path) -> dict:
    """A JSON object from ``file`` ({} when the file does not exist)."""
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except ValueError as error:
        raise ValueError(f"{str(file)!r} is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{str(file)!r} must hold a JSON object, got {type(data).__name__}.")
    return data


def config_model_type(folder: Path) -> str | None:
    """``model_type`` of ``folder/config.json``, or None when there is no readable config."""
    if not folder.is_dir():
        return None
    try:
        return read_json(folder / "config.json").get("model_type")
    except ValueError:
        return None


def pick_grid(family: str, resolution: tuple[int, int] | None,
              grids: dict[tuple[int, int], tuple[int, int]]) -> tuple[int, int]:
    """(grid_height, grid_width) for a (width, height) resolution; the first entry is the default."""
    if resolution is None:
        return next(iter(grids.values()))
    key = tuple(int(v) for v in resolution)
    if key not in grids:
        listing = ", ".join(f"{w}x{h}" for w, h in grids)
        raise ValueError(f"resolution={resolution[0]}x{resolution[1]} is not supported by {family}: "
                         f"use one of {listing} (width x height, in pixels).")
    return grids[key]


def load_tokenizer(folder: Path, family: str):
    """The checkpoint's own tokenizer (local files only, no remote code)."""
    from transformers import AutoTokenizer

    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json",
                                                       "vocab.json", "tokenizer.model")):
        raise FileNotFoundError(f"{family} checkpoint {str(folder)!r} has no tokenizer: expected its "
                                f"tokenizer files (tokenizer.json, or vocab.json + merges.txt, with "
                                f"tokenizer_config.json) next to config.json; download them with the "
                                f"weights.")
    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of plain text, without special tokens added by the tokenizer."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def check_codes(family: str, codes: torch.Tensor, codebook_size: int) -> None:
    """Refuse a code grid that is not (B, H, W) integers in [0, codebook_size)."""
    if codes.dim() != 3 or codes.dtype.is_floating_point:
        raise ValueError(f"{family} decode needs integer codes of shape (B, H, W), got "
                         f"{codes.dtype} {tuple(codes.shape)}.")
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= codebook_size):
        raise ValueError(f"{family} decode got codes in [{int(codes.min())}, {int(codes.max())}]; "
                         f"codes must lie in [0, {codebook_size}).")


def to_images(pixels: torch.Tensor, mean: list[float], std: list[float]) -> torch.Tensor:
    """(B, 3, H, W) normalised decoder output -> (B, H, W, 3) float32 in [0, 1] on the CPU."""
    m = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
    return (pixels.float().cpu() * s + m).clamp(0, 1).permute(0, 2, 3, 1).contiguous()


def image_norm(folder: Path) -> tuple[list[float], list[float]]:
    """The image processor's mean and std (``preprocessor_config.json``); default 0.5 / 0.5."""
    config = read_json(folder / "preprocessor_config.json")
    mean = config.get("image_mean", [0.5, 0.5, 0.5])
    std = config.get("image_std", [0.5, 0.5, 0.5])
    return [float(v) for v in mean], [float(v) for v in std]
