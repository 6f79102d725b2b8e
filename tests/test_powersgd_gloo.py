"""Why PyTorch's PowerSGD DDP hook fails on Gloo, and a way to run it that works.

Findings (details, evidence and commands: docs/powersgd_on_gloo.md):

* ``powerSGD_hook`` issues its P and Q all-reduces from ``Future.then()``
  callbacks, i.e. on Gloo's worker threads, while DDP calls the hook for the
  next bucket (whose first all-reduce is issued at once) on the autograd
  thread. With two or more buckets, the order in which a rank issues its
  collectives then depends on thread timing, differs between ranks, and Gloo
  pairs collectives of different sizes: "Received data size doesn't match
  expected size" (the process aborts), or all ranks hang (the callbacks also
  block Gloo's worker threads in ``.wait()``).
* With one bucket (the whole model fits in ``bucket_cap_mb``) there is
  nothing to race with and the hook works. That is why it is the
  configuration (how many buckets), not error feedback or warm start.
* :func:`pycomm.ddp.serialized_hook` runs the unmodified hook one bucket at a
  time on one worker thread, each bucket's collectives finishing before the
  next bucket's start: same order on every rank, identical parameters.
"""

import os
import sys
import threading
import time

import pytest
import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(__file__))
from _dist import RankError, run_ranks  # noqa: E402

from pycomm.ddp import serialized_hook  # noqa: E402

VOCAB, SEQ = 96, 32
# 0.05 MiB buckets split the test model into ~10 buckets: the race shows at
# once. With bucket_cap_mb=25 the same model is one bucket and works.
SMALL_CAP_MB = 0.05


def blocking_hook(hook):
    """Wrap a comm hook to run it to completion inside the hook call (on the
    autograd thread): also correct, but no overlap of communication with the
    rest of the backward pass. Used here to check that :func:`serialized_hook`
    computes exactly the same thing."""

    def wrapped(state, bucket):
        fut = torch.futures.Future()
        fut.set_result(hook(state, bucket).wait())
        return fut

    return wrapped


def _model(d=64, layers=4):
    torch.manual_seed(0)

    class TinyTransformer(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(VOCAB, d)
            self.pos = nn.Parameter(torch.zeros(SEQ, d))
            layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
            self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.head = nn.Linear(d, VOCAB)

        def forward(self, x):
            mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
            return self.head(self.blocks(self.emb(x) + self.pos[: x.shape[1]], mask=mask, is_causal=True))

    return TinyTransformer()


def _train(rank, world_size, cap_mb, wrap, steps, log_dir=None):
    """DDP + PowerSGD (rank 4, start_powerSGD_iter=2) for ``steps`` steps.
    Returns (number of buckets, PowerSGD iterations, buckets with error
    feedback, flat parameters). With ``log_dir``, every all-reduce is logged
    (issuing thread, element count) to ``log_dir/rank{rank}.log`` as it is
    issued, flushed at once (the process may abort in Gloo)."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as P
    from torch.nn.parallel import DistributedDataParallel as DDP

    if log_dir is not None:
        log = open(os.path.join(log_dir, f"rank{rank}.log"), "w", buffering=1)
        orig = dist.all_reduce

        def logged_all_reduce(tensor, *a, **k):
            log.write(f"{threading.current_thread().name} {tensor.numel()}\n")
            return orig(tensor, *a, **k)

        # powerSGD_hook and default_hooks call dist.all_reduce through the module.
        dist.all_reduce = logged_all_reduce

    model = _model()
    ddp = DDP(model, bucket_cap_mb=cap_mb)
    state = P.PowerSGDState(process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2)
    hook = {"plain": lambda h: h, "serialized": serialized_hook, "blocking": blocking_hook}[wrap](P.powerSGD_hook)
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1234 + rank)  # different data per rank
    for _ in range(steps):
        x = torch.randint(0, VOCAB, (4, SEQ), generator=gen)
        loss = nn.functional.cross_entropy(ddp(x).flatten(0, 1), x.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    n_buckets = len(ddp.reducer._get_zeros_like_grad_buckets())
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    return n_buckets, state.iter, len(state.error_dict), flat


def test_powersgd_one_bucket_works():
    # bucket_cap_mb=25 holds this whole model (~0.5 MB): one bucket, no race.
    res = run_ranks(_train, 2, 25, "plain", 5, timeout=40)
    assert res[0][0] == 1
    assert res[0][1] > 2 and res[0][2] == 1  # PowerSGD really ran, with error feedback
    assert torch.equal(res[0][3], res[1][3])


def test_powersgd_many_buckets_fails_plain(tmp_path):
    # Several buckets: the P/Q all-reduces issued from then() callbacks (Gloo's
    # threads) race with the next bucket's all-reduce (autograd thread).
    # Observed outcomes: gloo's size-mismatch abort, or a hang (killed at the
    # timeout, or Gloo's own recv timeout). Either way the run does not complete.
    try:
        run_ranks(_train, 2, SMALL_CAP_MB, "plain", 6, str(tmp_path), timeout=20)
    except (RankError, TimeoutError) as exc:
        failure = exc
    else:
        # The race depends on thread timing; it fired in every run measured
        # here, but a run where it does not fire proves nothing either way.
        pytest.skip("the collective-order race did not fire in this run")
    killed_at = time.time()

    class info:  # noqa: N801 - the shape pytest.raises would give
        value = failure

    logs = [(tmp_path / f"rank{r}.log").read_text().splitlines() for r in range(2)]
    threads = {line.rsplit(" ", 1)[0] for lines in logs for line in lines}
    # The race needs collectives from more than one thread (autograd's and
    # Gloo's); a run that failed before any callback issued one (a timeout
    # on a loaded machine) is not the race, and proves nothing either way.
    if len(threads) < 2:
        pytest.skip(f"the run failed before the race could fire ({type(failure).__name__}, threads {threads})")
    if isinstance(info.value, TimeoutError):
        # A hang, not a slow machine: no rank issued a collective in the last
        # seconds before the kill (a healthy step issues ~15 in well under 1 s).
        last = max((tmp_path / f"rank{r}.log").stat().st_mtime for r in range(2))
        assert killed_at - last > 5.0, "ranks were still making progress when killed"
    if isinstance(info.value, RankError):
        # Gloo's enforce aborts the rank that detects the mismatch (SIGABRT,
        # exit code -6, often before it can report); its peer then sees the
        # connection drop, or is killed by the harness before reporting. Or
        # the ranks wait on different collectives until Gloo's own timeout.
        msg = str(info.value)
        signs = ("doesn't match expected size", "exited with code -6", "Connection", "closed", "Timed out waiting",
                 "Application timeout caused pair closure")
        assert any(s in msg for s in signs), msg[-3000:]


def test_powersgd_serialized_matches_blocking_and_ranks_agree():
    ser = run_ranks(_train, 2, SMALL_CAP_MB, "serialized", 6, timeout=40)
    blk = run_ranks(_train, 2, SMALL_CAP_MB, "blocking", 6, timeout=40)
    assert ser[0][0] > 2  # several buckets: the configuration that fails plain
    assert ser[0][1] > 2 and ser[0][2] == ser[0][0]  # PowerSGD + error feedback on every bucket
    assert torch.equal(ser[0][3], ser[1][3])  # identical parameters on all ranks
    # The thread wrapper computes exactly what the blocking one does.
    assert torch.equal(ser[0][3], blk[0][3]) and torch.equal(blk[0][3], blk[1][3])
