"""DDP with pycomm's compressed hook, started by torchrun (2 CPU processes).

    torchrun --nproc-per-node 2 examples/torchrun_ddp.py                    # the hook over Gloo
    torchrun --nproc-per-node 2 examples/torchrun_ddp.py --backend pycomm   # the pycomm backend
    torchrun --nproc-per-node 2 examples/torchrun_ddp.py --steps 40 --save-at 20 --checkpoint ckpt
    torchrun --nproc-per-node 2 examples/torchrun_ddp.py --steps 40 --resume ckpt

Over Gloo the hook wraps the group into a pycomm group of its own at the
first bucket; with ``--backend pycomm`` the default group is already one
(``pd.init_process_group``) and the hook hands it each bucket with its key.
Every rank saves its own checkpoint file: the error-feedback residuals in
the hook's state differ between ranks. The resumed run ends with exactly
the parameters of the uninterrupted one.
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import pycomm.distributed as pd
from pycomm.ddp import CompressionState, compressed_hook

from _common import add_run_options, make_model, report, train

# Exact all-reduce for 5 iterations, then int8 (no error feedback, its default): the
# setup for momentum SGD (onebit on gradients costs final loss under
# momentum; docs/results.md, "The quality study").
HOOK = dict(compressor="int8", start_iter=5)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["gloo", "pycomm"], default="gloo")
    parser.add_argument("--steps", type=int, default=30)
    add_run_options(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)  # the ranks share the machine's cores

    if args.backend == "pycomm":
        # The default group compresses; the hook must ask for the same settings.
        pd.init_process_group(compressor=HOOK["compressor"], backend="gloo")
    else:
        dist.init_process_group("gloo")
    rank = dist.get_rank()

    model = make_model()
    ddp = DDP(model, bucket_cap_mb=0.25)
    state = CompressionState(process_group=None, **HOOK)  # None: the default group
    ddp.register_comm_hook(state, compressed_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    start = 0
    if args.resume:
        ck = torch.load(os.path.join(args.resume, f"rank{rank}.pt"), weights_only=True)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        state.load_state_dict(ck["hook"])
        start = ck["step"]

    loss = train(args, rank, ddp, opt, start, lambda step: {"model": model.state_dict(), "opt": opt.state_dict(),
                                                            "hook": state.state_dict(), "step": step})
    report(args.out, rank, model, loss.item(), state)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
