"""The repository imported as one package named ``sjd_pack``, the way ComfyUI imports a custom
node folder (the node modules import the core relatively, so they need a parent package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parent.parent
NAME = "sjd_pack"


def import_pack() -> ModuleType:
    """The pack as a package (imported once per process)."""
    if NAME not in sys.modules:
        spec = importlib.util.spec_from_file_location(NAME, REPO / "__init__.py",
                                                      submodule_search_locations=[str(REPO)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[NAME] = module
        spec.loader.exec_module(module)
    return sys.modules[NAME]
