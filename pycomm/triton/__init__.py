"""Triton kernels of pycomm (the GPU fast path), registered as torch ops.

One module per kernel family (``onebit``, ``topk``, ``quant``: every width of the quant rows). Importing one
registers its kernels as ``torch.ops.pycomm.<family>_*_triton`` ops, with the
schemas of the C++ ops ``torch.ops.pycomm.<family>_*`` (``csrc/ops``), so
Python and the C++ engine reach every implementation the same way: by op
name, through the dispatcher. Each module also keeps ``compress`` /
``decompress`` functions that call those ops. ``pycomm.compressors`` imports
these modules lazily, so importing pycomm never needs Triton; nothing here
imports ``pycomm.compressors``. Under ``TRITON_INTERPRET=1`` the same kernels
run on CPU tensors (slowly), which is how the tests check them on machines
without a GPU.
"""
