"""The example scripts (examples/), run as a user runs them: 2 CPU processes
started by torchrun or by the framework's own launcher. Each trains with
pycomm's compressed hook, and a run resumed from a checkpoint ends with
exactly the parameters of the uninterrupted one (bit for bit: every rank
saved and restored its own error-feedback residuals). The hook over Gloo
(wrapped into the engine's group) and over the pycomm backend run the same
engine with the same settings, so they end identical too.

Every run is bounded by a timeout; its process group is killed past it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from _dist import subprocess_env

from pycomm.distributed import spec

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
TIMEOUT = 240  # seconds per run: a few seconds of training, imports of a framework, a shared machine


def _run(args, timeout=TIMEOUT):
    env = subprocess_env()
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # its own process group: the workers die with it
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(map(str, args))} did not finish within {timeout} s:\n{out[-4000:]}")
    assert proc.returncode == 0, f"{' '.join(map(str, args))} exited with {proc.returncode}:\n{out[-6000:]}"
    return out


def _torchrun(script, *args):
    return _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                 str(EXAMPLES / script), *map(str, args)])


def _reports(directory):
    return [json.loads((Path(directory) / f"rank{r}.json").read_text()) for r in range(2)]


#: Whether the examples' hook method (int8) keeps residuals by default (the
#: table's rule: spec.error_feedback_for).
HOOK_EF = spec.error_feedback_for("int8", None)


def _check(reports, backend, iterations, buckets=(0, 1), ef=HOOK_EF):
    for rank, r in enumerate(reports):
        assert r["rank"] == rank
        assert r["backend"] == backend or (backend.endswith("*") and r["backend"].startswith(backend[:-1])), r
        assert r["hook_iteration"] == iterations  # the hook ran every iteration
        # and compressed; residuals kept per bucket where error feedback is on
        assert r["residual_buckets"] == (list(buckets) if ef else [])
    assert reports[0]["params_sha256"] == reports[1]["params_sha256"]  # ranks identical


def _same_model(a, b):
    return [r["params_sha256"] for r in a] == [r["params_sha256"] for r in b]


def test_torchrun_example(tmp_path):
    full, resumed, ckpt = tmp_path / "full", tmp_path / "resumed", tmp_path / "ckpt"
    out = _torchrun("torchrun_ddp.py", "--steps", 30, "--save-at", 15, "--checkpoint", ckpt, "--out", full)
    assert "hook: 30 iterations" in out
    assert sorted(os.listdir(ckpt)) == ["rank0.pt", "rank1.pt"]
    # resumed over the pycomm backend: the same engine, the same settings
    _torchrun("torchrun_ddp.py", "--steps", 30, "--resume", ckpt, "--backend", "pycomm", "--out", resumed)
    _check(_reports(full), "gloo", 30)
    _check(_reports(resumed), "pycomm", 30)
    assert _same_model(_reports(full), _reports(resumed))


def test_onebit_adam_example(tmp_path):
    full, resumed, ckpt = tmp_path / "full", tmp_path / "resumed", tmp_path / "ckpt"
    out = _torchrun("torchrun_onebit_adam.py", "--steps", 30, "--save-at", 15, "--checkpoint", ckpt, "--out", full)
    assert "OneBitAdam: 30 iterations" in out
    _torchrun("torchrun_onebit_adam.py", "--steps", 30, "--resume", ckpt, "--out", resumed)
    # With overlap the residuals are per DDP bucket: keys 1 + bucket index.
    _check(_reports(full), "gloo", 30, buckets=(1, 2), ef=True)
    _check(_reports(resumed), "gloo", 30, buckets=(1, 2), ef=True)
    assert _same_model(_reports(full), _reports(resumed))


def test_deepspeed_migration_example(tmp_path):
    # A DeepSpeed OneBitAdam config converted to pycomm's OneBitAdam and
    # trained under DDP on 2 Gloo ranks.
    out = _torchrun("deepspeed_migration.py", "--steps", 30, "--out", tmp_path)
    assert ("mapped: lr -> lr=0.001, betas -> betas=(0.9, 0.999), eps -> eps=1e-08, "
            "weight_decay -> weight_decay=0.0, freeze_step -> warmup_steps=5; "
            "no effect: cuda_aware, comm_backend_name; variance_update_every=0") in out
    assert "DeepSpeed key 'cuda_aware' has no effect in pycomm" in out
    before, after = map(float, re.search(r"data set loss: before ([\d.]+), after ([\d.]+)", out).groups())
    assert after < 0.5 * before, out
    assert "OneBitAdam: 30 iterations" in out
    _check(_reports(tmp_path), "gloo", 30, buckets=(0,), ef=True)  # one flat buffer: key_base + 0

    # The conversion alone, in this process: the example imported by path.
    import importlib.util
    import warnings

    import torch

    sys.path.insert(0, str(EXAMPLES))
    try:
        spec_ = importlib.util.spec_from_file_location("deepspeed_migration", EXAMPLES / "deepspeed_migration.py")
        ex = importlib.util.module_from_spec(spec_)
        spec_.loader.exec_module(ex)
    finally:
        sys.path.remove(str(EXAMPLES))
    params = list(torch.nn.Linear(4, 2).parameters())

    def config(**kv):
        return {"optimizer": {"type": "OneBitAdam", "params": kv}}

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # mapped keys warn about nothing
        opt = ex.onebit_adam_from_deepspeed(config(lr=4e-4, betas=[0.8, 0.99], eps=1e-6, weight_decay=0.01,
                                                   freeze_step=7, amsgrad=False), params)
    group = opt.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (4e-4, (0.8, 0.99), 1e-6, 0.01)
    assert (opt.warmup_steps, opt.variance_update_every, opt.compressor) == (7, 0, "onebit")
    # DeepSpeed's defaults for absent keys, where pycomm's differ
    opt = ex.onebit_adam_from_deepspeed(config(), params)
    assert (opt.param_groups[0]["weight_decay"], opt.warmup_steps) == (0.0, 100000)
    for key in ("cuda_aware", "comm_backend_name", "bias_correction", "eps_inside_sqrt"):
        with pytest.warns(UserWarning, match=f"'{key}' has no effect in pycomm"):
            ex.onebit_adam_from_deepspeed(config(**{key: True}), params)
    for kv, named in [({"freeze_stpe": 5}, "freeze_stpe"), ({"var_freeze_step": 10}, "var_freeze_step (a ZeroOneAdam"),
                      ({"max_coeff": 0.3}, "max_coeff (a OneBitLamb"), ({"max_grad_norm": 1.0}, "max_grad_norm"),
                      ({"amsgrad": True}, "amsgrad")]:
        with pytest.raises(ValueError, match=re.escape(named)):
            ex.onebit_adam_from_deepspeed(config(lr=1e-3, cuda_aware=False, **kv), params)
    for kind in ("ZeroOneAdam", "OneBitLamb"):
        with pytest.raises(ValueError, match=f"'{kind}' has no pycomm counterpart"):
            ex.onebit_adam_from_deepspeed({"optimizer": {"type": kind, "params": {}}}, params)
    with pytest.raises(ValueError, match="freeze_step must be an int >= 1"):
        ex.onebit_adam_from_deepspeed(config(freeze_step=0), params)

    # docs/optim.md's key table says what the example does: each mapped key
    # to its argument, every other key to none.
    section = (EXAMPLES.parent / "docs" / "optim.md").read_text().split("### Config keys")[1].split("\n### ")[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`"):
            for key in re.findall(r"`(\w+)`", cells[0]):
                rows[key] = cells[3]
    for key, arg in ex.MAPPED.items():
        assert rows[key].startswith(f"`{arg}`"), (key, rows[key])
    for key in [*ex.NO_EFFECT, *ex.OTHER_OPTIMIZERS, "amsgrad", "max_grad_norm"]:
        assert rows[key].startswith("none"), (key, rows[key])


def test_lightning_example(tmp_path):
    pytest.importorskip("lightning")
    full, resumed, ckpt = tmp_path / "full", tmp_path / "resumed", tmp_path / "ckpt"
    # torchrun, the pycomm backend named with its settings
    _torchrun("lightning_train.py", "--backend", "pycomm", "--epochs", 2, "--checkpoint", ckpt, "--out", full)
    assert sorted(os.listdir(ckpt)) == ["epoch=0.ckpt", "epoch=1.ckpt"]
    # Lightning's own launcher starts the second process
    _run([sys.executable, str(EXAMPLES / "lightning_train.py"), "--backend", "pycomm", "--epochs", "2",
          "--resume", str(ckpt / "epoch=0.ckpt"), "--out", str(resumed)])
    _check(_reports(full), "pycomm_int8*", 16)
    _check(_reports(resumed), "pycomm_int8*", 16)
    assert _same_model(_reports(full), _reports(resumed))

    import torch

    saved = torch.load(ckpt / "epoch=0.ckpt", weights_only=True)["callbacks"]["pycomm.CompressionCallback"]
    assert sorted(saved["ranks"]) == [0, 1]  # every rank's hook state, in the one file rank 0 wrote
    assert [saved["ranks"][r]["engine"]["rank"] for r in (0, 1)] == [0, 1]
    assert all(saved["ranks"][r]["iteration"] == 8 and bool(saved["ranks"][r]["engine"]["residuals"]) == HOOK_EF
               for r in (0, 1))


def test_accelerate_example(tmp_path):
    pytest.importorskip("accelerate")
    full, resumed, ckpt = tmp_path / "full", tmp_path / "resumed", tmp_path / "ckpt"
    _torchrun("accelerate_train.py", "--epochs", 2, "--checkpoint", ckpt, "--out", full)
    assert {"pycomm_hook_rank0.pt", "pycomm_hook_rank1.pt"} <= set(os.listdir(ckpt))
    # resumed over the pycomm backend (initialized before Accelerate): the same engine
    _torchrun("accelerate_train.py", "--backend", "pycomm", "--epochs", 2, "--resume", ckpt, "--out", resumed)
    _check(_reports(full), "gloo", 16)
    _check(_reports(resumed), "pycomm", 16)
    assert _same_model(_reports(full), _reports(resumed))


def test_diloco_example(tmp_path):
    full, resumed, ckpt = tmp_path / "full", tmp_path / "resumed", tmp_path / "ckpt"
    # int4 with error feedback, streamed: 2 fragments, each sync in flight for 1 step; the
    # checkpoint at step 24 is taken with fragment 0's sync (sent at 24) in flight.
    args = ("--steps", 48, "--compressor", "int4", "--error-feedback", "--fragments", 2, "--delay", 1)
    out = _torchrun("diloco_train.py", *args, "--save-at", 24, "--checkpoint", ckpt, "--out", full)
    assert "DiLoCo: 48 iterations" in out
    assert sorted(os.listdir(ckpt)) == ["rank0.pt", "rank1.pt"]
    _torchrun("diloco_train.py", *args, "--resume", ckpt, "--out", resumed)
    for a, b in zip(_reports(full), _reports(resumed)):
        assert a["hook_iteration"] == b["hook_iteration"] == 48
        assert a["residual_buckets"] == b["residual_buckets"] == [0, 1]  # one key per fragment
        assert a["params_sha256"] == b["params_sha256"]  # each rank's replica, bit for bit
        assert a["loss"] < 0.1
    # finish(): one final model on every rank (48 steps end with fragment 1's sync in flight).
    assert len({r["params_sha256"] for r in _reports(full)}) == 1


def test_torchft_example():
    # Fault-tolerant DiLoCo on torchft: the example launches a lighthouse and
    # 3 replicas, kills one at 40% with SIGKILL and restarts it; it heals
    # from a live peer and every replica ends with the same parameters.
    pytest.importorskip("torchft")
    out = _run([sys.executable, str(EXAMPLES / "diloco_torchft.py"), "--outer-steps", "10"])
    assert "killed replica 2 (SIGKILL) after outer step" in out
    assert "[replica2-restarted] replica 2: healed from a live peer" in out
    assert "[replica2-restarted] replica 2: done at outer step 10, 1 heal(s)" in out
    assert "3 replicas finished; their parameters are identical" in out


def test_torchft_example_with_sharded_replicas():
    # The same with 2 replicas, each FSDP2-sharded over 2 processes (a
    # Manager per process): replica 1 killed whole, both processes, and
    # restarted; each of its shards heals from the same shard of replica 0.
    pytest.importorskip("torchft")
    out = _run([sys.executable, str(EXAMPLES / "diloco_torchft.py"), "--shards", "2", "--outer-steps", "8"])
    assert "killed replica 1 (SIGKILL, all its processes) after outer step" in out
    for s in (0, 1):
        assert f"[replica1-restarted-shard{s}] replica 1 shard {s}: healed from a live peer" in out
        assert f"[replica1-restarted-shard{s}] replica 1 shard {s}: done at outer step 8, 1 heal(s)" in out
        assert f"[replica0-shard{s}] replica 0 shard {s}: done at outer step 8, 0 heal(s)" in out
    assert "2 replicas finished; their parameters are identical shard by shard" in out


@pytest.mark.parametrize("compressor,compile_,optimizer", [("onebit", False, False), ("int8", True, False),
                                                           ("onebit", False, True)])
def test_transformers_trainer_example(tmp_path, compressor, compile_, optimizer):
    # A Hugging Face Trainer: checkpoint at step 8 (the Trainer's folder, with
    # every rank's hook state), resume from it in fresh processes; onebit
    # keeps residuals, int8 runs under torch_compile=True. With OneBitAdam as
    # the Trainer's optimizer, each rank's optimizer state (its residuals)
    # is saved and loaded beside the Trainer's rank-0 optimizer.pt.
    full, resumed, ckpt = tmp_path / "full", tmp_path / "resumed", tmp_path / "ckpt"
    args = ("--compressor", compressor, "--steps", 16, *(("--compile",) if compile_ else ()),
            *(("--onebit-adam",) if optimizer else ()))
    _torchrun("transformers_train.py", *args, "--save-at", 8, "--checkpoint", ckpt, "--out", full)
    what = "optimizer" if optimizer else "hook"
    assert {f"pycomm_{what}_rank0.pt", f"pycomm_{what}_rank1.pt"} <= set(os.listdir(ckpt / "checkpoint-8"))
    _torchrun("transformers_train.py", *args, "--resume", ckpt / "checkpoint-8", "--out", resumed)
    keeps = [0] if optimizer or spec.error_feedback_for(compressor, None) else []
    for a, b in zip(_reports(full), _reports(resumed)):
        assert a["hook_iteration"] == b["hook_iteration"] == 16  # the resumed hook went on from 8
        assert a["residual_buckets"] == b["residual_buckets"] == keeps
        assert a["params_sha256"] == b["params_sha256"]  # bit for bit
