"""Every code block of README.md, run or checked against the code, so that the
README cannot drift from it.

The blocks are read from README.md when the tests run (fenced with ```python,
```bash or a bare ```) and sorted by rules (``_kinds``), and
``test_every_block_is_covered`` fails for a block that no rule takes:

- ``exec``: a Python block whose every name is defined by itself or by an
  earlier such block ("Using the compressors" and the int4 block after it) is
  run for real, in one namespace, in order; the numbers and lists its
  comments state (``# exact bytes on the wire: 133120 here``) are parsed from
  the README and compared with what that line evaluates to.
- ``ranks``: every other Python block, unless its example script needs a
  training framework's launcher, runs for real on 2 ranks (tests/_dist.py,
  one run for all of them) in a namespace holding real objects for the names
  it uses but does not define (a small ``model``, a ``ddp`` model, tensors
  ``t``, ``shard``, ``full``, ``loss``, a per-rank ``path``, ...); its
  ``init_process_group`` lines initialize the default group for real. What
  its comments claim is then checked (against the single-process simulation
  where the README says "compressed").
- ``example``: a Python block whose preceding text names an example script
  (examples/*.py, run by tests/test_examples.py) must say what that script
  does: each of its statements is one of the script's (see
  ``_same_statement`` for what "the same" allows).
- ``bash``: not run; the make targets, scripts and pip paths they name exist.
- ``plan``: the ``$ pycomm plan`` block's command is run; its output holds the
  README's lines, in order.
- ``layout``: every path of the directory tree exists.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import io
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
from _dist import run_ranks, subprocess_env

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
EXAMPLES = ROOT / "examples"
WORLD = 2
RANKS_TIMEOUT = 150.0  # seconds for the one multi-rank run: imports, ~10 group inits, a calibration


# --------------------------------------------------------------- parsing ----
@dataclass(frozen=True)
class Block:
    index: int  # position among the README's fenced blocks
    lang: str  # "python", "bash", or "" for a bare fence
    line: int  # README line number of the block's first line of code
    text: str
    heading: str  # the README heading the block is under
    before: str  # the text between the previous block (or heading) and this one

    @property
    def key(self) -> str:
        """A stable name: the example script the block stands for, else its
        heading and its position under that heading."""
        example = example_of(self)
        if example:
            return f"examples/{example}"
        same = [b for b in readme_blocks() if b.heading == self.heading]
        return f"{self.heading} #{same.index(self) + 1}"


_CACHE: Dict[str, List[Block]] = {}


def readme_blocks() -> List[Block]:
    """The README's fenced code blocks, in order."""
    text = README.read_text()
    if text not in _CACHE:
        blocks, lines = [], text.splitlines()
        heading, since, i = "", [], 0
        while i < len(lines):
            line = lines[i]
            if line.startswith("```"):
                lang, start, i = line[3:].strip(), i + 1, i + 1
                while not lines[i].startswith("```"):
                    i += 1
                blocks.append(Block(len(blocks), lang, start + 1, "\n".join(lines[start:i]) + "\n", heading,
                                    "\n".join(since)))
                since = []
            elif line.startswith("#"):
                heading, since = line.lstrip("#").strip(), []
            else:
                since.append(line)
            i += 1
        _CACHE.clear()
        _CACHE[text] = blocks
    return _CACHE[text]


def example_of(block: Block) -> Optional[str]:
    """The example script (examples/NAME.py) the text just before a Python
    block names, if any."""
    if block.lang != "python":
        return None
    names = re.findall(r"examples/(\w+\.py)", block.before)
    return names[-1] if names else None


def _free_names(tree: ast.AST, defined: set) -> set:
    """Names a block reads before (or without) defining them."""
    free = set()
    for stmt in tree.body:
        loads = {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        free |= loads - defined - set(dir(builtins))
        for n in ast.walk(stmt):
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                defined.add(n.id)
            elif isinstance(n, ast.alias):
                defined.add((n.asname or n.name).split(".")[0])
    return free


#: Training frameworks whose scripts need the framework's own launcher.
FRAMEWORKS = ("lightning", "accelerate", "transformers")


def _imports(tree: ast.AST) -> set:
    mods = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            mods |= {a.name.split(".")[0] for a in n.names}
        elif isinstance(n, ast.ImportFrom) and n.module:
            mods.add(n.module.split(".")[0])
    return mods


def _kinds() -> Dict[int, set]:
    """Which checks take each block (by index): the rules of the module
    docstring."""
    kinds: Dict[int, set] = {}
    defined: set = set()  # what the self-contained blocks so far define
    for b in readme_blocks():
        k = kinds.setdefault(b.index, set())
        if b.lang == "bash":
            k.add("bash")
        elif b.lang == "" and b.text.startswith("$ pycomm plan "):
            k.add("plan")
        elif b.lang == "" and all(re.match(r"([\w.-]+/)+[\w.-]*(\s|$)|\s+\S", ln) for ln in b.text.splitlines()):
            k.add("layout")
        elif b.lang == "python":
            tree = ast.parse(_runnable(b.text))
            example = example_of(b)
            if example:
                k.add("example")
            if not example and not _free_names(tree, set(defined)):
                _free_names(tree, defined)  # its names are there for the next blocks
                k.add("exec")
            elif not (example and _imports(ast.parse((EXAMPLES / example).read_text())) & set(FRAMEWORKS)):
                k.add("ranks")
    return kinds


def _blocks_of(kind: str) -> List[Block]:
    kinds = _kinds()
    return [b for b in readme_blocks() if kind in kinds[b.index]]


def _runnable(src: str) -> str:
    """A README block as Python: ``...`` as the last argument of a call (after
    keyword arguments) means "and the other arguments", which Python does not
    parse: it is dropped. ``...`` elsewhere is Python's Ellipsis."""
    return re.sub(r",\s*\.\.\.\)", ")", src)


def _comment(line: str) -> str:
    """The comment of a line of code ('' if none; no '#' inside strings here)."""
    code = re.sub(r"\"[^\"]*\"|'[^']*'", lambda m: "_" * len(m.group()), line)
    return line[code.index("#") + 1:].strip() if "#" in code else ""


def _code(line: str) -> str:
    return line[:len(line) - len(_comment(line))].rstrip().rstrip("#").rstrip() if _comment(line) else line.rstrip()


def test_every_block_is_covered():
    kinds = _kinds()
    blocks = readme_blocks()
    assert len(blocks) >= 10, "the README's code blocks were not found"
    uncovered = [f"README.md:{b.line} ({b.lang or 'bare'}): {b.text.splitlines()[0]}" for b in blocks
                 if not kinds[b.index]]
    assert not uncovered, "code blocks no test checks (add a rule):\n" + "\n".join(uncovered)
    # Each kind the README has now is still recognized: a rule that silently
    # stops matching would leave its blocks to no test.
    counts = {k: sum(k in s for s in kinds.values()) for k in ("exec", "ranks", "example", "bash", "plan", "layout")}
    assert all(counts.values()), counts


# ------------------------------------------------ self-contained blocks ----
#: Claims a comment makes about the value of its line: (pattern, how the
#: README's text becomes the expected value, when it applies).
CLAIMS = [
    (r"exact bytes on the wire: (\d+) here", int, lambda: True),
    (r"^(\d+) bytes for 2\^\d+ elements", int, lambda: True),
    (r"^(\[.*?\]) on a CPU-only machine", ast.literal_eval, lambda: not torch.cuda.is_available()),
]

#: Claims about a user's machine where the test suite's setup differs: the
#: line is evaluated in a fresh process, in that machine's environment.
#: "CPU-only": without TRITON_INTERPRET=1, which the root conftest.py sets
#: so that the Triton kernels run (interpreted) in the tests.
FRESH_PROCESS = {r"on a CPU-only machine": {"TRITON_INTERPRET": None}}


def _value_in_fresh_process(line: int, env_changes: Dict[str, Optional[str]]) -> Any:
    env = subprocess_env()
    for k, v in env_changes.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    code = f"import test_readme as t; print(repr(t._run_self_contained()[1][{line}]))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT / "tests", env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return ast.literal_eval(proc.stdout.strip().splitlines()[-1])


def _run_self_contained():
    """Run the self-contained blocks in one namespace; returns it and each
    expression statement's value by README line."""
    ns: Dict[str, Any] = {}
    values: Dict[int, Any] = {}
    for b in _blocks_of("exec"):
        tree = ast.parse(_runnable(b.text))
        ast.increment_lineno(tree, b.line - 1)
        for stmt in tree.body:
            if isinstance(stmt, ast.Expr):
                values[stmt.end_lineno] = eval(compile(ast.Expression(stmt.value), str(README), "eval"), ns)
            else:
                exec(compile(ast.Module([stmt], type_ignores=[]), str(README), "exec"), ns)
    return ns, values


def test_self_contained_blocks_and_their_numbers():
    ns, values = _run_self_contained()
    lines = README.read_text().splitlines()
    found = {pattern: 0 for pattern, _, _ in CLAIMS}
    for b in _blocks_of("exec"):
        for n in range(b.line, b.line + len(b.text.splitlines())):
            comment = _comment(lines[n - 1])
            for pattern, parse, applies in CLAIMS:
                m = re.search(pattern, comment)
                if m:
                    found[pattern] += 1
                    assert n in values, f"README.md:{n}: the claim is on a line that is not an expression"
                    if applies():
                        fresh = [env for p, env in FRESH_PROCESS.items() if re.search(p, comment)]
                        value = _value_in_fresh_process(n, fresh[0]) if fresh else values[n]
                        assert value == parse(m.group(1)), (
                            f"README.md:{n}: `{lines[n - 1].strip()}` evaluates to {value!r}")
    # A reworded comment must not drop its check unnoticed.
    assert all(c == 1 for c in found.values()), f"claims found (pattern: count): {found}"
    # "for 2^20 elements": the int4 line's claim is about that size.
    assert ns["grad"].numel() == 1 << 20
    # `payload.data: uint8, payload.scales: float32` style comments: dtypes.
    checked = 0
    for b in _blocks_of("exec"):
        for n in range(b.line, b.line + len(b.text.splitlines())):
            for expr, dtype in re.findall(r"([\w.]+): (u?int\d+|float\d+|bfloat16)\b", _comment(lines[n - 1])):
                assert eval(expr, ns).dtype == getattr(torch, dtype), f"README.md:{n}: {expr} is not {dtype}"
                checked += 1
    assert checked >= 2


def test_error_feedback_invariant_of_the_compressors_block():
    # The README's invariant on the block's own objects, at its first
    # compress: decompress(payload) + residual_new == grad + residual_old, to
    # float32 rounding for onebit.
    block = _blocks_of("exec")[0]
    ns: Dict[str, Any] = {}
    for text, _, _, stmt in _statements(_runnable(block.text), block.line):
        old = ns["residual"].clone() if "residual" in ns else None
        exec(compile(ast.Module([stmt], type_ignores=[]), str(README), "exec"), ns)
        if "payload" in ns:
            break
    assert old is not None, "the block's first compress came before its residual"
    decoded = ns["c"].decompress(ns["payload"])
    assert decoded.dtype == torch.float32 and decoded.shape == ns["grad"].shape  # "float32, grad's shape"
    assert not torch.equal(ns["residual"], old)  # "residual updated in place"
    torch.testing.assert_close(decoded + ns["residual"], ns["grad"] + old, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------- distributed blocks ----
def _model() -> torch.nn.Module:
    """82,560 parameters: one DDP bucket, above min_compress_numel=65536."""
    torch.manual_seed(0)  # the same start on every rank
    return torch.nn.Sequential(torch.nn.Linear(32, 512), torch.nn.ReLU(), torch.nn.Linear(512, 128))


T_NUMEL = 1 << 17  # above min_compress_numel: the README's pd.* calls compress it


def _t_input(rank: int) -> torch.Tensor:
    return torch.randn(T_NUMEL, generator=torch.Generator().manual_seed(10 + rank))


def _plugin_class() -> type:
    """The class of tests/plugin_int8.py (the file the README names), without
    the file's own registration: the README's register line does that."""
    path = ROOT / "tests" / "plugin_int8.py"
    tree = ast.parse(path.read_text())
    tree.body = [s for s in tree.body if not (isinstance(s, ast.Expr) and "register_compressor" in ast.unparse(s))]
    ns: Dict[str, Any] = {}
    exec(compile(tree, str(path), "exec"), ns)
    return ns["Int8AbsMax"]


class _Names(dict):
    """A block's local namespace: a name the block uses but does not define
    is made on first use (so after the group the block has created by then)."""

    def __init__(self, rank: int, tmp: str) -> None:
        super().__init__(rank=rank, step=0)
        self.makers = {
            "model": _model,
            # `ddp` is a DDP model of `model`, or of a fresh one where the
            # block has already made `model` a DDP model itself.
            "ddp": lambda: self._ddp(),
            "t": lambda: _t_input(rank),
            "shard": lambda: torch.empty(self["t"].numel() // WORLD),
            "full": lambda: torch.empty(WORLD * self["shard"].numel()),
            "loss": lambda: torch.tensor([rank + 1.0]),
            "path": lambda: os.path.join(tmp, f"state-rank{rank}.pt"),
            "Int8AbsMax": _plugin_class,
        }

    def _ddp(self):
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = self["model"]
        return DDP(_model() if isinstance(model, DDP) else model)

    def __missing__(self, name):
        if name not in self.makers:
            raise KeyError(name)  # then globals and builtins are looked up
        self[name] = self.makers[name]()
        return self[name]


def _globals() -> Dict[str, Any]:
    """The imports the README's fragments leave out."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import pycomm
    import pycomm.distributed as pd
    import pycomm.optim  # noqa: F401  (the README reaches it as pycomm.optim.OneBitAdam)
    from pycomm.ddp import CompressionState, compressed_hook
    from pycomm.optim import DiLoCo, OneBitAdam

    return dict(torch=torch, dist=dist, DDP=DDP, pycomm=pycomm, pd=pd, CompressionState=CompressionState,
                compressed_hook=compressed_hook, OneBitAdam=OneBitAdam, DiLoCo=DiLoCo)


def _train(ns, net, opt, steps, rank):
    """Training steps a fragment leaves out (``...``): each rank its own data."""
    for _ in range(steps):
        g = torch.Generator().manual_seed(100 * rank + ns["step"])
        x = torch.randn(16, 32, generator=g)
        loss = net(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ns["step"] += 1


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _residual_keys(saved) -> list:
    return sorted(saved["engine"]["residuals"])


# Probes: what each program's run records, by (block key, variant). `before`
# runs before each statement that starts with its prefix, `after` at the end.
def _backend_after(ns, rank, out):
    import pycomm.distributed as pd

    out["ef_keys"] = sorted(pd.error_feedback_state())
    out.update({name: ns[name].clone() for name in ("t", "shard", "full", "loss")})
    model = ns["model"]  # DDP over the pycomm group, no hook
    model(torch.randn(8, 32, generator=torch.Generator().manual_seed(rank))).pow(2).mean().backward()
    out["ddp_grad"] = torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _hook_after(ns, rank, out):
    # Past start_iter=10: the hook's last steps compress, keeping residuals.
    ddp, state = ns["ddp"], ns["state"]
    _train(ns, ddp, torch.optim.SGD(ddp.parameters(), lr=0.01), 12, rank)
    out.update(iteration=state.iteration, residual_keys=_residual_keys(state.state_dict()), params=_flat(ddp),
               state_file=os.path.exists(ns["path"]))


def _plugin_after(ns, rank, out):
    import pycomm.distributed as pd

    x = _t_input(rank)
    pd.all_reduce(x, key=3)
    out.update(options=pd.options_of(), result=x, ef_keys=sorted(pd.error_feedback_state()))


def _auto_before_second_init(ns, rank, out):
    import pycomm.distributed as pd

    out["first"] = pd.options_of()


def _auto_after(ns, rank, out):
    out["cal_json"] = json.loads(Path("cal.json").read_text()) if os.path.exists("cal.json") else None


def _adam_after(ns, rank, out):
    opt, ddp = ns["opt"], ns["ddp"]
    _train(ns, ddp, opt, 1, rank)
    out.update(variance_update_every=opt.variance_update_every, step_count=opt.step_count, params=_flat(ddp),
               overlap=opt._overlap)


def _torchrun_before_save(ns, rank, out):
    # The script's training loop, past start_iter=5, so the saved state holds residuals.
    _train(ns, ns["ddp"], torch.optim.SGD(ns["model"].parameters(), lr=0.01), 6, rank)


def _torchrun_after(ns, rank, out):
    saved = torch.load(f"ckpt/rank{rank}.pt", weights_only=False)  # the README saves `...` (Ellipsis) too
    ns["state"].load_state_dict(saved["hook"])  # this rank's own state loads back
    from pycomm.distributed import spec

    state = ns["state"]
    out.update(iteration=saved["hook"]["iteration"], residual_keys=_residual_keys(saved["hook"]),
               params=_flat(ns["model"]), keeps=spec.error_feedback_for(state.compressor, state.error_feedback))


def _torchrun_adam_before_save(ns, rank, out):
    _train(ns, ns["ddp"], ns["opt"], 6, rank)  # the warm-up (5), then a compressed step


def _torchrun_adam_after(ns, rank, out):
    saved = torch.load(f"ckpt/rank{rank}.pt", weights_only=False)["opt"]["pycomm"]
    out.update(step_count=saved["step_count"], residual_keys=_residual_keys(saved), params=_flat(ns["model"]))


def _diloco_before_save(ns, rank, out):
    _train(ns, ns["model"], ns["opt"], 3, rank)
    out["diverged"] = _flat(ns["model"])


def _diloco_after(ns, rank, out):
    out.update(params=_flat(ns["model"]), saved=os.path.exists(f"ckpt/rank{rank}.pt"))


PROBES = {
    ("Compressed all-reduce in training #1", "1."): ({}, _backend_after),
    ("Compressed all-reduce in training #1", "2."): ({}, _hook_after),
    ("Compressed all-reduce in training #1", "3."): ({}, _plugin_after),
    ("Compressed all-reduce in training #2", ""): (
        {'pd.init_process_group(compressor="auto"': _auto_before_second_init}, _auto_after),
    ("Compressed momentum: OneBitAdam and OneBitSGD #1", ""): ({}, _adam_after),
    ("Compressed momentum: OneBitAdam and OneBitSGD #1", "instead"): ({}, _adam_after),
    ("examples/torchrun_ddp.py", ""): ({"torch.save(": _torchrun_before_save}, _torchrun_after),
    ("examples/torchrun_onebit_adam.py", ""): ({"torch.save(": _torchrun_adam_before_save}, _torchrun_adam_after),
    ("examples/diloco_train.py", ""): ({"torch.save(": _diloco_before_save}, _diloco_after),
}


def _statements(src: str, line: int) -> List[Tuple[str, int, int, ast.stmt]]:
    """(source, first line, last line, node) of each top-level statement,
    lines numbered as in the README."""
    tree = ast.parse(src)
    out = []
    for stmt in tree.body:
        text = ast.get_source_segment(src, stmt)
        ast.increment_lineno(stmt, line - 1)
        out.append((text, stmt.lineno, stmt.end_lineno, stmt))
    return out


def _blank_except(lines: List[str], first: int, last: int) -> List[str]:
    """Lines first..last (1-based) kept, the others blank: README line numbers stay."""
    return [ln if first <= n + 1 <= last else "" for n, ln in enumerate(lines)]


def _programs(block: Block) -> List[Tuple[str, str]]:
    """The programs a block shows, as (variant, source). Sections headed by a
    numbered comment (``# 1. ...``, ``# 2. ...``) are alternative ways in, each
    a program of its own ("1.", "2."). A statement commented ``(instead)`` is
    an alternative to the statement before it: two programs, one without
    each ("" and "instead")."""
    lines = _runnable(block.text).splitlines()
    heads = [n + 1 for n, ln in enumerate(lines) if re.match(r"# \d+\. ", ln)]
    if heads:
        ends = heads[1:] + [len(lines) + 1]
        sections = [(re.match(r"# (\d+\.)", lines[h - 1]).group(1), _blank_except(lines, h, e - 1))
                    for h, e in zip(heads, ends)]
    else:
        sections = [("", lines)]
    programs = []
    for name, src in sections:
        stmts = _statements("\n".join(src) + "\n", 1)
        alt = [i for i, (_, _, last, _) in enumerate(stmts) if _comment(src[last - 1]).startswith("(instead)")]
        assert len(alt) <= 1 and alt != [0], "one (instead), after another statement, per program is handled"
        if not alt:
            programs.append((name, "\n".join(src) + "\n"))
            continue
        for variant, drop in (("", stmts[alt[0]]), ("instead", stmts[alt[0] - 1])):
            kept = [ln if not drop[1] <= n + 1 <= drop[2] else "" for n, ln in enumerate(src)]
            programs.append((name + variant, "\n".join(kept) + "\n"))
    return programs


def _calls_init(stmt: ast.AST) -> bool:
    return any(isinstance(n, ast.Call) and ast.unparse(n.func).endswith("init_process_group") for n in ast.walk(stmt))


def _rank_blocks(rank, world, runs, ports, tmp):
    """Every ``ranks`` block, on this rank: returns {(key, variant): record}."""
    import torch.distributed as dist

    ports = list(ports)
    clean = [True]

    def fresh_group():
        # A new default group meets on a port of its own (see _dist.reinit_on_a_new_port).
        if dist.is_initialized():
            if clean[0]:
                dist.barrier()
            dist.destroy_process_group()
        os.environ["MASTER_PORT"] = str(ports.pop(0))

    results = {}
    for key, variant, line, src in runs:
        before, after = PROBES.get((key, variant), ({}, None))
        workdir = os.path.join(tmp, re.sub(r"\W+", "_", key) + variant)
        os.makedirs(os.path.join(workdir, "ckpt"), exist_ok=True)  # the torchrun fragments save to ckpt/
        os.chdir(workdir)
        out: Dict[str, Any] = {}
        printed = io.StringIO()
        try:
            stmts = _statements(src, line)
            fresh_group()
            if not any(_calls_init(s) for *_, s in stmts):
                dist.init_process_group("gloo")  # a fragment that assumes a group: a plain one (torchrun's)
            ns, globs = _Names(rank, workdir), _globals()
            with contextlib.redirect_stdout(printed):
                for text, _, _, stmt in stmts:
                    for prefix, probe in before.items():
                        if text.startswith(prefix):
                            probe(ns, rank, out)
                    if _calls_init(stmt):
                        fresh_group()
                    exec(compile(ast.Module([stmt], type_ignores=[]), str(README), "exec"), globs, ns)
                if after:
                    after(ns, rank, out)
            out["printed"] = printed.getvalue()
            clean[0] = True
        except BaseException:  # noqa: BLE001 - reported per block in the parent
            out = {"error": traceback.format_exc()}
            clean[0] = False
        results[(key, variant)] = out
    return results


def _free_ports(n: int) -> List[int]:
    """n distinct free ports (all bound at once, so none is handed out twice)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    runs = [(b.key, variant, b.line, src) for b in _blocks_of("ranks") for variant, src in _programs(b)]
    tmp = str(tmp_path_factory.mktemp("readme_ranks"))
    results = run_ranks(_rank_blocks, WORLD, runs, _free_ports(4 * len(runs)), tmp, timeout=RANKS_TIMEOUT,
                        init_process_group=False)
    return {k: [results[r][k] for r in range(WORLD)] for k in results[0]}


def _record(ranks, key, variant=""):
    assert (key, variant) in ranks, f"no README block {key!r} ({variant or 'as written'}); blocks: {sorted(ranks)}"
    records = ranks[(key, variant)]
    for r, rec in enumerate(records):
        if "error" in rec:
            pytest.fail(f"README block {key!r} ({variant or 'as written'}) failed on rank {r}:\n{rec['error']}")
    return records


def test_every_distributed_block_runs(ranks):
    # Blocks without a probe of their own are run too: they must not raise.
    for key, variant in ranks:
        _record(ranks, key, variant)
    assert set(PROBES) <= set(ranks), f"probed programs no longer in the README: {set(PROBES) - set(ranks)}"


def test_backend_section(ranks):
    from pycomm.distributed.simulate import ErrorFeedback, simulate_all_gather, simulate_allreduce, \
        simulate_reduce_scatter

    rec = _record(ranks, "Compressed all-reduce in training #1", "1.")
    efs = lambda: [ErrorFeedback() for _ in range(WORLD)]  # noqa: E731
    # pd.all_reduce(t, key=0, op="avg"): compressed; the simulation's result, bit for bit, on every rank.
    want = simulate_allreduce([_t_input(r) for r in range(WORLD)], "onebit", op="avg", efs=efs(), impl="cpu")
    # pd.reduce_scatter(shard, t, key=1): this rank's shard of the sum (of the averaged t's).
    shards = simulate_reduce_scatter([rec[r]["t"] for r in range(WORLD)], "onebit", efs=efs(), impl="cpu")
    # pd.all_gather(full, shard, key=2): every rank's shard, decoded.
    full = simulate_all_gather([rec[r]["shard"] for r in range(WORLD)], "onebit", efs=efs(), impl="cpu")
    for r in range(WORLD):
        assert torch.equal(rec[r]["t"], want[r]), f"rank {r}: pd.all_reduce differs from the simulation"
        assert torch.equal(rec[r]["shard"], shards[r]), f"rank {r}: pd.reduce_scatter differs from the simulation"
        assert torch.equal(rec[r]["full"], full[r]), f"rank {r}: pd.all_gather differs from the simulation"
        assert rec[r]["ef_keys"] == [0, 1, 2]  # "error feedback kept under key 0" (and 1, 2)
        # dist.all_reduce(loss): exact, forwarded
        assert rec[r]["loss"].tolist() == [float(sum(range(1, WORLD + 1)))]
    assert not torch.equal(want[0], sum(_t_input(r) for r in range(WORLD)) / WORLD)  # it did compress
    # model = DDP(model): DDP's bucket went through onebit: the same gradient
    # on every rank, one magnitude per block (tens of values, not 82K).
    g = rec[0]["ddp_grad"]
    assert torch.equal(g, rec[1]["ddp_grad"])
    assert g.abs().unique().numel() < g.numel() // 100


def test_hook_section(ranks):
    rec = _record(ranks, "Compressed all-reduce in training #1", "2.")
    for r in range(WORLD):
        # exact until start_iter=10, then topk with error feedback: residuals per bucket
        assert rec[r]["iteration"] == 12 and rec[r]["residual_keys"] == [0], rec[r]
        assert rec[r]["state_file"]  # torch.save(state.state_dict(), path)
    assert torch.equal(rec[0]["params"], rec[1]["params"])


def test_own_compressor_section(ranks):
    from pycomm.distributed.simulate import ErrorFeedback, simulate_allreduce

    import plugin_int8  # noqa: F401  (the simulation runs the class registered under that name)

    rec = _record(ranks, "Compressed all-reduce in training #1", "3.")
    want = simulate_allreduce([_t_input(r) for r in range(WORLD)], "int8-absmax",
                              efs=[ErrorFeedback() for _ in range(WORLD)], levels=127)
    for r in range(WORLD):
        options = rec[r]["options"]
        assert options["method"] == "int8-absmax" and json.loads(options["plugin_options"]) == {"levels": 127}
        assert torch.equal(rec[r]["result"], want[r])  # run by the engine, as the simulation runs it
        assert rec[r]["ef_keys"] == [3]  # with error feedback


def test_hierarchy_and_auto_block(ranks):
    rec = _record(ranks, "Compressed all-reduce in training #2")
    for r in range(WORLD):
        first = rec[r]["first"]
        assert first["method"] == "onebit"
        # "auto" reads LOCAL_WORLD_SIZE (the harness: every rank on one node): flat, which is 1 rank per node.
        assert first["ranks_per_node"] == 1, first
    # calibration="cal.json": measured, and written (by rank 0) for the next run.
    cal = rec[0]["cal_json"]
    assert cal is not None and cal["world_size"] == WORLD and len(cal["sizes"]) == 2  # "at two sizes"
    # print(pd.calibration().format()): what was measured, and a method for each size.
    printed = rec[0]["printed"]
    for method in ("none", "fp16", "int8", "int4", "onebit", "topk"):
        assert re.search(rf"^{method}\s+\d", printed, re.M), f"{method} not measured:\n{printed}"


def test_onebitadam_block(ranks):
    # Two programs: opt.attach(ddp), and opt.attach(ddp, overlap=True) instead of it.
    for variant, overlap in (("", False), ("instead", True)):
        rec = _record(ranks, "Compressed momentum: OneBitAdam and OneBitSGD #1", variant)
        for r in range(WORLD):
            assert rec[r]["overlap"] is overlap
            assert rec[r]["variance_update_every"] == 0  # the "(or)" constructor, the later line, is in use
            assert rec[r]["step_count"] == 1
        assert torch.equal(rec[0]["params"], rec[1]["params"])  # the step averaged the ranks' gradients


def test_torchrun_blocks(ranks):
    rec = _record(ranks, "examples/torchrun_ddp.py")
    for r in range(WORLD):
        # every rank saved its own hook state, with residuals once compressing (start_iter=5) where
        # the method keeps them (the spec's rule: not int8 by default)
        assert rec[r]["iteration"] == 6 and bool(rec[r]["residual_keys"]) == rec[r]["keeps"], rec[r]
    assert torch.equal(rec[0]["params"], rec[1]["params"])
    rec = _record(ranks, "examples/torchrun_onebit_adam.py")
    for r in range(WORLD):
        assert rec[r]["step_count"] == 6 and rec[r]["residual_keys"], rec[r]
    assert torch.equal(rec[0]["params"], rec[1]["params"])
    rec = _record(ranks, "examples/diloco_train.py")
    assert not torch.equal(rec[0]["diverged"], rec[1]["diverged"])  # each rank trained its own copy
    assert torch.equal(rec[0]["params"], rec[1]["params"])  # opt.finish(): one model on every rank
    assert all(rec[r]["saved"] for r in range(WORLD))


# ------------------------------------------------------ example scripts ----
#: README statements that are not statements of their example script, and
#: why; one no longer in the README fails test_not_in_script_lines_are_in_the_readme.
#: The three scripts save through _common.train's checkpoint callback (a
#: lambda's dict, saved to <--checkpoint>/rank<r>.pt), which the README folds
#: into one torch.save per block; each line runs for real in the ranks tests.
NOT_IN_SCRIPT = {
    'torch.save({"model": ..., "opt": ..., "hook": state.state_dict()}, f"ckpt/rank{rank}.pt")':
        "torchrun_ddp.py: the checkpoint lambda, saved by _common.train",
    'torch.save({"model": ..., "opt": opt.state_dict(), "step": step}, f"ckpt/rank{rank}.pt")':
        "torchrun_onebit_adam.py: the checkpoint lambda, saved by _common.train",
    'torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, f"ckpt/rank{rank}.pt")':
        "diloco_train.py: the checkpoint lambda, saved by _common.train",
}

_ANY = object()  # an option without a default: whatever the user passes


class _Script:
    """An example script's statements, and what its names stand for: a name
    assigned once, a dict's entries, a command-line option's default."""

    def __init__(self, name: str) -> None:
        self.tree = ast.parse((EXAMPLES / name).read_text())
        common = ast.parse((EXAMPLES / "_common.py").read_text())  # the shared options
        assigned: Dict[str, list] = {}
        for n in ast.walk(self.tree):
            if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name):
                assigned.setdefault(n.targets[0].id, []).append(n.value)
        self.bound = {k: v[0] for k, v in assigned.items() if len(v) == 1}
        self.options: Dict[str, Any] = {}
        for tree in (self.tree, common):
            for n in ast.walk(tree):
                if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "add_argument":
                    kw = {k.arg: k.value for k in n.keywords}
                    flag = n.args[0].value
                    dest = kw["dest"].value if "dest" in kw else flag.lstrip("-").replace("-", "_")
                    action = kw["action"].value if "action" in kw else None
                    if "default" in kw:
                        self.options[dest] = kw["default"]
                    elif action in ("store_true", "store_false"):
                        self.options[dest] = ast.Constant(action == "store_false")
                    else:
                        self.options[dest] = _ANY

    def dict_of(self, node) -> Optional[Dict[str, ast.AST]]:
        node = self.bound.get(node.id, node) if isinstance(node, ast.Name) else node
        if isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) for k in node.keys):
            return {k.value: v for k, v in zip(node.keys, node.values)}
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "dict" and not node.args:
            return {k.arg: k.value for k in node.keywords if k.arg}
        return None

    def meanings(self, node) -> list:
        """What a node of the script may stand for: itself, and what its name,
        option, dict entry or conditional resolves to."""
        out = [node]
        if isinstance(node, ast.Name) and node.id in self.bound:
            out += self.meanings(self.bound[node.id])
        elif isinstance(node, ast.Attribute) and ast.unparse(node.value) == "args" and node.attr in self.options:
            out.append(self.options[node.attr])
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            entries = self.dict_of(node.value)
            if entries and node.slice.value in entries:
                out += self.meanings(entries[node.slice.value])
        elif isinstance(node, ast.IfExp):
            out += self.meanings(node.body) + self.meanings(node.orelse)
        return out

    def keywords(self, call: ast.Call) -> Dict[str, ast.AST]:
        kw: Dict[str, ast.AST] = {}
        for k in call.keywords:
            if k.arg is None:  # **NAME: its entries
                kw.update(self.dict_of(k.value) or {})
            else:
                kw[k.arg] = k.value
        return kw


def _same(readme, node, script: _Script) -> bool:
    """The README's node says what the script's does: the same code, where the
    README's ``...`` stands for anything, the README may leave out keyword
    arguments the script passes, and the script's names may stand for their
    values (``_Script.meanings``)."""
    if isinstance(readme, ast.Constant) and readme.value is Ellipsis:
        return True
    for meaning in script.meanings(node):
        if meaning is _ANY or _same_node(readme, meaning, script):
            return True
    return False


def _same_node(readme, node, script: _Script) -> bool:
    if type(readme) is not type(node):
        return False
    if isinstance(readme, ast.Call):
        if not _same(readme.func, node.func, script) or len(readme.args) != len(node.args):
            return False
        kw = script.keywords(node)
        return (all(_same(a, b, script) for a, b in zip(readme.args, node.args))
                and all(k.arg in kw and _same(k.value, kw[k.arg], script) for k in readme.keywords))
    for field in readme._fields:
        a, b = getattr(readme, field, None), getattr(node, field, None)
        if field == "ctx":
            continue
        if isinstance(a, list):
            if not isinstance(b, list) or len(a) != len(b):
                return False
            if not all(_same(x, y, script) if isinstance(x, ast.AST) else x == y for x, y in zip(a, b)):
                return False
        elif isinstance(a, ast.AST):
            if not isinstance(b, ast.AST) or not _same(a, b, script):
                return False
        elif a != b:
            return False
    return True


def _same_statement(stmt: ast.stmt, script: _Script) -> bool:
    if isinstance(stmt, ast.ImportFrom):  # the README may import fewer of the names
        return any(isinstance(n, ast.ImportFrom) and (n.module, n.level) == (stmt.module, stmt.level)
                   and {(a.name, a.asname) for a in stmt.names} <= {(a.name, a.asname) for a in n.names}
                   for n in ast.walk(script.tree))
    if isinstance(stmt, ast.Expr):  # a call whose result the README drops, the script may keep
        return any(isinstance(n, type(stmt.value)) and _same_node(stmt.value, n, script) for n in ast.walk(script.tree))
    return any(type(n) is type(stmt) and _same_node(stmt, n, script) for n in ast.walk(script.tree))


@pytest.mark.parametrize("block", _blocks_of("example"), ids=lambda b: b.key)
def test_example_block_is_its_script(block):
    script = _Script(example_of(block))
    missing = []
    readme = README.read_text().splitlines()
    for text, first, last, stmt in _statements(_runnable(block.text), block.line):
        normalized = " ".join(_code(ln).strip() for ln in text.splitlines())
        if normalized in NOT_IN_SCRIPT:
            continue
        if not _same_statement(stmt, script):
            missing.append(f"README.md:{first}: " + " ".join(_code(ln).strip() for ln in readme[first - 1:last]))
    assert not missing, f"README statements that examples/{example_of(block)} does not run:\n" + "\n".join(missing)


def test_not_in_script_lines_are_in_the_readme():
    statements = {" ".join(_code(ln).strip() for ln in text.splitlines())
                  for b in _blocks_of("example") for text, *_ in _statements(_runnable(b.text), b.line)}
    assert set(NOT_IN_SCRIPT) <= statements, f"no longer in the README: {set(NOT_IN_SCRIPT) - statements}"


# ------------------------------------------------------------ bash blocks ----
def _check_command(line: str) -> Optional[str]:
    """Why a README shell line names something missing (None: all there)."""
    words = shlex.split(_code(line))
    if words[0] == "make":
        targets = re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M)
        return None if words[1] in targets else f"no make target {words[1]!r}"
    if words[0] == "bash":
        return None if (ROOT / words[1]).is_file() else f"no script {words[1]}"
    if words[:2] == ["pip", "install"]:
        paths = [w for w in words[2:] if not w.startswith("-")]
        bad = [p for p in paths if not any((ROOT / p / f).is_file() for f in ("pyproject.toml", "setup.py"))]
        return f"not a Python project: {bad}" if bad or not paths else None
    return "no rule for this command"


def test_bash_blocks_name_what_exists():
    lines = [ln for b in _blocks_of("bash") for ln in b.text.splitlines() if _code(ln).strip()]
    assert len(lines) >= 4
    problems = [f"{ln}: {why}" for ln in lines if (why := _check_command(ln))]
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------ pycomm plan ----
@pytest.mark.parametrize("block", _blocks_of("plan"), ids=lambda b: b.key)
def test_plan_output(block):
    command, *shown = block.text.splitlines()
    args = shlex.split(command)[3:]  # after "$ pycomm plan"
    proc = subprocess.run([sys.executable, "-m", "pycomm", "plan", *args], cwd=ROOT, env=subprocess_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    printed = proc.stdout.splitlines()
    # The README shows an abridged output (docs/plan.md has all of it): every
    # line it shows is printed, in that order. Nothing in it depends on the
    # machine: the compressor times are the engine measurement shipped in
    # the package, the rest is arithmetic on the flags.
    at = 0
    for line in shown:
        if line not in printed[at:]:
            close = [p for p in printed if p.split()[:1] == line.split()[:1]]
            pytest.fail(f"README line not printed (in this order):\n  README: {line}\n  printed: {close}")
        at = printed.index(line, at) + 1


# ----------------------------------------------------------------- layout ----
_FILE = re.compile(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+\.(?:py|h|toml|md|json))\b")


@pytest.mark.parametrize("block", _blocks_of("layout"), ids=lambda b: b.key)
def test_layout_paths_exist(block):
    missing, entries = [], 0
    entry = ROOT
    for line in block.text.splitlines():
        if not line.startswith(" "):
            name, _, rest = line.partition(" ")
            entries += 1
            entry = ROOT / name
            if not (entry.is_dir() if name.endswith("/") else entry.is_file()):
                missing.append(name)
        else:
            rest = line
        # files the description names: from the repository root, or in the entry's folder
        for f in _FILE.findall(rest):
            if not ((ROOT / f).exists() or (entry / f).exists() or (entry.parent / f).exists()):
                missing.append(f"{f} (in the description of {entry.relative_to(ROOT)})")
    assert entries >= 10
    assert not missing, f"paths the layout names that do not exist: {missing}"
