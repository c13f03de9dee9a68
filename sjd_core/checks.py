"""Checks that read values back from the device, for the test suite.

Each read makes the host wait for the device, so decoding runs without them; the suite turns
them on (environment variable ``SJD_DEVICE_CHECKS=1``), so that an inconsistency fails where it
starts: a draw from weights that are all 0 (:func:`.decoding.sampling.sample`), and slots or
committed counts that do not continue what a session cached
(:class:`.models.session.slot_session.SlotSession`).
"""

from __future__ import annotations

import os

DEVICE_CHECKS = os.environ.get("SJD_DEVICE_CHECKS") == "1"
