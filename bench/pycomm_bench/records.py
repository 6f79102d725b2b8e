"""Where the benchmark records live, what each folder's ``INDEX.md`` says,
and the doc tables drawn from them.

``benchmarks/results/`` holds one folder per benchmark (:data:`FOLDERS`).
Each folder holds the current record(s) of its benchmark under stable names
(``kernels/cpu.json``, ``ddp/cpu-4ranks.json``, ...): a new run of the same
benchmark, machine kind and settings overwrites the old record (git keeps
its history), and every writer of ``pycomm-bench`` regenerates the folder's
``INDEX.md`` (:func:`write_index`): per record its benchmark, date, machine,
command and headline figure, then every other file of the folder.

The docs quote figures through tables drawn from the records: a line
``<!-- table: FOLDER/NAME.json [VIEW] -->`` before a table says which record
(and which of its benchmark's tables, :data:`VIEWS`) it is, and
:func:`update_docs` rewrites the table below it from the record. A test
checks that every such table is what its record says today, so a doc cannot
drift from its records. ``pycomm-bench index`` does both::

    $ pycomm-bench index            # rewrite every INDEX.md and every doc table
    $ pycomm-bench index --check    # exit 1 naming each one that is stale
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shlex
import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

#: The results tree, relative to the source tree's root (and to the working
#: directory the benchmarks run in).
RESULTS = os.path.join("benchmarks", "results")


@dataclass(frozen=True)
class Folder:
    """A benchmark's folder under :data:`RESULTS`."""

    name: str
    title: str
    what: str


FOLDERS: Tuple[Folder, ...] = (
    Folder("kernels", "Kernels", "each kernel against memory-copy bandwidth (`pycomm-bench kernels`)"),
    Folder("allreduce", "All-reduce", "compressed all-reduce through the engine against plain Gloo, CPU ranks on "
           "loopback (`pycomm-bench allreduce`; the engine on a GPU: the GPU check's `engine.json` in gpu/)"),
    Folder("per-call", "Per call", "the engine's own cost per call against plain Gloo "
           "(`pycomm-bench allreduce --per-call`)"),
    Folder("ddp", "DDP", "DDP training on emulated links: step time, bytes and held-out loss (`pycomm-bench ddp`)"),
    Folder("fsdp", "FSDP2", "FSDP2 training on emulated links: step time, bytes, memory and loss (`pycomm-bench fsdp`)"),
    Folder("quality", "Quality study", "final held-out loss over seeds at a realistic batch, each method tuned "
           "alike (`pycomm-bench quality`); `runs*/` hold one file per run, the study's resume cache"),
    Folder("hierarchy", "Hierarchy", "flat against hierarchical compressed all-reduce on emulated nodes "
           "(`pycomm-bench hierarchy`)"),
    Folder("gpu", "GPU check", "the GPU check's report per device (`pycomm-bench gpu-check`)"),
    Folder("soak", "Soak", "many concurrent keyed and keyless calls against the simulation (`benchmarks/soak.py`)"),
    Folder("pytest-benchmark", "Micro-benchmarks", "pytest-benchmark's saved baseline (`scripts/microbench.sh`)"),
)

#: Which folder a benchmark writes to (the name ``default_json_path`` gets).
BENCH_FOLDER: Dict[str, str] = {"kernels": "kernels", "allreduce": "allreduce", "allreduce-per-call": "per-call",
                                "ddp": "ddp", "fsdp": "fsdp", "quality": "quality", "hierarchy": "hierarchy",
                                "soak": "soak"}


def folder_of(bench: str) -> str:
    """The folder of benchmark ``bench`` (``ddp-mlp`` goes where ``ddp`` goes).

    >>> folder_of("allreduce-per-call"), folder_of("ddp-mlp")
    ('per-call', 'ddp')
    """
    if bench in BENCH_FOLDER:
        return BENCH_FOLDER[bench]
    head = bench.split("-")[0]
    if head in BENCH_FOLDER:
        return BENCH_FOLDER[head]
    raise ValueError(f"benchmark {bench!r} has no results folder (known: {', '.join(sorted(BENCH_FOLDER))})")


def record_path(bench: str, name: str, quick: bool = False, root: str = RESULTS) -> str:
    """``<root>/<folder>/<name>[-quick].json``: the stable name of a record.
    A ``--quick`` smoke run never overwrites a measurement, and the index
    leaves it out.

    >>> record_path("ddp-mlp", "cpu-4ranks-mlp")
    'benchmarks/results/ddp/cpu-4ranks-mlp.json'
    """
    return os.path.join(root, folder_of(bench), f"{name}{'-quick' if quick else ''}.json")


def command_line(argv: Optional[Sequence[str]] = None) -> str:
    """The command that is running, as a user would type it: ``pycomm-bench
    ...`` for the harness (however it was started), else the script.

    >>> command_line(["/x/bin/pycomm-bench", "kernels", "--numel", "4M"])
    'pycomm-bench kernels --numel 4M'
    """
    argv = list(sys.argv if argv is None else argv)
    head = os.path.basename(argv[0]) if argv else ""
    if head in ("pycomm-bench", "__main__.py", "-m", "-c") or head.startswith("pycomm_bench"):
        return shlex.join(["pycomm-bench", *argv[1:]])
    return shlex.join(["python", os.path.relpath(os.path.abspath(argv[0])) if argv else head, *argv[1:]])


def stamp_command(doc: Any, command: Optional[str] = None) -> Any:
    """``doc`` with its ``command`` set (every record of a list of records),
    unless it has one."""
    command = command or command_line()
    for rec in (doc if isinstance(doc, list) else [doc]):
        if isinstance(rec, dict):
            rec.setdefault("command", command)
    return doc


# ------------------------------------------------------------- describing ---
def _first(doc: Any) -> Dict[str, Any]:
    if isinstance(doc, list):
        return doc[0] if doc and isinstance(doc[0], dict) else {}
    return doc if isinstance(doc, dict) else {}


def kind_of(doc: Any) -> Optional[str]:
    """Which benchmark wrote ``doc`` (None: not a record this module reads)."""
    head = _first(doc)
    if "benchmark" in head:
        return {"allreduce-engine": "allreduce-cuda"}.get(head["benchmark"], head["benchmark"])
    if head.get("bench") == "hierarchy":
        return "hierarchy"
    if "arms" in head and "regime" in head:
        return "quality"
    if "checks" in head and "calls" in head:
        return "soak"
    if isinstance(doc, list) and "reduce_dtype" in head and "method" in head:
        return "fsdp"
    if isinstance(doc, list) and "speedup_vs_allreduce" in head and "method" in head:
        return "ddp"
    if "mode" in head and "steps" in head and "failed_steps" in head:
        return "gpu-check"
    return None


def machine_of(doc: Any) -> str:
    """A short name of what a record was measured on."""
    head = _first(doc)
    if head.get("gpu"):
        return str(head["gpu"])
    if isinstance(head.get("device"), dict) and head["device"].get("name"):
        return str(head["device"]["name"])
    m = head.get("machine") or {}
    if not isinstance(m, dict):
        return str(m)
    cpu = str(m.get("cpu_model") or m.get("processor") or "CPU")
    cpu = re.sub(r"\s+\d+-Core Processor|\(R\)|\(TM\)", "", cpu).strip()
    bits = [cpu]
    if m.get("cpu_count"):
        bits.append(f"{m['cpu_count']} cores")
    if m.get("torch"):
        bits.append(f"torch {m['torch']}")
    return ", ".join(bits)


def _pct(x: float) -> str:
    return f"{(x - 1) * 100:+.1f}%"


def _headline_kernels(doc: Dict[str, Any]) -> str:
    own = [r for r in doc.get("rows", []) if r.get("impl") in ("cpu", "cuda", "triton") and r.get("op") == "compress"
           and r.get("pct_copy") is not None and r.get("status", "ok") == "ok" and "topk exact" not in r["compressor"]]
    if not own:
        return "-"
    lo, hi = min(r["pct_copy"] for r in own), max(r["pct_copy"] for r in own)
    return (f"copy {doc['copy_gbps']:.1f} GB/s; compress with error feedback at {lo:.0f}-{hi:.0f}% of copy "
            f"({len(own)} kernels, {doc['numel']:,} elements)")


def _headline_allreduce(doc: Dict[str, Any]) -> str:
    ok = [r for r in doc.get("records", []) if r.get("status") == "ok" and r.get("speedup_vs_plain")]
    if not ok:
        return "-"
    top = max(ok, key=lambda r: (r["ranks"], r["numel"]))
    at = [r for r in ok if r["ranks"] == top["ranks"] and r["numel"] == top["numel"] and r["method"] != "plain"]
    best = max(at, key=lambda r: r["speedup_vs_plain"]) if at else top
    return f"{top['ranks']} ranks, {top['numel']:,} elements: {best['method']} {best['speedup_vs_plain']:.2f}x plain"


def _headline_per_call(doc: Dict[str, Any]) -> str:
    recs = [r for r in doc.get("records", []) if r.get("vs_plain") is not None and r["method"] != "plain"]
    if not recs:
        return "-"
    small = min(r["numel"] for r in recs)
    at = [r for r in recs if r["numel"] == small]
    lo, hi = min(r["vs_plain"] for r in at), max(r["vs_plain"] for r in at)
    return f"{small:,} elements, {at[0]['ranks']} rank(s): a compressed call costs {lo:.2f}-{hi:.2f}x plain Gloo's"


def _headline_cuda(doc: Dict[str, Any]) -> str:
    recs = [r for r in doc.get("records", []) if r.get("engine_over_kernels")]
    if not recs:
        return "-"
    return f"{doc['numel']:,} elements: engine / bare kernels " + ", ".join(
        f"{r['method']} {r['engine_over_kernels']:.1f}x" for r in recs)


def _headline_hierarchy(doc: Dict[str, Any]) -> str:
    recs = [r for r in doc.get("records", []) if r.get("median_s")]
    big = max(r["numel"] for r in recs)
    at = {r["method"]: r["median_s"] for r in recs if r["numel"] == big}
    plain = at.pop("plain", None)
    best = min(at, key=at.get)
    link = doc.get("bandwidth_bits_per_s")
    return (f"{big:,} elements at {link / 1e6:.0f} Mbit/s between nodes: {best} {plain / at[best]:.1f}x plain"
            if plain and link else f"{best} fastest")


def _headline_steps(records: List[Dict[str, Any]], key: str, plain: str) -> str:
    by_link: Dict[str, Tuple[float, str]] = {}
    for r in records:
        if r.get("method") == plain or r.get(key) is None:
            continue
        label = _link_label(r.get("bandwidth"))
        if label not in by_link or r[key] > by_link[label][0]:
            by_link[label] = (r[key], r["method"])
    if not by_link:  # no baseline in the run: the fastest step per link
        for r in records:
            t = r.get("step_time_mean_s") or r.get("step_time_median_s")
            label = _link_label(r.get("bandwidth"))
            if t and (label not in by_link or t < by_link[label][0]):
                by_link[label] = (t, r["method"])
        return "; ".join(f"{link}: fastest {m}, {t * 1e3:.0f} ms per step" for link, (t, m) in by_link.items()) or "-"
    return "; ".join(f"{link}: {m} {s:.2f}x {plain}" for link, (s, m) in by_link.items())


def _link_label(bits: Any) -> str:
    if not bits:
        return "unshaped"
    bits = float(bits)
    return f"{bits / 1e9:g} Gbit/s" if bits >= 1e9 else f"{bits / 1e6:g} Mbit/s"


def _headline_quality(doc: Dict[str, Any]) -> str:
    if doc.get("against_torchft"):
        return "; ".join(f"{r['arm']} {_pct(r['loss_vs_torchft_mean'])} at {r['fewer_bytes_than_torchft']:.1f}x "
                         f"fewer bytes" for r in doc["against_torchft"] if r.get("loss_vs_torchft_mean") is not None)
    arms = [a for a in doc["arms"] if a.get("final_loss_vs_allreduce_mean") is not None and a["method"] != "allreduce"
            and a.get("bytes_vs_allreduce")]
    best = [a for a in arms if a["final_loss_vs_allreduce_mean"] <= 1.005]
    best = max(best or arms, key=lambda a: a["bytes_vs_allreduce"])
    return (f"{len(doc['arms'])} arms, {len(doc['seeds'])} seeds, {doc['regime']['steps']} steps; "
            f"{best['arm']}: {_pct(best['final_loss_vs_allreduce_mean'])} held-out loss at "
            f"{best['bytes_vs_allreduce']:.0f}x fewer bytes than plain")


def _headline_kill_rejoin(doc: Dict[str, Any]) -> str:
    s = doc["summary"]
    k, u = s["killed"], s["uninterrupted"]
    if k["mean"] is None or u["mean"] is None:
        return "-"
    return (f"{len(k['seeds'])} seeds: a replica killed and rejoined ends at {_pct(k['vs_uninterrupted_mean'])} held-out "
            f"loss against uninterrupted ({'within' if s['within_seed_spread'] else 'outside'} its seed spread)")


def _headline_soak(doc: Dict[str, Any]) -> str:
    return f"{doc['calls']:,} calls on {doc['world_size']} ranks: {sum(doc['checks'].values())}/{len(doc['checks'])} checks hold"


def _headline_gpu(doc: Dict[str, Any]) -> str:
    return f"{len(doc.get('steps', []))} steps, {len(doc.get('failed_steps', []))} failed"


HEADLINES: Dict[str, Callable[[Any], str]] = {
    "kernels": _headline_kernels, "allreduce": _headline_allreduce, "allreduce-per-call": _headline_per_call,
    "allreduce-cuda": _headline_cuda, "hierarchy": _headline_hierarchy,
    "ddp": lambda d: _headline_steps(d, "speedup_vs_allreduce", "allreduce"),
    "fsdp": lambda d: _headline_steps(d, "speedup_vs_plain", "plain"),
    "quality": _headline_quality, "soak": _headline_soak, "gpu-check": _headline_gpu,
    "kill-rejoin": _headline_kill_rejoin,
}


def describe(path: str) -> Optional[Dict[str, str]]:
    """What the index says of a record: benchmark, date, machine, command,
    headline; None for a file that is not a record."""
    if not path.endswith(".json"):
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            doc = json.load(fh)
    except (OSError, ValueError):
        return None
    kind = kind_of(doc)
    if kind is None:
        return None
    head = _first(doc)
    return {"benchmark": kind, "date": str(head.get("date", "-"))[:10], "machine": machine_of(doc),
            "command": str(head.get("command", "-")), "headline": HEADLINES[kind](doc)}


# ----------------------------------------------------------------- indexes ---
def results_root(start: Optional[str] = None) -> str:
    """The results tree of the source tree around ``start`` (default: this
    package's source tree, else the working directory)."""
    here = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, RESULTS))
    return start or (here if os.path.isdir(here) else os.path.abspath(RESULTS))


def _files(folder: str) -> List[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames.sort()
        for name in sorted(filenames):
            rel = os.path.relpath(os.path.join(dirpath, name), folder)
            if rel != "INDEX.md" and not name.endswith((".tmp", "-quick.json")) and "-quick" not in rel.split(os.sep)[0]:
                out.append(rel)
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def index_text(folder: str) -> str:
    """The ``INDEX.md`` of one results folder, from its files."""
    name = os.path.basename(os.path.normpath(folder))
    meta = next((f for f in FOLDERS if f.name == name), Folder(name, name, ""))
    files = _files(folder)
    rows, rest = [], []
    for rel in files:
        d = describe(os.path.join(folder, rel)) if os.sep not in rel or not rel.startswith("runs") else None
        if d:
            rows.append((rel, d))
        else:
            rest.append(rel)
    lines = [f"# {meta.title}", "", f"{meta.what}.", "",
             "Generated by `pycomm-bench index` from the records themselves; every file of this folder is listed.", ""]
    if rows:
        lines += ["| record | benchmark | date | machine | command | headline |", "|---|---|---|---|---|---|"]
        lines += [f"| [{rel}]({rel}) | {d['benchmark']} | {d['date']} | {_cell(d['machine'])} | `{_cell(d['command'])}` "
                  f"| {_cell(d['headline'])} |" for rel, d in rows]
        lines.append("")
    if rest:
        groups: Dict[str, List[str]] = {}
        for rel in rest:
            groups.setdefault(os.path.dirname(rel), []).append(rel)
        lines += ["Other files (plots beside their record, logs, one file per run):", ""]
        for sub, rels in groups.items():
            links = ", ".join(f"[{os.path.basename(r)}]({r})" for r in rels)
            lines.append(f"- {sub + '/: ' if sub else ''}{links}")
        lines.append("")
    return "\n".join(lines)


def top_index_text(root: str) -> str:
    """The ``INDEX.md`` of the results tree: its folders."""
    lines = ["# Benchmark records", "",
             "One folder per benchmark, each with its current records under stable names and an `INDEX.md` "
             "(generated by `pycomm-bench index`). Superseded records are in git's history, not here; "
             "[docs/results.md](../../docs/results.md) quotes the figures.", "",
             "| folder | what |", "|---|---|"]
    lines += [f"| [{f.name}/]({f.name}/INDEX.md) | {f.what} |" for f in FOLDERS
              if os.path.isdir(os.path.join(root, f.name))]
    return "\n".join(lines) + "\n"


def write_index(folder: str) -> str:
    """Rewrite ``folder``'s ``INDEX.md`` (and the tree's) from its files;
    returns the path written."""
    path = os.path.join(folder, "INDEX.md")
    _write_if_changed(path, index_text(folder))
    root = os.path.dirname(os.path.normpath(folder))
    _write_if_changed(os.path.join(root, "INDEX.md"), top_index_text(root))
    return path


def update_index_of(path: str) -> Optional[str]:
    """After a record was written to ``path``: rewrite its folder's index if
    the folder is one of :data:`FOLDERS` of a results tree; else None."""
    folder = os.path.dirname(os.path.abspath(path))
    while os.path.basename(os.path.dirname(folder)) != "results" and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    if os.path.basename(folder) not in {f.name for f in FOLDERS} or path.endswith("-quick.json"):
        return None
    return write_index(folder)


def _write_if_changed(path: str, text: str) -> bool:
    try:
        with open(path, encoding="utf-8") as fh:
            if fh.read() == text:
                return False
    except OSError:
        pass
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)
    return True


# -------------------------------------------------------------- doc tables ---
def _view_table(doc: Any) -> str:
    from . import allreduce, ddp, engine_cuda, fsdp, hierarchy, kernels, per_call

    kind = kind_of(doc)
    fn = {"kernels": kernels.format_table, "allreduce": allreduce.format_table,
          "allreduce-per-call": per_call.format_table, "allreduce-cuda": engine_cuda.format_table,
          "hierarchy": hierarchy.format_table, "ddp": ddp.format_table, "fsdp": fsdp.format_table}.get(kind or "")
    if fn is None:
        raise ValueError(f"a {kind} record has no default table: name a view ({', '.join(sorted(VIEWS))})")
    return fn(doc)


def _quality(fn_name: str) -> Callable[[Any], str]:
    def view(doc: Any) -> str:
        from . import quality

        if fn_name == "summary":
            return quality.format_summary(doc["arms"], len(doc["seeds"]))
        if fn_name == "links":
            return quality.format_links(doc["arms"])
        return quality.format_against_torchft(doc["against_torchft"])
    return view


def _ddp(fn_name: str) -> Callable[[Any], str]:
    def view(doc: Any) -> str:
        from . import ddp

        return getattr(ddp, fn_name)(doc)
    return view


def _md(rows: List[List[Any]], head: List[str], caption: str = "") -> str:
    from .report import table

    return (f"_{caption}_\n\n" if caption else "") + table(rows, head, tablefmt="github")


def _view_kernels(doc: Dict[str, Any]) -> str:
    """One row per compressor: each op of the device's own kernel, its time
    and share of the copy bandwidth, and compress against the unfused peer."""
    from .report import fmt_number

    ops = ("compress", "decompress", "decompress_acc")
    own = [r for r in doc["rows"] if r.get("impl") in ("cpu", "cuda", "triton") and r.get("status") == "ok"]
    by: Dict[str, Dict[str, Dict[str, Any]]] = {}
    for r in own:  # the fastest implementation of each op
        cur = by.setdefault(r["compressor"], {}).get(r["op"])
        if cur is None or r["median_s"] < cur["median_s"]:
            by[r["compressor"]][r["op"]] = r
    rows = []
    for comp, got in by.items():
        cells = [f"{fmt_number(got[o]['median_s'] * 1e3)} ({fmt_number(got[o]['pct_copy'], 2)}%)" if o in got else ""
                 for o in ops]
        peer = got.get("compress", {}).get("speedup_vs_unfused")
        impls = sorted({g["impl"] for g in got.values()})
        rows.append([comp, "/".join(impls), *cells, fmt_number(peer) if peer else ""])
    m = doc["machine"]
    caption = (f"{doc['numel']:,} float32 elements, {m.get('gpu') or m.get('cpu_model')}, {m.get('threads')} "
               f"thread(s); ms (% of the copy bandwidth, {fmt_number(doc['copy_gbps'])} GB/s by median)")
    return _md(rows, ["compressor", "impl", "compress (EF) ms", "decompress ms", "decompress + add ms",
                      "compress x unfused peer"], caption)


def _view_per_call(doc: Dict[str, Any]) -> str:
    """Microseconds per call and x plain Gloo, one row per method, one
    column per size."""
    from .report import fmt_number, size_label

    sizes = sorted({r["numel"] for r in doc["records"]})
    cells: Dict[str, Dict[int, str]] = {}
    for r in doc["records"]:
        x = "" if r["method"] == "plain" else f" ({fmt_number(r['vs_plain'])}x)"
        cells.setdefault(r["method"], {})[r["numel"]] = f"{fmt_number(r['median_s'] * 1e6)}{x}"
    rows = [[m, *(c.get(n, "") for n in sizes)] for m, c in cells.items()]
    ranks = sorted({r["ranks"] for r in doc["records"]})
    return _md(rows, ["method", *(f"{size_label(n)}: us (x plain)" for n in sizes)],
               f"{'/'.join(map(str, ranks))} rank(s), median of {doc['repeats']} rounds of back-to-back keyed calls")


def _view_allreduce(doc: Dict[str, Any]) -> str:
    """Milliseconds and x plain per size, one row per ranks and method, with
    the largest size's kernels-alone and wire-alone times beside."""
    from .report import fmt_number, size_label

    ok = [r for r in doc["records"] if r.get("status") == "ok"]
    sizes = sorted({r["numel"] for r in ok})
    cells: Dict[Tuple[int, str], Dict[int, Dict[str, Any]]] = {}
    for r in ok:
        cells.setdefault((r["ranks"], r["method"]), {})[r["numel"]] = r
    rows = []
    for (w, m), by in cells.items():
        row = [w, m]
        for n in sizes:
            r = by.get(n)
            row.append("" if r is None else fmt_number(r["median_s"] * 1e3)
                       + ("" if m == "plain" else f" ({fmt_number(r['speedup_vs_plain'])}x)"))
        big = by.get(sizes[-1], {})
        row += [fmt_number((big.get("compress_median_s") or float("nan")) * 1e3),
                fmt_number((big.get("wire_median_s") or float("nan")) * 1e3)]
        rows.append(row)
    last = size_label(sizes[-1])
    return _md(rows, ["W", "method", *(f"{size_label(n)}: ms (x plain)" for n in sizes), f"{last}: compress ms",
                      f"{last}: wire ms"])


def _view_hierarchy(doc: Dict[str, Any]) -> str:
    """Per size: milliseconds, x plain and MB out of each node, one row per
    method."""
    from .report import fmt_number, size_label

    sizes = sorted({r["numel"] for r in doc["records"]})
    plain = {r["numel"]: r["median_s"] for r in doc["records"] if r["method"] == "plain"}
    cells: Dict[str, Dict[int, str]] = {}
    for r in doc["records"]:
        x = "" if r["method"] == "plain" else f", {fmt_number(plain[r['numel']] / r['median_s'])}x"
        cells.setdefault(r["method"], {})[r["numel"]] = \
            f"{fmt_number(r['median_s'] * 1e3)}{x}, {fmt_number(r['node_bytes_out_per_call'] / 1e6)} MB"
    rows = [[m, *(c.get(n, "") for n in sizes)] for m, c in cells.items()]
    return _md(rows, ["method", *(f"{size_label(n)}: ms, x plain, MB out of a node" for n in sizes)],
               f"{_link_label(doc.get('bandwidth_bits_per_s'))} between the nodes")


def _view_kill_rejoin(doc: Dict[str, Any]) -> str:
    """One row per run: the final held-out loss, the killed run against the
    uninterrupted one of its seed (and, for a restart, how long after the
    kill it healed), whether the replicas ended identical, and the
    survivors' longest and median wait between two syncs."""
    rows = []
    plain = {r["seed"]: r["heldout_loss"] for r in doc["runs"] if r["mode"] == "uninterrupted"}
    for r in sorted(doc["runs"], key=lambda r: (r["seed"], r["mode"] != "uninterrupted")):
        vs = "" if r["mode"] == "uninterrupted" or r["seed"] not in plain else _pct(r["heldout_loss"] / plain[r["seed"]])
        label = r["mode"]
        if r.get("killed_after_outer_step"):
            label += f" after outer step {r['killed_after_outer_step']}"
        if r.get("kill_to_heal_s") is not None:
            label += f", restarted {r['restart']}, healed {r['kill_to_heal_s']:.0f} s after the kill"
        rows.append([r["seed"], label,
                     f"{r['heldout_loss']:.4f}", vs, "yes" if r["replicas_identical"] else "NO",
                     f"{r['survivor_sync_gap_max_s']:.1f} / {r['survivor_sync_gap_median_s']:.2f}"])
    s = doc["summary"]
    for m in ("uninterrupted", "killed"):
        if s[m]["mean"] is not None:
            rows.append(["mean", m, f"{s[m]['mean']:.4f} ({s[m]['min']:.4f}..{s[m]['max']:.4f})",
                         _pct(s["killed"]["vs_uninterrupted_mean"]) if m == "killed" and
                         s["killed"]["vs_uninterrupted_mean"] else "", "", ""])
    return _md(rows, ["seed", "run", "held-out loss", "vs uninterrupted", "replicas identical",
                      "survivors' wait between syncs, s: longest / median"])


def _view_seeds(docs: List[Any]) -> str:
    """Held-out loss per seed against plain's of the same seed, one row per
    method, from one training record per seed."""
    per: Dict[str, Dict[int, float]] = {}
    for doc in docs:
        recs = {r["method"]: r for r in doc}
        plain = recs.get("plain") or recs.get("allreduce")
        for m, r in recs.items():
            per.setdefault(m, {})[r["seeds"][0] if r.get("seeds") else len(per.get(m, {}))] = \
                r["final_loss"] / plain["final_loss"]
    seeds = sorted({s for v in per.values() for s in v})
    rows = [[m, *(f"{v[s]:.3f}" if s in v else "-" for s in seeds), f"{sum(v.values()) / len(v):.3f}"]
            for m, v in per.items()]
    return _md(rows, ["method", *(f"seed {s}: loss x plain" for s in seeds), "mean"])


#: The tables a doc may draw from a record: ``table`` is the benchmark's own
#: (what it prints at the end of a run); ``seeds`` takes a glob of records,
#: one per seed.
VIEWS: Dict[str, Callable[[Any], str]] = {
    "table": _view_table, "diloco": _ddp("format_diloco"), "profile": _ddp("format_profile"),
    "summary": _quality("summary"), "links": _quality("links"), "torchft": _quality("torchft"),
    "kernels": _view_kernels, "per-call": _view_per_call, "seeds": _view_seeds, "allreduce": _view_allreduce,
    "hierarchy": _view_hierarchy, "kill-rejoin": _view_kill_rejoin,
}

_MARK = re.compile(r"^<!-- table: (?P<record>\S+)(?: (?P<view>[\w-]+))? -->$")


def render(record: str, view: str = "table", root: Optional[str] = None) -> str:
    """The table ``view`` of ``record`` (a path under the results tree) as
    markdown: a benchmark's github table as it is, its plain text tables in
    a ``text`` fence."""
    if view not in VIEWS:
        raise ValueError(f"table view {view!r}: expected one of {', '.join(sorted(VIEWS))}")
    paths = sorted(glob.glob(os.path.join(results_root(root), record)))
    if not paths:
        raise FileNotFoundError(f"no record {record} under {results_root(root)}")
    docs = []
    for path in paths:
        with open(path, encoding="utf-8") as fh:
            docs.append(json.load(fh))
    text = VIEWS[view](docs if "*" in record else docs[0]).rstrip("\n")
    return text if text.startswith(("|", "_")) else f"```text\n{text}\n```"


def _table_end(lines: List[str], start: int) -> int:
    """The index after the table (or fenced block) that starts at ``start``."""
    i = start
    if i < len(lines) and lines[i].startswith("_"):  # a caption, a blank line, then the table
        i += 1
        while i < len(lines) and not lines[i].strip():
            i += 1
    if i < len(lines) and lines[i].startswith("```"):
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            i += 1
        return i + 1
    while i < len(lines) and lines[i].startswith("|"):
        i += 1
    return i


def rewrite_doc(text: str, root: Optional[str] = None) -> str:
    """``text`` (a markdown doc) with every marked table drawn anew from its
    record."""
    lines, out, i = text.split("\n"), [], 0
    while i < len(lines):
        out.append(lines[i])
        m = _MARK.match(lines[i])
        i += 1
        if m:
            out.extend(render(m["record"], m["view"] or "table", root).split("\n"))
            i = _table_end(lines, i)
    return "\n".join(out)


def strip_tables(text: str) -> str:
    """``text`` with its marked tables left out (the markers kept): the prose."""
    lines, out, i = text.split("\n"), [], 0
    while i < len(lines):
        out.append(lines[i])
        i = _table_end(lines, i + 1) if _MARK.match(lines[i]) else i + 1
    return "\n".join(out)


def marked_tables(text: str) -> List[Tuple[str, str]]:
    """The (record, view) of every marked table of a doc."""
    return [(m["record"], m["view"] or "table") for m in map(_MARK.match, text.split("\n")) if m]


def doc_paths(source_root: str) -> List[str]:
    """The docs that draw tables from records."""
    return [p for p in sorted(glob.glob(os.path.join(source_root, "docs", "*.md")))
            if "<!-- table: " in open(p, encoding="utf-8").read()]


def update_docs(source_root: str, check: bool = False) -> List[str]:
    """Rewrite (or, with ``check``, only find) the docs whose marked tables
    differ from their records; returns those docs."""
    stale = []
    root = os.path.join(source_root, RESULTS)
    for path in doc_paths(source_root):
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        new = rewrite_doc(text, root)
        if new != text:
            stale.append(path)
            if not check:
                with open(path, "w", encoding="utf-8") as fh:
                    fh.write(new)
    return stale


def update_all(source_root: str, check: bool = False) -> List[str]:
    """Every INDEX.md and doc table of the source tree at ``source_root``
    made current (or, with ``check``, the stale ones named)."""
    root = os.path.join(source_root, RESULTS)
    stale = []
    for f in FOLDERS:
        folder = os.path.join(root, f.name)
        if not os.path.isdir(folder):
            continue
        path, text = os.path.join(folder, "INDEX.md"), index_text(folder)
        if not os.path.exists(path) or open(path, encoding="utf-8").read() != text:
            stale.append(path)
            if not check:
                _write_if_changed(path, text)
    top = os.path.join(root, "INDEX.md")
    if not os.path.exists(top) or open(top, encoding="utf-8").read() != top_index_text(root):
        stale.append(top)
        if not check:
            _write_if_changed(top, top_index_text(root))
    return stale + update_docs(source_root, check)


HELP = "rewrite every results folder's INDEX.md and every doc table drawn from a record"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``pycomm-bench index`` options."""
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 naming what is stale")
    p.add_argument("--root", default=None, help="the source tree (default: the one around this package, else .)")


def run(args: argparse.Namespace) -> int:
    """Make every index and doc table current (or name the stale ones)."""
    src = os.path.abspath(args.root) if args.root else os.path.dirname(os.path.dirname(results_root()))
    if not os.path.isdir(os.path.join(src, RESULTS)):
        print(f"pycomm-bench index: no {RESULTS} under {src}", file=sys.stderr)
        return 2
    stale = update_all(src, check=args.check)
    for path in stale:
        print(f"{'stale' if args.check else 'wrote'} {os.path.relpath(path, src)}")
    return 1 if args.check and stale else 0
