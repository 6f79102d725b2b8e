"""Tests of pycomm_bench.models: deterministic data, sizes as documented, and
models that actually learn (fast: tiny configs, one process)."""

import math

import torch

from pycomm_bench.models import (
    GPT_DEFAULT,
    GPT_TINY,
    MLP_DEFAULT,
    MLP_TINY,
    WORKLOADS,
    CharGPT,
    NarrowMLP,
    char_lm,
    narrow_mlp,
    stdlib_text,
    text_batch_fn,
)

SMALL = 65536  # elements: below this, a tensor is "small" for compression


def test_stdlib_text_deterministic_and_real():
    a = stdlib_text(n_files=8, max_bytes=200_000)
    b = stdlib_text.__wrapped__(n_files=8, max_bytes=200_000)  # re-read, bypassing the cache
    assert a == b
    assert 10_000 < len(a) <= 200_000
    assert b"def " in a and b"import " in a  # Python source, not noise
    assert len(stdlib_text()) > 500_000  # the default corpus is substantial


def test_text_batches_reproducible_and_distinct():
    f1, f2 = text_batch_fn(4, 32), text_batch_fn(4, 32)
    x, y = f1(0, 0)
    assert x.shape == y.shape == (4, 32) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])  # next-byte targets
    assert int(x.max()) < 256
    for rank, step in [(0, 0), (1, 0), (0, 1), (3, 7)]:
        assert all(torch.equal(u, v) for u, v in zip(f1(rank, step), f2(rank, step)))
    batches = [f1(r, s)[0] for r in range(3) for s in range(3)]
    for i in range(len(batches)):
        for j in range(i):
            assert not torch.equal(batches[i], batches[j])
    # The seed changes the batches too.
    assert not torch.equal(text_batch_fn(4, 32, seed=1)(0, 0)[0], x)


def test_mlp_batches_reproducible_and_distinct():
    _, f1, _ = narrow_mlp("tiny")
    _, f2, _ = narrow_mlp("tiny")
    assert all(torch.equal(u, v) for u, v in zip(f1(1, 5), f2(1, 5)))
    assert not torch.equal(f1(0, 0)[0], f1(1, 0)[0])
    assert not torch.equal(f1(0, 0)[0], f1(0, 1)[0])


def test_parameter_counts_match_docs():
    counts = {
        "gpt default": (CharGPT(GPT_DEFAULT), 4_902_912),
        "gpt tiny": (CharGPT(GPT_TINY), 42_880),
        "mlp default": (NarrowMLP(MLP_DEFAULT), 1_073_152),
        "mlp tiny": (NarrowMLP(MLP_TINY), 2_432),
    }
    for name, (model, expected) in counts.items():
        assert sum(p.numel() for p in model.parameters()) == expected, name
    tied, _, _ = char_lm("tiny", tie_weights=True)
    assert sum(p.numel() for p in tied.parameters()) == 42_880 - 256 * 32
    assert GPT_DEFAULT.num_parameters() == 4_902_912 and MLP_DEFAULT.num_parameters() == 1_073_152


def test_same_seed_same_weights_and_rng_untouched():
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    m1, _, _ = char_lm("tiny", seed=5)
    assert torch.equal(torch.random.get_rng_state(), before)
    m2, _, _ = char_lm("tiny", seed=5)
    m3, _, _ = char_lm("tiny", seed=6)
    p1, p2, p3 = (torch.cat([p.detach().flatten() for p in m.parameters()]) for m in (m1, m2, m3))
    assert torch.equal(p1, p2) and not torch.equal(p1, p3)


def test_char_lm_loss_starts_at_log_vocab_and_decreases():
    torch.manual_seed(0)
    model, batch_fn, loss_fn = char_lm("tiny", batch_size=8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(30):
        loss = loss_fn(model, batch_fn(0, step))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert abs(losses[0] - math.log(256)) < 0.1, losses[0]
    assert sum(losses[-5:]) / 5 < losses[0] - 1.5, losses


def test_narrow_mlp_learns():
    model, batch_fn, loss_fn = narrow_mlp("tiny")
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for step in range(30):
        loss = loss_fn(model, batch_fn(0, step))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < 0.8 * losses[0], losses


def _grad_numels(workload):
    model, batch_fn, loss_fn = workload
    loss_fn(model, batch_fn(0, 0)).backward()
    return [p.grad.numel() for p in model.parameters() if p.grad is not None]


def test_small_tensor_model_gradients_are_mostly_small_tensors():
    numels = _grad_numels(narrow_mlp("default", batch_size=4))
    assert sum(numels) == 1_073_152  # every parameter gets a gradient
    small = sum(n for n in numels if n < SMALL)
    assert small / sum(numels) > 0.9
    # ... whereas the LM's gradient is mostly large matrices (where compression can pay).
    numels = _grad_numels(char_lm("default", batch_size=1))
    assert sum(n for n in numels if n >= SMALL) / sum(numels) > 0.9


def test_workloads_registry():
    for name, factory in WORKLOADS.items():
        if name.endswith("-tiny"):
            model, batch_fn, loss_fn = factory()
            assert loss_fn(model, batch_fn(0, 0)).ndim == 0, name
