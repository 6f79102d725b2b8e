"""pycomm.optim: optimizers that all-reduce their momentum compressed.

:class:`OneBitAdam` (AdamW) and :class:`OneBitSGD` (momentum SGD) average the
gradients exactly for ``warmup_steps`` steps, then all-reduce each rank's
momentum through pycomm's engine, compressed with error feedback (worker and
server residuals), over any process group and with or without DDP
(``optimizer.attach(ddp_model)``). docs/optim.md describes the algorithm,
the state and the guarantees.

:class:`DiLoCo` synchronizes rarely instead: each rank trains its whole copy
of the model with any torch optimizer, and every ``sync_every`` steps the
change of the parameters is all-reduced (compressed, optionally in streamed
fragments) and applied by an outer Nesterov SGD (docs/diloco.md).

Example (on every rank)::

    from pycomm.optim import OneBitAdam

    opt = OneBitAdam(model.parameters(), lr=1e-3, warmup_steps=100, compressor="onebit")
    for x, y in data:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
"""

from .diloco import DILOCO_KEY_BASE, DiLoCo
from .adam import OneBitAdam
from .base import KEY_BASE, KEY_SPAN
from .sgd import OneBitSGD

__all__ = ["DILOCO_KEY_BASE", "KEY_BASE", "KEY_SPAN", "DiLoCo", "OneBitAdam", "OneBitSGD"]
