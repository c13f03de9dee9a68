"""The embedded reference model: a small class-conditional Fashion-MNIST image model.

Shipped in ``weights/`` (about 7 MB), retrained by ``python -m sjd_core.tools.reference.train``,
loaded by :func:`sjd_core.models.registry.load_model` like any real family (family ``reference``).
"""

from .adapter import (DESCRIPTION, EXPECTS, FAMILY, RECIPE, WEIGHTS_DIR, ReferenceModel, build,
                      is_reference_folder, resolutions_on_disk)

__all__ = ["DESCRIPTION", "EXPECTS", "FAMILY", "RECIPE", "WEIGHTS_DIR", "ReferenceModel", "build",
           "is_reference_folder", "resolutions_on_disk"]
