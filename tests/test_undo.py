"""``pd.undo_error_feedback``: after a call that kept new residuals, the
undo puts back exactly the residuals from before it (worker and server),
for double-buffered codecs (onebit, int4 on CPU) and copied ones (topk),
and for the all-reduce, reduce-scatter and all-gather; a call repeated from
the restored residuals gives the same result bit for bit. What cannot be
undone (no call, a non-finite call, an undo already done, residuals loaded
since) is refused whole, naming the key, and changes nothing.
"""

from __future__ import annotations

import pytest
import torch
from _dist import run_ranks

N, CHUNK = 996, 512  # divisible by every world size tested
METHODS = {"onebit": dict(block_size=64), "int4": dict(block_size=64), "topk": dict(density=0.02)}


def _input(rank, step, n=N):
    return torch.randn(n, generator=torch.Generator().manual_seed(31 * rank + step))


def _snap(pg, key):
    import pycomm.distributed as pd

    ef = pd.error_feedback_state(pg, keys=[key])[key]
    return [ef["worker"].clone(), *[s.clone() for s in ef["server"]]]


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _refused(fn, *words):
    try:
        fn()
    except (RuntimeError, ValueError, TypeError) as exc:
        return all(w in str(exc) for w in words)
    return False


def _rank_undo(rank, world):
    import pycomm.distributed as pd

    out = {}
    for method, settings in METHODS.items():
        pg = pd.wrap(compressor=method, min_compress_numel=1, chunk_numel=CHUNK, **settings)
        r = {}
        calls = {
            "all_reduce": lambda x: (pd.all_reduce(x, key=1, group=pg, op="avg"), x)[1],
            "reduce_scatter": lambda x: (lambda o: (pd.reduce_scatter(o, x, key=2, group=pg, op="avg"), o)[1])(
                torch.empty(N // world)),
            "all_gather": lambda x: (lambda o: (pd.all_gather(o, x[: N // world], key=3, group=pg), o)[1])(
                torch.empty(N // world * world)),
        }
        for (name, call), key in zip(calls.items(), (1, 2, 3), strict=True):
            call(_input(rank, 0))                     # non-zero residuals
            before = _snap(pg, key)
            first = call(_input(rank, 1))
            after = _snap(pg, key)
            pd.undo_error_feedback([key], pg)
            restored = _snap(pg, key)
            again_refused = _refused(lambda k=key: pd.undo_error_feedback([k], pg), f"key {key}", "cannot be undone")
            second = call(_input(rank, 1))            # from the restored residuals
            r[name] = dict(changed=not _same(before, after), restored=_same(before, restored),
                           again_refused=again_refused, same_result=torch.equal(first, second),
                           same_residuals=_same(after, _snap(pg, key)))
        # Refused whole: a key with no residuals, or one given twice, leaves key 1 as it is.
        kept = _snap(pg, 1)
        r["unknown_refused"] = _refused(lambda: pd.undo_error_feedback([1, 99], pg), "key 99", "no residuals")
        r["twice_refused"] = _refused(lambda: pd.undo_error_feedback([1, 1], pg), "key 1", "twice")
        r["unchanged_after_refusals"] = _same(kept, _snap(pg, 1))
        r["bad_key_refused"] = _refused(lambda: pd.undo_error_feedback([-1], pg), "key")
        r["none_refused"] = _refused(lambda: pd.undo_error_feedback([None], pg), "None")
        r["str_refused"] = _refused(lambda: pd.undo_error_feedback("1", pg), "keys")
        # A non-finite call leaves the residuals as they were: nothing to undo.
        x = _input(rank, 2)
        x[7] = float("nan")
        pd.all_reduce(x, key=1, group=pg, op="avg")
        r["nonfinite_kept"] = _same(kept, _snap(pg, 1))
        r["nonfinite_refused"] = _refused(lambda: pd.undo_error_feedback([1], pg), "key 1", "cannot be undone")
        # Loaded residuals have no earlier ones.
        pd.all_reduce(_input(rank, 3), key=1, group=pg, op="avg")
        pd.load_error_feedback_state(pd.error_feedback_state(pg, keys=[1]), pg, replace=False)
        r["loaded_refused"] = _refused(lambda: pd.undo_error_feedback([1], pg), "key 1", "cannot be undone")
        # A call the check refused (another op on one rank; every call is
        # checked) is the key's last call: the kept one before it cannot be
        # undone any more.
        checked = pd.wrap(compressor=method, min_compress_numel=1, chunk_numel=CHUNK, check_calls="every",
                          **settings)
        pd.all_reduce(_input(rank, 3), key=1, group=checked, op="avg")
        try:
            pd.all_reduce(_input(rank, 4), key=1, group=checked, op=("avg", "sum")[rank % 2])
            r["mismatch_raised"] = False
        except RuntimeError:
            r["mismatch_raised"] = True
        kept_checked = _snap(checked, 1)
        r["refused_call_undo_refused"] = _refused(lambda: pd.undo_error_feedback([1], checked), "key 1",
                                                  "cannot be undone")
        r["refused_call_kept"] = _same(kept_checked, _snap(checked, 1))
        # The group still works, on every rank alike.
        y = _input(rank, 4)
        pd.all_reduce(y, key=1, group=pg, op="avg")
        r["after"] = y
        out[method] = r
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_undo_error_feedback(world):
    results = run_ranks(_rank_undo, world)
    for method in METHODS:
        for rank, res in enumerate(results):
            r = res[method]
            where = f"{method} rank {rank}"
            for name in ("all_reduce", "reduce_scatter", "all_gather"):
                c = r[name]
                assert c["changed"], f"{where} {name}: the call changed no residual, the test proves nothing"
                assert c["restored"], f"{where} {name}: undo did not restore the residuals"
                assert c["again_refused"], f"{where} {name}: a second undo was not refused"
                assert c["same_result"], f"{where} {name}: the repeated call differs"
                assert c["same_residuals"], f"{where} {name}: the repeated call's residuals differ"
            for k in ("unknown_refused", "twice_refused", "unchanged_after_refusals", "bad_key_refused",
                      "none_refused", "str_refused", "nonfinite_kept", "nonfinite_refused", "loaded_refused",
                      "mismatch_raised", "refused_call_undo_refused", "refused_call_kept"):
                assert r[k], f"{where}: {k}"
            assert torch.equal(r["after"], results[0][method]["after"]), f"{where}: ranks disagree after"
