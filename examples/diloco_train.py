"""DiLoCo started by torchrun (2 CPU processes): every rank trains its own
whole copy of the model with AdamW, and every H inner steps the ranks
average the pseudo-gradient (parameters at the last sync minus now),
compressed, and a Nesterov outer step moves every copy to the new average.

    torchrun --nproc-per-node 2 examples/diloco_train.py                        # int8, H=16
    torchrun --nproc-per-node 2 examples/diloco_train.py --compressor int4 --error-feedback
    torchrun --nproc-per-node 2 examples/diloco_train.py --fragments 2 --delay 1   # streaming
    torchrun --nproc-per-node 2 examples/diloco_train.py --steps 64 --save-at 24 --checkpoint ckpt
    torchrun --nproc-per-node 2 examples/diloco_train.py --steps 64 --resume ckpt

Every rank saves its own checkpoint file (its model, which differs from the
others' between syncs, and its DiLoCo state: inner AdamW, outer momentum,
anchor, residuals, the sync in flight). At the end, ``opt.finish()`` leaves
every rank with the same model; the resumed run ends with exactly the
parameters of the uninterrupted one.
"""

import argparse
import os

import torch
import torch.distributed as dist

from pycomm.optim import DiLoCo

from _common import add_run_options, make_model, report, train


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=64, help="inner steps")
    parser.add_argument("--sync-every", type=int, default=16, help="H: inner steps between syncs")
    parser.add_argument("--fragments", type=int, default=1, help="F: fragments synced at staggered steps")
    parser.add_argument("--delay", type=int, default=0, help="inner steps a sync stays in flight")
    parser.add_argument("--compressor", default="int8", help="method of the pseudo-gradient's all-reduce")
    parser.add_argument("--error-feedback", action="store_true", help="keep the compression error")
    add_run_options(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)  # the ranks share the machine's cores

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = make_model()  # the same start on every rank
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt = DiLoCo(model, inner, sync_every=args.sync_every, fragments=args.fragments, delay=args.delay,
                 compressor=args.compressor, error_feedback=args.error_feedback or None)

    start = 0
    if args.resume:
        ck = torch.load(os.path.join(args.resume, f"rank{rank}.pt"), weights_only=True)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])  # this rank's residuals and sync in flight
        start = opt.step_count
    elif rank == 0:
        print(f"DiLoCo sends {opt.bytes_per_step():.0f} bytes per step on average, "
              f"{opt.memory_bytes()} bytes of state besides AdamW's", flush=True)

    # The sync in flight, if any, is saved with the optimizer's state.
    loss = train(args, rank, model, opt, start, lambda step: {"model": model.state_dict(), "opt": opt.state_dict()})
    opt.finish()  # the sync in flight applied and every fragment synced once more: one model on every rank
    report(args.out, rank, model, loss.item(), opt)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
