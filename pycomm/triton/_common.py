"""Triton helpers shared by the kernel families in this package."""

import contextlib

import torch
import triton
import triton.language as tl


def device_guard(t: torch.Tensor):
    """Launch on ``t``'s GPU (Triton uses the current device); nothing on CPU
    tensors (the interpreter)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


@triton.jit
def load_c(grad_ptr, res_ptr, offs, mask, HAS_RES: tl.constexpr):
    """c = grad (as float32) + residual, the value every compressor works on.
    Without a residual c is grad alone: adding 0.0 would turn -0.0 into +0.0."""
    if grad_ptr.dtype.element_ty == tl.bfloat16:
        # bfloat16 -> float32 is the 16 bits shifted up (compress_math.h),
        # exact for subnormals too; a converting load may flush those to
        # zero (Triton's CPU interpreter does).
        bits = tl.load(grad_ptr.to(tl.pointer_type(tl.uint16)) + offs, mask=mask, other=0)
        c = (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        c = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        c = c + tl.load(res_ptr + offs, mask=mask, other=0.0)
    return c
