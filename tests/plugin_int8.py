"""A compressor as a user writes it, in their own file: int8 with one
absmax scale per chunk, pure torch, registered at import. pycomm knows
nothing about it; tests/test_plugin.py runs it through every entry point."""

import torch

import pycomm


class Int8AbsMax:
    """Round ``c = grad + residual`` to int8 steps of ``absmax / levels``."""

    def __init__(self, levels: int = 127):
        if not 1 <= levels <= 127:
            raise ValueError(f"levels must be in [1, 127], got {levels}")
        self.levels = levels

    def compress(self, grad, residual):
        c = grad if residual is None else grad + residual
        scale = (c.abs().max() / self.levels).clamp(min=1e-30)
        q = torch.round(c / scale).to(torch.int8)
        if residual is not None:
            residual.copy_(c - q.float() * scale)
        return [q, scale.reshape(1)]

    def decompress(self, payload, out, accumulate):
        q, scale = payload
        decoded = q.float() * scale
        if accumulate:
            out.add_(decoded)
        else:
            out.copy_(decoded)


pycomm.register_compressor("int8-absmax", Int8AbsMax)
