"""Which model family a checkpoint on disk belongs to, and loading it.

:data:`FAMILIES` is the explicit table of every family the pack can load, in the order they are
asked: ``load_model(path)`` builds the first family whose ``detect`` recognises ``path``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..files import describe_entry
from ..messages import first_line, missing_library, quote
from . import chameleon, emu3, janus, llamagen, lumina2, reference
from .family_common import read_json
from .protocol import ImageTokenModel
from .weights import DeviceMap

__all__ = ["Family", "FAMILIES", "family_of", "load_model", "resolutions_on_disk", "offered_resolutions",
           "offered_recipes"]


@dataclass(frozen=True)
class Family:
    """A model family the loader can build.

    detect: path -> True when the folder (or file) holds this family's checkpoint.
    build: (path, device=, dtype=, device_map=, weights=) -> the loaded model.
    expects: what must be on disk, shown to users when no family matches.
    resolutions: path -> the (width, height) sizes the checkpoint draws, the default first, read
        from its config files without loading any weights.
    """

    name: str
    detect: Callable[[Path], bool]
    build: Callable[..., ImageTokenModel]
    expects: str
    resolutions: Callable[[Path], list[tuple[int, int]]]


# Files whose contents tell the families apart; when none matches, these must at least parse.
DESCRIPTIONS = ("config.json", reference.DESCRIPTION)
# Libraries whose own exception classes, raised while a checkpoint loads, are reported as
# ValueError naming the family and the checkpoint.
LIBRARIES = ("transformers", "tokenizers", "huggingface_hub", "safetensors", "accelerate", "torch",
             "json", "yaml")

FAMILIES: tuple[Family, ...] = (
    Family(lumina2.FAMILY, lumina2.detect, lumina2.build, lumina2.EXPECTS, lumina2.resolutions_on_disk),
    Family(chameleon.LUMINA, chameleon.detect_lumina, chameleon.build_lumina,
           chameleon.EXPECTS_LUMINA, chameleon.resolutions_on_disk),
    Family(chameleon.ANOLE, chameleon.detect_anole, chameleon.build_anole, chameleon.EXPECTS_ANOLE,
           chameleon.resolutions_on_disk),
    Family("emu3", emu3.detect, emu3.build, emu3.EXPECTS, emu3.resolutions_on_disk),
    Family("janus", janus.detect, janus.build, janus.EXPECTS, janus.resolutions_on_disk),
    Family("llamagen", llamagen.detect, llamagen.build, llamagen.EXPECTS, llamagen.resolutions_on_disk),
    Family(reference.FAMILY, reference.is_reference_folder, reference.build, reference.EXPECTS,
           reference.resolutions_on_disk),
)


def family_of(path: str | os.PathLike) -> Family:
    """The family whose ``detect`` recognises ``path`` first; errors name what each expects."""
    p = Path(path).expanduser()
    kind = describe_entry(p)
    if kind == "missing":
        raise FileNotFoundError(f"Model path {quote(str(p))} does not exist.")
    if kind not in ("a folder", "a regular file"):
        raise ValueError(f"Model path {quote(str(p))} is {kind}: a checkpoint is a folder or a "
                         "weights file (or a link to one).")
    for family in FAMILIES:
        if family.detect(p):
            return family
    for name in DESCRIPTIONS:
        read_json(p / name)  # a damaged description says so, instead of "no known family"
    listing = "\n".join(f"  - {f.name}: {f.expects}" for f in FAMILIES)
    names = ", ".join(f.name for f in FAMILIES)
    raise ValueError(f"{quote(str(p))} is not a checkpoint of a known model family ({names}). "
                     f"Known families and what each expects on disk:\n{listing}")


def resolutions_on_disk(path: str | os.PathLike) -> tuple[str, list[tuple[int, int]]]:
    """(family name, supported sizes) of the checkpoint at ``path``, without loading weights."""
    family = family_of(path)
    return family.name, family.resolutions(Path(path).expanduser())


def offered_resolutions() -> list[tuple[int, int]]:
    """Every size a released checkpoint of any family supports, for a node's static size list.

    Lumina-mGPT's sizes at each trained size, Lumina-mGPT 2.0's, Emu3's at its default area,
    LlamaGen's trained sizes (256, 384, 512), Janus-Pro's 384 and the reference model's 32.
    """
    sizes = [(32, 32), (256, 256), (384, 384), (512, 512)]
    for trained in chameleon.LUMINA_TRAINED_SIZES:
        sizes += chameleon.lumina_resolutions(trained)
    sizes += lumina2.resolutions_on_disk(Path("."))
    sizes += list(emu3.size_grids(emu3.DEFAULT_IMAGE_AREA, 8))
    return list(dict.fromkeys(sizes))


def offered_recipes() -> list[str]:
    """Every official recipe name a family offers, in the order of :data:`FAMILIES`, for a node's
    static list; the loaded model's own ``recipes`` decide which of them it has."""
    names = [*lumina2.RECIPES, *chameleon.LUMINA_RECIPES, *chameleon.ANOLE_RECIPES,
             *emu3.Emu3Model.recipes, *janus.JanusModel.recipes, *llamagen.RECIPE_NAMES,
             reference.RECIPE]
    return list(dict.fromkeys(names))


def load_model(path: str | os.PathLike, device: str | torch.device | None = None,
               dtype: torch.dtype | None = None, device_map: DeviceMap = None,
               weights: str | None = None) -> ImageTokenModel:
    """Detect the family of the checkpoint at ``path`` and load it.

    device: where the whole model goes (default: CUDA when available, else the CPU); ignored when
        ``device_map`` places the modules.
    dtype: compute dtype (default bfloat16 on CUDA, float32 on the CPU).
    device_map: accelerate placement for models larger than one device (see :mod:`.weights`).
    weights: how weights are stored, one of :data:`~.weights.WEIGHT_FORMATS`: ``"bf16"``,
        ``"fp16"``, ``"fp32"`` (the same as that dtype) or ``"int8"`` / ``"int4"`` weight-only
        (torchao; decoding is exact with respect to the quantised model). None: as ``dtype``.
    """
    family = family_of(path)
    p = Path(path).expanduser()
    try:
        return family.build(p, device=device, dtype=dtype, device_map=device_map, weights=weights)
    except ImportError as error:
        package = missing_library(error)
        if package is None:
            raise
        raise ImportError(f"Loading the {family.name} checkpoint {quote(str(p))} needs the "
                          f"{package} package, which is not installed: install it with "
                          f"`python -m pip install {package}` (in the Python that runs ComfyUI or "
                          "the pack's tools), then start again.") from error
    except Exception as error:
        if type(error).__module__.split(".")[0] not in LIBRARIES:
            raise  # the pack's own errors already say what to do
        raise ValueError(f"{family.name} checkpoint {quote(str(p))} could not be loaded: "
                         f"{type(error).__name__} from {type(error).__module__} "
                         f"({first_line(error)}); check that every file of the checkpoint is "
                         "complete, or download it again.") from error
