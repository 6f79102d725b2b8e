"""Triton helpers shared by the kernel families in this package: the input
checks of ``csrc/ops/common.h``, the value every compressor works on, and the
registration of a family's launchers as ``torch.ops.pycomm.*_triton`` ops.

Nothing here (nor anywhere in this package) imports ``pycomm.compressors``:
the compressors reach these kernels through the registered ops, by name, as
the C++ engine does; the kernels never reach back into the reference.
"""

import contextlib
from typing import Callable, Iterable, Optional

import torch
import triton
import triton.language as tl
from torch._subclasses.functional_tensor import FunctionalTensorMode
from torch.library import wrap_triton
from triton.runtime.interpreter import InterpretedFunction


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


# Triton picks the interpreter when a @triton.jit function is defined (with
# TRITON_INTERPRET=1 in the environment), so this package's kernels are
# interpreted exactly when load_c is.
INTERPRETED = isinstance(load_c, InterpretedFunction)

GRAD_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# --------------------------------------------------- checks (common.h) ---
# The Triton ops raise what the C++ ops raise (TORCH_CHECK: RuntimeError),
# with the same messages, so a caller cannot tell the impls apart by errors.
def check(ok: bool, message: str) -> None:
    if not ok:
        raise RuntimeError(message)


def check_compress_inputs(grad: torch.Tensor, residual: Optional[torch.Tensor]) -> None:
    """check_compress_inputs of csrc/ops/common.h."""
    check(grad.dtype in GRAD_DTYPES, f"grad must be float32, float16 or bfloat16, got {grad.dtype}")
    check(grad.numel() > 0, "grad is empty: there is nothing to compress")
    check(grad.is_contiguous(), "grad must be contiguous")
    check(
        grad.numel() < 2**31,
        f"grad has {grad.numel()} elements; the payload uses int32 indices, so at most 2^31 - 1",
    )
    if residual is None:
        return
    check(residual.dtype == torch.float32, f"residual must be float32, got {residual.dtype}")
    check(
        residual.numel() == grad.numel(),
        f"residual has {residual.numel()} elements but grad has {grad.numel()}",
    )
    check(
        residual.device == grad.device,
        f"residual is on {residual.device} but grad is on {grad.device}",
    )
    check(residual.is_contiguous(), "residual must be contiguous: it is updated in place")


def check_out(out: torch.Tensor, device: torch.device) -> None:
    """check_out of csrc/ops/common.h."""
    check(out.dtype == torch.float32, f"out must be float32, got {out.dtype}")
    check(out.is_contiguous(), "out must be contiguous: it is written in place")
    check(out.device == device, f"out is on {out.device} but the payload is on {device}")


def check_decompress_out(out: torch.Tensor, payload: torch.Tensor) -> int:
    """A block decoder's first checks: ``out`` (check_out) on the device of
    the payload tensor ``payload``, and not empty. Returns its element count."""
    check_out(out, payload.device)
    n = out.numel()
    check(n > 0, "out is empty")
    return n


def check_scales(scales: torch.Tensor, n: int, block_size: int, payload: torch.Tensor, payload_name: str) -> None:
    """A block decoder's last checks: one scale per block of ``block_size``
    of the ``n`` elements, on the device of the payload tensor ``payload``
    (called ``payload_name`` in the message, as the C++ op names it)."""
    blocks = triton.cdiv(n, block_size)
    check(
        scales.numel() == blocks,
        f"scales has {scales.numel()} entries; {n} elements in blocks of {block_size} need {blocks}",
    )
    check(scales.device == payload.device, f"scales and {payload_name} are on different devices")


def stage_residual_out(grad: torch.Tensor, residual: torch.Tensor, residual_out: torch.Tensor) -> None:
    """What a ``*_compress_into`` op does before its launch, after its
    checks: ``residual`` and ``residual_out`` must be one tensor or not
    overlap, and ``residual_out`` takes ``residual``'s values. Not fused,
    unlike the C++ kernels: the Triton kernels update the residual they
    read, so the old residual is copied over first (one more read and write
    of n floats)."""
    nbytes = 4 * grad.numel()
    r_in, r_out = residual.data_ptr(), residual_out.data_ptr()
    check(
        r_in == r_out or r_in + nbytes <= r_out or r_out + nbytes <= r_in,
        "residual and residual_out must be the same tensor or not overlap",
    )
    if r_in != r_out:
        residual_out.copy_(residual)


def launch_decompress(
    kernel, tile: int, payload: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, block_size: int,
    **meta,
) -> None:
    """Launch a block decoder ``kernel(payload, scales, out, n, block_size,
    **meta)``, one program per ``tile`` elements of ``out`` (``meta``: its
    constexprs and launch options)."""
    n = out.numel()
    with device_guard(out):
        wrap_triton(kernel)[(triton.cdiv(n, tile),)](payload, scales, out, n, block_size, **meta)


# ------------------------------------------------------------ registration ---
def _keep_opaque(mode, op, types, args, kwargs):
    # What triton_op itself does under torch.export: functionalize the op as
    # a whole (auto_functionalize, shapes from its fake) instead of tracing
    # into its body.
    return mode.__torch_dispatch__(op, types, args, kwargs)


def register_op(
    name: str, *, mutates_args: Iterable[str], fake: Callable, traceable: bool = True
) -> Callable:
    """Register a function that launches Triton kernels (each through
    ``torch.library.wrap_triton``) as the dispatcher op ``name``.

    ``torch.library.triton_op`` defines the op (schema inferred from the type
    annotations: a Python ``int`` becomes ``SymInt`` where the C++ ops say
    ``int``, and torch 2.13's triton_op ignores a ``schema=`` given to it; a
    C++ caller passes an int64 either way) with a
    CompositeExplicitAutograd kernel, so C++ reaches it through
    ``c10::Dispatcher`` like any other op. Two things differ from a bare
    ``triton_op``:

    * ``fake`` is the op's FakeTensor kernel. triton_op would use the body
      itself, which launches the kernels: fine on a GPU, where wrap_triton
      turns a launch on FakeTensors into a traced no-op, but the interpreter
      (TRITON_INTERPRET=1) runs kernels on the tensors' memory, which
      FakeTensors do not have. Explicit fakes also cover bodies that are not
      traceable at all.
    * Under functionalization (torch.compile's AOTDispatcher) triton_op
      traces into the body so that Inductor sees the kernels. That needs
      compiled kernels and a body free of host syncs and pointer checks;
      otherwise (``traceable=False``, or interpreted kernels) the op stays
      one opaque node, as a ``torch.library.custom_op`` would.

    Example (how ``onebit.py`` registers its decoder)::

        @register_op("pycomm::onebit_decompress_triton", mutates_args=("out",),
                     fake=_decompress_fake)
        def onebit_decompress_triton(out: Tensor, bits: Tensor, scales: Tensor,
                                     block_size: int, accumulate: bool) -> None:
            ...  # checks, then torch.library.wrap_triton(_decompress_kernel)[grid](...)

        torch.ops.pycomm.onebit_decompress_triton(out, bits, scales, 2048, False)
    """

    def register(fn: Callable):
        op = torch.library.triton_op(name, fn, mutates_args=mutates_args)
        op.register_fake(fake)
        if INTERPRETED or not traceable:
            op.register_torch_dispatch(FunctionalTensorMode, _keep_opaque)
        return op

    return register
