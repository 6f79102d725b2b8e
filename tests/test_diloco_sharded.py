"""DiLoCo over sharded replicas: 4 Gloo ranks on a 2-D mesh (2 replicas x 2
shards), each replica an FSDP2 model over its "shard" ranks, the outer sync
over the "replicate" dimension only. A sharded run equals the unsharded run
of the same replicas (2 ranks, each the whole replica, fed both halves of its
replica's batch), holds half the memory per rank and sends half the bytes;
a compressed run leaves the ranks of a replicate group bit-identical; a run
resumed through torch.distributed.checkpoint (DCP), with a sync in flight at
the save, ends bit for bit where the uninterrupted one does."""

from __future__ import annotations

import pytest
import torch
from _dist import refusal, run_ranks

H, OUTER = 4, 8  # sync_every, outer steps
STEPS = H * OUTER
ROWS = 6  # examples per rank per step


class Net(torch.nn.Module):
    """Two blocks (an FSDP module each) and a head (the root's)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(12, 23), torch.nn.Tanh(), torch.nn.Linear(23, 12)) for _ in range(2))
        # One row: the second shard of the head is empty (a fragment with
        # nothing to send on that rank).
        self.head = torch.nn.Linear(12, 1)

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


def _net(sharded_over=None):
    torch.manual_seed(0)
    net = Net()
    if sharded_over is not None:
        from torch.distributed.fsdp import fully_shard

        for b in net.blocks:
            fully_shard(b, mesh=sharded_over)
        fully_shard(net, mesh=sharded_over)
    return net


def _batch(step, replica, shard):
    """Rank (replica, shard)'s examples of ``step``: the unsharded replica
    trains on both shards' examples at once."""
    g = torch.Generator().manual_seed(1000 * step + 10 * replica + shard)
    x = torch.randn(ROWS, 12, generator=g)
    return x, torch.sin(x[:, :1] * 2.0) + 0.1 * torch.randn(ROWS, 1, generator=g)


def _train(model, opt, replica, shards, start, stop, mine):
    for t in range(start, stop):
        if shards is None:  # the whole replica: every shard's examples
            xs, ys = zip(*(_batch(t, replica, s) for s in range(2)))
            x, y = torch.cat(xs), torch.cat(ys)
        else:
            x, y = _batch(t, replica, mine)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _full(model):
    return [p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone() for p in model.parameters()]


def _diloco(model, mesh, **kw):
    from pycomm.optim import DiLoCo

    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return DiLoCo(model, inner, sync_every=H, mesh=mesh, **kw)


def _unsharded(rank, world):
    model = _net()
    opt = _diloco(model, None, outer_momentum=0.9)
    _train(model, opt, rank, None, 1, STEPS + 1, None)
    return {"params": _full(model), "memory": opt.memory_bytes(), "bytes": opt.bytes_per_sync(),
            "syncs": opt.syncs}


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))


def _sharded(rank, world, ckpt):
    import torch.distributed.checkpoint as dcp

    mesh = _mesh()
    replica, mine = mesh.get_local_rank("replicate"), mesh.get_local_rank("shard")
    out = {"replica": replica}

    # 1. Exact, one fragment: the run to compare with the unsharded one.
    model = _net(mesh["shard"])
    opt = _diloco(model, mesh, outer_momentum=0.9)
    _train(model, opt, replica, 2, 1, STEPS + 1, mine)
    out.update(exact=_full(model), memory=opt.memory_bytes(), bytes=opt.bytes_per_sync(), syncs=opt.syncs,
               bounds=opt._bounds)

    # 2. int4 with error feedback, two fragments (whole FSDP modules), a
    # sync in flight for one step; saved through DCP at a step whose sync is
    # in flight, and resumed in fresh objects.
    kw = dict(compressor="int4", error_feedback=True, fragments=2, delay=1, block_size=64)
    model = _net(mesh["shard"])
    opt = _diloco(model, mesh, **kw)
    out["int4_bounds"], out["int4_sizes"] = opt._bounds, opt.fragment_sizes()
    save_at = STEPS // 2 - 2  # a send step: its sync is in flight at the save
    assert opt.due(save_at) is not None
    _train(model, opt, replica, 2, 1, save_at + 1, mine)
    assert opt._pending is not None
    dcp.save({"model": model.state_dict(), "diloco": opt.state_dict()}, checkpoint_id=f"{ckpt}/replica{replica}",
             process_group=mesh.get_group("shard"))
    _train(model, opt, replica, 2, save_at + 1, STEPS + 1, mine)
    opt.finish()  # the sync in flight applied, every fragment synced: one model per replicate group
    out["int4"] = _full(model)
    out["int4_local"] = [p.to_local().clone() for p in model.parameters()]
    out["int4_residuals"] = opt.memory_bytes()

    model = _net(mesh["shard"])
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().add_(1.0)  # a fresh replica: the load must bring every value back
    opt = _diloco(model, mesh, **kw)
    state = {"model": model.state_dict(), "diloco": opt.state_dict()}
    dcp.load(state, checkpoint_id=f"{ckpt}/replica{replica}", process_group=mesh.get_group("shard"))
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["diloco"])
    assert opt.step_count == save_at and opt._pending is not None
    _train(model, opt, replica, 2, save_at + 1, STEPS + 1, mine)
    opt.finish()
    out["resumed"] = _full(model)

    # 3. Refusals, before anything changes.
    out["no_mesh"] = refusal(lambda: _diloco(_net(mesh["shard"]), None))
    out["flat_mesh"] = refusal(lambda: _diloco(_net(mesh["shard"]), mesh["shard"]))
    out["plain_model"] = refusal(lambda: _diloco(_net(), mesh))
    out["unsharded_state"] = refusal(lambda: opt.load_state_dict({"inner": {}, "outer": {}, "anchor": [],
                                                                  "pycomm": {"version": 2}}))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("dcp")
    return {"sharded": run_ranks(_sharded, 4, str(ckpt), timeout=300), "plain": run_ranks(_unsharded, 2, timeout=120)}


def test_sharded_equals_unsharded(runs):
    plain, sharded = runs["plain"], runs["sharded"]
    for r in sharded:
        ref = plain[r["replica"]]["params"]
        assert r["syncs"] == plain[0]["syncs"] == OUTER
        diff = max((a - b).abs().max().item() for a, b in zip(r["exact"], ref))
        assert diff <= 1e-6, diff
    # the two replicas end on one model (the last step is a sync)
    for a, b in zip(plain[0]["params"], plain[1]["params"]):
        assert torch.equal(a, b)


def test_memory_and_bytes_per_rank_halve(runs):
    plain, sharded = runs["plain"], runs["sharded"]
    for replica in range(2):
        shards = [r for r in sharded if r["replica"] == replica]
        # what the two shard ranks of a replica hold and send adds up to the whole replica's
        assert sum(r["memory"] for r in shards) == plain[replica]["memory"]
        assert sum(r["bytes"] for r in shards) == plain[replica]["bytes"]
        for r in shards:
            assert r["memory"] <= 0.55 * plain[replica]["memory"]


def test_fragments_are_whole_fsdp_modules(runs):
    # parameters: block 0 (4), block 1 (4), head (2); two fragments: the blocks, then the head
    assert all(r["int4_bounds"] == [0, 8, 10] and r["bounds"] == [0, 10] for r in runs["sharded"])
    # the head's one row is the first shard's: the second syncs an empty fragment
    assert [r["int4_sizes"][1] for r in runs["sharded"]] == [13, 0, 13, 0]


def test_compressed_replicate_peers_hold_the_same_bits(runs):
    by_shard = {}
    for rank, r in enumerate(runs["sharded"]):
        by_shard.setdefault(rank % 2, []).append(r["int4_local"])
    for peers in by_shard.values():
        assert len(peers) == 2 and all(torch.equal(a, b) for a, b in zip(*peers))
    assert all(r["int4_residuals"] > 0 for r in runs["sharded"])


def test_dcp_resume_is_bit_exact(runs):
    for r in runs["sharded"]:
        assert all(torch.equal(a, b) for a, b in zip(r["resumed"], r["int4"]))


def test_refusals_name_the_argument(runs):
    r = runs["sharded"][0]
    assert "mesh=" in r["no_mesh"] and "DTensors" in r["no_mesh"]
    assert "('replicate', 'shard')" in r["flat_mesh"]
    assert "parameter 0 is a plain tensor" in r["plain_model"]
    assert "no entry 'shard0'" in r["unsharded_state"]
