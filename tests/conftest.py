"""Test set-up: the repository root is importable, and pytest collects it as a plain folder.

The root ``__init__.py`` is ComfyUI's entry point and imports only as part of a package
(``from .nodes import ...``). pytest imports it to collect the root as a package, which fails when
the checkout's folder name is not a Python identifier (``sjd-autoregressive``, as a git clone
names it). The tests import ``sjd_core`` and ``nodes`` from the root instead, so the root is
collected as a plain folder whatever its name.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# The checks that read the device back run in every test (and in the servers tests start): a
# draw from weights that are all 0 raises instead of silently giving code 0, and a forward that
# does not continue a session's cache is refused (``sjd_core.checks``).
os.environ["SJD_DEVICE_CHECKS"] = "1"

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


class _RootAsFolder:
    """Collects the repository root as a ``pytest.Dir`` instead of a package."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_collect_directory(self, path: Path, parent: pytest.Collector) -> pytest.Collector | None:
        if str(path) == ROOT:
            return pytest.Dir.from_parent(parent, path=path)
        return None


def pytest_configure(config: pytest.Config) -> None:
    # A plugin object, unlike this file's own hooks, also applies to the root folder itself.
    config.pluginmanager.register(_RootAsFolder(), "sjd-root-as-folder")


@pytest.fixture
def without_device_checks(monkeypatch):
    """Decoding without the device checks, for tests that count reads from the device or
    operations (each check is some of both)."""
    from sjd_core import checks

    monkeypatch.setattr(checks, "DEVICE_CHECKS", False)
