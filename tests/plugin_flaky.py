"""A registered compressor that fails on purpose at its ``fail_at``-th
compress call (counted per instance, so on every rank alike): a call that
fails part-way, after earlier chunks have updated their residuals."""

import torch

import pycomm


class Flaky:
    def __init__(self, fail_at: int = 0):
        self.fail_at = fail_at
        self.calls = 0

    def compress(self, grad, residual):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError(f"flaky compressor: failing at call {self.calls} on purpose")
        c = grad if residual is None else grad + residual
        half = c.to(torch.float16)
        if residual is not None:
            residual.copy_(c - half.float())
        return [half]

    def decompress(self, payload, out, accumulate):
        if accumulate:
            out.add_(payload[0].float())
        else:
            out.copy_(payload[0])


pycomm.register_compressor("flaky", Flaky)
