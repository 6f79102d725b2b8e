"""The checks the engine client (session.py), its clients and the backend
(pycomm.distributed) share: a saved state's fields and ints, a key's
residuals' fields, and a comparison of settings across ranks. It imports
nothing of pycomm, so that the backend and the session both import it
without importing each other.

Example::

    >>> check_int("state['rank']", 1, 0, 2), is_int(True)
    (1, False)
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Dict, Optional, Sequence

import torch
import torch.distributed as dist

__all__ = ["MAX_KEY", "OPTIONAL_RESIDUAL_FIELDS", "RESIDUAL_FIELDS", "agree", "all_reduce_max", "check_fields",
           "check_int", "check_residual_fields", "gather_json", "is_int", "settings_digest"]

#: The largest key the engine takes (an int64).
MAX_KEY = (1 << 63) - 1
#: The fields of one key's residuals as the engine saves them, and those a
#: state may lack ("calls", the key's count for stochastic rounding, is
#: absent from states saved before keys counted).
RESIDUAL_FIELDS = ("numel", "world_size", "chunk_numel", "method", "worker", "server")
OPTIONAL_RESIDUAL_FIELDS = ("calls",)


def is_int(value: Any) -> bool:
    """An int, not a bool (what a saved size or count must be)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(where: str, value: Any, lo: int = 0, hi: Optional[int] = None) -> int:
    """``value``, an int (not a bool) in ``[lo, hi)`` (no upper bound when
    ``hi`` is None): what a saved count, size, rank or key must be; raises
    ValueError naming ``where``.

    >>> check_int("state['rank']", 2, 0, 2)
    Traceback (most recent call last):
    ...
    ValueError: state['rank'] must be an int in [0, 2), got 2
    """
    if not is_int(value) or value < lo or (hi is not None and value >= hi):
        what = f"an int in [{lo}, {hi})" if hi is not None else {0: "a non-negative int", 1: "a positive int"}.get(
            lo, f"an int >= {lo}")
        raise ValueError(f"{where} must be {what}, got {value!r}")
    return value


def check_fields(label: str, d: Any, fields: Sequence[str], optional: Sequence[str] = ()) -> None:
    """``d`` is a dict holding every name of ``fields`` and no name outside
    ``fields`` and ``optional``; raises naming ``label`` and what is
    missing or unknown.

    >>> check_fields("state", {"a": 1, "c": 2}, ("a", "b"))
    Traceback (most recent call last):
    ...
    ValueError: state must hold the fields ['a', 'b']; missing ['b']; unknown ['c']
    """
    if not isinstance(d, dict):
        raise TypeError(f"{label} must be a dict, got {type(d).__name__}")
    missing = [f for f in fields if f not in d]
    unknown = sorted(map(str, set(d) - set(fields) - set(optional)))
    if missing or unknown:
        raise ValueError(f"{label} must hold the fields {list(fields)}"
                         + (f"; missing {missing}" if missing else "")
                         + (f"; unknown {unknown}" if unknown else ""))


def check_residual_fields(label: str, ef: Any) -> None:
    """One key's residuals (``label``: their name in errors) hold the
    fields the engine saves, of its types: what any load of residuals
    checks first (:func:`check_residual`, and
    :func:`pycomm.distributed.load_error_feedback_state`, whose layout
    rules are the engine's own).

    >>> check_residual_fields("state[1]", {"numel": 0, "world_size": 2, "chunk_numel": 8, "method": "onebit",
    ...                                    "worker": torch.zeros(0), "server": []})
    Traceback (most recent call last):
    ...
    ValueError: state[1]['numel'] must be a positive integer, got 0
    """
    if not isinstance(ef, dict):
        raise TypeError(f"{label} must be a dict of residuals, got {type(ef).__name__}")
    check_fields(label, ef, RESIDUAL_FIELDS, OPTIONAL_RESIDUAL_FIELDS)
    for name in ("numel", "world_size", "chunk_numel", *OPTIONAL_RESIDUAL_FIELDS):
        # "calls" may be 0; every value fits the engine's int64.
        if name in ef and (not is_int(ef[name]) or not (name != "calls") <= ef[name] <= MAX_KEY):
            kind = "non-negative" if name == "calls" else "positive"
            raise ValueError(f"{label}['{name}'] must be a {kind} integer, got {ef[name]!r}")
    if not isinstance(ef["method"], str):
        raise TypeError(f"{label}['method'] must be a str, got {type(ef['method']).__name__}")
    if not isinstance(ef["worker"], torch.Tensor):
        raise ValueError(f"{label}['worker'] must be a 1-D float32 tensor, got {type(ef['worker']).__name__}")
    server = ef["server"]
    if not isinstance(server, (list, tuple)) or not all(isinstance(t, torch.Tensor) for t in server):
        raise TypeError(f"{label}['server'] must be a list of tensors, got {type(server).__name__}")


def settings_digest(settings: Dict[str, Any]) -> int:
    """A 56-bit digest of ``settings`` (a dict by the names users know them
    by): what :func:`agree` compares, and what a client keeps to see that
    its settings changed since the ranks agreed on them.

    >>> settings_digest({"a": 1, "b": [2]}) == settings_digest({"b": [2], "a": 1})
    True
    """
    return int.from_bytes(hashlib.sha1(repr(sorted(settings.items())).encode()).digest()[:7], "little")


def agree(owner: str, settings: Dict[str, Any], group: Any, device: Any,
          fix: str = "Every rank must build, attach and load it alike") -> None:
    """Raise on every rank of ``group`` when the ranks' ``settings`` (a
    dict by the names users know them by) differ, naming each setting that
    differs and every rank's value. One int64 per rank on the wire (a digest
    of the settings, and its negation); the settings themselves (as JSON)
    only when the digests differ. ``group``: a ProcessGroup, or a backend
    (a pycomm group's inner one, compared before the group exists);
    ``fix``: what the error tells the user to do. A collective: every rank
    of ``group`` calls it at the same point."""
    world = group.size()
    if world < 2:
        return
    digest = settings_digest(settings)
    # max(d) == -max(-d) = min(d): every rank's digest is the same. One
    # all-reduce, exact (int64) in every backend.
    both = all_reduce_max(group, torch.tensor([digest, -digest], dtype=torch.int64, device=device))
    if int(both[0]) == -int(both[1]):
        return
    theirs = gather_json(group, settings, device)
    diff = [k for k in settings if any(t.get(k) != theirs[0].get(k) for t in theirs)]
    if not diff:
        return  # equal values printed differently (density 1 and 1.0; one dict in two key orders) run alike
    raise ValueError(
        f"{owner}: the ranks disagree on "
        + "; ".join(f"{k} (" + ", ".join(f"rank {r}: {t.get(k)!r}" for r, t in enumerate(theirs)) + ")"
                    for k in diff)
        + f". {fix}. Nothing was changed."
    )


def gather_json(group: Any, obj: Any, device: Any) -> list:
    """Every rank's ``obj`` (as JSON; what JSON cannot write, by its repr),
    in rank order; ``group``: a ProcessGroup, or a backend (a pycomm group's
    inner one, or a group torch.distributed does not hold). A collective."""
    text = json.dumps(obj, sort_keys=True, default=repr).encode()
    buf = torch.zeros(int(all_reduce_max(group, torch.tensor([len(text)], device=device))[0]), dtype=torch.uint8)
    buf[:len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    buf = buf.to(device)
    every = [torch.empty_like(buf) for _ in range(group.size())]
    if isinstance(group, dist.ProcessGroup):
        dist.all_gather(every, buf, group=group)
    else:
        group.allgather([every], [buf]).wait()
    return [json.loads(bytes(t.cpu().tolist()).rstrip(b"\0")) for t in every]


def all_reduce_max(group: Any, t: torch.Tensor) -> torch.Tensor:
    """``t``, every rank's element-wise maximum, in place (exact for int64
    in every backend); ``group``: a ProcessGroup, or a backend (a pycomm
    group's inner one, before the group exists). A collective."""
    if isinstance(group, dist.ProcessGroup):
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    else:  # a backend whose group does not exist yet
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        group.allreduce([t], opts).wait()
    return t
