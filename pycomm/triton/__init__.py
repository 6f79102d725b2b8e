"""Triton kernels of pycomm (the GPU fast path).

One module per compressor family (``onebit``, ``topk``), each exposing
``compress`` / ``decompress`` on flat contiguous tensors; they are imported
lazily by ``pycomm.compressors`` so that importing pycomm never needs Triton.
Under ``TRITON_INTERPRET=1`` the same kernels run on CPU tensors (slowly),
which is how the tests check them on machines without a GPU.
"""
