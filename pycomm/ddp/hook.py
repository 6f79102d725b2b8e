"""DDP communication hook that all-reduces gradient buckets compressed.

Usage::

    from pycomm.ddp import CompressionState, compressed_hook

    state = CompressionState(process_group=None, compressor="topk", density=0.01,
                             start_iter=10, error_feedback=True)
    ddp.register_comm_hook(state, compressed_hook)
    ...
    torch.save(state.state_dict(), f"hook_rank{rank}.pt")      # every rank its own
    state.load_state_dict(torch.load(f"hook_rank{rank}.pt"))

How a bucket is reduced (always to the AVERAGE over ranks; DDP hands the
bucket over NOT divided by the world size):

* iterations ``< start_iter`` (warm-up): a plain all-reduce, exact;
* afterwards, over an ordinary process group (Gloo, NCCL): the algorithms of
  ``docs/allreduce.md`` (:mod:`pycomm.distributed.algorithms`), run on ONE
  worker thread per state, bucket after bucket in the order DDP hands them
  over. That thread issues every collective of the hook and waits on them
  there; the hook returns a ``torch.futures.Future`` at once and that thread
  completes it (``set_result`` / ``set_exception``). Issuing the second stage
  of a two-stage algorithm from a future callback instead (on the backend's
  thread) races with the next bucket's first collective, issued by autograd:
  ranks then issue collectives in different orders, which Gloo reports as
  "Received data size doesn't match expected size" (the likely cause of
  PyTorch's PowerSGD hook failing on Gloo);
* over a process group of the ``"pycomm"`` backend: the bucket goes to the
  backend, ``pycomm.distributed.all_reduce(t, key=bucket.index(), op="avg",
  async_op=True)``, which compresses it in C++ with its own residuals.

Error-feedback residuals are kept per bucket index. DDP rebuilds its buckets
after the first iteration of every process (the first iteration has one
bucket holding every parameter), so indices mean something only from the
second iteration on: ``start_iter >= 2`` is enforced, and after a restore
(first iteration of a fresh process, buckets not yet rebuilt) the hook maps
the saved bucket layout onto the bucket DDP hands over, parameter by
parameter, so that a resumed run continues exactly as an uninterrupted one.
"""

# No `from __future__ import annotations`: DDP compares the hook's annotations
# with dist.GradBucket and torch.futures.Future[torch.Tensor] as objects.
import contextlib
import queue
import threading
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .. import get_compressor
from ..compressors.base import check_density
from ..distributed.algorithms import ErrorFeedback, allreduce_compressed, check_mode

__all__ = ["CompressionState", "compressed_hook"]

#: "auto": the pycomm group's own choice per bucket size (docs/auto.md).
COMPRESSORS = ("onebit", "topk", "fp16", "bf16", "auto")
_STATE_VERSION = 1


def _pycomm_group_api():
    """``(is_pycomm_group, all_reduce)`` of the pycomm backend, or None while
    that backend (pycomm/distributed/__init__.py) does not provide them."""
    try:
        from .. import distributed as pd
    except ImportError:
        return None
    is_pg = getattr(pd, "is_pycomm_group", None)
    ar = getattr(pd, "all_reduce", None)
    if callable(is_pg) and callable(ar):
        return is_pg, ar
    return None


class _Worker:
    """One daemon thread running tasks in FIFO order (the hook's collectives)."""

    def __init__(self) -> None:
        self._tasks: "queue.SimpleQueue[Optional[Callable[[], None]]]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="pycomm-ddp-hook", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            task = self._tasks.get()
            if task is None:
                return
            task()  # tasks catch their own exceptions (they own a future)

    def submit(self, task: Callable[[], None]) -> None:
        self._tasks.put(task)

    def drain(self) -> None:
        """Block until every task submitted so far has run."""
        done = threading.Event()
        self._tasks.put(done.set)
        done.wait()

    def stop(self) -> None:
        self._tasks.put(None)


class CompressionState:
    """State of :func:`compressed_hook`: configuration, iteration count,
    error-feedback residuals per bucket, and the worker thread.

    Args:
        process_group: the group DDP reduces over (None: the default group).
        compressor: "onebit", "topk", "fp16" or "bf16".
        density: fraction of entries topk sends per chunk.
        approx: topk's approximate (threshold) selection instead of exact.
        block_size: onebit block length (a multiple of 32).
        chunk_numel: chunk length of the algorithms (None: their default).
        start_iter: iterations before this one use a plain all-reduce; must
            be >= 2 (bucket indices are only stable once DDP has rebuilt its
            buckets after the first iteration).
        error_feedback: keep residuals (onebit, topk; fp16/bf16 have none).
        impl: compressor implementation ("auto", "reference", "cpu", ...).
        check_calls: when ranks compare their calls, to raise on every rank
            on a mismatch instead of hanging: "first" (first use of each
            bucket), "every" or "off"; ``PYCOMM_DEBUG=detail`` means "every".
        private_group: reduce over a private copy of ``process_group``
            (``dist.new_group``, so every rank of the default group must
            construct the state, in the same order as its other new_group
            calls). Needed when other collectives are issued on
            ``process_group`` while the hook's thread is busy, e.g. DDP's own
            all-reduce of the used-parameter map with
            ``find_unused_parameters=True``: the relative order of those and
            the hook's collectives could differ between ranks.

    Example::

        >>> state = CompressionState(compressor="onebit", block_size=2048, start_iter=100)
        >>> ddp_model.register_comm_hook(state, compressed_hook)      # doctest: +SKIP
        >>> torch.save(state.state_dict(), f"hook_rank{rank}.pt")    # doctest: +SKIP

    ``state_dict()`` holds the iteration, the configuration, and this rank's
    residuals and bucket layout: each rank saves and loads its own.
    ``load_state_dict`` refuses a state saved with another world size or by
    another rank (and, at the first iteration where DDP's buckets are known,
    one saved with another bucket layout) unless
    ``reset_error_feedback=True``, which keeps the iteration and drops the
    residuals. Pickling keeps everything but the process group (restored as
    the default group), like PyTorch's PowerSGD state.
    """

    def __init__(
        self,
        process_group: Optional[dist.ProcessGroup] = None,
        compressor: str = "topk",
        *,
        density: float = 0.01,
        approx: bool = True,
        block_size: int = 2048,
        chunk_numel: Optional[int] = None,
        start_iter: int = 10,
        error_feedback: bool = True,
        impl: str = "auto",
        private_group: bool = False,
        check_calls: str = "first",
    ) -> None:
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(
                f"process_group must be a torch.distributed.ProcessGroup or None, got {type(process_group).__name__}"
            )
        if not isinstance(private_group, bool):
            raise TypeError(f"private_group must be a bool, got {private_group!r}")
        self.process_group = process_group
        self._apply_config(
            dict(
                compressor=compressor, density=density, approx=approx, block_size=block_size,
                chunk_numel=chunk_numel, start_iter=start_iter, error_feedback=error_feedback,
            )
        )
        if not isinstance(impl, str):
            raise TypeError(f"impl must be a string, got {impl!r}")
        if compressor in ("onebit", "topk"):
            get_compressor(compressor, impl=impl)  # names the allowed impls
        #: When ranks compare their calls (see allreduce_compressed's ``check``).
        check_mode(check_calls, "check_calls")  # validates
        self.check_calls = check_calls
        self.impl = impl
        #: Backward passes completed (counted at the last bucket of each).
        self.iteration = 0
        #: Residuals per bucket index.
        self.error_dict: Dict[int, ErrorFeedback] = {}
        #: Bucket index -> (numel, parameter positions), recorded once DDP's
        #: buckets are stable; a position is a parameter's index in the
        #: concatenated parameter lists of DDP's initial buckets (deterministic
        #: for a given model and DDP configuration, in any process).
        self.bucket_layouts: Dict[int, Tuple[int, Tuple[int, ...]]] = {}
        self.private_group = bool(private_group)
        self._saved_world: Optional[Tuple[int, int]] = None  # (world, rank) a loaded state expects
        self._init_runtime()
        if self.private_group:
            base = process_group if process_group is not None else dist.group.WORLD
            self._comm_group = dist.new_group(ranks=dist.get_process_group_ranks(base))

    # -- configuration ---------------------------------------------------------
    def _apply_config(self, cfg: Dict[str, Any]) -> None:
        compressor = cfg["compressor"]
        if compressor not in COMPRESSORS:
            raise ValueError(f"compressor must be one of {list(COMPRESSORS)}, got {compressor!r}")
        start_iter = cfg["start_iter"]
        if isinstance(start_iter, bool) or not isinstance(start_iter, int):
            raise TypeError(f"start_iter must be an int, got {start_iter!r}")
        if start_iter < 2:
            raise ValueError(
                f"start_iter must be >= 2, got {start_iter}: DDP rebuilds its gradient buckets "
                f"after the first iteration, so bucket.index(), which keys the error-feedback "
                f"residuals, is not stable before the second (pytorch issue #51427)"
            )
        chunk_numel = cfg["chunk_numel"]
        if chunk_numel is not None and (
            isinstance(chunk_numel, bool) or not isinstance(chunk_numel, int) or chunk_numel <= 0
        ):
            raise ValueError(f"chunk_numel must be a positive integer or None, got {chunk_numel!r}")
        if not isinstance(cfg["error_feedback"], bool):
            raise TypeError(f"error_feedback must be a bool, got {cfg['error_feedback']!r}")
        density = check_density(cfg["density"])
        if not isinstance(cfg["approx"], bool):
            raise TypeError(f"approx must be a bool, got {cfg['approx']!r}")
        get_compressor("onebit", block_size=cfg["block_size"])  # validates block_size
        self.compressor = compressor
        self.density = density
        self.approx = cfg["approx"]
        self.block_size = cfg["block_size"]
        self.chunk_numel = chunk_numel
        self.start_iter = start_iter
        self.error_feedback = cfg["error_feedback"]

    def config(self) -> Dict[str, Any]:
        """The configuration as a dict (what :meth:`state_dict` saves)."""
        return {
            "compressor": self.compressor,
            "density": self.density,
            "approx": self.approx,
            "block_size": self.block_size,
            "chunk_numel": self.chunk_numel,
            "start_iter": self.start_iter,
            "error_feedback": self.error_feedback,
        }

    def _ef_config(self) -> Tuple:
        # What the residuals depend on: another value makes them meaningless.
        c = self.config()
        return (c["compressor"], c["block_size"] if c["compressor"] == "onebit" else None,
                c["chunk_numel"], c["error_feedback"])

    def _uses_ef(self) -> bool:
        # "auto": the backend keeps residuals for the buckets it sends by onebit or topk.
        return self.error_feedback and self.compressor in ("onebit", "topk", "auto")

    def _compressor_kwargs(self) -> Dict[str, Any]:
        if self.compressor == "onebit":
            return {"block_size": self.block_size, "impl": self.impl}
        if self.compressor == "topk":
            return {"density": self.density, "approx": self.approx, "impl": self.impl}
        return {}

    # -- runtime (not saved, not pickled) --------------------------------------
    def _init_runtime(self) -> None:
        self._worker: Optional[_Worker] = None
        self._worker_lock = threading.Lock()
        self._comm_group: Optional[dist.ProcessGroup] = None
        self._positions: Dict[int, int] = {}  # id(parameter) -> position
        self._local_iter = 0  # backward passes seen by this object in this process
        self._warned_unmapped = False
        self._pycomm_checked = False  # a pycomm group's settings were compared

    def _get_worker(self) -> _Worker:
        with self._worker_lock:
            if self._worker is None:
                self._worker = _Worker()
            return self._worker

    def __del__(self) -> None:
        # Let the idle worker thread end (tasks already queued run first; they
        # hold no reference to the state).
        worker = self.__dict__.get("_worker")
        if worker is not None:
            try:
                worker.stop()
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass

    def _group(self) -> Optional[dist.ProcessGroup]:
        return self._comm_group if self._comm_group is not None else self.process_group

    def _pycomm_backend_group(self) -> Optional[dist.ProcessGroup]:
        """The group if it runs the pycomm backend (on CPU), else None."""
        api = _pycomm_group_api()
        group = self._group()
        if api is None or not dist.is_initialized() or not api[0](group):
            return None
        return group

    def _check_pycomm_group(self, group, device) -> None:
        """A pycomm group compresses with its own settings: they must be this state's."""
        if self._pycomm_checked:
            return
        from .. import distributed as pd

        opts = pd.options_of(group, device)
        mine = {"method": self.compressor}
        if self.compressor == "onebit":
            mine["block_size"] = self.block_size
        if self.compressor == "topk":
            mine.update(density=self.density, approx=self.approx)
        diff = {k: (opts[k], v) for k, v in mine.items() if opts[k] != v}
        if diff:
            raise ValueError(
                "this CompressionState asks for "
                + ", ".join(f"{k}={v[1]!r}" for k, v in diff.items())
                + " but its process group runs the pycomm backend with "
                + ", ".join(f"{k}={v[0]!r}" for k, v in diff.items())
                + ": the group's settings decide, so make them agree"
            )
        self._pycomm_checked = True

    def _backend_error_feedback(self) -> Dict[int, Any]:
        group = self._pycomm_backend_group()
        if group is None:
            return {}
        from .. import distributed as pd

        return pd.error_feedback_state(group)

    def _load_backend_error_feedback(self, saved: Dict[int, Any]) -> None:
        group = self._pycomm_backend_group()
        if group is None:
            raise ValueError(
                "this state holds residuals of a pycomm backend group; load it after the "
                "pycomm process group is initialized (or with reset_error_feedback=True)"
            )
        from .. import distributed as pd

        pd.load_error_feedback_state(saved, group)

    def synchronize(self) -> None:
        """Wait until every bucket handed to the worker thread is done (DDP
        already waits for them before backward() returns)."""
        if self._worker is not None:
            self._worker.drain()

    def _world(self) -> Tuple[int, int]:
        return dist.get_world_size(self.process_group), dist.get_rank(self.process_group)

    # -- persistence -----------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """Iteration, configuration, bucket layout and this rank's residuals."""
        self.synchronize()
        world, rank = self._world() if dist.is_initialized() else (None, None)
        if self._saved_world is not None and world is None:
            world, rank = self._saved_world
        return {
            "version": _STATE_VERSION,
            "config": self.config(),
            "iteration": self.iteration,
            "world_size": world,
            "rank": rank,
            "bucket_layouts": {i: (n, list(p)) for i, (n, p) in self.bucket_layouts.items()},
            "error_feedback": {i: ef.state_dict() for i, ef in self.error_dict.items()},
            # On a pycomm group the backend holds the residuals (per bucket key).
            "backend_error_feedback": self._backend_error_feedback(),
        }

    def load_state_dict(self, state: Dict[str, Any], reset_error_feedback: bool = False) -> None:
        """Restore :meth:`state_dict`: iteration, configuration (the saved one
        replaces the constructor's), bucket layout and residuals.

        Raises ValueError for a state saved with another world size or by
        another rank, unless ``reset_error_feedback=True``: then the
        iteration and configuration are restored and the residuals and
        bucket layout start over. A saved bucket layout that does not match
        DDP's buckets (another model, another ``bucket_cap_mb``) is refused
        at the first iteration where DDP's buckets are known: ``backward()``
        raises the ValueError.
        """
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            raise ValueError("not a CompressionState state_dict (or of another version)")
        prev = self.config()
        try:
            self._apply_config(dict(state["config"]))
        except Exception:
            self._apply_config(prev)
            raise
        saved_world = (state.get("world_size"), state.get("rank"))
        problems = []
        if saved_world[0] is not None and dist.is_initialized():
            world, rank = self._world()
            if saved_world[0] != world:
                problems.append(f"it was saved with world size {saved_world[0]}, this group has {world}")
            elif saved_world[1] != rank:
                problems.append(f"it holds rank {saved_world[1]}'s residuals, this is rank {rank}")
        if problems and not reset_error_feedback:
            self._apply_config(prev)
            raise ValueError(
                "cannot load this CompressionState: " + "; ".join(problems)
                + ". Save and load each rank's own state, or pass reset_error_feedback=True "
                "to keep the iteration and start the residuals over."
            )
        self.iteration = int(state["iteration"])
        if reset_error_feedback:
            self.error_dict = {}
            self.bucket_layouts = {}
            self._saved_world = None
            group = self._pycomm_backend_group()
            if group is not None:
                from .. import distributed as pd

                pd.reset_error_feedback(group=group)
            return
        self.bucket_layouts = {int(i): (int(n), tuple(p)) for i, (n, p) in state["bucket_layouts"].items()}
        efs = {}
        for i, sd in state["error_feedback"].items():
            ef = ErrorFeedback()
            ef.load_state_dict(sd)
            efs[int(i)] = ef
        self.error_dict = efs
        backend_ef = state.get("backend_error_feedback")
        if backend_ef:
            self._load_backend_error_feedback(backend_ef)
        # Checked at the first hook call if the group was not up at load time.
        self._saved_world = saved_world if saved_world[0] is not None else None

    def __getstate__(self) -> Dict[str, Any]:
        self.synchronize()
        keep = {k: v for k, v in self.__dict__.items() if not k.startswith("_") or k == "_saved_world"}
        keep["process_group"] = None
        return keep

    def __setstate__(self, d: Dict[str, Any]) -> None:
        self.__dict__.update(d)
        self.__dict__.setdefault("check_calls", "first")
        self.process_group = None  # the default group of the process that unpickles
        self.private_group = False  # a private group cannot be re-created here safely
        self._init_runtime()

    def __repr__(self) -> str:
        cfg = ", ".join(f"{k}={v!r}" for k, v in self.config().items())
        return f"CompressionState({cfg}, iteration={self.iteration})"

    # -- planning (on the hook's calling thread) --------------------------------
    def _bucket_positions(self, params: List[torch.Tensor]) -> Tuple[int, ...]:
        out = []
        for p in params:
            pos = self._positions.get(id(p))
            if pos is None:
                pos = self._positions[id(p)] = len(self._positions)
            out.append(pos)
        return tuple(out)

    def _check_world(self) -> None:
        if self._saved_world is None:
            return
        world, rank = self._world()
        if self._saved_world != (world, rank):
            raise ValueError(
                f"CompressionState was loaded from a state of rank {self._saved_world[1]} of "
                f"{self._saved_world[0]}, but this is rank {rank} of {world}; load it with "
                f"reset_error_feedback=True to start the residuals over"
            )
        self._saved_world = None

    def _ef_for(self, index: int) -> Optional[ErrorFeedback]:
        if not self._uses_ef():
            return None
        ef = self.error_dict.get(index)
        if ef is None:
            ef = self.error_dict[index] = ErrorFeedback()
        return ef


def _plain_avg(tensor: torch.Tensor, group) -> None:
    """Exact average: ReduceOp.AVG where the backend has it (NCCL), else
    divide by the world size first (as PyTorch's allreduce_hook does) and sum."""
    if dist.get_backend(group) == "nccl":
        dist.all_reduce(tensor, op=dist.ReduceOp.AVG, group=group)
    else:
        tensor.div_(dist.get_world_size(group))
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)


def _run(fut: torch.futures.Future, result: torch.Tensor, body: Callable[[], None], stream) -> Callable[[], None]:
    def task() -> None:
        # On CUDA, run on the stream DDP produced the bucket on (the caller's
        # current stream), and complete the future there: a device-aware
        # future then makes DDP's stream wait for the result.
        ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with ctx:
            try:
                with torch.no_grad():
                    body()
            except BaseException as exc:  # noqa: BLE001 - every failure must reach DDP
                fut.set_exception(exc)
            else:
                fut.set_result(result)

    return task


def _new_future(tensor: torch.Tensor):
    if tensor.device.type == "cuda":
        return torch.futures.Future(devices=[tensor.device]), torch.cuda.current_stream(tensor.device)
    return torch.futures.Future(), None


def _failed(exc: BaseException) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_exception(exc)
    return fut


def compressed_hook(state: CompressionState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average ``bucket`` over ranks, compressed.

    Register with ``ddp_model.register_comm_hook(state, compressed_hook)``
    before the first forward. Returns a ``torch.futures.Future`` at once; the
    state's worker thread (or, on a pycomm group, the backend) completes it
    with the averaged bucket, or with the exception that stopped it, which
    then surfaces from ``loss.backward()``.

    Example (on every rank, after ``dist.init_process_group``)::

        from torch.nn.parallel import DistributedDataParallel as DDP
        from pycomm.ddp import CompressionState, compressed_hook

        ddp = DDP(model)
        state = CompressionState(compressor="topk", density=0.01, start_iter=10)
        ddp.register_comm_hook(state, compressed_hook)
        for x, y in data:
            loss_fn(ddp(x), y).backward()
            opt.step()
            opt.zero_grad()
    """
    if not isinstance(state, CompressionState):
        return _failed(TypeError(
            f"compressed_hook needs a pycomm.ddp.CompressionState as its state, got {type(state).__name__}"
        ))
    tensor = bucket.buffer()
    index = bucket.index()
    is_last = bucket.is_last()
    it, local = state.iteration, state._local_iter
    if is_last:  # one backward pass = one iteration, whatever happens below
        state.iteration += 1
        state._local_iter += 1
    try:
        state._check_world()
        params = bucket.parameters()
        positions = state._bucket_positions(params)
    except Exception as exc:
        return _failed(exc)
    warm = it < state.start_iter
    # Before DDP's first bucket rebuild in this process (its first iteration)
    # the buckets are not the ones the residuals belong to.
    stable = local >= 1

    numel = tensor.numel()
    record = (numel, positions)
    try:
        if stable:
            known = state.bucket_layouts.get(index)
            if known is None:
                state.bucket_layouts[index] = record
            elif known != record:
                if index in state.error_dict or not warm:
                    raise ValueError(
                        f"DDP bucket {index} holds {numel} elements (parameters {list(positions)}), "
                        f"but the residuals of bucket {index} were saved for {known[0]} elements "
                        f"(parameters {list(known[1])}): another model or bucket_cap_mb? Load the "
                        f"state with reset_error_feedback=True to start the residuals over"
                    )
                state.bucket_layouts[index] = record
    except Exception as exc:
        return _failed(exc)
    # This bucket is one whose residuals are kept under its index (else: the
    # first iteration of a resumed process, before DDP's rebuild).
    keyed = stable or state.bucket_layouts.get(index) == record

    api = _pycomm_group_api()
    group = state._group()
    if api is not None and api[0](group, tensor.device):
        # The backend compresses, keeps the residuals (per key) and orders
        # the collectives itself.
        try:
            state._check_pycomm_group(group, tensor.device)
            return _pycomm_hook(state, bucket, tensor, positions, group, api[1], warm, keyed, it)
        except Exception as exc:
            return _failed(exc)

    if state.compressor == "auto":
        return _failed(ValueError(
            "compressor='auto' is chosen per bucket by a pycomm process group created with "
            "compressor='auto' (pycomm.distributed.init_process_group or wrap); this bucket's group "
            "is not one"))
    fut, stream = _new_future(tensor)
    try:
        if warm:
            body = lambda: _plain_avg(tensor, group)  # noqa: E731
        elif keyed:
            ef = state._ef_for(index)
            body = _compressed_body(state, tensor, group, ef, index)
        else:
            body = _remapped_body(state, bucket, tensor, positions, group, it)
    except Exception as exc:
        return _failed(exc)
    state._get_worker().submit(_run(fut, tensor, body, stream))
    return fut


def _pycomm_hook(state, bucket, tensor, positions, group, pycomm_all_reduce, warm, keyed, it):
    """The bucket through a pycomm group: the backend's residuals are keyed
    by bucket index, so a resumed process's first (unrebuilt) bucket is cut
    into the saved buckets, as over a plain group."""
    if warm:
        work = pycomm_all_reduce(tensor, group=group, op="avg", async_op=True, compress=False)
        return work.get_future().then(lambda f: _first_tensor(f.value(), tensor))
    if keyed:
        key = bucket.index() if state._uses_ef() else None
        work = pycomm_all_reduce(tensor, key=key, group=group, op="avg", async_op=True)
        return work.get_future().then(lambda f: _first_tensor(f.value(), tensor))
    parts = _saved_parts(state, bucket, tensor, positions, it)
    if parts is None:
        work = pycomm_all_reduce(tensor, group=group, op="avg", async_op=True, compress=False)
        return work.get_future().then(lambda f: _first_tensor(f.value(), tensor))
    # One backend call per saved bucket, issued now in index order (the
    # backend runs them in submission order, the same on every rank).
    pending = []
    for index, slices in parts:
        flat = torch.cat([tensor[o : o + n] for o, n in slices])
        key = index if state._uses_ef() else None
        work = pycomm_all_reduce(flat, key=key, group=group, op="avg", async_op=True)
        pending.append((work.get_future(), flat, slices))

    def copy_back(_):
        for f, flat, slices in pending:
            f.wait()  # raises that call's error, if any
            start = 0
            for o, n in slices:
                tensor[o : o + n].copy_(flat[start : start + n])
                start += n
        return tensor

    return torch.futures.collect_all([f for f, _, _ in pending]).then(copy_back)


def _first_tensor(value: Any, default: torch.Tensor) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    return default


def _compressed_body(state: CompressionState, tensor: torch.Tensor, group, ef, index: int) -> Callable[[], None]:
    method, kwargs, chunk, check = state.compressor, state._compressor_kwargs(), state.chunk_numel, state.check_calls

    def body() -> None:
        allreduce_compressed(tensor, group=group, method=method, op="avg", chunk_numel=chunk, ef=ef,
                             key=index, check=check, **kwargs)

    return body


def _saved_parts(state: CompressionState, bucket, tensor, positions, it) -> Optional[List[Tuple[int, List[Tuple[int, int]]]]]:
    """First iteration of a process that resumes a saved state: DDP's bucket
    is not yet one of the saved ones (it holds every parameter). Returns the
    saved buckets it contains, as ``[(index, [(offset, numel) in this
    bucket's buffer, per parameter])]``, or None (with a warning, once) if
    they do not tile it."""
    buf_ptr, esize = tensor.data_ptr(), tensor.element_size()
    where = {}  # position -> (offset, numel) in this bucket's buffer
    for pos, g in zip(positions, bucket.gradients()):
        where[pos] = ((g.data_ptr() - buf_ptr) // esize, g.numel())
    mine = set(positions)
    parts = []
    for index in sorted(state.bucket_layouts):
        numel, pos = state.bucket_layouts[index]
        if set(pos) <= mine:
            parts.append((index, numel, pos))
    covered = [p for _, _, pos in parts for p in pos]
    ok = (
        parts
        and len(covered) == len(mine)
        and set(covered) == mine
        and all(sum(where[p][1] for p in pos) == numel for _, numel, pos in parts)
    )
    if not ok:
        if not state._warned_unmapped:
            state._warned_unmapped = True
            warnings.warn(
                f"pycomm CompressionState: at iteration {it}, DDP has not rebuilt its buckets in "
                f"this process yet and bucket {bucket.index()} does not match the saved bucket "
                f"layout; this iteration is all-reduced uncompressed (residuals kept)",
                RuntimeWarning,
                stacklevel=4,
            )
        return None
    return [(index, [where[p] for p in pos]) for index, _, pos in parts]


def _remapped_body(state: CompressionState, bucket, tensor, positions, group, it) -> Callable[[], None]:
    """Reduce the saved buckets that DDP's unrebuilt bucket contains, each on
    its own, as they were when saved, so the run continues exactly; if they
    do not tile it, reduce it plainly."""
    parts = _saved_parts(state, bucket, tensor, positions, it)
    if parts is None:
        return lambda: _plain_avg(tensor, group)
    jobs = [(index, state._ef_for(index), slices) for index, slices in parts]
    method, kwargs, chunk, check = state.compressor, state._compressor_kwargs(), state.chunk_numel, state.check_calls

    def body() -> None:
        for index, ef, slices in jobs:
            flat = torch.cat([tensor[o : o + n] for o, n in slices])
            allreduce_compressed(flat, group=group, method=method, op="avg", chunk_numel=chunk, ef=ef,
                                 key=index, check=check, **kwargs)
            start = 0
            for o, n in slices:
                tensor[o : o + n].copy_(flat[start : start + n])
                start += n

    return body
