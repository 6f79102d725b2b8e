"""Loading error-feedback state into the engine (pd.load_error_feedback_state):
a truncated, mistyped or non-finite state is refused naming the key and the
field, before anything is replaced; a good one is copied, so loading the same
object twice restores the same residuals."""

from __future__ import annotations

import pytest
import torch
from _dist import run_ranks


def _rank(rank, world):
    import pycomm.distributed as pd

    pg = pd.wrap(compressor="onebit", min_compress_numel=1, chunk_numel=1000, block_size=32)
    for step in range(2):
        pd.all_reduce(torch.randn(2500, generator=torch.Generator().manual_seed(rank + step)), key=1, group=pg)
    good = pd.error_feedback_state(pg)
    out = {"errors": {}}

    def bad(name, mutate):
        state = {1: dict(good[1], server=list(good[1]["server"]))}
        mutate(state[1])
        try:
            pd.load_error_feedback_state(state, group=pg)
            out["errors"][name] = None
        except (ValueError, TypeError, RuntimeError) as exc:
            out["errors"][name] = f"{type(exc).__name__}: {exc}"
        # Refused: the engine still holds the residuals of before.
        now = pd.error_feedback_state(pg)[1]
        out.setdefault("kept", {})[name] = torch.equal(now["worker"], good[1]["worker"]) and all(
            torch.equal(a, b) for a, b in zip(now["server"], good[1]["server"]))

    bad("truncated server", lambda s: s["server"].pop())
    bad("short server segment", lambda s: s["server"].__setitem__(0, s["server"][0][:-1]))
    bad("float64 worker", lambda s: s.__setitem__("worker", s["worker"].double()))
    bad("2-D worker", lambda s: s.__setitem__("worker", s["worker"].reshape(50, 50)))
    bad("nan worker", lambda s: s.__setitem__("worker", torch.full_like(s["worker"], float("nan"))))
    bad("inf server", lambda s: s["server"].__setitem__(1, torch.full_like(s["server"][1], float("inf"))))
    bad("missing field", lambda s: s.pop("chunk_numel"))
    bad("float numel", lambda s: s.__setitem__("numel", 2500.0))
    bad("negative numel", lambda s: s.__setitem__("numel", -1))
    bad("server not a list", lambda s: s.__setitem__("server", "x"))
    bad("other method", lambda s: s.__setitem__("method", "topk"))

    # A good state is copied: the caller's tensors stay the caller's, and
    # loading the same object twice restores the same residuals.
    saved = {1: dict(good[1], worker=good[1]["worker"].clone(), server=[t.clone() for t in good[1]["server"]])}
    x = torch.randn(2500, generator=torch.Generator().manual_seed(7))
    results = []
    for _ in range(2):
        pd.load_error_feedback_state(saved, group=pg)
        y = x.clone()
        pd.all_reduce(y, key=1, group=pg)
        pd.all_reduce(y.clone(), key=1, group=pg)  # double-buffering would overwrite a kept tensor
        results.append((y, pd.error_feedback_state(pg)[1]["worker"]))
    out["same_twice"] = torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    out["caller_untouched"] = torch.equal(saved[1]["worker"], good[1]["worker"])

    # Two owners of keys on one group: each saves and restores its own.
    pd.all_reduce(torch.randn(700), key=2, group=pg)
    mine = pd.error_feedback_state(pg, keys=[1])
    other = pd.error_feedback_state(pg, keys=[2])[2]["worker"].clone()
    out["keys_filter"] = sorted(mine) == [1] and sorted(pd.error_feedback_state(pg)) == [1, 2]
    pd.all_reduce(torch.randn(2500), key=1, group=pg)
    pd.load_error_feedback_state(mine, group=pg, replace=False)
    after = pd.error_feedback_state(pg)
    out["merge_keeps_others"] = (sorted(after) == [1, 2] and torch.equal(after[2]["worker"], other)
                                 and torch.equal(after[1]["worker"], mine[1]["worker"]))
    pd.load_error_feedback_state(mine, group=pg)  # replace: only key 1 is left
    out["replace_drops_others"] = sorted(pd.error_feedback_state(pg)) == [1]
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(_rank, 2, timeout=120)


WANT = {
    "truncated server": "['server'] must hold one tensor per chunk",
    "short server segment": "['server'][0] holds",
    "float64 worker": "['worker'] must be a 1-D float32 tensor",
    "2-D worker": "['worker'] must be a 1-D float32 tensor",
    "nan worker": "NaN or Inf",
    "inf server": "NaN or Inf",
    "missing field": "missing ['chunk_numel']",
    "float numel": "['numel'] must be a positive integer",
    "negative numel": "['numel'] must be a positive integer",
    "server not a list": "must be a list of tensors",
    "other method": "saved for topk",
}


@pytest.mark.parametrize("name", sorted(WANT))
def test_bad_state_is_refused_and_nothing_changes(results, name):
    for r in results:
        err = r["errors"][name]
        assert err is not None, f"{name} was accepted"
        assert WANT[name] in err and ("key 1" in err or "state[1]" in err), err
        assert r["kept"][name], f"{name}: the residuals changed although the state was refused"


def test_loading_copies(results):
    for r in results:
        assert r["same_twice"]
        assert r["caller_untouched"]


def test_keys_filter_and_merge(results):
    for r in results:
        assert r["keys_filter"] and r["merge_keeps_others"] and r["replace_drops_others"]
