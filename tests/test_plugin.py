"""A compressor registered from Python (tests/plugin_int8.py, written as a
user would, without a line of pycomm changed) runs through every entry point
of the engine with error feedback: pd.init_process_group, pd.wrap, DDP and
the DDP hook over a plain group; results and residuals equal the
simulation's bit for bit (it runs the same Python), on every rank."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks

import plugin_int8  # noqa: F401  (registers "int8-absmax")
import pycomm
import pycomm.distributed as pd
from pycomm.distributed.simulate import ErrorFeedback, simulate_allreduce

N, CHUNK, STEPS = 5003, 2000, 3  # three chunks, the last one short


def _inputs(step, world):
    return [torch.randn(N, generator=torch.Generator().manual_seed(31 * step + r)) * (1 + r) for r in range(world)]


def _rank(rank, world):
    import plugin_int8  # noqa: F401  (a spawned rank imports the user's file too)

    out = {}
    pg = pd.wrap(compressor="int8-absmax", chunk_numel=CHUNK, compressor_options={"levels": 100})
    steps = []
    for step in range(STEPS):
        x = _inputs(step, world)[rank].clone()
        pd.all_reduce(x, key=5, group=pg, op="avg")
        steps.append((x, pd.error_feedback_state(pg)[5]["worker"].clone()))
    out["wrap"] = steps
    # DDP with the hook over the plain (Gloo) group: the hook wraps it.
    from torch.nn.parallel import DistributedDataParallel as DDP

    from pycomm.ddp import CompressionState, compressed_hook

    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4)),
                bucket_cap_mb=0.02)
    state = CompressionState(compressor="int8-absmax", start_iter=2)
    model.register_comm_hook(state, compressed_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(8):
        g = torch.Generator().manual_seed(100 * rank + step)
        x = torch.randn(16, 32, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), x[:, :4])
        opt.zero_grad()
        loss.backward()
        opt.step()
    out["hook_params"] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    out["hook_keys"] = sorted(state.state_dict()["engine"]["residuals"])
    out["loss"] = loss.item()
    # A rank whose options differ is named on every rank, with the options,
    # when the group is made: not a hang, not two hashes at the first call.
    try:
        other = pd.wrap(compressor="int8-absmax", min_compress_numel=1, compressor_options={"levels": 100 + rank})
        pd.all_reduce(torch.randn(100), key=1, group=other)
        out["mismatch"] = None
    except ValueError as exc:
        out["mismatch"] = str(exc)
    return out


def _rank_default_group(rank, world):
    import plugin_int8  # noqa: F401

    # The default group itself: DDP without a hook compresses its buckets.
    dist.destroy_process_group()
    import os
    from datetime import timedelta

    pd.init_process_group(compressor="int8-absmax", backend="gloo", init_method="env://",
                          timeout=timedelta(seconds=float(os.environ["PYCOMM_TEST_TIMEOUT"])),
                          min_compress_numel=1)
    x = _inputs(0, world)[rank].clone()
    dist.all_reduce(x)
    return x


@pytest.fixture(scope="module")
def results():
    return run_ranks(_rank, 2, timeout=180)


def test_wrapped_group_equals_simulation_with_error_feedback(results):
    efs = [ErrorFeedback() for _ in range(2)]
    for step in range(STEPS):
        want = simulate_allreduce(_inputs(step, 2), "int8-absmax", op="avg", chunk_numel=CHUNK, efs=efs,
                                  levels=100)
        for rank in range(2):
            got, residual = results[rank]["wrap"][step]
            assert torch.equal(got, want[rank]), (rank, step)
            assert torch.equal(residual, efs[rank].worker), (rank, step)
        assert efs[0].worker.abs().sum() > 0  # error feedback holds something


def test_hook_over_a_plain_group_trains_with_it(results):
    assert torch.equal(results[0]["hook_params"], results[1]["hook_params"])
    assert results[0]["hook_keys"] and results[0]["hook_keys"] == results[1]["hook_keys"]
    assert results[0]["loss"] == results[0]["loss"]  # finite, not NaN


def test_ranks_with_other_options_are_named(results):
    for rank in range(2):
        msg = results[rank]["mismatch"]
        assert msg is not None and "compressor_options (rank 0: {'levels': 100}, rank 1: {'levels': 101})" in msg, msg


def test_init_process_group_runs_it():
    got = run_ranks(_rank_default_group, 2, timeout=120)
    want = simulate_allreduce(_inputs(0, 2), "int8-absmax", op="sum")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[0])


def test_registration_errors_name_the_problem():
    with pytest.raises(ValueError, match="already registered"):
        pycomm.register_compressor("int8-absmax", plugin_int8.Int8AbsMax)
    with pytest.raises(TypeError, match="does not take the options"):
        pd.PycommOptions(compressor="int8-absmax", compressor_options={"bits": 4})
    with pytest.raises(ValueError, match="levels must be in"):
        pd.PycommOptions(compressor="int8-absmax", compressor_options={"levels": 300})
    with pytest.raises(ValueError, match="compressor_options are for registered compressors"):
        pd.PycommOptions(compressor="onebit", compressor_options={"levels": 3})
    with pytest.raises(ValueError, match="or a registered compressor"):
        pd.PycommOptions(compressor="int9")


# ------------------------------------- a payload that depends on the data ----
class AboveThreshold:
    """Sends the entries above a threshold: a payload whose length depends
    on the data, which the contract forbids."""

    def __init__(self, same_bytes: bool = False):
        self.same_bytes = same_bytes  # as many bytes on every rank, split otherwise

    def compress(self, grad, residual):
        keep = grad.abs() > 1
        idx = keep.nonzero().reshape(-1).to(torch.int32)
        if self.same_bytes:  # [values, zeros]: grad.numel() words in all, in other shapes
            return [grad[keep], torch.zeros(grad.numel() - idx.numel(), dtype=torch.int32)]
        return [idx, grad[keep]]

    def decompress(self, payload, out, accumulate):
        if not accumulate:
            out.zero_()
        if not self.same_bytes:
            out.index_add_(0, payload[0].long(), payload[1])


def _rank_data_dependent(rank, world):
    pycomm.register_compressor("above-threshold", AboveThreshold)
    out = {}
    for same_bytes in (False, True):
        pg = pd.wrap(compressor="above-threshold", min_compress_numel=1,
                     compressor_options={"same_bytes": same_bytes})
        x = torch.randn(1000, generator=torch.Generator().manual_seed(rank))
        try:
            pd.all_reduce(x, key=1, group=pg)
            out[same_bytes] = None
        except RuntimeError as exc:
            out[same_bytes] = str(exc)
        # Every rank raised at the same point: the group is still in step.
        y = torch.full((1000,), float(rank + 2))
        pd.all_reduce(y, key=2, group=pg)
        out[("after", same_bytes)] = y
    return out


def test_a_payload_that_depends_on_the_data_is_refused_on_every_rank():
    for rank, out in enumerate(run_ranks(_rank_data_dependent, 2, timeout=120)):
        for same_bytes in (False, True):
            msg = out[same_bytes]
            assert msg is not None and "compressor 'above-threshold' made payloads of other sizes, shapes or dtypes" in msg, msg
            assert f"pycomm rank {rank} of 2" in msg and "depend on the element count alone" in msg, msg
            # Every element is above the threshold on both ranks: equal payloads, an exact sum.
            assert torch.equal(out[("after", same_bytes)], torch.full((1000,), 5.0 if not same_bytes else 0.0))
        sizes = re.search(r"rank 0: (\d+) bytes, rank 1: (\d+) bytes", out[False])
        assert sizes and sizes.group(1) != sizes.group(2), out[False]
        sizes = re.search(r"rank 0: (\d+) bytes, rank 1: (\d+) bytes", out[True])
        assert sizes and sizes.group(1) == sizes.group(2), out[True]  # the shapes differ


# ------------------------------------------- a compressor raising on one rank ----
class RefusesLargeValues:
    """int32-rounded values, refusing (raising) when an entry is above 100:
    a refusal that depends on the data, so it can hit one rank only."""

    def compress(self, grad, residual):
        if grad.abs().max() > 100:
            raise ValueError("RefusesLargeValues: an entry above 100")
        return [grad.round().to(torch.int32)]

    def decompress(self, payload, out, accumulate):
        if accumulate:
            out.add_(payload[0].float())
        else:
            out.copy_(payload[0].float())


def _rank_one_rank_raises(rank, world):
    pycomm.register_compressor("refuses-large", RefusesLargeValues)
    pg = pd.wrap(compressor="refuses-large", min_compress_numel=1, chunk_numel=300)
    out = {}
    for chunk in (0, 2):  # the first chunk, or one after others are on the wire
        x = torch.full((1000,), float(rank + 1))
        if rank == world - 1:
            x[300 * chunk + 5] = 1000.0
        try:
            pd.all_reduce(x, key=chunk, group=pg)
            out[chunk] = None
        except Exception as exc:  # noqa: BLE001 - the message is what is checked
            out[chunk] = f"{type(exc).__name__}: {exc}"
        # The same key, size and op next: it must not pair with the refused call.
        y = torch.full((1000,), float(rank + 2))
        pd.all_reduce(y, key=chunk, group=pg)
        out[("after", chunk)] = y
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_a_compressor_raising_on_one_rank_raises_on_every_rank(world):
    results = run_ranks(_rank_one_rank_raises, world, timeout=120)
    for rank, out in enumerate(results):
        for chunk in (0, 2):
            msg = out[chunk]
            assert msg is not None, f"rank {rank}, chunk {chunk}: no error"
            assert f"pycomm rank {rank} of {world}" in msg, msg
            if rank == world - 1:
                assert "RefusesLargeValues: an entry above 100" in msg, msg
            else:
                assert re.search(rf"compressor 'refuses-large' raised on rank\(s\) {world - 1} for \d+ elements", msg), msg
            expected = sum(r + 2 for r in range(world))
            assert torch.equal(out[("after", chunk)], torch.full((1000,), float(expected))), (rank, chunk)
