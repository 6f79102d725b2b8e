"""A DeepSpeed 1-bit Adam config run with pycomm's OneBitAdam over DDP,
started by torchrun (2 CPU processes, Gloo).

    torchrun --nproc-per-node 2 examples/deepspeed_migration.py
    torchrun --nproc-per-node 2 examples/deepspeed_migration.py --config ds_config.json

:func:`onebit_adam_from_deepspeed` reads the ``"optimizer"`` section of a
DeepSpeed config (``{"type": "OneBitAdam", "params": {...}}``), maps each key
it knows to pycomm's argument, warns for the keys that have no effect here
(``cuda_aware``, ``comm_backend_name``, ...) and raises ValueError naming any
key it cannot map. Keys the config leaves out take DeepSpeed's defaults
(``weight_decay`` 0, ``freeze_step`` 100000), and the variance stays frozen
after the warm-up as in DeepSpeed (``variance_update_every=0``; pycomm's own
default is 20). docs/optim.md, "Migrating from DeepSpeed's 1-bit
optimizers", lists what changes.
"""

import argparse
import json
import warnings
from typing import Any, Dict, Iterable, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from pycomm.optim import OneBitAdam

#: What the example trains with unless --config names a file: a DeepSpeed
#: config in the form of its 1-bit Adam tutorial's (freeze_step short for a
#: 30-step run).
DEEPSPEED_CONFIG = {
    "train_micro_batch_size_per_gpu": 16,
    "optimizer": {
        "type": "OneBitAdam",
        "params": {
            "lr": 1e-3,
            "betas": [0.9, 0.999],
            "eps": 1e-8,
            "weight_decay": 0.0,
            "freeze_step": 5,
            "cuda_aware": False,
            "comm_backend_name": "nccl",
        },
    },
}

#: DeepSpeed OneBitAdam key -> pycomm OneBitAdam argument.
MAPPED = {"lr": "lr", "betas": "betas", "eps": "eps", "weight_decay": "weight_decay",
          "freeze_step": "warmup_steps"}
#: DeepSpeed's defaults where pycomm's differ (OnebitAdam.__init__).
DEEPSPEED_DEFAULTS = {"weight_decay": 0.0, "freeze_step": 100000}
#: Keys accepted but without effect here: why.
NO_EFFECT = {
    "cuda_aware": "pycomm communicates over the torch.distributed process group it is given (Gloo or NCCL)",
    "comm_backend_name": "pycomm communicates over the torch.distributed process group it is given (Gloo or NCCL)",
    "bias_correction": "DeepSpeed's step never applied a bias correction; pycomm always applies AdamW's",
    "eps_inside_sqrt": "DeepSpeed's step never read it; pycomm adds eps outside the square root",
}
#: Keys of DeepSpeed's other 1-bit optimizers, named in the error.
OTHER_OPTIMIZERS = {
    "var_freeze_step": "ZeroOneAdam", "var_update_scaler": "ZeroOneAdam", "local_step_scaler": "ZeroOneAdam",
    "local_step_clipper": "ZeroOneAdam", "max_coeff": "OneBitLamb", "min_coeff": "OneBitLamb",
    "coeff_beta": "OneBitLamb", "factor_max": "OneBitLamb", "factor_min": "OneBitLamb",
    "factor_threshold": "OneBitLamb",
}


def deepspeed_to_pycomm(config: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, str]]:
    """The pycomm ``OneBitAdam`` arguments for a DeepSpeed config (the whole
    config or its ``"optimizer"`` section), and the DeepSpeed key each came
    from. Warns for each key without effect; raises ValueError naming every
    key it cannot map, or an optimizer type other than OneBitAdam."""
    section = config.get("optimizer", config)
    kind = str(section.get("type", ""))
    if kind.lower() in ("zerooneadam", "onebitlamb"):
        raise ValueError(f"DeepSpeed optimizer type {kind!r} has no pycomm counterpart (docs/optim.md, "
                         f"'Migrating from DeepSpeed's 1-bit optimizers'); only 'OneBitAdam' converts")
    if kind.lower() != "onebitadam":
        raise ValueError(f"optimizer type must be 'OneBitAdam', got {kind!r}")
    params = dict(section.get("params", {}))
    unknown = []
    for key in params:
        if key in MAPPED or key in NO_EFFECT:
            continue
        if key == "amsgrad" and params[key] is False:
            continue  # neither optimizer has AMSGrad; False asks for nothing
        if key == "amsgrad":
            unknown.append("amsgrad (True: neither DeepSpeed's 1-bit Adam nor pycomm's OneBitAdam has AMSGrad)")
        elif key == "max_grad_norm":
            unknown.append("max_grad_norm (clip the gradients before step(), "
                           "e.g. torch.nn.utils.clip_grad_norm_, with attach(model, overlap=False))")
        elif key in OTHER_OPTIMIZERS:
            unknown.append(f"{key} (a {OTHER_OPTIMIZERS[key]} key)")
        else:
            unknown.append(key)
    if unknown:
        raise ValueError(f"cannot map DeepSpeed OneBitAdam key(s) to pycomm: {', '.join(unknown)}")
    for key in params:
        if key in NO_EFFECT:
            warnings.warn(f"DeepSpeed key {key!r} has no effect in pycomm: {NO_EFFECT[key]}", UserWarning,
                          stacklevel=3)
    values = {**DEEPSPEED_DEFAULTS, **params}
    kwargs, source = {}, {}
    for key, arg in MAPPED.items():
        if key in values:
            kwargs[arg] = tuple(values[key]) if key == "betas" else values[key]
            source[arg] = key
    warmup = kwargs["warmup_steps"]
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
        raise ValueError(f"freeze_step must be an int >= 1 (pycomm's warmup_steps), got {warmup!r}")
    return kwargs, source


def onebit_adam_from_deepspeed(config: Dict[str, Any], params: Iterable[Any], *, variance_update_every: int = 0,
                               compressor: str = "onebit", **pycomm_settings: Any) -> OneBitAdam:
    """pycomm's OneBitAdam for a DeepSpeed OneBitAdam config. The variance
    stays frozen after the warm-up as in DeepSpeed unless
    ``variance_update_every`` says otherwise; ``compressor`` and
    ``pycomm_settings`` (``process_group``, ``block_size``, ``scaler``, ...)
    are pycomm's own."""
    kwargs, _ = deepspeed_to_pycomm(config)
    return OneBitAdam(params, **kwargs, variance_update_every=variance_update_every, compressor=compressor,
                      **pycomm_settings)


def main():
    from _common import dataset, make_model, report, train

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="a DeepSpeed JSON config (default: DEEPSPEED_CONFIG in this file)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=16, help="rows per rank per step")
    parser.add_argument("--out", help="folder for each rank's JSON report")
    parser.set_defaults(checkpoint=None, save_at=0)  # what _common.train reads; this example saves nothing
    args = parser.parse_args()
    torch.set_num_threads(1)  # the ranks share the machine's cores

    config = DEEPSPEED_CONFIG
    if args.config:
        with open(args.config) as f:
            config = json.load(f)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = make_model()
    ddp = DDP(model, bucket_cap_mb=0.25)
    opt = onebit_adam_from_deepspeed(config, model.parameters(), block_size=256)  # warns per key without effect
    opt.attach(ddp)  # the momenta all-reduced in step(), after backward, as in DeepSpeed
    if rank == 0:
        given = config.get("optimizer", config).get("params", {})
        group = opt.param_groups[0]
        actual = {**{a: group[a] for a in ("lr", "betas", "eps", "weight_decay")}, "warmup_steps": opt.warmup_steps}
        print("mapped: " + ", ".join(f"{k} -> {a}={actual[a]!r}" for k, a in MAPPED.items() if k in given)
              + "; no effect: " + ", ".join(k for k in given if k in NO_EFFECT)
              + f"; variance_update_every={opt.variance_update_every}", flush=True)

    x, y = dataset().tensors
    with torch.no_grad():
        before = nn.functional.mse_loss(model(x), y).item()
    loss = train(args, rank, ddp, opt, 0, checkpoint=None)
    with torch.no_grad():
        after = nn.functional.mse_loss(model(x), y).item()
    if rank == 0:
        print(f"data set loss: before {before:.5f}, after {after:.5f}", flush=True)
    report(args.out, rank, model, loss.item(), opt)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
