"""The benchmark records and the docs that quote them, checked against each
other, so that a doc cannot drift from its records and a record cannot hide
in the tree.

- Every table a doc draws from a record (``<!-- table: FOLDER/NAME.json
  [VIEW] -->``, ``pycomm_bench.records``) is what the record says today.
- docs/results.md and docs/performance.md quote no measured figure outside
  those tables, and fit in 700 lines together.
- Every file under benchmarks/results is listed in its folder's INDEX.md,
  every INDEX.md is what ``pycomm-bench index`` writes, no record is named
  after a date or a before/after run, and every record path a doc or the
  code names exists.
- A benchmark writes its record under its folder's stable name and updates
  the folder's index (``report.finish``).
- The section titles and anchors other files cite in results.md and
  performance.md exist.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _dist import subprocess_env

from pycomm_bench import records
from pycomm_bench.report import default_json_path, finish

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOCS = ROOT / "docs"
QUOTING = (DOCS / "results.md", DOCS / "performance.md")
MAX_LINES = 700

#: A measured figure: a number with a unit of time, throughput or ratio
#: ("12 ms", "1.5x", "+3.2%", "23 GB/s"). Settings (ranks, steps, elements,
#: link rates in bit/s) are not figures.
FIGURE = re.compile(r"(?<![\w.^-])[+-]?\d[\d,]*(?:\.\d+)?\s?(?:ms|us|µs|s|GB/s|MB/s|x|%)(?![\w/])")


def _prose(text: str) -> str:
    """``text`` without the tables drawn from records, fenced blocks, table
    rows, HTML comments and inline code: what a reader reads as sentences."""
    out, fenced = [], False
    for line in records.strip_tables(text).split("\n"):
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced or line.startswith("|") or line.startswith("<!--"):
            continue
        out.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(out)


@pytest.mark.parametrize("doc", [p for p in sorted(DOCS.glob("*.md")) if "<!-- table: " in p.read_text()],
                         ids=lambda p: p.name)
def test_every_table_drawn_from_a_record_is_what_the_record_says(doc):
    text = doc.read_text()
    marked = records.marked_tables(text)
    assert marked
    for record, view in marked:
        assert list(RESULTS.glob(record)), f"{doc.name}: {record} is not under benchmarks/results"
    new = records.rewrite_doc(text, str(RESULTS))
    if new != text:
        stale = [f"{r} {v}" for r, v in marked
                 if records.render(r, v, str(RESULTS)) not in text]
        pytest.fail(f"{doc.name}: tables differ from their records ({', '.join(stale)}); "
                    f"run `pycomm-bench index`")


def test_a_changed_figure_in_a_drawn_table_fails():
    # The check above would catch an edited table: the rewrite restores it.
    text = (DOCS / "results.md").read_text()
    rendered = records.render("kernels/cpu.json", "kernels", root=str(RESULTS))
    figures = re.findall(r"\d+\.\d+", rendered)
    assert figures
    edited = text.replace(rendered, rendered.replace(figures[-1], figures[-1] + "9", 1), 1)
    assert edited != text and records.rewrite_doc(edited, str(RESULTS)) == text


@pytest.mark.parametrize("doc", QUOTING, ids=lambda p: p.name)
def test_the_prose_quotes_no_figure_of_its_own(doc):
    found = [m.group(0) for m in FIGURE.finditer(_prose(doc.read_text()))]
    assert not found, f"{doc.name} quotes figures outside the tables drawn from records: {found}"


def test_the_figure_pattern_tells_figures_from_settings():
    assert FIGURE.findall("it took 12 ms, 1.5x plain, +3.2% loss at 23 GB/s") == \
        ["12 ms", "1.5x", "+3.2%", "23 GB/s"]
    assert not FIGURE.findall("4 ranks, 1000 steps, 2^20 elements at 100 Mbit/s, a 4.9M-parameter GPT, sm_90a")


def test_the_reference_docs_fit():
    lines = sum(len(p.read_text().splitlines()) for p in QUOTING)
    assert lines <= MAX_LINES, f"docs/results.md + docs/performance.md: {lines} lines (at most {MAX_LINES})"


def _tree_files():
    for dirpath, _, filenames in os.walk(RESULTS):
        for name in filenames:
            if not name.endswith((".tmp", "-quick.json")):
                yield Path(dirpath, name)


def test_every_results_file_is_listed_in_its_folders_index():
    missing = []
    for path in _tree_files():
        rel = path.relative_to(RESULTS)
        if rel.parts == ("INDEX.md",):
            continue
        folder = RESULTS / rel.parts[0]
        index = (folder / "INDEX.md").read_text() if (folder / "INDEX.md").is_file() else ""
        if path.name == "INDEX.md" and len(rel.parts) == 2:
            assert f"({rel.parts[0]}/INDEX.md)" in (RESULTS / "INDEX.md").read_text(), rel
            continue
        if f"({path.relative_to(folder).as_posix()})" not in index:
            missing.append(str(rel))
    assert not missing, f"not listed in their folder's INDEX.md: {missing[:10]}"
    assert {p.name for p in RESULTS.iterdir() if p.is_dir()} <= {f.name for f in records.FOLDERS}


def test_every_index_is_what_pycomm_bench_index_writes():
    stale = records.update_all(str(ROOT), check=True)
    assert not stale, f"stale: {stale}; run `pycomm-bench index`"


def test_no_record_is_named_after_a_date_or_a_side_by_side_run():
    bad = [str(p.relative_to(RESULTS)) for p in _tree_files()
           if re.search(r"\d{4}-\d\d-\d\d|before|after|-run\d|-round\d|-pair\d|wheel-[0-9a-f]{7}", p.name)
           and "runs" not in p.relative_to(RESULTS).parts[1:2]]
    assert not bad, bad


def test_every_record_path_named_in_the_docs_and_code_exists():
    # (the harness's own defaults and doctests name records a run would write)
    sources = [ROOT / "README.md", *DOCS.glob("*.md"), *(ROOT / "pycomm").rglob("*.py"), *(ROOT / "tools").glob("*.py"),
               *(ROOT / "benchmarks").glob("*.py"), *(ROOT / "scripts").glob("*.sh")]
    named = re.compile(r"benchmarks/results/([\w./-]*[\w/])")
    bad = []
    for src in sources:
        text = src.read_text()
        for m in named.finditer(text):
            rel = m.group(1)
            if text[m.end():m.end() + 1] in ("*", "<", "{", "-", "$"):
                continue  # a pattern, not a path
            if not (RESULTS / rel).exists():
                bad.append(f"{src.relative_to(ROOT)}: benchmarks/results/{rel}")
    assert not bad, bad


def test_a_benchmark_writes_its_stable_record_and_updates_the_index(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    path = default_json_path("kernels", "cpu")
    assert path == os.path.join("benchmarks", "results", "kernels", "cpu.json")
    doc = {"benchmark": "kernels", "date": "2026-12-07T10:00:00", "numel": 1024, "copy_gbps": 20.0,
           "machine": {"cpu_model": "TestCPU", "cpu_count": 2, "torch": "2.13.0"},
           "rows": [{"compressor": "onebit b=2048", "op": "compress", "impl": "cpu", "pct_copy": 90.0}]}
    monkeypatch.setattr(sys, "argv", ["/venv/bin/pycomm-bench", "kernels", "--numel", "1k"])
    assert finish(doc, path, "table") == 0
    index = (tmp_path / "benchmarks" / "results" / "kernels" / "INDEX.md").read_text()
    assert "| [cpu.json](cpu.json) | kernels | 2026-12-07 | TestCPU, 2 cores, torch 2.13.0 |" in index
    assert "`pycomm-bench kernels --numel 1k`" in index and "at 90-90% of copy" in index
    assert json.loads(Path(path).read_text())["command"] == "pycomm-bench kernels --numel 1k"
    top = (tmp_path / "benchmarks" / "results" / "INDEX.md").read_text()
    assert "[kernels/](kernels/INDEX.md)" in top
    # A smoke run writes beside it and stays out of the index.
    assert finish(doc, default_json_path("kernels", "cpu", quick=True), "table") == 0
    assert "quick" not in (tmp_path / "benchmarks" / "results" / "kernels" / "INDEX.md").read_text()
    capsys.readouterr()


def test_every_record_in_the_tree_has_a_headline():
    for path in _tree_files():
        rel = path.relative_to(RESULTS).parts
        if len(rel) > 2 and rel[1].startswith("runs"):
            continue  # the quality study's per-run cache: not records of their own
        d = records.describe(str(path))
        if d is not None:
            assert d["headline"] not in ("", "-") and d["command"] != "-" and d["date"] != "-", (path, d)


def test_pycomm_bench_index_check_exits_1_on_a_stale_index(tmp_path):
    tree = tmp_path / "benchmarks" / "results" / "soak"
    tree.mkdir(parents=True)
    (tree / "cpu.json").write_text(json.dumps({"calls": 20, "world_size": 2, "checks": {"a": True}, "ok": True,
                                               "date": "2026-12-07", "command": "python benchmarks/soak.py"}))
    cmd = [sys.executable, "-m", "pycomm_bench", "index", "--root", str(tmp_path)]
    proc = subprocess.run([*cmd, "--check"], capture_output=True, text=True, env=subprocess_env(), timeout=120)
    assert proc.returncode == 1 and "stale benchmarks/results/soak/INDEX.md" in proc.stdout, proc.stdout + proc.stderr
    proc = subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "20 calls on 2 ranks: 1/1 checks hold" in (tree / "INDEX.md").read_text()
    proc = subprocess.run([*cmd, "--check"], capture_output=True, text=True, env=subprocess_env(), timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _headings(doc: Path):
    return [line.lstrip("#").strip() for line in doc.read_text().splitlines() if line.startswith("#")]


def _anchor(title: str) -> str:
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def test_the_sections_other_files_cite_exist():
    cite = re.compile(r"(results|performance)\.md\)?[,:]?\s+\(?\"([^\"]+)\"", re.S)
    link = re.compile(r"(results|performance)\.md#([\w-]+)")
    files = [ROOT / "README.md", *DOCS.glob("*.md"), *(ROOT / "pycomm").rglob("*.py"), *(ROOT / "examples").glob("*.py"),
             *(ROOT / "benchmarks").glob("*.py")]
    bad = []
    for f in files:
        text = re.sub(r"\n\s*(#|//)?\s*", " ", f.read_text())  # citations wrap across comment lines
        for m in cite.finditer(text):
            titles = _headings(DOCS / f"{m.group(1)}.md")
            if not any(t.startswith(m.group(2).strip()) for t in titles):
                bad.append(f"{f.name}: {m.group(1)}.md \"{m.group(2)}\"")
        for m in link.finditer(text):
            if m.group(2) not in {_anchor(t) for t in _headings(DOCS / f"{m.group(1)}.md")}:
                bad.append(f"{f.name}: {m.group(1)}.md#{m.group(2)}")
    assert not bad, bad


def test_the_kill_rejoin_study_says_whether_the_killed_runs_end_within_the_spread():
    import importlib.util

    spec = importlib.util.spec_from_file_location("kill_rejoin", ROOT / "benchmarks" / "kill_rejoin.py")
    kr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kr)
    runs = [{"mode": "uninterrupted", "seed": s, "heldout_loss": v} for s, v in ((0, 2.0), (1, 2.2), (2, 2.1))]
    inside = kr.summarize(runs + [{"mode": "killed", "seed": s, "heldout_loss": v} for s, v in ((0, 2.05), (1, 2.1))])
    assert inside["within_seed_spread"] is True and inside["killed"]["seeds"] == [0, 1]
    assert inside["killed"]["vs_uninterrupted_per_seed"] == pytest.approx([2.05 / 2.0, 2.1 / 2.2])
    outside = kr.summarize(runs + [{"mode": "killed", "seed": 0, "heldout_loss": 2.3}])
    assert outside["within_seed_spread"] is False and outside["killed"]["mean"] == 2.3
    assert kr.summarize(runs)["within_seed_spread"] is None  # no killed run yet
