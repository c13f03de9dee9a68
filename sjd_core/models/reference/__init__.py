"""The embedded reference model: a small class-conditional Fashion-MNIST image model.

Shipped in ``weights/`` (about 7 MB), retrained by ``python -m sjd_core.models.reference.train``,
loaded by :func:`sjd_core.models.loader.load_model` like any real family (family ``reference``).
"""

from ..loader import register_family
from .adapter import FAMILY, WEIGHTS_DIR, ReferenceModel, build, is_reference_folder

__all__ = ["FAMILY", "WEIGHTS_DIR", "ReferenceModel", "build", "is_reference_folder"]

register_family(FAMILY, is_reference_folder, build,
                "a folder like sjd_core/models/reference/weights: reference.json (family "
                "'reference'), config.json, model.safetensors, codebook.safetensors")
