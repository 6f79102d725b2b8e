"""``pycomm-bench``: command-line front of the pycomm benchmarks.

Each subcommand is a module of :mod:`pycomm_bench` named in
:data:`SUBCOMMANDS`; it provides

- ``HELP``: one line for ``pycomm-bench --help``;
- ``add_arguments(parser)``: its own options (the common ones, below, are
  already there);
- ``resolve_args(args) -> args`` (optional): fills in defaults and checks
  what needs more than one option or the machine, raising ValueError with a
  message naming the option (reported like an argparse error: exit 2);
- ``run(args) -> int``: run, print, write JSON; returns the exit status.

Adding a benchmark is adding a module and a line in :data:`SUBCOMMANDS`
(:mod:`pycomm_bench.launch` says how). Tools with a command line of their
own (:data:`TOOLS`: the GPU check, ``tools/gpu_check.py`` of the source
tree, a file rather than a package) get their arguments as they are.

Example::

    $ pycomm-bench kernels --quick
    $ python -m pycomm_bench kernels --numel 4M --impls cpu --threads 2 --json out.json
    $ python -m pycomm_bench gpu-check --dry-run
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import re
import sys
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch

#: subcommand -> module implementing it (imported when the parser is built).
SUBCOMMANDS = {
    "kernels": "pycomm_bench.kernels",
    "allreduce": "pycomm_bench.allreduce",
    "ddp": "pycomm_bench.ddp",
    "quality": "pycomm_bench.quality",
    "fsdp": "pycomm_bench.fsdp",
    "hierarchy": "pycomm_bench.hierarchy",
    "all": "pycomm_bench.all",
    "index": "pycomm_bench.records",
}
#: tool -> its file in the source tree (relative to :data:`SOURCE_ROOT`), whose
#: ``main(argv, prog)`` takes the rest of the command line.
TOOLS = {
    "gpu-check": os.path.join("tools", "gpu_check.py"),
}
#: The source tree this package is part of (bench/pycomm_bench/ -> the root),
#: where the repository tools of :data:`TOOLS` are.
SOURCE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_SUFFIX = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def positive_int(text: str) -> int:
    """argparse type: a positive integer, optionally with a binary suffix
    (``4096``, ``64k``, ``16M`` = 1<<24, ``1G``)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)\s*", text)
    if m is None:
        raise argparse.ArgumentTypeError(f"expected a positive integer (e.g. 65536, 64k, 16M), got {text!r}")
    value = int(m.group(1)) * _SUFFIX[m.group(2).lower()]
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def nonnegative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return value


def split_list(values: Union[None, str, Sequence[object]]) -> Optional[List[str]]:
    """Items of options that take lists comma or space separated; None stays None.

    >>> split_list(["2,4", " 8"]), split_list(None)
    (['2', '4', '8'], None)
    """
    if values is None:
        return None
    if isinstance(values, str):
        values = [values]
    return [p.strip() for item in values for p in str(item).split(",") if p.strip()]


def list_option(values: Union[None, str, Sequence[object]], name: str, default: Sequence[object],
                parse: Callable[[str], object]) -> List[object]:
    """The items of a list option, each through ``parse`` (ValueError or
    ArgumentTypeError: reported naming ``--name``), repeats dropped;
    ``default`` when the option was not given.

    >>> list_option(["64k,1M", "64k"], "sizes", [], positive_int)
    [65536, 1048576]
    """
    items = split_list(values)
    if items is None:
        return list(default)
    if not items:
        raise ValueError(f"argument --{name}: empty list")
    parsed = []
    for text in items:
        try:
            parsed.append(parse(text))
        except (ValueError, argparse.ArgumentTypeError) as exc:
            raise ValueError(f"argument --{name}: {exc}") from None
    return list(dict.fromkeys(parsed))


def fill_defaults(args: argparse.Namespace, quick: bool, **defaults: Tuple[int, int]) -> None:
    """Set each option still None to its default, ``(full, with --quick)``,
    then check it is an integer >= 1 (>= 0 for ``warmup``); ValueError names it.

    >>> a = argparse.Namespace(repeats=None, warmup=2)
    >>> fill_defaults(a, True, repeats=(15, 3), warmup=(3, 1)); (a.repeats, a.warmup)
    (3, 2)
    """
    for name, (full, small) in defaults.items():
        if getattr(args, name, None) is None:
            setattr(args, name, small if quick else full)
        value, low = getattr(args, name), 0 if name == "warmup" else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"argument --{name.replace('_', '-')}: must be an integer >= {low}, got {value!r}")


def device_arg(text: str) -> torch.device:
    """argparse type: ``cpu`` or ``cuda[:N]``, and it must exist here."""
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"not a device: {text!r} (use cpu or cuda[:N])") from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"benchmarks run on cpu or cuda, got {text!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError("CUDA is not available on this machine")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(
                f"{text!r}: only {torch.cuda.device_count()} CUDA device(s) here"
            )
    return device


def common_options() -> argparse.ArgumentParser:
    """Options every subcommand takes (a parent parser)."""
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("common options")
    g.add_argument("--device", type=device_arg, default=torch.device("cpu"),
                   help="device to benchmark on: cpu or cuda[:N] (default: cpu)")
    g.add_argument("--repeats", type=positive_int, default=None,
                   help="timed runs per contender; the median and p10/p90 are reported "
                        "(default: 15, or fewer with --quick)")
    g.add_argument("--warmup", type=nonnegative_int, default=None,
                   help="untimed runs per contender first (default: 3, or 1 with --quick)")
    g.add_argument("--json", metavar="PATH", default=None,
                   help="where to write the results "
                        "(default: benchmarks/results/<bench>/<device>[-<settings>].json, "
                        "with -quick before .json for --quick, relative to the current directory)")
    g.add_argument("--quick", action="store_true",
                   help="small sizes and few repeats: a smoke test, not a measurement")
    g.add_argument("--threads", type=positive_int, default=None,
                   help="torch.set_num_threads(N) before running (default: torch's default)")
    g.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar on stderr")
    return p


def load_tool(name: str):
    """The module of the tool ``name`` (a key of :data:`TOOLS`), loaded from
    its file in the source tree; None where that file is not there (this
    package installed without the source tree it belongs to).

    >>> load_tool("gpu-check").HELP.startswith("the GPU check")
    True
    """
    path = os.path.join(SOURCE_ROOT, TOOLS[name])
    module_name = "_pycomm_tool_" + name.replace("-", "_")
    if module_name in sys.modules:
        return sys.modules[module_name]
    if not os.path.isfile(path):
        return None
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def build_parser() -> argparse.ArgumentParser:
    """The ``pycomm-bench`` parser, one subparser per entry of :data:`SUBCOMMANDS`."""
    parser = argparse.ArgumentParser(
        prog="pycomm-bench",
        description="Benchmarks of pycomm (gradient compression for PyTorch). "
                    "Results are medians of repeated runs; ratios are measured side by side.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    common = common_options()
    for name, module_name in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        doc = (module.__doc__ or "").strip().split("\n\n")[0]
        p = sub.add_parser(name, parents=[common], help=module.HELP, description=doc)
        module.add_arguments(p)
        p.set_defaults(_module=module, _parser=p)
    for name, path in TOOLS.items():  # listed in --help; main() hands them their arguments
        tool = load_tool(name)
        sub.add_parser(name, add_help=False,
                       help=tool.HELP if tool is not None else f"(needs the source tree: {path} is not there)")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of ``pycomm-bench`` (and ``python -m pycomm_bench``).

    Example::

        >>> from pycomm_bench.cli import main
        >>> main(["kernels", "--quick", "--json", "/tmp/k.json"])  # doctest: +SKIP
        0
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in TOOLS:
        tool = load_tool(argv[0])
        if tool is None:
            print(f"pycomm-bench {argv[0]}: {os.path.join(SOURCE_ROOT, TOOLS[argv[0]])} is not there: this "
                  f"repository tool runs from pycomm's source tree (python {TOOLS[argv[0]]})", file=sys.stderr)
            return 2
        return int(tool.main(argv[1:], prog=f"pycomm-bench {argv[0]}"))
    parser = build_parser()
    args = parser.parse_args(argv)
    module, sub_parser = args._module, args._parser
    if hasattr(module, "resolve_args"):
        try:
            vars(args).update(vars(module.resolve_args(args)))
        except ValueError as exc:
            sub_parser.error(str(exc))
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        return int(module.run(args))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
