"""pycomm.integrations: the adapters for frameworks (Lightning, Accelerate)
and for launchers that take only a backend name.

Each multi-process job runs several checks in the same 2 ranks (spawning
and importing a framework cost seconds here); the tests check its results.
The frameworks are optional: their tests skip when one is not installed.
Whole training runs with resume, as a user starts them, are in
tests/test_examples.py.
"""

from __future__ import annotations

import os
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _dist import reinit_on_a_new_port, run_ranks

from pycomm.ddp import CompressionState, compressed_hook
from pycomm.integrations import PerRankState, backend


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 2))


def _train(model, opt, rank, start, stop, backward=None):
    for step in range(start, stop):
        g = torch.Generator().manual_seed(100 * rank + step)
        x = torch.randn(8, 16, generator=g)
        loss = nn.functional.mse_loss(model(x), torch.sin(x[:, :2]))
        opt.zero_grad()
        (backward or torch.Tensor.backward)(loss)
        opt.step()


# ------------------------------------------------------------- backend() ---
def test_backend_names_carry_the_settings():
    name = backend("topk", density=0.05)
    assert name.startswith("pycomm_topk_") and name == name.lower()
    assert backend("topk", density=0.05) == name  # the same settings: the same name, any process
    assert backend("topk", density=0.1) != name
    assert backend("fp16") == "pycomm_fp16"
    assert backend("onebit", name="Pycomm_Test_Named", block_size=256) == "pycomm_test_named"
    with pytest.raises(ValueError, match="already registered"):
        backend("onebit", name="pycomm_test_named", block_size=512)
    with pytest.raises(ValueError, match="block_size must be a multiple of 32"):
        backend("onebit", block_size=100)
    with pytest.raises(ValueError, match="pycomm's own backend"):
        backend("onebit", name="pycomm")
    with pytest.raises(ValueError, match="letters, digits and underscores"):
        backend("onebit", name="cpu:gloo")
    with pytest.raises(ValueError, match="taken by another"):
        backend("onebit", name="gloo")
    with pytest.raises(TypeError):
        backend("onebit", blocksize=256)


def _rank_backends(rank, world):
    import pycomm.distributed as pd
    from pycomm.integrations import init_process_group

    out = {}
    name = backend("topk", density=0.05, min_compress_numel=1, chunk_numel=4096)
    dist.init_process_group(name, init_method="env://")
    out["is_pycomm"] = pd.is_pycomm_group()
    opts = pd.options_of()
    out["options"] = {k: opts[k] for k in ("method", "density", "min_compress_numel", "chunk_numel")}
    # New groups of that backend get the same settings, unless given their own.
    out["new_group"] = pd.options_of(dist.new_group())["density"]
    override = pd.PycommOptions(compressor="onebit", block_size=64)
    out["pg_options"] = pd.options_of(dist.new_group(backend=name, pg_options=override))["method"]
    # The hook trains over it (the group decides the settings: they agree).
    model = nn.parallel.DistributedDataParallel(_model())
    state = CompressionState(compressor="topk", density=0.05, chunk_numel=4096, start_iter=2)
    model.register_comm_hook(state, compressed_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    _train(model, opt, rank, 0, 4)
    out["keys"] = sorted(state.state_dict()["engine"]["residuals"])
    out["init again"] = init_process_group("onebit")  # a pycomm group is up: nothing to do
    reinit_on_a_new_port(rank)

    # init_process_group: the default group from the launcher's environment.
    out["init"] = init_process_group("onebit", backend="gloo", block_size=64, min_compress_numel=1)
    out["init options"] = pd.options_of()["block_size"]
    reinit_on_a_new_port(rank)
    dist.init_process_group("gloo", init_method="env://")
    try:
        init_process_group("onebit")
        out["init over gloo"] = None
    except RuntimeError as exc:
        out["init over gloo"] = str(exc)
    return out


def test_backend_and_init_process_group_in_ranks():
    res = run_ranks(_rank_backends, 2, init_process_group=False, timeout=120)
    for r in res:
        assert r["is_pycomm"]
        assert r["options"] == {"method": "topk", "density": 0.05, "min_compress_numel": 1, "chunk_numel": 4096}
        assert r["new_group"] == 0.05 and r["pg_options"] == "onebit"
        assert r["keys"] and r["init again"] is False
        assert r["init"] is True and r["init options"] == 64
        assert "already initialized with 'gloo'" in r["init over gloo"]


def test_init_process_group_without_a_launcher(monkeypatch):
    from pycomm.integrations import init_process_group

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    if dist.is_initialized():
        pytest.skip("this process has a default group")
    assert init_process_group("onebit") is False


# ---------------------------------------------------------- PerRankState ---
def _rank_per_rank_state(rank, world):
    model = nn.parallel.DistributedDataParallel(_model())
    state = CompressionState(compressor="onebit", block_size=64, start_iter=2)
    model.register_comm_hook(state, compressed_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    _train(model, opt, rank, 0, 4)
    saved = PerRankState(state).state_dict()  # collective
    out = {"saved ranks": sorted(saved["ranks"]), "world": saved["world_size"]}
    # Every rank loads what rank 0 wrote.
    everything = [saved]
    dist.broadcast_object_list(everything, src=0)
    fresh = CompressionState(compressor="onebit", block_size=64, start_iter=2)
    PerRankState(fresh).load_state_dict(everything[0])
    mine = fresh.state_dict()
    out["loaded rank"], out["loaded iteration"] = mine["engine"]["rank"], mine["iteration"]
    out["same residuals"] = all(
        torch.equal(a["worker"], b["worker"])
        for a, b in zip(mine["engine"]["residuals"].values(), state.state_dict()["engine"]["residuals"].values())
    ) and sorted(mine["engine"]["residuals"]) == sorted(state.state_dict()["engine"]["residuals"])
    # A checkpoint of one rank only: refused for rank 1, unless the residuals start over.
    r0 = everything[0]["ranks"][0]
    alone = dict(r0, engine=dict(r0["engine"], world_size=1, rank=0))  # as if saved by one process
    one = {"format": PerRankState.FORMAT, "world_size": 1, "ranks": {0: alone}}
    try:
        PerRankState(CompressionState(compressor="onebit", start_iter=2)).load_state_dict(one)
        out["fewer ranks"] = None
    except ValueError as exc:
        out["fewer ranks"] = str(exc)
    reset = CompressionState(compressor="onebit", start_iter=2)
    PerRankState(reset, reset_error_feedback=True).load_state_dict(one)
    out["reset"] = (reset.iteration, reset.state_dict()["engine"]["residuals"])
    return out


def test_per_rank_state_saves_every_rank():
    res = run_ranks(_rank_per_rank_state, 2, timeout=120)
    assert res[0]["saved ranks"] == [0, 1] and res[1]["saved ranks"] == [1]
    for rank, r in enumerate(res):
        assert r["world"] == 2
        assert r["loaded rank"] == rank and r["loaded iteration"] == 4 and r["same residuals"]
        assert r["reset"] == (4, {})
    assert "world size 1, this group has 2" in res[0]["fewer ranks"]  # rank 0 exists: the world differs
    assert "none for rank 1 of 2" in res[1]["fewer ranks"] and "reset_error_feedback=True" in res[1]["fewer ranks"]


def test_per_rank_state_refuses_other_objects():
    with pytest.raises(TypeError, match="CompressionState"):
        PerRankState({"iteration": 3})
    with pytest.raises(ValueError, match="not a pycomm.PerRankState/1 checkpoint"):
        PerRankState(CompressionState(start_iter=2)).load_state_dict(CompressionState(start_iter=2).state_dict())


# -------------------------------------------------------------- Lightning ---
def _lightning_env():
    # Lightning's torchrun environment, inside the harness's ranks (whose
    # default group is already up: Lightning then uses it).
    os.environ.setdefault("GROUP_RANK", "0")


def _rank_lightning(rank, world):
    _lightning_env()
    import lightning.pytorch as L
    from lightning.pytorch.strategies import DDPStrategy

    from pycomm.integrations.lightning import CompressionCallback

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _model()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=g)
    data = torch.utils.data.TensorDataset(x, torch.sin(x[:, :2]))

    def fit(strategy, callbacks):
        trainer = L.Trainer(accelerator="cpu", devices=2, max_epochs=1, strategy=strategy, callbacks=callbacks,
                            logger=False, enable_progress_bar=False, enable_model_summary=False,
                            enable_checkpointing=False)
        trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=8))
        return trainer

    out = {}
    # Lightning's own comm-hook arguments: on CPU the hook never runs.
    state = CompressionState(compressor="onebit", block_size=64, start_iter=2)
    fit(DDPStrategy(ddp_comm_state=state, ddp_comm_hook=compressed_hook), [])
    out["strategy hook iterations"] = state.iteration
    # The callback: registered on CPU too; its state is every rank's.
    cb = CompressionCallback(compressor="onebit", block_size=64, start_iter=2)
    trainer = fit(DDPStrategy(bucket_cap_mb=0.01), [cb])
    out["callback iterations"] = cb.state.iteration
    out["callback keys"] = sorted(cb.state.state_dict()["engine"]["residuals"])
    saved = trainer._checkpoint_connector.dump_checkpoint()["callbacks"]["pycomm.CompressionCallback"]
    out["checkpoint ranks"] = sorted(saved["ranks"])
    # Both ways at once would register two hooks.
    try:
        fit(DDPStrategy(ddp_comm_state=state, ddp_comm_hook=compressed_hook),
            [CompressionCallback(compressor="onebit", start_iter=2)])
        out["both"] = None
    except ValueError as exc:
        out["both"] = str(exc)
    return out


def test_lightning_callback_registers_on_cpu_and_saves_every_rank():
    pytest.importorskip("lightning")
    res = run_ranks(_rank_lightning, 2, timeout=240)
    for rank, r in enumerate(res):
        assert r["strategy hook iterations"] == 0  # why the callback exists
        assert r["callback iterations"] == 4  # 64 rows / 2 ranks / 8 per step
        assert r["callback keys"] and len(r["callback keys"]) >= 2, r["callback keys"]
        assert r["checkpoint ranks"] == ([0, 1] if rank == 0 else [1])
        assert "do not also pass ddp_comm_hook" in r["both"]


def test_lightning_callback_arguments():
    pytest.importorskip("lightning")
    from pycomm.integrations.lightning import CompressionCallback

    state = CompressionState(compressor="topk", start_iter=3)
    assert CompressionCallback(state).state is state
    with pytest.raises(TypeError, match="either a CompressionState or its settings"):
        CompressionCallback(state, compressor="onebit")
    with pytest.raises(ValueError, match="start_iter must be >= 2"):
        CompressionCallback(start_iter=1)
    # One process (no DDP): nothing to register, nothing raised.
    cb = CompressionCallback(compressor="onebit")
    cb.on_fit_start(types.SimpleNamespace(strategy=types.SimpleNamespace(model=nn.Linear(2, 2))), None)


# ------------------------------------------------------------- Accelerate ---
def _rank_accelerate(rank, world, directory):
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    from pycomm.integrations.accelerate import register_hook, state_file

    out = {}
    accelerator = Accelerator(cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(bucket_cap_mb=0.01)])
    module = _model()
    model, opt = accelerator.prepare(module, torch.optim.SGD(module.parameters(), lr=0.05))
    out["prepared"] = type(model).__name__
    try:
        register_hook(accelerator, model.module, compressor="onebit")
        out["unprepared"] = None
    except TypeError as exc:
        out["unprepared"] = str(exc)
    state = register_hook(accelerator, model, compressor="onebit", block_size=64, start_iter=2)
    _train(model, opt, rank, 0, 4, backward=accelerator.backward)
    accelerator.save_state(directory)
    accelerator.wait_for_everyone()  # each rank writes its own file: list them once all have
    out["files"] = sorted(f for f in os.listdir(directory) if f.startswith("pycomm_hook"))
    out["own file rank"] = torch.load(state_file(directory, rank), weights_only=True)["engine"]["rank"]
    saved = state.state_dict()
    _train(model, opt, rank, 4, 7, backward=accelerator.backward)
    accelerator.load_state(directory)
    back = state.state_dict()
    out["restored"] = back["iteration"] == 4 and all(
        torch.equal(back["engine"]["residuals"][k]["worker"], saved["engine"]["residuals"][k]["worker"])
        for k in saved["engine"]["residuals"]
    ) and sorted(back["engine"]["residuals"]) == sorted(saved["engine"]["residuals"])
    out["keys"] = sorted(saved["engine"]["residuals"])
    # A folder without rank 1's file: refused, unless the residuals start over.
    if rank == 1:
        os.rename(state_file(directory, 1), state_file(directory, 1) + ".away")
    accelerator.wait_for_everyone()
    try:
        accelerator.load_state(directory)
        out["missing"] = None
    except FileNotFoundError as exc:
        out["missing"] = str(exc)
    accelerator.wait_for_everyone()
    return out


def _rank_accelerate_comm_hook_kwargs(rank, world):
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    from pycomm.integrations.accelerate import register_hook

    accelerator = Accelerator(cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(comm_hook=compressed_hook)])
    model = accelerator.prepare(_model())
    try:
        register_hook(accelerator, model, compressor="onebit")
        return None
    except ValueError as exc:
        return str(exc)


def test_accelerate_register_hook_saves_each_rank(tmp_path):
    pytest.importorskip("accelerate")
    res = run_ranks(_rank_accelerate, 2, str(tmp_path), timeout=180)
    for rank, r in enumerate(res):
        assert r["prepared"] == "DistributedDataParallel"
        assert "accelerator.prepare(model) returned" in r["unprepared"]
        assert r["files"] == ["pycomm_hook_rank0.pt", "pycomm_hook_rank1.pt"]
        assert r["own file rank"] == rank
        assert len(r["keys"]) >= 2 and r["restored"]
    assert res[0]["missing"] is None
    assert "pycomm_hook_rank1.pt is missing" in res[1]["missing"]


def test_accelerate_comm_hook_kwargs_is_not_ignored():
    pytest.importorskip("accelerate")
    res = run_ranks(_rank_accelerate_comm_hook_kwargs, 2, timeout=120)
    for r in res:
        assert r is not None and "DistributedDataParallelKwargs(comm_hook=" in r


def test_transformers_compress_refuses_what_it_cannot_run(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from pycomm.integrations.transformers import compress

    model = GPT2LMHeadModel(GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=1))
    trainer = Trainer(model=model, args=TrainingArguments(str(tmp_path), use_cpu=True, report_to=[]))
    with pytest.raises(TypeError, match="either a CompressionState or its settings"):
        compress(trainer, CompressionState(compressor="int8"), compressor="int8")
    with pytest.raises(TypeError, match="reset_error_feedback must be a bool"):
        compress(trainer, reset_error_feedback="yes")
    state = compress(trainer, compressor="int8", start_iter=3)
    assert state.compressor == "int8" and state.start_iter == 3
    with pytest.raises(ValueError, match="already called on this Trainer"):
        compress(trainer, compressor="int8")


def test_transformers_attach_refuses_what_it_cannot_run(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from pycomm.integrations.transformers import attach
    from pycomm.optim import OneBitAdam

    model = GPT2LMHeadModel(GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=1))
    args = TrainingArguments(str(tmp_path), use_cpu=True, report_to=[])
    with pytest.raises(TypeError, match=r"needs a Trainer given a pycomm optimizer .* got NoneType"):
        attach(Trainer(model=model, args=args))
    with pytest.raises(TypeError, match=r"needs a Trainer given a pycomm optimizer .* got AdamW"):
        attach(Trainer(model=model, args=args, optimizers=(torch.optim.AdamW(model.parameters()), None)))
    opt = OneBitAdam(model.parameters(), lr=1e-3, warmup_steps=2)
    trainer = Trainer(model=model, args=args, optimizers=(opt, None))
    with pytest.raises(TypeError, match="overlap must be a bool"):
        attach(trainer, overlap=1)
    with pytest.raises(TypeError, match="reset_error_feedback must be a bool"):
        attach(trainer, reset_error_feedback="yes")
    assert attach(trainer) is opt
    with pytest.raises(ValueError, match=r"attach\(\) was already called on this Trainer"):
        attach(trainer)
    # A checkpoint saved without attach(): this rank's optimizer state is missing, named.
    folder = tmp_path / "checkpoint-4"
    folder.mkdir()
    with pytest.raises(FileNotFoundError, match=r"pycomm_optimizer_rank0.pt is missing: .*\(saved without attach"):
        trainer._load_optimizer_and_scheduler(str(folder))
    assert "load_state_dict" not in vars(opt)  # nothing left patched
