"""pycomm.ddp: a drop-in DDP communication hook with gradient compression.

Example::

    from pycomm.ddp import CompressionState, compressed_hook

    state = CompressionState(process_group=None, compressor="topk", density=0.01,
                             start_iter=10, error_feedback=True)
    ddp_model.register_comm_hook(state, compressed_hook)

See :mod:`pycomm.ddp.hook` for how buckets are reduced, and
:mod:`pycomm.integrations` for Lightning and Accelerate (the hook on every
device, every rank's state in their checkpoints).
"""

from .hook import CompressionState, compressed_hook
from .serialized import serialized_hook

__all__ = ["CompressionState", "compressed_hook", "serialized_hook"]
