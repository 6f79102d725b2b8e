"""DDP's gradient buckets as a communication hook sees them, and how a hook
reports a failure: what the compressed-gradient hook
(:func:`pycomm.ddp.compressed_hook`) and the compressed-momentum
optimizers' hook (:func:`pycomm.ddp.optimizer_hook`) share.

DDP rebuilds its buckets after the first backward pass of every process
(the first has one bucket holding every parameter), so a bucket index means
something only from the second backward on: :class:`BucketTracker` counts
the backward passes, and records, per bucket index, the bucket's
:class:`BucketLayout` (its element count and its parameters' positions),
which is saved with the residuals kept under that index and checked against
DDP's buckets after a restore.
"""

# No `from __future__ import annotations`: DDP compares a hook's annotations
# with dist.GradBucket and torch.futures.Future[torch.Tensor] as objects.
from typing import Any, Callable, Dict, Iterable, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist

from ..distributed.checks import check_int

__all__ = ["BucketLayout", "BucketTracker", "checked_layouts", "failed", "result"]


class BucketLayout(NamedTuple):
    """One DDP bucket: its element count and its parameters' positions (a
    parameter's position is fixed for a given model: the order in which the
    owner first saw it, or its place in an optimizer's parameter groups)."""

    numel: int
    positions: Tuple[int, ...]


class BucketTracker:
    """The buckets of one DDP model as its hook sees them.

    ``owner`` names the hook's state in errors; ``positions``: parameter id
    -> position, for an owner whose parameters have positions already (an
    optimizer's); others get positions in the order the hook first sees
    them (deterministic for a given model and DDP configuration).

    Example::

        >>> t = BucketTracker("CompressionState")
        >>> t.record(0, BucketLayout(10, (0, 1)))
        >>> t.record(0, BucketLayout(12, (0, 1)))
        Traceback (most recent call last):
        ...
        ValueError: DDP bucket 0 holds 12 elements (parameters [0, 1]), but CompressionState's residuals of bucket 0 were saved for 10 elements (parameters [0, 1]): another model or bucket_cap_mb? Load the state with reset_error_feedback=True to start the residuals over
    """

    def __init__(self, owner: str, positions: Optional[Dict[int, int]] = None) -> None:
        self.owner = owner
        #: Bucket index -> its layout, recorded once DDP's buckets are stable
        #: (saved with the residuals).
        self.layouts: Dict[int, BucketLayout] = {}
        self.detach(positions)

    def detach(self, positions: Optional[Dict[int, int]] = None) -> None:
        """Forget what belongs to this process (after unpickling)."""
        self._positions: Dict[int, int] = dict(positions or {})
        #: Backward passes DDP ran in this process.
        self.backwards = 0

    def start(self, bucket: dist.GradBucket) -> bool:
        """At each bucket: True when DDP has rebuilt its buckets in this
        process (its indices are the ones layouts are recorded for); a
        backward pass is counted at its last bucket."""
        stable = self.backwards >= 1
        if bucket.is_last():
            self.backwards += 1
        return stable

    def layout(self, bucket: dist.GradBucket) -> BucketLayout:
        """The layout of ``bucket`` as DDP hands it over now."""
        out = []
        for p in bucket.parameters():
            pos = self._positions.get(id(p))
            if pos is None:
                pos = self._positions[id(p)] = len(self._positions)
            out.append(pos)
        return BucketLayout(bucket.buffer().numel(), tuple(out))

    def record(self, index: int, layout: BucketLayout, replace: bool = False) -> None:
        """Record bucket ``index``'s layout; one that differs from the one
        recorded (or loaded) is refused, naming both, unless ``replace``."""
        known = self.layouts.get(index)
        if known is not None and known != layout and not replace:
            raise ValueError(
                f"DDP bucket {index} holds {layout.numel} elements (parameters {list(layout.positions)}), but "
                f"{self.owner}'s residuals of bucket {index} were saved for {known.numel} elements (parameters "
                f"{list(known.positions)}): another model or bucket_cap_mb? Load the state with "
                f"reset_error_feedback=True to start the residuals over"
            )
        self.layouts[index] = layout

    def state(self) -> Dict[int, Tuple[int, List[int]]]:
        """The layouts as a state saves them: ``{index: (numel, [positions])}``."""
        return {i: (lay.numel, list(lay.positions)) for i, lay in self.layouts.items()}

    def __getstate__(self) -> Dict[str, Any]:
        return {"owner": self.owner, "layouts": self.layouts}

    def __setstate__(self, d: Dict[str, Any]) -> None:
        self.__dict__.update(d)
        self.detach()


def checked_layouts(layouts: Any, where: str) -> Dict[int, BucketLayout]:
    """Saved layouts (:meth:`BucketTracker.state`; ``where``: their name in
    errors) checked and copied: indices and sizes non-negative ints, every
    parameter in one bucket at most.

    >>> checked_layouts({0: (4, [0, 1]), 1: (2, [1])}, "state['bucket_layouts']")
    Traceback (most recent call last):
    ...
    ValueError: state['bucket_layouts'][1]: parameter 1 is also in bucket 0
    """
    if not isinstance(layouts, dict):
        raise TypeError(f"{where} must be a dict, got {type(layouts).__name__}")
    out: Dict[int, BucketLayout] = {}
    owner: Dict[int, int] = {}  # parameter position -> bucket
    for index, value in layouts.items():
        label = f"{where}[{index!r}]"
        check_int(f"{label}: a key (a bucket index)", index)
        if not isinstance(value, (list, tuple)) or len(value) != 2:
            raise ValueError(f"{label} must be (numel, [parameter positions]), got {value!r}")
        numel, positions = value
        check_int(f"{label}: numel", numel, 1)
        if not isinstance(positions, (list, tuple)) or not positions:
            raise ValueError(f"{label}: the parameter positions must be a non-empty list, got {positions!r}")
        for p in positions:
            check_int(f"{label}: a parameter position", p)
            if p in owner:
                raise ValueError(f"{label}: parameter {p} is also in bucket {owner[p]}")
            owner[p] = index
        out[index] = BucketLayout(numel, tuple(positions))
    return out


# --------------------------------------------------------- error delivery ---
def _after_ddp(check: Callable[[], None]) -> bool:
    """Run ``check`` at the end of the current backward pass, after DDP's
    own end-of-backward step (which DDP queues once its last bucket is
    ready, after the hooks ran): queued now, it queues itself once more,
    behind DDP's. An exception it raises comes out of ``loss.backward()`` as
    itself (DDP would report only a RuntimeError with its text), and DDP has
    ended its pass, so the model trains on after a refusal. False when not
    inside a backward pass (nothing queued)."""
    engine = torch.autograd.Variable._execution_engine

    def again():
        engine.queue_callback(check)

    try:
        engine.queue_callback(again)
    except RuntimeError:  # not inside a backward pass
        return False
    return True


def failed(exc: BaseException, tensor: Optional[torch.Tensor] = None, as_itself: bool = True) -> torch.futures.Future:
    """The future a hook returns when it refuses a bucket. Inside a backward
    pass with ``as_itself`` and the bucket's ``tensor``: a future of the
    tensor as it is (DDP ends its pass), and ``exc`` raised by backward()
    as itself after it; otherwise a future that fails with ``exc`` (DDP
    raises a RuntimeError with its text)."""

    def check():
        raise exc

    done: torch.futures.Future = torch.futures.Future()
    if as_itself and tensor is not None and _after_ddp(check):
        done.set_result(tensor)
        return done
    done.set_result(None)
    return done.then(lambda _: check())


def result(raw: Iterable[torch.futures.Future], finish: Callable[[], torch.Tensor],
           tensor: torch.Tensor) -> torch.futures.Future:
    """The future DDP waits on: ``finish()`` once every future in ``raw``
    has completed. A failure (an engine call's, or one in ``finish``) is
    raised by backward() as the original exception, after DDP ended its
    pass (the future then gives the bucket's ``tensor`` as it is); outside
    a backward pass the future fails with it."""
    raw = list(raw)
    errors: List[BaseException] = []

    def check():
        if errors:
            raise errors[0]

    deferred = _after_ddp(check)

    def then(_):
        try:
            for f in raw:
                f.wait()  # the engine's error, with its own type
            return finish()
        except BaseException as exc:
            errors.append(exc)
            if deferred:
                return tensor
            raise

    source = raw[0] if len(raw) == 1 else torch.futures.collect_all(raw)
    return source.then(then)
