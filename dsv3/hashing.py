"""Counter-based random numbers: a hash of (seed, index) instead of a generator's stream, so that a value depends
only on what it is for (an exact resume, a recompute, needs no RNG state) and costs a few integer ops."""

from __future__ import annotations

import torch


def mix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser on int32 (wrapping arithmetic; `& mask` makes the shifts logical)."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * -2048144789  # 0x85EBCA6B
    x = x ^ ((x >> 13) & 0x7FFFF)
    x = x * -1028477387  # 0xC2B2AE35
    return x ^ ((x >> 16) & 0xFFFF)


STRIDE = -1640531535  # 0x9E3779B1, the golden-ratio stride: consecutive elements' hash inputs


def random_bits(like: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
    """32 random bits (int32) per element of `like`, a hash of (seed, element index)."""
    index = torch.arange(like.numel(), device=like.device).view(like.shape)
    return mix32((index * STRIDE + seed).int())
