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

from ..messages import first_line, quote
from . import chameleon, emu3, janus, llamagen, reference
from .family_common import read_json
from .protocol import ImageTokenModel
from .weights import DeviceMap

__all__ = ["Family", "FAMILIES", "load_model"]


@dataclass(frozen=True)
class Family:
    """A model family the loader can build.

    detect: path -> True when the folder (or file) holds this family's checkpoint.
    build: (path, device=, dtype=, device_map=) -> the loaded model.
    expects: what must be on disk, shown to users when no family matches.
    """

    name: str
    detect: Callable[[Path], bool]
    build: Callable[..., ImageTokenModel]
    expects: str


# Files whose contents tell the families apart; when none matches, these must at least parse.
DESCRIPTIONS = ("config.json", reference.DESCRIPTION)
# Libraries whose own exception classes, raised while a checkpoint loads, are reported as
# ValueError naming the family and the checkpoint.
LIBRARIES = ("transformers", "tokenizers", "huggingface_hub", "safetensors", "accelerate", "torch",
             "json", "yaml")

FAMILIES: tuple[Family, ...] = (
    Family(chameleon.LUMINA, chameleon.detect_lumina, chameleon.build_lumina,
           chameleon.EXPECTS_LUMINA),
    Family(chameleon.ANOLE, chameleon.detect_anole, chameleon.build_anole, chameleon.EXPECTS_ANOLE),
    Family("emu3", emu3.detect, emu3.build, emu3.EXPECTS),
    Family("janus", janus.detect, janus.build, janus.EXPECTS),
    Family("llamagen", llamagen.detect, llamagen.build, llamagen.EXPECTS),
    Family(reference.FAMILY, reference.is_reference_folder, reference.build, reference.EXPECTS),
)


def load_model(path: str | os.PathLike, device: str | torch.device | None = None,
               dtype: torch.dtype | None = None, device_map: DeviceMap = None) -> ImageTokenModel:
    """Detect the family of the checkpoint at ``path`` and load it.

    device: where the whole model goes (default: CUDA when available, else the CPU); ignored when
        ``device_map`` places the modules.
    dtype: compute dtype (default bfloat16 on CUDA, float32 on the CPU).
    device_map: accelerate placement for models larger than one device (see :mod:`.weights`).
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"Model path {quote(str(p))} does not exist.")
    for family in FAMILIES:
        if family.detect(p):
            try:
                return family.build(p, device=device, dtype=dtype, device_map=device_map)
            except Exception as error:
                if type(error).__module__.split(".")[0] not in LIBRARIES:
                    raise  # the pack's own errors already say what to do
                raise ValueError(f"{family.name} checkpoint {quote(str(p))} could not be loaded: "
                                 f"{type(error).__name__} from {type(error).__module__} "
                                 f"({first_line(error)}); check that every file of the "
                                 "checkpoint is complete, or download it again.") from error
    for name in DESCRIPTIONS:
        read_json(p / name)  # a damaged description says so, instead of "no known family"
    listing = "\n".join(f"  - {f.name}: {f.expects}" for f in FAMILIES)
    raise ValueError(f"{quote(str(p))} is not a checkpoint of a known model family. Known families "
                     f"and what each expects on disk:\n{listing}")
