"""Small helpers the transformers-based family adapters share (Emu3, Janus-Pro, LlamaGen)."""

from __future__ import annotations

from pathlib import Path

import torch

from ..files import json_field, present_regular_file, read_json_object
from ..messages import first_line, quote

# Tokenizer files that are JSON: each is checked on its own, so a damaged one is named.
TOKENIZER_JSON = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                  "added_tokens.json", "vocab.json")
MIN_PROMPT_ROOM = 1024  # prompt tokens always allowed (see check_prompt_length)
# Encoded once when a tokenizer loads, so a broken vocabulary fails there and not mid-run.
TOKENIZER_PROBE = ("A photo of a red fox, 1024x1024: watercolour; \"quoted\" (text) & symbols "
                   "!?#$%*+-/<=>@[]^_`{|}~ \\ caf\u00e9 na\u00efve \u65e5\u672c \U0001f98a\n")


def read_json(file: Path) -> dict:
    """A JSON object from ``file`` ({} when nothing is there); ValueError naming the file when it
    is not a regular, readable, well-formed object (see :mod:`sjd_core.files`)."""
    try:
        return read_json_object(file)
    except FileNotFoundError:
        return {}


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


def load_config(config_class: type, folder: Path, family: str):
    """``config_class`` from ``folder/config.json``; ValueError naming the file and the family.

    transformers checks field types when it builds a config (a string where a number belongs
    raises a huggingface_hub validation error); that and any other failure to read the file is
    reported as the checkpoint's problem, with the file.
    """
    file = folder / "config.json"
    read_json(file)
    try:
        return config_class.from_pretrained(str(folder), local_files_only=True)
    except Exception as error:
        detail = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
        raise ValueError(f"{family} checkpoint: {quote(str(file))} is not a valid {config_class.__name__} "
                         f"({quote(detail)}); fix the field it names or download the file again."
                         ) from error


def load_tokenizer(folder: Path, family: str):
    """The checkpoint's own tokenizer (local files only, no remote code), checked on a test text.

    Every failure names the family and the tokenizer file: a JSON file that does not parse, a
    tokenizer transformers cannot build, or one that cannot encode ordinary text (for example a
    vocabulary without its unknown token), which would otherwise fail only when generating.
    """
    from transformers import AutoTokenizer

    present = [name for name in (*TOKENIZER_JSON, "merges.txt", "tokenizer.model")
               if present_regular_file(folder / name, f"{family} tokenizer file")]
    if not set(present) & {"tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model"}:
        raise FileNotFoundError(f"{family} checkpoint {quote(str(folder))} has no tokenizer: expected its "
                                f"tokenizer files (tokenizer.json, or vocab.json + merges.txt, with "
                                f"tokenizer_config.json) next to config.json; download them with the "
                                f"weights.")
    for name in TOKENIZER_JSON:
        try:
            read_json(folder / name)
        except ValueError as error:
            raise ValueError(f"{family} tokenizer: {error}") from None
    listing = ", ".join(present)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True,
                                                  trust_remote_code=False)
    except Exception as error:
        raise ValueError(f"{family} tokenizer in {quote(str(folder))} ({listing}) cannot be loaded "
                         f"({first_line(error)}); download the tokenizer files again.") from error
    try:
        tokenizer(TOKENIZER_PROBE, add_special_tokens=False)
    except Exception as error:
        raise ValueError(f"{family} tokenizer in {quote(str(folder))} ({listing}) loads but cannot "
                         f"encode text ({first_line(error)}): its vocabulary is damaged; download "
                         "the tokenizer files again.") from error
    return tokenizer


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of plain text, without special tokens added by the tokenizer."""
    try:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    except Exception as error:
        raise ValueError(f"the tokenizer cannot encode the text {quote(text)} "
                         f"({first_line(error)}); remove unusual characters or repair the "
                         "tokenizer files.") from error


def check_prompt_length(family: str, input_name: str, tokens: int, image_tokens: int,
                        context: int) -> None:
    """Refuse a prompt that leaves the image too few of the model's ``context`` positions.

    ``tokens`` counts the whole conditioning sequence (template and special tokens included);
    ``image_tokens`` the codes and structural tokens of the image at the chosen resolution.
    Rotary-position models also read past their configured context (a family's largest size may
    need more than ``max_position_embeddings`` by itself), so a prompt always has at least
    ``MIN_PROMPT_ROOM`` tokens. Called before the prefill, so an overlong prompt costs no memory.
    """
    room = max(context - image_tokens, MIN_PROMPT_ROOM)
    if tokens > room:
        floor = f"; a prompt may always have {MIN_PROMPT_ROOM:,}" if room > context - image_tokens else ""
        raise ValueError(f"{input_name} is {tokens:,} tokens long with {family}'s prompt template; "
                         f"at most {room:,} fit ({family}'s context is {context:,} positions and the "
                         f"image takes {image_tokens:,} at this resolution{floor}): shorten the "
                         f"{input_name.split('[')[0]}.")


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
    file = folder / "preprocessor_config.json"
    config, source = read_json(file), f"file {quote(str(file))}"
    mean, std = (json_field(config, name, source, "number list", default=[0.5, 0.5, 0.5], length=3)
                 for name in ("image_mean", "image_std"))
    return [float(v) for v in mean], [float(v) for v in std]
