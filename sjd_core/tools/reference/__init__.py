"""Training and benchmarking the embedded reference model (its adapter lives in ``sjd_core.models``)."""
