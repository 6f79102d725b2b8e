"""What the example scripts share: a tiny model, deterministic data, and a
report (printed by rank 0; with ``--out DIR``, one JSON file per rank)."""

import argparse
import hashlib
import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn

IN, HIDDEN, OUT = 32, 256, 4


def make_model() -> nn.Module:
    """~75K parameters: with bucket_cap_mb=0.25, DDP makes two buckets."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                         nn.Linear(HIDDEN, OUT))


def dataset(rows: int = 256):
    """A fixed regression problem (the same in every process)."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(rows, IN, generator=g)
    w = torch.randn(IN, OUT, generator=g) / IN**0.5
    return torch.utils.data.TensorDataset(x, torch.tanh(x @ w))


def add_run_options(parser) -> None:
    """The options every example takes: the batch, a checkpoint to save
    (``--checkpoint`` at ``--save-at``) or resume from, the reports' folder."""
    parser.add_argument("--batch", type=int, default=16, help="rows per rank per step")
    parser.add_argument("--checkpoint", help="folder to save a checkpoint in (at --save-at)")
    parser.add_argument("--save-at", type=int, default=0, help="save after this many steps")
    parser.add_argument("--resume", help="checkpoint folder to resume from")
    parser.add_argument("--out", help="folder for each rank's JSON report")


def parse_epoch_args(doc: str, checkpoint_help: str, resume_help: str) -> argparse.Namespace:
    """The command line of the examples that train by epochs through a
    framework (Accelerate, Lightning; ``doc``: the script's docstring): the
    backend, the epochs, a checkpoint to save (``checkpoint_help`` says
    when) or to resume from (``resume_help`` says what), the reports' folder."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--backend", choices=["gloo", "pycomm"], default="gloo")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--checkpoint", help=checkpoint_help)
    parser.add_argument("--resume", help=resume_help)
    parser.add_argument("--out", help="folder for each rank's JSON report")
    return parser.parse_args()


def train(args, rank, net, opt, start, checkpoint):
    """Steps ``start`` to ``args.steps`` of the regression on ``net`` (the
    DDP model or the module), rank ``rank``'s rows of each step's batch, the
    same in any run; at ``args.save_at`` each rank saves ``checkpoint(step)``
    (a dict) to ``args.checkpoint/rank<r>.pt``. Returns the last loss."""
    data = dataset()
    loss = torch.tensor(0.0)
    for step in range(start, args.steps):
        rows = torch.arange(args.batch) + (step * dist.get_world_size() + rank) * args.batch
        x, y = data[rows % len(data)]
        loss = nn.functional.mse_loss(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if args.checkpoint and step + 1 == args.save_at:
            os.makedirs(args.checkpoint, exist_ok=True)
            torch.save(checkpoint(step + 1), os.path.join(args.checkpoint, f"rank{rank}.pt"))
    return loss


def report(out_dir, rank, model, loss, state) -> dict:
    """What a run ends with; rank 0 prints it, ``out_dir`` gets every rank's.
    ``state``: the hook's CompressionState, or a pycomm.optim optimizer."""
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    saved = state.state_dict()
    if "pycomm" in saved:  # a compressed-momentum optimizer: its steps, its residuals
        who, saved, iterations = type(state).__name__, saved["pycomm"], saved["pycomm"]["step_count"]
    else:
        who, iterations = "hook", state.iteration
    result = {
        "rank": rank,
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "loss": float(loss),
        "hook_iteration": iterations,
        "residual_buckets": sorted(saved["engine"]["residuals"]),
        "params_sha256": hashlib.sha256(params.numpy().tobytes()).hexdigest(),
    }
    if rank == 0:
        print(f"backend {result['backend']}; final loss {result['loss']:.5f}; {who}: {iterations} iterations, "
              f"error-feedback residuals of buckets {result['residual_buckets']}", flush=True)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    return result
