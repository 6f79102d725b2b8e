"""Lightning with pycomm: compressed DDP on CPU (2 processes), every rank's
hook state in Lightning's checkpoints.

    python examples/lightning_train.py                     # Lightning starts the 2 processes
    torchrun --nproc-per-node 2 examples/lightning_train.py
    python examples/lightning_train.py --backend pycomm    # the pycomm backend, with its settings
    python examples/lightning_train.py --epochs 2 --checkpoint ckpt           # a checkpoint per epoch
    python examples/lightning_train.py --epochs 2 --resume ckpt/epoch=0.ckpt  # the same final model

``CompressionCallback`` registers pycomm's hook on the DDP model on any
device (``DDPStrategy(ddp_comm_hook=...)`` does so on CUDA only) and keeps
each rank's hook state in the checkpoint. ``--backend pycomm`` names a
backend that carries pycomm's settings (``pycomm.integrations.backend``), as
``DDPStrategy`` takes only a name.
"""

import lightning.pytorch as L
import torch
import torch.nn as nn
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy

from pycomm.integrations import backend
from pycomm.integrations.lightning import CompressionCallback

from _common import dataset, make_model, parse_epoch_args, report

# Exact all-reduce for 5 iterations, then int8 (no error feedback, its default): the
# setup for momentum SGD (onebit on gradients costs final loss under
# momentum; docs/results.md, "The quality study").
HOOK = dict(compressor="int8", start_iter=5)


class Regressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = make_model()
        self.last_loss = float("nan")

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.last_loss = loss.item()
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def main():
    args = parse_epoch_args(__doc__, checkpoint_help="folder for a checkpoint at the end of every epoch",
                            resume_help="checkpoint file to resume from")
    torch.set_num_threads(1)  # the ranks share the machine's cores

    compression = CompressionCallback(**HOOK)
    callbacks = [compression]
    if args.checkpoint:
        callbacks.append(ModelCheckpoint(dirpath=args.checkpoint, filename="{epoch}", save_top_k=-1,
                                         every_n_epochs=1))
    # The pycomm backend must compress as the hook asks (block_size); DDP's
    # own small collectives go through it unchanged.
    pg_backend = backend(HOOK["compressor"]) if args.backend == "pycomm" else None
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_epochs=args.epochs,
        strategy=DDPStrategy(process_group_backend=pg_backend, bucket_cap_mb=0.25),
        callbacks=callbacks, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=bool(args.checkpoint), deterministic=True,
    )
    model = Regressor()
    # 256 rows, 16 per rank per step: 8 steps per epoch.
    loader = torch.utils.data.DataLoader(dataset(), batch_size=16)
    trainer.fit(model, loader, ckpt_path=args.resume)
    report(args.out, trainer.global_rank, model.net, model.last_loss, compression.state)


if __name__ == "__main__":
    main()
