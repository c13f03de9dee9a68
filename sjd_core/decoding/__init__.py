"""The decoding core: the one loop, drafting, acceptance rules, target distribution, settings, trace.

Pure torch. It sees a model only through :mod:`sjd_core.models.protocol`; it never imports a
model family, a tool or ComfyUI. The rules it implements, with their proofs, are written down in
``docs/algorithms.md``.
"""
