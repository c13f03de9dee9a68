"""The decoder half of SBER-MoVQGAN (``ai-forever/MoVQGAN``), the image tokenizer of Lumina-mGPT 2.0.

MoVQGAN is a VQGAN whose decoder normalises with *spatial* norms: every GroupNorm is followed by a
per-pixel scale and shift computed (1x1 convolutions ``conv_y``, ``conv_b``) from the quantised
code vectors, resized to the feature map by nearest-neighbour interpolation. Decoding:
code -> codebook vector ``zq`` -> ``post_quant_conv`` -> conv in -> middle (residual, attention,
residual) -> for each level from the coarsest: ``num_res_blocks + 1`` residual blocks (each
followed by attention at the coarsest level) and a 2x nearest upsample + conv except at the
finest level -> spatial norm, swish, conv out. Every norm sees ``zq``. Output in [-1, 1].

The released ``movqgan_270M.ckpt`` is a pickle: it is read with ``torch.load(weights_only=True)``
(nothing executable), or converted once to safetensors with
``python -m sjd_core.models.movqgan movqgan_270M.ckpt movqgan_270M.safetensors``. The architecture
is read from the tensor shapes (the 270M release: 16384 x 4 codebook, channels 256 x (1, 2, 2, 4),
two residual blocks per level, attention at the coarsest level: 8 pixels per code), and every
tensor the decoder needs is checked by name and shape; the encoder tensors are ignored.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..command_line import ArgumentParser, new_file, run_command
from ..files import require_regular_file
from ..messages import first_line, quote, unpickling_problem

PROG = "python -m sjd_core.models.movqgan"

__all__ = ["MoVQConfig", "MoVQDecoder", "load_movqgan_decoder", "read_movqgan_state", "convert_to_safetensors"]


@dataclass(frozen=True)
class MoVQConfig:
    """The shape of a MoVQGAN decoder (the defaults are the 270M release)."""

    n_embed: int = 16384
    embed_dim: int = 4
    z_channels: int = 4
    ch: int = 256
    ch_mult: tuple[int, ...] = (1, 2, 2, 4)
    num_res_blocks: int = 2
    attention_levels: tuple[int, ...] = (3,)  # levels (0 = finest) whose blocks have attention
    out_ch: int = 3

    @property
    def pixels_per_code(self) -> int:
        return 2 ** (len(self.ch_mult) - 1)

    @classmethod
    def from_shapes(cls, shapes: dict[str, tuple[int, ...]], source: str) -> "MoVQConfig":
        """The decoder configuration implied by a checkpoint's tensor shapes."""
        def shape(name: str) -> tuple[int, ...]:
            if name not in shapes:
                raise ValueError(f"{source} is not a MoVQGAN checkpoint: it has no {quote(name)} tensor.")
            return shapes[name]

        levels = sorted({int(m.group(1)) for k in shapes if (m := re.match(r"decoder\.up\.(\d+)\.", k))})
        if not levels or levels != list(range(len(levels))):
            raise ValueError(f"{source} is not a MoVQGAN checkpoint: no decoder.up.N levels.")
        blocks = {int(m.group(1)) for k in shapes if (m := re.match(r"decoder\.up\.0\.block\.(\d+)\.", k))}
        ch = shape("decoder.conv_out.weight")[1]
        mult = tuple(shape(f"decoder.up.{lv}.block.0.conv1.weight")[0] // ch for lv in levels)
        n_embed, embed_dim = shape("quantize.embedding.weight")
        return cls(n_embed=n_embed, embed_dim=embed_dim, z_channels=shape("post_quant_conv.weight")[0],
                   ch=ch, ch_mult=mult, num_res_blocks=len(blocks) - 1,
                   attention_levels=tuple(lv for lv in levels if f"decoder.up.{lv}.attn.0.q.weight" in shapes),
                   out_ch=shape("decoder.conv_out.weight")[0])


class _SpatialNorm(nn.Module):
    """GroupNorm(32) of the features, then a scale and shift per pixel computed from ``zq``."""

    def __init__(self, channels: int, zq_channels: int) -> None:
        super().__init__()
        self.norm_layer = nn.GroupNorm(32, channels, eps=1e-6)
        self.conv_y = nn.Conv2d(zq_channels, channels, 1)
        self.conv_b = nn.Conv2d(zq_channels, channels, 1)

    def forward(self, x: torch.Tensor, zq: torch.Tensor) -> torch.Tensor:
        zq = F.interpolate(zq, size=x.shape[-2:], mode="nearest")
        return self.norm_layer(x) * self.conv_y(zq) + self.conv_b(zq)


class _Residual(nn.Module):
    def __init__(self, cin: int, cout: int, zq_channels: int) -> None:
        super().__init__()
        self.norm1, self.conv1 = _SpatialNorm(cin, zq_channels), nn.Conv2d(cin, cout, 3, padding=1)
        self.norm2, self.conv2 = _SpatialNorm(cout, zq_channels), nn.Conv2d(cout, cout, 3, padding=1)
        if cin != cout:
            self.nin_shortcut = nn.Conv2d(cin, cout, 1)

    def forward(self, x: torch.Tensor, zq: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x, zq)))
        h = self.conv2(F.silu(self.norm2(h, zq)))
        skip = self.nin_shortcut(x) if hasattr(self, "nin_shortcut") else x
        return skip + h


class _Attention(nn.Module):
    """Single-head self-attention over all pixels, 1x1 convolutions for q, k, v and output."""

    def __init__(self, channels: int, zq_channels: int) -> None:
        super().__init__()
        self.norm = _SpatialNorm(channels, zq_channels)
        self.q, self.k, self.v, self.proj_out = (nn.Conv2d(channels, channels, 1) for _ in range(4))

    def forward(self, x: torch.Tensor, zq: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        y = self.norm(x, zq)
        q, k, v = (m(y).flatten(2).transpose(1, 2) for m in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v)
        return x + self.proj_out(out.transpose(1, 2).reshape(b, c, h, w))


class _Level(nn.Module):
    def __init__(self, cin: int, cout: int, blocks: int, attention: bool, upsample: bool,
                 zq_channels: int) -> None:
        super().__init__()
        self.block = nn.ModuleList(_Residual(cin if i == 0 else cout, cout, zq_channels) for i in range(blocks))
        self.attn = nn.ModuleList(_Attention(cout, zq_channels) for _ in range(blocks if attention else 0))
        if upsample:
            self.upsample = nn.Module()
            self.upsample.conv = nn.Conv2d(cout, cout, 3, padding=1)

    def forward(self, x: torch.Tensor, zq: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.block):
            x = block(x, zq)
            if len(self.attn):
                x = self.attn[i](x, zq)
        if hasattr(self, "upsample"):
            x = self.upsample.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))
        return x


class _Decoder(nn.Module):
    def __init__(self, cfg: MoVQConfig) -> None:
        super().__init__()
        zq = cfg.embed_dim
        width = cfg.ch * cfg.ch_mult[-1]
        self.conv_in = nn.Conv2d(cfg.z_channels, width, 3, padding=1)
        self.mid = nn.Module()
        self.mid.block_1 = _Residual(width, width, zq)
        self.mid.attn_1 = _Attention(width, zq)
        self.mid.block_2 = _Residual(width, width, zq)
        up: list[_Level] = []
        for level in reversed(range(len(cfg.ch_mult))):
            out = cfg.ch * cfg.ch_mult[level]
            up.append(_Level(width, out, cfg.num_res_blocks + 1, level in cfg.attention_levels,
                             upsample=level != 0, zq_channels=zq))
            width = out
        self.up = nn.ModuleList(reversed(up))  # indexed by level, finest first, as in the checkpoint
        self.norm_out = _SpatialNorm(width, zq)
        self.conv_out = nn.Conv2d(width, cfg.out_ch, 3, padding=1)

    def forward(self, z: torch.Tensor, zq: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(z)
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(h, zq), zq), zq)
        for level in reversed(self.up):
            h = level(h, zq)
        return self.conv_out(F.silu(self.norm_out(h, zq)))


class MoVQDecoder(nn.Module):
    """Codes (B, H, W) -> pixels (B, 3, 8H, 8W) in [-1, 1] (for the four-level 270M release)."""

    def __init__(self, cfg: MoVQConfig) -> None:
        super().__init__()
        self.config = cfg
        self.quantize = nn.Module()
        self.quantize.embedding = nn.Embedding(cfg.n_embed, cfg.embed_dim)
        self.post_quant_conv = nn.Conv2d(cfg.embed_dim, cfg.z_channels, 1)
        self.decoder = _Decoder(cfg)

    @torch.no_grad()
    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        zq = self.quantize.embedding(codes).permute(0, 3, 1, 2)
        return self.decoder(self.post_quant_conv(zq), zq)


def read_movqgan_state(file: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a MoVQGAN ``.ckpt`` (weights-only pickle) or ``.safetensors`` file."""
    file = require_regular_file(file, "MoVQGAN weights file")
    if file.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(file))
        except (SafetensorError, OSError) as err:
            raise ValueError(f"MoVQGAN weights {quote(str(file))} are damaged or truncated ({first_line(err)}); "
                             "convert or download them again.") from err
    try:
        blob = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:  # pickle errors of many kinds: a file that is not plain tensors
        raise ValueError(f"Could not read {quote(str(file))} as a weights-only checkpoint ({unpickling_problem(err)[1]}); it must "
                         "be the released movqgan_270M.ckpt (tensors only, nothing executable).") from err
    state = blob.get("state_dict", blob) if isinstance(blob, dict) else None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{quote(str(file))} holds no state dict of tensors.")
    return state


def load_movqgan_decoder(file: Path, device: torch.device, dtype: torch.dtype = torch.float32) -> MoVQDecoder:
    """Build the decoder from the shapes in ``file`` and fill it, checking every tensor it needs."""
    state = read_movqgan_state(file)
    try:
        cfg = MoVQConfig.from_shapes({k: tuple(v.shape) for k, v in state.items()}, quote(str(file)))
        with torch.device("meta"):
            model = MoVQDecoder(cfg)
    except (IndexError, ZeroDivisionError, RuntimeError, ValueError) as error:
        if str(error).startswith(quote(str(file))):
            raise  # from_shapes' own message names the file and the tensor
        raise ValueError(f"{quote(str(file))} is not a MoVQGAN checkpoint: its tensor shapes do "
                         f"not make a decoder ({first_line(error)}).") from error
    needed = model.state_dict()
    missing = sorted(set(needed) - set(state))
    wrong = sorted(k for k in set(needed) & set(state) if tuple(state[k].shape) != tuple(needed[k].shape))
    if missing or wrong:
        raise ValueError(f"{quote(str(file))} is not a complete MoVQGAN decoder: missing {missing[:6]}, wrong "
                         f"shapes {wrong[:6]} ({len(missing)} and {len(wrong)} in all).")
    model.load_state_dict({k: state[k] for k in needed}, assign=True)
    return model.to(device=device, dtype=dtype).eval()


def convert_to_safetensors(checkpoint: Path, out: Path) -> Path:
    """Write the decoder tensors of a MoVQGAN ``.ckpt`` to ``out`` (read weights-only, checked)."""
    from safetensors.torch import save_file

    decoder = load_movqgan_decoder(checkpoint, torch.device("cpu"))
    save_file({k: v.contiguous() for k, v in decoder.state_dict().items()}, str(out),
              metadata={"format": "pt", "source": checkpoint.name})
    return out


def main(argv: list[str] | None = None) -> None:
    """Command-line converter: one line and exit code 2 for a missing, damaged or refused file."""
    parser = ArgumentParser(prog=PROG, description="Convert the decoder of a MoVQGAN .ckpt to "
                                                   "safetensors (read weights-only, checked).")
    parser.add_argument("checkpoint", help="the released movqgan_270M.ckpt")
    parser.add_argument("out", type=new_file, help="the safetensors file to write")
    args = parser.parse_args(argv)
    print(run_command(PROG, lambda: convert_to_safetensors(Path(args.checkpoint), Path(args.out))))


if __name__ == "__main__":
    main()
