"""``pycomm plan``: what gradient synchronization costs, before renting a cluster.

An alpha-beta model: a collective that sends ``m`` sequential messages and
``b`` bytes per rank over a link of ``B`` bytes/s per direction takes
``m * alpha + b / B``. A ring all-reduce of ``n`` bytes over ``W`` ranks is
``2(W-1) alpha + 2(W-1)/W * n / B``. From this, for one training setup, it
predicts the flat ring, the hierarchical all-reduce, the compressed
all-reduce (any of pycomm's methods as pycomm runs it, its bytes from
``spec.wire_bytes``, see docs/allreduce.md) and hierarchical + compressed;
it adds the method's kernel time only where a benchmark measured it,
estimates the compute time of a step (6 N tokens FLOPs) and says what to
use. Every formula,
preset and assumption is in docs/plan.md.

Example::

    $ pycomm plan --params 70e9 --gpus 64 --gpus-per-node 8 --intra nvlink4 --inter ib-ndr400 --compressor onebit

    >>> p = plan(params=70e9, gpus=8, gpus_per_node=8, intra="pcie4", kernels_json=False)
    >>> p["gradient_bytes"], p["envelope"]["seconds"]   # 280 GB / 64 GB/s
    (280000000000, 4.375)
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import sys
from dataclasses import asdict, dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Union

from pycomm._optional import require
from pycomm.distributed import spec
from pycomm.distributed.spec import chunk_bounds, chunk_length, default_chunk_numel

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
#: What ``--compressor`` takes: the exact all-reduce (no compression, the
#: default), then every compressing method in code order.
COMPRESSORS = (spec.EXACT_METHOD,) + tuple(m for m in spec.METHODS if m != spec.EXACT_METHOD)
#: What predict_allreduce_time models: "allreduce" is the exact ring.
METHODS = ("allreduce",) + COMPRESSORS[1:]
#: The kinds of method whose kernels ``pycomm-bench kernels`` times.
KERNEL_KINDS = ("block", "sparse")

#: 4M = 2**22 tokens: 1024 sequences of 4096 tokens, Llama 2's global batch.
DEFAULT_TOKENS = 1 << 22
DEFAULT_MFU = 0.4  # typical of well-tuned large dense runs (PaLM reports 46%)
DEFAULT_BUCKET_MB = 25.0  # torch DDP's default bucket_cap_mb
DEFAULT_MIN_SAVING = 0.10  # below this saving of step time, plain is fine


@dataclass(frozen=True)
class Link:
    """A link as one GPU sees it: ``bytes_per_s`` per direction (a ring sends
    and receives at the same time, each at this rate), latency ``alpha_s``;
    ``quoted`` is how the vendor states the bandwidth (the envelope figure)."""

    name: str
    bytes_per_s: float
    alpha_s: float
    quoted_bytes_per_s: float
    quoted: str
    source: str


_NVLINK_ALPHA = 3e-6  # assumed: NCCL's per-step latency inside a node, a few us
_PCIE_ALPHA = 5e-6  # assumed: a copy through PCIe switches / host memory
_IB_ALPHA = 2e-6  # adapter < 1 us (ConnectX datasheets) + switch hop + NCCL protocol
_ROCE_ALPHA = 3e-6  # assumed: as IB plus an Ethernet switch
_TCP_ALPHA = 30e-6  # assumed: kernel TCP stack, 10-50 us per message

def _bidirectional(name: str, quoted_gb_s: float, alpha_s: float, source: str) -> Link:
    """A link its vendor quotes as both directions together (NVLink, PCIe):
    each direction carries half of the quoted GB/s."""
    quoted = quoted_gb_s * 1e9
    return Link(name, quoted / 2, alpha_s, quoted, f"{quoted_gb_s} GB/s bidirectional", source)


def _per_direction(name: str, gbit_s: float, alpha_s: float, source: str) -> Link:
    """A full-duplex port quoted in Gbit/s per direction (InfiniBand,
    Ethernet): the quoted rate is what each direction carries."""
    rate = gbit_s * 1e9 / 8
    return Link(name, rate, alpha_s, rate, f"{gbit_s} Gbit/s per direction", source)


# One line a link: its vendor figure, once; the per-direction rate and the
# quoted text derive from it.
LINKS: Dict[str, Link] = {
    l.name: l
    for l in (
        _bidirectional("nvlink3", 600, _NVLINK_ALPHA, "NVIDIA A100 datasheet: NVLink 600 GB/s (12 links x 50 GB/s, both directions)"),
        _bidirectional("nvlink4", 900, _NVLINK_ALPHA, "NVIDIA H100 SXM datasheet: NVLink 900 GB/s (18 links x 50 GB/s, both directions)"),
        _bidirectional("pcie4", 64, _PCIE_ALPHA, "PCIe 4.0 spec: 16 GT/s x16, 128b/130b = 31.5 GB/s per direction, quoted 32 / 64 bidirectional"),
        _bidirectional("pcie5", 128, _PCIE_ALPHA, "PCIe 5.0 spec: 32 GT/s x16 = 63 GB/s per direction, quoted 64 / 128 bidirectional"),
        _per_direction("ib-hdr", 200, _IB_ALPHA, "InfiniBand HDR (NVIDIA ConnectX-6 datasheet): 200 Gb/s per port, full duplex"),
        _per_direction("ib-ndr400", 400, _IB_ALPHA, "InfiniBand NDR (NVIDIA ConnectX-7 datasheet): 400 Gb/s per port, full duplex"),
        _per_direction("roce100", 100, _ROCE_ALPHA, "100 Gigabit Ethernet (IEEE 802.3) with RoCE v2, full duplex"),
        _per_direction("roce400", 400, _ROCE_ALPHA, "400 Gigabit Ethernet (IEEE 802.3bs) with RoCE v2, full duplex"),
        _per_direction("eth25", 25, _TCP_ALPHA, "25 Gigabit Ethernet (IEEE 802.3by), TCP, full duplex"),
        _per_direction("eth10", 10, _TCP_ALPHA, "10 Gigabit Ethernet (IEEE 802.3ae), TCP, full duplex"),
        _per_direction("eth1", 1, _TCP_ALPHA, "Gigabit Ethernet (IEEE 802.3ab), TCP, full duplex"),
    )
}

#: Peak dense bf16 tensor TFLOP/s (vendor datasheets quote twice this "with sparsity").
GPUS: Dict[str, tuple] = {
    "h100": (989.0, "NVIDIA H100 SXM datasheet: BF16 1,979 TFLOPS with sparsity, 989 dense"),
    "h200": (989.0, "NVIDIA H200 SXM datasheet: BF16 1,979 TFLOPS with sparsity, 989 dense"),
    "a100": (312.0, "NVIDIA A100 datasheet: BF16 312 TFLOPS dense (624 with sparsity)"),
    "v100": (125.0, "NVIDIA V100 SXM2 datasheet: 125 TFLOPS tensor (fp16)"),
}

#: Memory per GPU, GB (the datasheets above: H100 SXM 80 GB, H200 141 GB,
#: A100 80 GB (the larger model), V100 32 GB (the larger model)).
GPU_MEMORY_GB = {"h100": 80.0, "h200": 141.0, "a100": 80.0, "v100": 32.0}
#: Bytes per parameter element a DDP rank holds besides activations: the
#: fp32 parameter, AdamW's two fp32 moments (the gradient's width is added).
STATE_BYTES = 4 + 8

#: ``<number><k|m|g|t><unit>``: ``bit``, ``bit/s``, ``bps`` are bits; ``b/s`` (as in GB/s) bytes.
_RATE = re.compile(r"(\d+(?:\.\d*)?(?:e[+-]?\d+)?)\s*([kmgt]?)(bit/s|bit|bps|b/s)")
_BIT_MULT = {"k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_link(text: str, flag: str = "--inter", alpha_s: float = _TCP_ALPHA) -> Link:
    """A preset name or a free rate per direction: ``1gbit``, ``2.5gbit``,
    ``100mbit`` (bits/s, decimal) or ``40GB/s`` (bytes/s). A free rate gets
    latency ``alpha_s`` (by default an Ethernet/TCP assumption).

    Example::

        >>> parse_link("2.5gbit").bytes_per_s, parse_link("ib-ndr400").bytes_per_s
        (312500000.0, 50000000000.0)
        >>> parse_link("warp9")
        Traceback (most recent call last):
        ...
        ValueError: --inter: unknown link 'warp9'; presets: nvlink3, nvlink4, pcie4, pcie5, ib-hdr, ib-ndr400, roce100, roce400, eth25, eth10, eth1, or a rate per direction such as 1gbit, 2.5gbit, 100mbit, 40GB/s
    """
    key = text.strip().lower()
    if key in LINKS:
        return LINKS[key]
    m = _RATE.fullmatch(key)
    if m:
        value, prefix, unit = float(m.group(1)), m.group(2), m.group(3)
        rate = value * _BIT_MULT.get(prefix, 1.0) / (1 if unit == "b/s" else 8)
        if rate > 0:
            return Link(key, rate, alpha_s, rate, f"{text} per direction", "free rate given on the command line")
    raise ValueError(
        f"{flag + ': ' if flag else ''}unknown link {text!r}; presets: {', '.join(LINKS)}, "
        "or a rate per direction such as 1gbit, 2.5gbit, 100mbit, 40GB/s"
    )


def parse_count(text: Union[str, float, int], flag: str = "--params") -> float:
    """``70e9``, ``70B``, ``4.9M``, ``125k`` -> a positive number.

    >>> parse_count("70B"), parse_count("4.9e6")
    (70000000000.0, 4900000.0)
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d*)?(?:e[+-]?\d+)?)\s*([kmbtg]?)\s*", str(text), re.I)
        if m is None:
            raise ValueError(f"{flag}: expected a positive number such as 70e9 or 70B, got {text!r}")
        mult = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}[m.group(2).lower()]
        value = float(m.group(1)) * mult
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{flag}: must be a positive number, got {text!r}")
    return value


# ------------------------------------------------------------- alpha-beta ---
def _cost(messages: float, nbytes: float, bandwidth: float, alpha: float) -> Dict[str, float]:
    return {"messages": messages, "bytes_per_rank": nbytes, "latency_s": messages * alpha,
            "transfer_s": nbytes / bandwidth}


def ring_allreduce(nbytes: float, world: int, bandwidth: float, alpha: float, chunks: int = 1) -> Dict[str, float]:
    """``2(W-1) alpha + 2(W-1)/W * n / B`` per collective (``chunks`` of them).

    >>> ring_allreduce(4e6, 4, 1e9, 1e-5)["transfer_s"]    # 2*3/4 * 4e6 / 1e9
    0.006
    """
    return _cost(2 * (world - 1) * chunks, 2 * (world - 1) / world * nbytes, bandwidth, alpha)


def ring_half(nbytes: float, world: int, bandwidth: float, alpha: float, chunks: int = 1) -> Dict[str, float]:
    """Reduce-scatter or all-gather of ``n`` bytes: ``(W-1) alpha + (W-1)/W * n / B``."""
    return _cost((world - 1) * chunks, (world - 1) / world * nbytes, bandwidth, alpha)


def _n_chunks(numel: int, chunk_numel: Optional[int]) -> int:
    return 1 if not chunk_numel else -(-numel // chunk_length(numel, chunk_numel))


def chunked_wire_bytes(method: str, numel: int, world: int, chunks: int = 1, **settings) -> int:
    """Bytes one rank sends in an all-reduce of ``numel`` elements cut into
    ``chunks`` collectives of near-equal length (DDP buckets x pycomm
    chunks): :func:`pycomm.distributed.spec.wire_bytes` of each, one chunk
    each (``method``: a method of :data:`METHODS`, "allreduce" the exact
    ring; ``settings``: ``block_size``, ``density``, ``approx``, ``itemsize``).

    >>> chunked_wire_bytes("allreduce", 1000, 4), chunked_wire_bytes("bf16", 1000, 4)
    (6000, 3000)
    >>> chunked_wire_bytes("topk", 1000, 4, density=0.01)    # 3 x (count + 12 entries of 8 B + tag)
    324
    """
    name = spec.EXACT_METHOD if method == "allreduce" else method
    q, r = divmod(numel, chunks)

    def one(m: int) -> int:
        return spec.wire_bytes(name, m, world, chunk_numel=max(1, m), **settings)

    return (chunks - r) * one(q) + (r * one(q + 1) if r else 0)


def predict_allreduce_time(
    method: str,
    numel: int,
    world: int,
    bandwidth_bytes_per_s: float,
    alpha_s: float,
    compress_throughput: Union[None, float, Mapping[str, float]] = None,
    density: float = 0.01,
    block_size: Optional[int] = None,
    approx: bool = True,
    dtype: str = "fp32",
    chunks: int = 1,
) -> Dict[str, object]:
    """Predicted time of one all-reduce of ``numel`` gradient elements over
    ``world`` ranks on one link (``bandwidth_bytes_per_s`` per direction,
    latency ``alpha_s``), as pycomm runs ``method`` (docs/allreduce.md); the
    bytes are :func:`chunked_wire_bytes`, pycomm's own count (``spec.wire_bytes``):

    - ``allreduce``: ring all-reduce of ``numel`` x bytes of ``dtype``,
      ``2(W-1)`` messages;
    - a block codec (a method of kind ``block``, e.g. ``onebit``):
      all-to-all + all-gather, each ``(W-1)`` messages and ``(W-1)/W`` x the
      payload (the method's bits per element + a float32 scale per block,
      ``block_size`` elements, None: the method's default), and the call's
      tag; on a small tensor (``spec.all_reduce_gathers``) an all-gather of
      the payloads, ``(W-1)`` messages and ``(W-1)`` x per rank;
    - a sparse method (e.g. ``topk``): all-gather of the ``4 + 8 cap`` byte
      payloads and the tag, ``(W-1)`` messages and ``(W-1)`` x per rank (``cap = k``, or
      ``floor(1.25 k)`` approximate; ``k = ceil(density n)``);
    - a cast (e.g. ``bf16``): ring all-reduce of its 2 bytes per element.

    ``chunks``: separate collectives the tensor is cut into (DDP buckets x
    pycomm chunks); each pays the latency term. ``compress_throughput``: kernel
    elements/s, one number for every kernel op or ``{op: elements/s}`` (ops
    ``compress``, ``decompress``, ``decompress_acc``); ops it lacks are left
    out of ``compute_s`` and listed in ``compute_excluded``, and ``compute_s``
    is None when nothing was measured. Returns seconds and bytes sent per rank.

    Example::

        >>> r = predict_allreduce_time("allreduce", 1_000_000, 4, 1e9, 1e-5)
        >>> round(r["wire_s"], 9)       # 2*3*1e-5 + 2*3/4 * 4e6 / 1e9
        0.00606
        >>> r = predict_allreduce_time("onebit", 1_000_000, 4, 1e9, 1e-5, compress_throughput=1e9)
        >>> r["bytes_per_rank"]         # ~ 2*3/4 * (31250 words + 489 scales) * 4, padded, and 3 tags
        191904.0
        >>> round(r["compute_s"], 6)    # (1e6 + 1e6/4 + 1e6 + 1e6) / 1e9: worker+server compress, acc, decode
        0.00325
        >>> r = predict_allreduce_time("int4", 1_000_000, 4, 1e9, 1e-5)
        >>> r["bytes_per_rank"]         # 4 bits (1/8 of 6 MB) + a float32 per 256 elements, padded, and 3 tags
        773808.0
        >>> r = predict_allreduce_time("onebit", 2048, 4, 1e9, 1e-5)
        >>> r["messages"], r["bytes_per_rank"]   # gathered: 3 x (64 words + a scale + the tag) x 4 B
        (3, 804.0)
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    for name, value in (("numel", numel), ("world", world), ("chunks", chunks)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if not bandwidth_bytes_per_s > 0 or not alpha_s >= 0:
        raise ValueError("bandwidth_bytes_per_s must be > 0 and alpha_s >= 0")
    W, n = world, numel
    kind = spec.method_spec(spec.EXACT_METHOD if method == "allreduce" else method).kind
    work: Dict[str, float] = {}  # kernel op -> elements it processes per rank
    unmeasurable: List[str] = []  # work the kernel benchmark does not time
    nbytes = float(chunked_wire_bytes(method, n, W, chunks, block_size=block_size, density=density,
                                      approx=approx, itemsize=DTYPE_BYTES[dtype]))
    if W == 1:
        cost = _cost(0, 0.0, bandwidth_bytes_per_s, alpha_s)
    elif kind == "sparse":
        cost = _cost((W - 1) * chunks, nbytes, bandwidth_bytes_per_s, alpha_s)
        work = {"compress": n}
        unmeasurable.append("scatter-add of W payloads")
    elif kind == "block":
        messages = 0
        work = {"compress": 0.0, "decompress_acc": 0.0, "decompress": 0.0}
        q, r = divmod(n, chunks)
        for m, count in ((q, chunks - r), (q + 1, r)):
            if count == 0 or m == 0:
                continue
            if spec.all_reduce_gathers(method, m, W):
                # An all-gather of every rank's payload: compress (m); every
                # rank decodes the first payload (m) and adds the others.
                messages += count * (W - 1)
                work["compress"] += count * m
                work["decompress"] += count * m
                work["decompress_acc"] += count * (W - 1) * m
            else:
                # All-to-all then all-gather: worker compress (m) + server
                # compress of its segment (m/W); the server accumulates W
                # segment payloads (m); everyone decodes all segments (m).
                messages += count * 2 * (W - 1)
                work["compress"] += count * (m + m / W)
                work["decompress_acc"] += count * m
                work["decompress"] += count * m
        cost = _cost(messages, nbytes, bandwidth_bytes_per_s, alpha_s)
    else:  # a ring all-reduce
        cost = _cost(2 * (W - 1) * chunks, nbytes, bandwidth_bytes_per_s, alpha_s)
        if kind == "cast":
            unmeasurable.append("cast")
    if isinstance(compress_throughput, (int, float)) and not isinstance(compress_throughput, bool):
        rates: Mapping[str, float] = {op: float(compress_throughput) for op in work}
    else:
        rates = compress_throughput or {}
    measured = {op: e / rates[op] for op, e in work.items() if op in rates and rates[op] > 0}
    compute = sum(measured.values()) if measured else None
    wire = cost["latency_s"] + cost["transfer_s"]
    return {
        "method": method, **cost, "wire_s": wire, "compute_s": compute,
        "compute_ops": sorted(measured),
        "compute_excluded": sorted(set(work) - set(measured)) + unmeasurable,
        "total_s": wire + (compute or 0.0),
    }


# ----------------------------------------------------------- kernel timing ---
#: The engine measurements shipped in the package (the newest engine
#: benchmark result per device, copied here by ``pycomm-bench allreduce
#: --device cuda``), so that an installed wheel plans as the source tree does.
MEASUREMENTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "measurements")


def _results_dirs() -> List[str]:
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "results")
    cwd = os.path.abspath(os.path.join("benchmarks", "results"))
    return ([here] if here == cwd else [here, cwd]) + [MEASUREMENTS_DIR]


def _newest_result(patterns: Sequence[str], accept=lambda doc: True) -> Optional[str]:
    """The newest file (by its ``date``) matching the first of ``patterns``
    that any file matches, under ``benchmarks/results`` next to the package
    or under the working directory, or among the package's measurements,
    whose document ``accept`` takes; ``--quick`` smoke runs are skipped (too
    small to trust). None if there is none."""
    for pattern in patterns:
        found = _newest_of(pattern, accept)
        if found:
            return found
    return None


def _newest_of(pattern: str, accept) -> Optional[str]:
    best = None
    for d in _results_dirs():
        for path in glob.glob(os.path.join(d, pattern)):
            if path.endswith("-quick.json"):
                continue
            try:
                with open(path) as f:
                    doc = json.load(f)
            except (OSError, ValueError):
                continue
            if not isinstance(doc, dict) or not accept(doc):
                continue
            date = str(doc.get("date", ""))
            if best is None or date > best[0]:
                best = (date, path)
    return best[1] if best else None


def find_kernels_json(device: str) -> Optional[str]:
    """The kernel benchmark record of ``device`` at its default settings
    (``benchmarks/results/kernels/<device>.json``), else a GPU check's
    (``gpu/*/kernels-<device>.json``), else the newest other one of the
    device (``kernels/<device>-<settings>.json``)."""
    return _newest_result([os.path.join("kernels", f"{device}.json"), os.path.join("gpu", "*", f"kernels-{device}*.json"),
                           os.path.join("kernels", f"{device}*.json"), f"kernels-{device}-*.json"])


def find_engine_json(device: str) -> Optional[str]:
    """The newest engine benchmark record of ``device`` written by
    the engine benchmark (``pycomm-bench allreduce --device cuda``: it has
    per-method ``records`` and a ``bucket`` part, which the multi-rank Gloo
    benchmark's files do not): ``benchmarks/results/allreduce/<device>*.json``,
    a GPU check's ``gpu/*/engine.json``, or the package's measurements."""
    return _newest_result([os.path.join("allreduce", f"{device}*.json"), os.path.join("gpu", "*", "engine.json"),
                           f"allreduce-{device}-*.json"],
                          lambda doc: "records" in doc and "bucket" in doc
                          and str(doc.get("device", device)).startswith(device))


def engine_cost(doc: Mapping, method: str, block_size: Optional[int] = None, density: float = 0.01,
                approx: bool = True) -> Optional[Dict[str, object]]:
    """The engine's own time for a compressed all-reduce of ``method``, from
    an engine benchmark result: ``per_call_s + chunks * per_chunk_s + numel *
    per_element_s``, fitted exactly through the three times it measured (the
    large tensor in one chunk and in many, and a DDP bucket). Measured on one
    rank, where nothing crosses a wire, it is the time the engine adds to
    the collectives: its kernels, its launches and its host work. None when
    the file has no such method at these settings (``block_size`` None: the
    method's default).

    >>> doc = {"gpu": "GPU9", "date": "2026-12-04T10:00:00", "records": [
    ...     {"method": "onebit", "status": "ok", "numel": 1000, "chunks": 1, "block_size": 2048,
    ...      "engine_ms": 3.0, "variants": {"small": {"status": "ok", "chunks": 11, "engine_ms": 8.0}}}],
    ...     "bucket": {"numel": 100, "methods": {"onebit": {"chunk_numel": 1000, "gpu_ms": 1.2}}}}
    >>> c = engine_cost(doc, "onebit")
    >>> [round(c[k] * 1e3, 6) for k in ("per_call_s", "per_chunk_s", "per_element_s")]
    [0.5, 0.5, 0.002]
    """
    rec = next((r for r in doc.get("records", []) if r.get("method") == method and r.get("status") == "ok"), None)
    if rec is None or not rec.get("engine_ms") or not rec.get("chunks"):
        return None
    kind = spec.method_spec(method).kind
    if kind == "block" and rec.get("block_size") not in (None, spec.block_size_for(method, block_size)):
        return None
    if kind == "sparse" and (rec.get("density", density), rec.get("approx", approx)) != (density, approx):
        return None
    n1, c1, t1 = rec["numel"], rec["chunks"], rec["engine_ms"] / 1e3
    more = [v for v in (rec.get("variants") or {}).values()
            if v.get("status") == "ok" and v.get("engine_ms") and (v.get("chunks") or 0) > c1]
    bucket = doc.get("bucket") or {}
    b = (bucket.get("methods") or {}).get(method) or {}
    if not more or not b.get("gpu_ms") or not bucket.get("numel") or bucket["numel"] == n1:
        return None
    c2, t2 = more[0]["chunks"], more[0]["engine_ms"] / 1e3
    n3, t3 = bucket["numel"], b["gpu_ms"] / 1e3
    c3 = len(chunk_bounds(n3, b.get("chunk_numel") or n3))
    per_chunk = max(0.0, (t2 - t1) / (c2 - c1))
    per_element = max(0.0, (t1 - t3 - per_chunk * (c1 - c3)) / (n1 - n3))
    per_call = max(0.0, t1 - per_chunk * c1 - per_element * n1)
    where = doc.get("gpu") or (doc.get("machine") or {}).get("gpu") or "unknown device"
    return {"per_call_s": per_call, "per_chunk_s": per_chunk, "per_element_s": per_element,
            "label": (f"engine measured on {where} ({doc.get('backend', 'nccl')}, one rank), "
                      f"{str(doc.get('date', '?'))[:10]}: {fmt_s(per_call)} per call + {fmt_s(per_chunk)} "
                      f"per chunk + {per_element * 1e12:.3g} ps per element")}


def kernel_throughput(doc: Mapping, compressor: str, block_size: Optional[int] = None, density: float = 0.01,
                      approx: bool = True) -> Dict[str, object]:
    """Elements/s per kernel op for ``compressor`` from a ``pycomm-bench
    kernels`` result (the fastest implementation that ran and verified), and
    a label saying where it was measured; ``rates`` is empty when the file
    has no row for this configuration (``block_size`` None: the method's
    default).

    >>> doc = {"device": "cpu", "date": "2026-01-02T10:00:00", "machine": {"cpu_model": "EPYC"},
    ...        "rows": [{"family": "onebit", "params": {"block_size": 2048}, "op": "compress",
    ...                  "impl": "cpu", "kind": "impl", "status": "ok", "elements_per_s": 3e9}]}
    >>> k = kernel_throughput(doc, "onebit")
    >>> k["rates"], k["label"]
    ({'compress': 3000000000.0}, 'measured on EPYC (cpu, cpu kernels), 2026-01-02')
    """
    kind = spec.method_spec(compressor).kind
    want = ({"block_size": spec.block_size_for(compressor, block_size)} if kind == "block"
            else {"density": density, "approx": approx} if kind == "sparse" else None)
    machine = doc.get("machine", {})
    where = machine.get("gpu") or machine.get("cpu_model") or machine.get("node") or "unknown machine"
    rates: Dict[str, float] = {}
    impls: Dict[str, str] = {}  # op -> the implementation whose rate is kept
    for row in doc.get("rows", []) if want else []:
        if (row.get("family") != compressor or row.get("kind") != "impl" or row.get("status") != "ok"
                or any(row.get("params", {}).get(k) != v for k, v in want.items())):
            continue
        eps = float(row.get("elements_per_s") or 0)
        if eps > rates.get(row["op"], 0):  # pycomm picks its fastest available implementation
            rates[row["op"]] = eps
            impls[row["op"]] = str(row.get("impl"))
    label = (f"measured on {where} ({doc.get('device')}, {'/'.join(sorted(set(impls.values())))} kernels), "
             f"{str(doc.get('date', '?'))[:10]}")
    return {"rates": rates, "label": label if rates else None}


# -------------------------------------------------------------------- plan ---
#: What "plain" means in a recommendation: the framework's own all-reduce
#: (NCCL's, flat or hierarchical as NCCL runs it), not pycomm, whose exact
#: all-reduce runs flat.
PLAIN = "plain: NCCL's own all-reduce, without pycomm"


def _check_int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def plan(params: float, gpus: int, gpus_per_node: int = 8, intra: str = "nvlink4", inter: str = "ib-ndr400",
         compressor: str = spec.EXACT_METHOD, density: float = 0.01, block_size: Optional[int] = None,
         topk_exact: bool = False,
         tp: int = 1, pp: int = 1, dtype: str = "fp32", tokens_per_step: float = DEFAULT_TOKENS,
         gpu: str = "h100", peak_tflops: Optional[float] = None, mfu: float = DEFAULT_MFU, overlap: float = 0.0,
         bucket_mb: float = DEFAULT_BUCKET_MB, chunk_numel: Optional[int] = None,
         kernels_json: Union[None, bool, str] = None, kernel_device: str = "cuda",
         engine_json: Union[None, bool, str] = None,
         intra_alpha: Optional[float] = None, inter_alpha: Optional[float] = None,
         min_saving: float = DEFAULT_MIN_SAVING, sync_every: int = 16) -> Dict[str, object]:
    """The plan for one setup as data (what ``pycomm plan`` prints). Errors
    name the command-line flag. ``kernels_json``: a result file, None for the
    newest ``kernels-<kernel_device>-*.json``, False for none.
    ``engine_json``: an engine benchmark result (``pycomm-bench allreduce
    --device cuda``), None for the newest ``allreduce-<kernel_device>-*.json``
    of that kind, False for none; where it has the compressor at these
    settings, the compressor's compute is the engine's measured time
    (:func:`engine_cost`), kernels included, instead of the kernels' rates.
    ``chunk_numel``: None for pycomm's default where the gradients are
    compressed (:func:`default_chunk_numel`). ``block_size``: None for the
    block codec's default (``spec.DEFAULT_BLOCK_SIZE``).

    ``alternatives``: the methods that change the optimizer rather than
    compress its gradients, on the same link, by bytes and wire time per
    step (their compute is not measured here, and their loss is the quality
    study's question: docs/results.md): OneBitAdam (the onebit momentum
    after its warm-up) and DiLoCo (one all-reduce of the pseudo-gradient,
    with ``compressor``, every ``sync_every`` steps). The recommendation
    weighs the gradient methods only.

    Example::

        >>> p = plan(params=4.9e6, gpus=4, gpus_per_node=1, inter="1gbit", compressor="onebit",
        ...          kernels_json=False, engine_json=False)
        >>> [(m["method"], round(m["wire_s"], 3)) for m in p["methods"]]
        [('flat ring', 0.235), ('hierarchical', 0.235), ('onebit', 0.008), ('hierarchical + onebit', 0.008)]
        >>> [(m["method"], round(m["wire_s"], 4)) for m in p["alternatives"]]
        [('OneBitAdam (onebit momentum)', 0.0077), ('DiLoCo H=16 (onebit pseudo-gradient)', 0.0005)]
        >>> p["methods"][2]["compute"]
        'no measurement'
        >>> plan(params=1e9, gpus=12, tp=8)
        Traceback (most recent call last):
        ...
        ValueError: --gpus 12 is not a multiple of --tp x --pp = 8 x 1 = 8
    """
    params = parse_count(params)
    if kernel_device not in ("cuda", "cpu"):
        raise ValueError(f"--kernel-device must be cuda or cpu, got {kernel_device!r}")
    if chunk_numel is None:
        chunk_numel = default_chunk_numel(kernel_device)
    for flag, v in (("--gpus", gpus), ("--gpus-per-node", gpus_per_node), ("--tp", tp), ("--pp", pp),
                    ("--chunk-numel", chunk_numel)):
        _check_int(flag, v, 0 if flag == "--chunk-numel" else 1)
    if block_size is not None:
        _check_int("--block-size", block_size)
    if compressor not in COMPRESSORS:
        raise ValueError(f"--compressor must be one of {', '.join(COMPRESSORS)}, got {compressor!r}")
    kind = spec.method_spec(compressor).kind
    compressed = kind != "exact"
    # What the inputs report: the block length the codec runs with.
    block_size = spec.block_size_for(compressor, block_size) or block_size
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    if gpu not in GPUS and peak_tflops is None:
        raise ValueError(f"--gpu must be one of {', '.join(GPUS)} (or give --peak-tflops), got {gpu!r}")
    for flag, v, lo, hi in (("--density", density, 0, 1), ("--mfu", mfu, 0, 1), ("--overlap", overlap, -1e-12, 1),
                            ("--min-saving", min_saving, -1e-12, 1)):
        if not (lo < v <= hi):  # lo < 0 stands for "0 allowed"
            raise ValueError(f"{flag} must be in {'[0' if lo < 0 else '(0'}, {hi}], got {v!r}")
    for flag, v in (("--tokens-per-step", tokens_per_step), ("--peak-tflops", peak_tflops), ("--bucket-mb", bucket_mb)):
        if v is not None and not v > 0:
            raise ValueError(f"{flag} must be > 0, got {v!r}")
    _check_int("--sync-every", sync_every)
    if gpus % (tp * pp):
        raise ValueError(f"--gpus {gpus} is not a multiple of --tp x --pp = {tp} x {pp} = {tp * pp}")
    if gpus > gpus_per_node and gpus % gpus_per_node:
        raise ValueError(f"--gpus {gpus} is not a multiple of --gpus-per-node {gpus_per_node}")
    if gpus_per_node % tp and tp % gpus_per_node:
        raise ValueError(f"--tp {tp} must divide --gpus-per-node {gpus_per_node} or be a multiple of it")
    intra_l = parse_link(intra, "--intra")
    inter_l = parse_link(inter, "--inter")
    if intra_alpha is not None:
        intra_l = Link(**{**asdict(intra_l), "alpha_s": intra_alpha})
    if inter_alpha is not None:
        inter_l = Link(**{**asdict(inter_l), "alpha_s": inter_alpha})

    # Layout (Megatron-LM order): TP innermost, then DP, then PP outermost, so
    # a DP group has gpus_per_node / tp members in each node it spans.
    dp = gpus // (tp * pp)
    local = max(1, min(dp, min(gpus, gpus_per_node) // tp))
    if dp % local:
        raise ValueError(f"data-parallel degree {dp} does not split evenly over nodes of {local} DP ranks; "
                         "check --gpus, --gpus-per-node, --tp, --pp")
    dp_nodes = dp // local
    n = math.ceil(params / (tp * pp))  # gradient elements per rank
    width = DTYPE_BYTES[dtype]
    grad_bytes = n * width
    flat_link = inter_l if dp_nodes > 1 else intra_l  # a ring is as slow as its slowest hop

    # DDP all-reduces one bucket at a time; pycomm cuts each bucket into chunks.
    buckets = max(1, math.ceil(grad_bytes / (bucket_mb * 1e6)))
    bucket_numel = max(1, n // buckets)
    cchunks = buckets * _n_chunks(bucket_numel, chunk_numel)
    shard_chunks = buckets * _n_chunks(max(1, bucket_numel // local), chunk_numel)

    kernels: Dict[str, object] = {"path": None, "label": None, "rates": {}}
    if kind in KERNEL_KINDS and kernels_json is not False:
        path = kernels_json or find_kernels_json(kernel_device)
        kernels["path"] = path
        if path:
            try:
                with open(path) as f:
                    doc = json.load(f)
            except (OSError, ValueError) as err:
                raise ValueError(f"--kernels-json {path}: cannot read a kernel benchmark result ({err})") from None
            kernels.update(kernel_throughput(doc, compressor, block_size, density, not topk_exact))
        if kernels["label"]:
            kernels["note"] = kernels["label"]
        else:  # never fill in a guess: say what is missing and leave compute out
            why = (f"{path} has no {compressor} row for these settings" if path
                   else f"no benchmarks/results/kernels/{kernel_device}*.json")
            kernels["note"] = (f"no measurement ({why}; run `pycomm-bench kernels --device {kernel_device}`): "
                               "compressor compute left out of the totals")
    elif kind in KERNEL_KINDS:
        kernels["note"] = "not read (kernels_json=False): compressor compute left out of the totals"
    else:
        kernels["note"] = "casts are not timed by the kernel benchmark: left out" if compressed else "-"
    opts = dict(compress_throughput=kernels["rates"] or None, density=density, block_size=block_size,
                approx=not topk_exact, dtype=dtype)
    engine: Optional[Dict[str, object]] = None
    engine_path = None
    if compressed and engine_json is not False:
        engine_path = engine_json or find_engine_json(kernel_device)
        if engine_path:
            try:
                with open(engine_path) as f:
                    engine = engine_cost(json.load(f), compressor, block_size, density, not topk_exact)
            except (OSError, ValueError) as err:
                raise ValueError(f"--engine-json {engine_path}: cannot read an engine benchmark result ({err})") \
                    from None
    if engine:
        kernels["note"] = str(engine["label"]) + " (the compressor's compute below)"
    kernels["engine"] = {"path": engine_path, **(engine or {})}

    def with_engine(part: Dict[str, object], numel: int, chunks: int) -> Dict[str, object]:
        # The engine's measured time replaces the kernels' estimate: it holds
        # them, and the launches and host work around them.
        if not engine:
            return part
        s = (buckets * float(engine["per_call_s"]) + chunks * float(engine["per_chunk_s"])
             + numel * float(engine["per_element_s"]))
        return {**part, "compute_s": s, "compute_ops": ["engine"], "compute_excluded": [],
                "total_s": float(part["wire_s"]) + s}

    def row(name: str, parts: Sequence[Dict[str, object]]) -> Dict[str, object]:
        out: Dict[str, object] = {"method": name}
        for key in ("messages", "bytes_per_rank", "latency_s", "transfer_s", "wire_s"):
            out[key] = sum(float(p.get(key, 0.0)) for p in parts)
        computes = [p["compute_s"] for p in parts if p.get("compute_s") is not None]
        excluded = sorted({e for p in parts for e in p.get("compute_excluded", [])})
        out["compute_s"] = sum(computes) if computes else None
        out["compute_excluded"] = excluded
        out["compute"] = ("measured" if computes and not excluded else
                          "partly measured" if computes else "no measurement" if excluded else "none")
        out["total_s"] = out["wire_s"] + (out["compute_s"] or 0.0)
        return out

    def exact(c: Dict[str, float]) -> Dict[str, object]:
        return {**c, "wire_s": c["latency_s"] + c["transfer_s"]}

    rs = exact(ring_half(grad_bytes, local, intra_l.bytes_per_s, intra_l.alpha_s, buckets))
    flat = exact(ring_allreduce(grad_bytes, dp, flat_link.bytes_per_s, flat_link.alpha_s, buckets))
    shard_ar = exact(ring_allreduce(grad_bytes / local, dp_nodes, inter_l.bytes_per_s, inter_l.alpha_s, buckets))
    methods = [row("flat ring", [flat]), row("hierarchical", [rs, shard_ar, rs] if dp_nodes > 1 else [flat])]
    if compressed:
        comp = with_engine(predict_allreduce_time(compressor, n, dp, flat_link.bytes_per_s, flat_link.alpha_s,
                                                  chunks=cchunks, **opts), n, cchunks)
        methods.append(row(compressor, [comp]))
        if dp_nodes > 1 and local > 1:
            inner = with_engine(predict_allreduce_time(compressor, max(1, n // local), dp_nodes,
                                                       inter_l.bytes_per_s, inter_l.alpha_s, chunks=shard_chunks,
                                                       **opts), max(1, n // local), shard_chunks)
            methods.append(row(f"hierarchical + {compressor}", [rs, inner, rs]))
        else:  # one GPU per node or one node: nothing to split
            methods.append(row(f"hierarchical + {compressor}", [comp]))

    # The methods that change the optimizer (flat, as their groups run).
    alternatives = []
    if dp > 1:
        def other(name: str, method: str, every: int) -> Dict[str, object]:
            part = predict_allreduce_time(method, n, dp, flat_link.bytes_per_s, flat_link.alpha_s, chunks=cchunks,
                                          density=density, block_size=None if method != compressor else block_size,
                                          approx=not topk_exact)
            out = row(name, [part])
            for key in ("messages", "bytes_per_rank", "latency_s", "transfer_s", "wire_s", "total_s"):
                out[key] = float(out[key]) / every
            return out

        alternatives.append(other("OneBitAdam (onebit momentum)", "onebit", 1))
        alternatives.append(other(f"DiLoCo H={sync_every} ({compressor if compressed else 'exact'} pseudo-gradient)",
                                  compressor if compressed else "allreduce", sync_every))

    # What each GPU holds unsharded (DDP), activations aside.
    held = n * (STATE_BYTES + width)
    capacity = GPU_MEMORY_GB.get(gpu) if peak_tflops is None or gpu in GPU_MEMORY_GB else None
    memory = {"bytes_per_gpu": held, "gpu_bytes": None if capacity is None else capacity * 1e9,
              "fits": None if capacity is None else held <= capacity * 1e9}

    peak = (peak_tflops if peak_tflops is not None else GPUS[gpu][0]) * 1e12
    compute_s = 6 * params * tokens_per_step / (gpus * peak * mfu)
    backward_s = compute_s * 2 / 3  # backward is 4 of the 6 N FLOPs per token
    for m in methods:
        m["exposed_s"] = m["total_s"] - min(overlap * m["total_s"], backward_s)
        m["step_s"] = compute_s + m["exposed_s"]
    plain = min(methods[:2], key=lambda m: m["step_s"])
    best = min(methods, key=lambda m: m["step_s"])
    for m in methods:
        m["saving_vs_plain"] = 1 - m["step_s"] / plain["step_s"] if plain["step_s"] else 0.0
    if dp == 1:
        advice = "data-parallel degree 1: no gradient all-reduce to plan"
    elif not compressed:
        advice = f"use {plain['method']} (pass --compressor to see whether compression pays)"
    elif best is plain or best["saving_vs_plain"] < min_saving:
        fastest = min(methods[2:], key=lambda m: m["step_s"])
        if fastest["step_s"] > plain["step_s"]:
            advice = (f"use {plain['method']} ({PLAIN}): it wins here; {fastest['method']} would take "
                      f"{fmt_s(fastest['total_s'])} per step to communicate against {fmt_s(plain['total_s'])}")
        else:
            advice = (f"use {plain['method']} ({PLAIN}): compression would save "
                      f"{best['saving_vs_plain']:.0%} of step time, under {min_saving:.0%}; plain is fine")
    else:
        advice = f"use {best['method']}: saves {best['saving_vs_plain']:.0%} of step time over {plain['method']}"
        if best["compute"] != "measured":
            advice += " (wire only: compressor compute not fully measured, a lower bound)"
    return {
        "inputs": {"params": params, "gpus": gpus, "gpus_per_node": gpus_per_node, "intra": intra, "inter": inter,
                   "compressor": compressor, "density": density, "block_size": block_size,
                   "topk_exact": topk_exact, "tp": tp, "pp": pp, "dtype": dtype,
                   "tokens_per_step": tokens_per_step, "gpu": gpu, "peak_tflops": peak / 1e12, "mfu": mfu,
                   "overlap": overlap, "bucket_mb": bucket_mb, "chunk_numel": chunk_numel,
                   "kernel_device": kernel_device, "min_saving": min_saving, "sync_every": sync_every},
        "topology": {"dp": dp, "dp_ranks_per_node": local, "dp_nodes": dp_nodes,
                     "nodes": max(1, gpus // gpus_per_node), "buckets": buckets,
                     "compressed_chunks": cchunks, "flat_ring_link": "inter" if dp_nodes > 1 else "intra"},
        "links": {"intra": asdict(intra_l), "inter": asdict(inter_l)},
        "gradient_elements": n,
        "gradient_bytes": grad_bytes,
        "envelope": {"link": flat_link.name, "quoted": flat_link.quoted,
                     "seconds": grad_bytes / flat_link.quoted_bytes_per_s,
                     "per_direction_seconds": grad_bytes / flat_link.bytes_per_s},
        "methods": methods,
        "alternatives": alternatives,
        "memory": memory,
        "compute": {"seconds": compute_s, "flops": 6 * params * tokens_per_step, "peak_flops_per_gpu": peak},
        "comm_to_compute": plain["total_s"] / compute_s,
        "kernels": kernels,
        "best": best["method"],
        "recommendation": advice,
    }


# --------------------------------------------------------------- printing ---
def fmt_count(x: float) -> str:
    """70e9 -> '70B', 4.9e6 -> '4.9M'.

    >>> fmt_count(70e9), fmt_count(4.9e6), fmt_count(4194304)
    ('70B', '4.9M', '4.19M')
    """
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


def fmt_bytes(b: float) -> str:
    """Decimal units, as link rates are quoted.

    >>> fmt_bytes(2.8e11), fmt_bytes(190434)
    ('280 GB', '190 kB')
    """
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= scale:
            return f"{b / scale:.3g} {unit}"
    return f"{b:.0f} B"


def fmt_s(s: Optional[float]) -> str:
    """Seconds with a readable unit.

    >>> fmt_s(0.00325), fmt_s(17.5), fmt_s(None)
    ('3.25 ms', '17.5 s', '-')
    """
    if s is None:
        return "-"
    if s >= 1 or s == 0:
        return f"{s:.3g} s"
    return f"{s * 1e3:.3g} ms" if s >= 1e-3 else f"{s * 1e6:.3g} us"


def _fmt_link(l: Dict[str, object]) -> str:
    return (f"{l['name']} {fmt_bytes(l['bytes_per_s'])}/s per direction ({l['quoted']}), "
            f"alpha {fmt_s(l['alpha_s'])}")


def format_plan(p: Mapping) -> str:
    """The human-readable report of a :func:`plan`."""
    i, t, e = p["inputs"], p["topology"], p["envelope"]
    W = t["dp"]
    rows = [[m["method"], fmt_bytes(m["bytes_per_rank"]), fmt_s(m["latency_s"]), fmt_s(m["transfer_s"]),
             fmt_s(m["compute_s"]) if m["compute_s"] is not None else m["compute"],
             fmt_s(m["total_s"]), fmt_s(m["step_s"]), f"{m['saving_vs_plain']:+.0%}"] for m in p["methods"]]
    lines = [
        f"pycomm plan: {fmt_count(i['params'])} parameters, {i['dtype']} gradients, {i['gpus']} GPUs "
        f"({t['nodes']} node(s) x {min(i['gpus'], i['gpus_per_node'])}), tp {i['tp']} x pp {i['pp']} "
        f"-> data-parallel degree {W} ({t['dp_ranks_per_node']} per node, {t['dp_nodes']} node(s))",
        f"intra: {_fmt_link(p['links']['intra'])}",
        f"inter: {_fmt_link(p['links']['inter'])}",
        f"gradient bytes per DP rank: {fmt_bytes(p['gradient_bytes'])} "
        f"({fmt_count(p['gradient_elements'])} elements x {DTYPE_BYTES[i['dtype']]} B)",
        f"gradient bytes / link bandwidth: {fmt_bytes(p['gradient_bytes'])} / {e['quoted']} ({e['link']}) "
        f"= {fmt_s(e['seconds'])}; per direction: {fmt_s(e['per_direction_seconds'])}",
        f"ring all-reduce: 2(W-1)/W = {2 * (W - 1) / W:.3g} x the bytes each way + 2(W-1) latencies per bucket "
        f"= {fmt_s(p['methods'][0]['total_s'])} (flat ring over {t['flat_ring_link']} links)",
        f"({t['buckets']} DDP bucket(s) of {i['bucket_mb']:g} MB"
        + (f"; {i['compressor']}: {t['compressed_chunks']} chunk(s) of ~{fmt_count(p['gradient_elements'] / t['compressed_chunks'])} elements, "
           "each its own collectives)" if i["compressor"] != spec.EXACT_METHOD and i["chunk_numel"] else ")"),
        "",
        require("tabulate").tabulate(rows, headers=["method", "sent/rank (all links)", "latency", "transfer", "compressor compute",
                                "comm", "step", "vs plain"], disable_numparse=True),
        "",
        *([f"compressor kernels: {p['kernels']['note']}"] if i["compressor"] != spec.EXACT_METHOD else []),
        f"compute per step: 6 x {fmt_count(i['params'])} params x {fmt_count(i['tokens_per_step'])} tokens / "
        f"({i['gpus']} GPUs x {i['peak_tflops']:g} TFLOP/s x MFU {i['mfu']:g}) = {fmt_s(p['compute']['seconds'])}"
        f" (communication overlap {i['overlap']:.0%})",
        f"communication / compute (best plain): {p['comm_to_compute']:.3g}",
        f"recommendation: {p['recommendation']}",
        *([f"memory: each GPU holds {fmt_bytes(p['memory']['bytes_per_gpu'])} of parameters, gradients and AdamW "
           f"state ({STATE_BYTES} B + {DTYPE_BYTES[i['dtype']]} B per element) against its "
           f"{fmt_bytes(p['memory']['gpu_bytes'])}: it does not fit unsharded. Shard it (FSDP, --tp, --pp) first"]
          if p["memory"]["fits"] is False else []),
        *([f"methods that change the optimizer (wire only; their loss cost: docs/results.md, the quality study): "
           + "; ".join(f"{m['method']}: {fmt_bytes(m['bytes_per_rank'])} sent per rank per step, "
                       f"{fmt_s(m['total_s'])} of communication per step" for m in p["alternatives"])]
          if p["alternatives"] else []),
    ]
    return "\n".join(lines)


# -------------------------------------------------------------------- CLI ---
def _alpha(text: str) -> float:
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?(?:e[+-]?\d+)?)\s*(s|ms|us)?\s*", text)
    if m is None:
        raise argparse.ArgumentTypeError(f"expected a latency such as 2us, 0.5ms or 3e-6, got {text!r}")
    return float(m.group(1)) * {"s": 1, "ms": 1e-3, "us": 1e-6, None: 1}[m.group(2)]


def _link_arg(text: str) -> str:
    """argparse type: fail while parsing, listing the presets (argparse names the flag)."""
    try:
        parse_link(text, "")
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def build_parser() -> argparse.ArgumentParser:
    links = ", ".join(f"{k} ({l.quoted})" for k, l in LINKS.items())
    ap = argparse.ArgumentParser(prog="pycomm plan", description=__doc__.split("\n\n")[1],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--params", required=True, help="model parameters, e.g. 70e9 or 70B")
    ap.add_argument("--gpus", type=int, required=True, help="GPUs in the job")
    ap.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node")
    ap.add_argument("--intra", type=_link_arg, default="nvlink4", help=f"link inside a node: {links}")
    ap.add_argument("--inter", type=_link_arg, default="ib-ndr400",
                    help="link between nodes, per GPU (one NIC per GPU; if GPUs share a NIC give their share as a "
                         "rate, e.g. 50gbit): a preset as for --intra or a rate per direction (1gbit, 2.5gbit, 100mbit)")
    ap.add_argument("--intra-alpha", type=_alpha, help="override the intra link latency (e.g. 3us)")
    ap.add_argument("--inter-alpha", type=_alpha, help="override the inter link latency (free rates: 30us, TCP)")
    ap.add_argument("--compressor", choices=COMPRESSORS, default=spec.EXACT_METHOD)
    ap.add_argument("--density", type=float, default=0.01, help="topk: fraction of entries sent")
    ap.add_argument("--topk-exact", action="store_true", help="topk: exact selection (default approximate, "
                                                             "whose payload reserves 1.25 k entries)")
    ap.add_argument("--block-size", type=int, default=None,
                    help="block codecs: elements per float32 scale; default each one's ("
                         + ", ".join(f"{m} {b}" for m, b in spec.DEFAULT_BLOCK_SIZE.items()) + ")")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (innermost, inside a node)")
    ap.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree (outermost)")
    ap.add_argument("--dtype", choices=tuple(DTYPE_BYTES), default="fp32", help="gradient dtype on the wire")
    ap.add_argument("--tokens-per-step", type=float, default=DEFAULT_TOKENS,
                    help="global batch in tokens; default 4M = 1024 x 4096, Llama 2's global batch")
    ap.add_argument("--gpu", choices=tuple(GPUS), default="h100",
                    help="peak dense bf16 TFLOP/s preset: " + "; ".join(f"{k} {v[0]:g} ({v[1]})" for k, v in GPUS.items()))
    ap.add_argument("--peak-tflops", type=float, help="peak TFLOP/s per GPU, overrides --gpu")
    ap.add_argument("--mfu", type=float, default=DEFAULT_MFU, help="model FLOPs utilization of the compute")
    ap.add_argument("--overlap", type=float, default=0.0,
                    help="fraction of communication hidden behind backward compute (0: none, the worst case)")
    ap.add_argument("--bucket-mb", type=float, default=DEFAULT_BUCKET_MB, help="DDP bucket size (torch's default)")
    ap.add_argument("--chunk-numel", type=int, default=None,
                    help="pycomm chunk, elements (each chunk is its own collectives); 0: one per bucket; "
                         "default: pycomm's where the gradients are compressed (2^26 on cuda, 2^20 on cpu)")
    ap.add_argument("--kernels-json", help="pycomm-bench kernels result for compressor throughput "
                                           "(default: newest benchmarks/results/kernels/<kernel-device>*.json)")
    ap.add_argument("--engine-json", help="pycomm-bench allreduce --device cuda result: the engine's measured time "
                                          "per call, chunk and element as the compressor's compute (default: newest "
                                          "benchmarks/results/allreduce/<kernel-device>*.json with engine records)")
    ap.add_argument("--kernel-device", choices=("cuda", "cpu"), default="cuda",
                    help="where gradients are compressed (cuda for GPU training)")
    ap.add_argument("--min-saving", type=float, default=DEFAULT_MIN_SAVING,
                    help="recommend compression only when it saves at least this fraction of step time")
    ap.add_argument("--sync-every", type=int, default=16,
                    help="DiLoCo's H in the rows of the methods that change the optimizer (default 16)")
    ap.add_argument("--json", metavar="OUT", help="also write the plan as JSON to OUT")
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``pycomm plan ...`` (also ``python -m pycomm plan ...``); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and not argv[0].startswith("-"):
        if argv[0] != "plan":
            print(f"pycomm: unknown command {argv[0]!r}; commands: plan", file=sys.stderr)
            return 2
        argv = argv[1:]
    ap = build_parser()
    a = ap.parse_args(argv)
    try:
        p = plan(params=a.params, gpus=a.gpus, gpus_per_node=a.gpus_per_node, intra=a.intra, inter=a.inter,
                 compressor=a.compressor, density=a.density, block_size=a.block_size, topk_exact=a.topk_exact,
                 tp=a.tp, pp=a.pp, dtype=a.dtype, tokens_per_step=a.tokens_per_step, gpu=a.gpu,
                 peak_tflops=a.peak_tflops, mfu=a.mfu, overlap=a.overlap, bucket_mb=a.bucket_mb,
                 chunk_numel=a.chunk_numel, kernels_json=a.kernels_json, kernel_device=a.kernel_device,
                 engine_json=a.engine_json,
                 intra_alpha=a.intra_alpha, inter_alpha=a.inter_alpha, min_saving=a.min_saving,
                 sync_every=a.sync_every)
    except (ValueError, OSError) as err:
        ap.error(str(err))
    print(format_plan(p))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(p, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
