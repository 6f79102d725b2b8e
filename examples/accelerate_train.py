"""Accelerate with pycomm: compressed DDP on CPU (2 processes, torchrun),
every rank's hook state in ``save_state`` / ``load_state``.

    torchrun --nproc-per-node 2 examples/accelerate_train.py
    torchrun --nproc-per-node 2 examples/accelerate_train.py --backend pycomm
    torchrun --nproc-per-node 2 examples/accelerate_train.py --epochs 2 --checkpoint ckpt  # saved after epoch 1
    torchrun --nproc-per-node 2 examples/accelerate_train.py --epochs 2 --resume ckpt      # the same final model

``register_hook`` registers pycomm's hook on the prepared model
(``DistributedDataParallelKwargs(comm_hook=...)`` takes only Accelerate's own
hooks) and saves each rank's hook state in the checkpoint folder
(``register_for_checkpointing`` would save rank 0's only). On CPUs
Accelerate accepts no backend name but Gloo (and MPI): ``--backend pycomm``
initializes the default group as a pycomm group first
(``pycomm.integrations.init_process_group``), which Accelerate then uses.
"""

import torch
import torch.nn as nn
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs

from pycomm.integrations import init_process_group
from pycomm.integrations.accelerate import register_hook

from _common import dataset, make_model, parse_epoch_args, report

# Exact all-reduce for 5 iterations, then int8 (no error feedback, its default): the
# setup for momentum SGD (onebit on gradients costs final loss under
# momentum; docs/results.md, "The quality study").
HOOK = dict(compressor="int8", start_iter=5)


class Progress:
    """Epochs done: the same on every rank, so Accelerate's one-rank
    ``register_for_checkpointing`` is right for it (not for the hook state)."""

    def __init__(self):
        self.epochs = 0

    def state_dict(self):
        return {"epochs": self.epochs}

    def load_state_dict(self, d):
        self.epochs = d["epochs"]


def main():
    args = parse_epoch_args(__doc__, checkpoint_help="folder to save the state in after the first epoch",
                            resume_help="folder to resume from")
    torch.set_num_threads(1)  # the ranks share the machine's cores

    if args.backend == "pycomm":
        init_process_group(HOOK["compressor"], backend="gloo")
    # Small buckets, so that this small model has two (each with its residuals).
    accelerator = Accelerator(cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(bucket_cap_mb=0.25)])
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    # 256 rows, 16 per rank per step: 8 steps per epoch.
    loader = torch.utils.data.DataLoader(dataset(), batch_size=16)
    ddp, opt, loader = accelerator.prepare(model, opt, loader)
    state = register_hook(accelerator, ddp, **HOOK)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    if args.resume:
        accelerator.load_state(args.resume)

    loss = torch.tensor(0.0)
    for epoch in range(progress.epochs, args.epochs):
        for x, y in loader:
            loss = nn.functional.mse_loss(ddp(x), y)
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
        progress.epochs = epoch + 1
        if args.checkpoint and progress.epochs == 1:
            accelerator.save_state(args.checkpoint)

    report(args.out, accelerator.process_index, model, loss.item(), state)
    accelerator.end_training()


if __name__ == "__main__":
    main()
