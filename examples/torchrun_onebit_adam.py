"""OneBitAdam over DDP, started by torchrun (2 CPU processes): AdamW on
exactly averaged gradients for a warm-up, then the variance frozen and the
momenta all-reduced compressed (onebit), sent per DDP bucket while backward
runs (``attach(ddp, overlap=True)``).

    torchrun --nproc-per-node 2 examples/torchrun_onebit_adam.py
    torchrun --nproc-per-node 2 examples/torchrun_onebit_adam.py --no-overlap    # momenta sent in step()
    torchrun --nproc-per-node 2 examples/torchrun_onebit_adam.py --steps 40 --save-at 20 --checkpoint ckpt
    torchrun --nproc-per-node 2 examples/torchrun_onebit_adam.py --steps 40 --resume ckpt

Every rank saves its own checkpoint file: the optimizer's state holds this
rank's error-feedback residuals (one per DDP bucket with overlap). The
resumed run ends with exactly the parameters of the uninterrupted one.
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from pycomm.optim import OneBitAdam

from _common import add_run_options, make_model, report, train


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="steps of exact averaging first")
    parser.add_argument("--no-overlap", dest="overlap", action="store_false",
                        help="send the momenta in step(), after backward")
    add_run_options(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)  # the ranks share the machine's cores

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = make_model()
    ddp = DDP(model, bucket_cap_mb=0.25)
    opt = OneBitAdam(model.parameters(), lr=1e-3, warmup_steps=args.warmup, compressor="onebit", block_size=256)
    opt.attach(ddp, overlap=args.overlap)

    start = 0
    if args.resume:
        ck = torch.load(os.path.join(args.resume, f"rank{rank}.pt"), weights_only=True)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])  # this rank's residuals
        start = ck["step"]

    loss = train(args, rank, ddp, opt, start,
                 lambda step: {"model": model.state_dict(), "opt": opt.state_dict(), "step": step})
    report(args.out, rank, model, loss.item(), opt)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
