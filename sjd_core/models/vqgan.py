"""The decoder half of Chameleon's VQGAN (used by Lumina-mGPT and Anole), which transformers lacks.

transformers ships only the encoder (``ChameleonVQVAE``). The decoder weights come with Meta's
Chameleon release as ``vqgan.ckpt`` (a checkpoint whose ``state_dict`` holds ``decoder.*``,
``post_quant_conv.*`` and ``quantize.embedding.weight``) next to ``vqgan.yaml`` (its
``model.params``: ``ddconfig``, ``n_embed``, ``embed_dim``). The module names below follow that
checkpoint so it loads without renaming; the encoder keys it also holds are skipped.

Decoding: code -> codebook vector -> ``post_quant_conv`` -> conv in -> middle (res, attention,
res) -> for each level from the coarsest: ``num_res_blocks + 1`` residual blocks (+ attention at
the listed resolutions) and a 2x nearest upsample except at the finest level -> norm, swish,
conv out. Output in [-1, 1].
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..files import read_text
from ..messages import first_line, quote, unpickling_problem

__all__ = ["VQGANConfig", "VQGANDecoder", "load_vqgan_decoder"]


@dataclass(frozen=True)
class VQGANConfig:
    """The ``ddconfig`` fields the decoder needs, plus the codebook shape."""

    n_embed: int = 8192
    embed_dim: int = 256
    z_channels: int = 256
    ch: int = 128
    ch_mult: tuple[int, ...] = (1, 1, 2, 2, 4)
    num_res_blocks: int = 2
    attn_resolutions: tuple[int, ...] = ()
    resolution: int = 512
    out_ch: int = 3

    @classmethod
    def from_yaml(cls, file: Path) -> "VQGANConfig":
        import yaml

        try:
            params = yaml.safe_load(read_text(file, what="VQGAN config"))["model"]["params"]
            dd = params["ddconfig"]
            return cls(n_embed=int(params["n_embed"]), embed_dim=int(params["embed_dim"]),
                       z_channels=int(dd["z_channels"]), ch=int(dd["ch"]),
                       ch_mult=tuple(int(m) for m in dd["ch_mult"]),
                       num_res_blocks=int(dd["num_res_blocks"]),
                       attn_resolutions=tuple(int(r) for r in dd.get("attn_resolutions") or ()),
                       resolution=int(dd["resolution"]), out_ch=int(dd.get("out_ch", 3)))
        except (KeyError, TypeError, ValueError, yaml.YAMLError, RecursionError) as err:
            raise ValueError(f"{quote(str(file))} is not a VQGAN config: expected model.params "
                             f"with ddconfig, n_embed and embed_dim ({first_line(err)}).") from err


def _norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(32, channels, eps=1e-6)


class _Residual(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.norm1, self.conv1 = _norm(cin), nn.Conv2d(cin, cout, 3, padding=1)
        self.norm2, self.conv2 = _norm(cout), nn.Conv2d(cout, cout, 3, padding=1)
        if cin != cout:
            self.nin_shortcut = nn.Conv2d(cin, cout, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        skip = self.nin_shortcut(x) if hasattr(self, "nin_shortcut") else x
        return skip + h


class _Attention(nn.Module):
    """Single-head self-attention over all pixels, 1x1 convolutions for q, k, v and output."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.norm = _norm(channels)
        self.q, self.k, self.v, self.proj_out = (nn.Conv2d(channels, channels, 1) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        y = self.norm(x)
        q, k, v = (m(y).flatten(2).transpose(1, 2) for m in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v)
        return x + self.proj_out(out.transpose(1, 2).reshape(b, c, h, w))


class _Level(nn.Module):
    def __init__(self, cin: int, cout: int, blocks: int, attention: bool, upsample: bool) -> None:
        super().__init__()
        self.block = nn.ModuleList(_Residual(cin if i == 0 else cout, cout) for i in range(blocks))
        self.attn = nn.ModuleList(_Attention(cout) for _ in range(blocks if attention else 0))
        if upsample:
            self.upsample = nn.Module()
            self.upsample.conv = nn.Conv2d(cout, cout, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.block):
            x = block(x)
            if len(self.attn):
                x = self.attn[i](x)
        if hasattr(self, "upsample"):
            x = self.upsample.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))
        return x


class _Decoder(nn.Module):
    def __init__(self, cfg: VQGANConfig) -> None:
        super().__init__()
        levels = len(cfg.ch_mult)
        width = cfg.ch * cfg.ch_mult[-1]
        self.conv_in = nn.Conv2d(cfg.z_channels, width, 3, padding=1)
        self.mid = nn.Module()
        self.mid.block_1, self.mid.attn_1, self.mid.block_2 = (
            _Residual(width, width), _Attention(width), _Residual(width, width))
        resolution = cfg.resolution // 2 ** (levels - 1)
        up: list[_Level] = []
        for level in reversed(range(levels)):
            out = cfg.ch * cfg.ch_mult[level]
            up.append(_Level(width, out, cfg.num_res_blocks + 1, resolution in cfg.attn_resolutions,
                             upsample=level != 0))
            width = out
            resolution *= 2 if level != 0 else 1
        self.up = nn.ModuleList(reversed(up))  # indexed by level, finest first, as in the checkpoint
        self.norm_out = _norm(width)
        self.conv_out = nn.Conv2d(width, cfg.out_ch, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(z)
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(h)))
        for level in reversed(self.up):
            h = level(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class VQGANDecoder(nn.Module):
    """Codes (B, H, W) -> pixels (B, 3, 16H, 16W) in [-1, 1] (for the 5-level Chameleon config)."""

    def __init__(self, cfg: VQGANConfig) -> None:
        super().__init__()
        self.config = cfg
        self.quantize = nn.Module()
        self.quantize.embedding = nn.Embedding(cfg.n_embed, cfg.embed_dim)
        self.post_quant_conv = nn.Conv2d(cfg.embed_dim, cfg.z_channels, 1)
        self.decoder = _Decoder(cfg)

    @torch.no_grad()
    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        z = self.quantize.embedding(codes).permute(0, 3, 1, 2)
        return self.decoder(self.post_quant_conv(z))


def load_vqgan_decoder(config_file: Path, checkpoint_file: Path, device: torch.device,
                       dtype: torch.dtype = torch.float32) -> VQGANDecoder:
    """Build the decoder from ``vqgan.yaml`` and fill it from ``vqgan.ckpt`` (weights only)."""
    cfg = VQGANConfig.from_yaml(config_file)
    try:
        blob = torch.load(checkpoint_file, map_location="cpu", weights_only=True)
    except Exception as err:  # pickle errors of many kinds: a file that is not plain tensors
        raise ValueError(f"Could not read {quote(str(checkpoint_file))} as a weights-only checkpoint ({unpickling_problem(err)[1]}); "
                         "it must be the original Chameleon vqgan.ckpt (tensors only, nothing executable).") from err
    state = blob.get("state_dict", blob) if isinstance(blob, dict) else None
    if not isinstance(state, dict):
        raise ValueError(f"{quote(str(checkpoint_file))} holds no state dict of tensors.")
    with torch.device("meta"):
        model = VQGANDecoder(cfg)
    wanted = {k: v for k, v in state.items() if k in model.state_dict()}
    missing = sorted(set(model.state_dict()) - set(wanted))
    if missing:
        raise ValueError(f"{quote(str(checkpoint_file))} does not match {config_file.name}: missing {missing[:6]}"
                         f"{' ...' if len(missing) > 6 else ''}.")
    try:
        model.load_state_dict(wanted, assign=True)
    except RuntimeError as err:
        raise ValueError(f"{quote(str(checkpoint_file))} does not match {config_file.name}: {err}") from err
    return model.to(device=device, dtype=dtype).eval()
