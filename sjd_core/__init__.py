"""Exact (and optionally relaxed) speculative Jacobi decoding for autoregressive image models.

Pure torch: this package never imports ComfyUI.
"""
