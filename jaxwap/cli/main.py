"""The command line, `jaxwap` (or `python -m jaxwap`): calibrate, plan, explain.

    jaxwap calibrate [--quick] [--fresh] [--coordinator HOST:PORT ...]
    jaxwap plan MODULE:FUNCTION [--hardware h100-sxm --devices 512 --devices-per-node 8
                [--inter-node-bandwidth 50e9] ...] [--objective balanced] [--json plan.json]
    jaxwap explain plan.json
    jaxwap profiles [--add RECORD ...] [--docs PAGE [--check]]

`plan` is planning ahead of time for a cluster described on the command line, which need
not be present (the plan is then analytic): FUNCTION, a function of an importable module
or of a .py file given by its path, returns `(step, example_args)`, the training step and
a tuple of its arguments (jax.ShapeDtypeStruct or arrays; abstract ones allocate nothing).
The command prints the plan's `explain()` and, with `--json`, saves `plan.to_json()`, which
`auto_shard(..., plan=path)` runs on the cluster and `jaxwap explain` prints again.

This is the top layer: it imports the library and nothing in jaxwap imports it. Bad input
(an unknown device, a target that does not import or returns the wrong thing, a device
count that is not positive) is argparse's error, naming the argument, with exit status 2;
a planning failure (nothing fits, say) is its message and exit status 1.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from jaxwap.api import plan as plan_step
from jaxwap.cli.calibrate import add_command as add_calibrate
from jaxwap.cli.calibrate import run_command
from jaxwap.cli.profiles import add_command as add_profiles
from jaxwap.core.objective import KINDS, Objective
from jaxwap.hardware.builtin_profiles import builtin_device_names, device_spec
from jaxwap.hardware.cluster import Cluster
from jaxwap.hardware.device import DeviceSpec
from jaxwap.options import PlanOptions
from jaxwap.plans.plan import Plan

TARGET = "MODULE:FUNCTION"
_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


# --------------------------------------------------------------------------- arg types
def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _count(text: str) -> int:
    """An integer >= 0 (how many candidates to verify)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


def _number(text: str, *, strict: bool) -> float:
    """A finite float, > 0 when `strict` else >= 0; "50e9" as Python reads it."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (value > 0 if strict else value >= 0) or value == float("inf"):
        raise argparse.ArgumentTypeError(
            f"must be a finite number {'> 0' if strict else '>= 0'}, got {text!r}")
    return value


def _bandwidth(text: str) -> float:
    return _number(text, strict=True)


def _latency(text: str) -> float:
    return _number(text, strict=False)


def _bytes(text: str) -> float:
    """Bytes as a number ("70e9") or with a unit ("70GB", "64GiB", "512 MiB")."""
    s = text.strip().lower().removesuffix("b").strip()
    digits = s.rstrip("kmgti")
    unit = s[len(digits):]
    if unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"must be bytes such as 70e9, 70GB or 64GiB, "
                                         f"got {text!r}")
    try:
        return _number(digits, strict=True) * _UNITS[unit]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be bytes > 0 such as 70e9, 70GB or 64GiB, "
                                         f"got {text!r}") from None


def _device(text: str) -> DeviceSpec:
    try:
        return device_spec(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"unknown device {text!r}; the built-in profiles are "
            f"{', '.join(builtin_device_names())}") from None


def _objective(text: str) -> Objective:
    try:
        return Objective.parse(text)
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# --------------------------------------------------------------------------- the parser
def build_parser() -> argparse.ArgumentParser:
    """The whole command line: one subparser per command, each carrying `run`."""
    p = argparse.ArgumentParser(
        prog="jaxwap", description="jaxwap: a workload-aware auto-parallelizer for JAX "
        "training steps. Commands: calibrate (measure this machine), plan (plan a step "
        "for a described cluster), explain (print a saved plan), profiles (where the "
        "built-in profiles' figures come from).")
    sub = p.add_subparsers(dest="command", required=True,
                           metavar="{calibrate,plan,explain,profiles}")
    add_calibrate(sub)
    _add_plan(sub)
    _add_explain(sub)
    add_profiles(sub)
    return p


def _add_plan(sub: Any) -> None:
    c = sub.add_parser(
        "plan", help="plan a training step for a described cluster, offline",
        description="Plan FUNCTION's training step and print the plan's explain(). "
        "FUNCTION returns (step, example_args), example_args a tuple of the step's "
        "arguments (jax.ShapeDtypeStruct or arrays). With --hardware and --devices the "
        "plan is for that cluster, present or not (analytic, no verification unless "
        "--verify); without, for the devices present.")
    c.add_argument("target", metavar=TARGET,
                   help="module.path:function (importable from the current directory) or "
                   "path/to/file.py:function")
    hw = c.add_argument_group("the cluster (leave out to plan for the devices present)")
    hw.add_argument("--hardware", type=_device, metavar="DEVICE",
                    help=f"built-in device profile: {', '.join(builtin_device_names())}")
    hw.add_argument("--devices", type=_positive_int, metavar="N",
                    help="devices in the cluster (with --hardware)")
    hw.add_argument("--devices-per-node", type=_positive_int, metavar="N",
                    help="devices per node (default: one flat domain)")
    hw.add_argument("--link-bandwidth", type=_bandwidth, metavar="BYTES_PER_S",
                    help="per-device link bandwidth inside a node (default: the device's)")
    hw.add_argument("--link-latency", type=_latency, metavar="SECONDS",
                    help="link latency inside a node (default: the device's)")
    hw.add_argument("--inter-node-bandwidth", type=_bandwidth, metavar="BYTES_PER_S",
                    help="per-device bandwidth between nodes, e.g. 50e9 for 400 Gb/s "
                    "InfiniBand per GPU (default: the device's network figure)")
    hw.add_argument("--inter-node-latency", type=_latency, metavar="SECONDS",
                    help="latency between nodes (default: the device's)")
    o = c.add_argument_group("planning options (PlanOptions fields)")
    o.add_argument("--objective", type=_objective, default=Objective(), metavar="NAME",
                   help=f"{', '.join(KINDS[:3])} or max_slowdown=X (default balanced)")
    o.add_argument("--memory-budget", type=_bytes, metavar="BYTES",
                   help="per-device memory budget: 70e9, 70GB, 64GiB (default: the device's)")
    o.add_argument("--batch-size", type=_positive_int, metavar="N",
                   help="the global batch size, when the arguments' leading dim is not it")
    o.add_argument("--num-devices", type=_positive_int, metavar="N",
                   help="use exactly this many of the devices (default: choose)")
    o.add_argument("--verify", type=_count, metavar="N",
                   help="compile this many finalists (needs the devices present; default 0 "
                   "for a described cluster, else PlanOptions' default)")
    o.add_argument("--no-pipeline", action="store_true", help="never pipeline")
    o.add_argument("--no-cache", action="store_true",
                   help="neither read nor write the plan cache")
    out = c.add_argument_group("output")
    out.add_argument("--json", type=Path, metavar="PATH", help="save plan.to_json() here")
    out.add_argument("--max-params", type=_positive_int, default=40, metavar="N",
                     help="parameters listed by explain() (default 40)")
    c.set_defaults(run=lambda args: run_plan(args, c))


def _add_explain(sub: Any) -> None:
    c = sub.add_parser("explain", help="print a saved plan's explain()",
                       description="Print the explain() of a plan saved by `jaxwap plan "
                       "--json` or Plan.to_json().")
    c.add_argument("plan", type=Path, metavar="PLAN_JSON", help="the saved plan")
    c.add_argument("--max-params", type=_positive_int, default=40, metavar="N",
                   help="parameters listed (default 40)")
    c.set_defaults(run=lambda args: run_explain(args, c))


# --------------------------------------------------------------------------- plan
def load_target(spec: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """Import `spec` ("module.path:function" or "path/to/file.py:function"), call the
    function and check it returned `(step, example_args)`. Raises ValueError saying what
    is wrong; the caller reports it against the argument."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise ValueError(f"expected {TARGET} (module.path:function or file.py:function), "
                         f"got {spec!r}")
    module = _import(where)
    fn = getattr(module, name, None)
    if fn is None:
        raise ValueError(f"{where!r} has no attribute {name!r}")
    if not callable(fn):
        raise ValueError(f"{spec} is a {type(fn).__name__}, not a function")
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 - the user's code: say what it raised
        raise ValueError(f"{spec}() raised {type(e).__name__}: {e}") from e
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        got = (f"a {len(result)}-tuple" if isinstance(result, (tuple, list))
               else type(result).__name__)
        raise ValueError(f"{spec}() must return (step, example_args), got {got}")
    step, example_args = result
    if not callable(step):
        raise ValueError(f"{spec}() returned a step that is not callable "
                         f"({type(step).__name__})")
    if not isinstance(example_args, (tuple, list)):
        raise ValueError(f"{spec}() must return example_args as a tuple of the step's "
                         f"arguments, got {type(example_args).__name__}")
    return step, tuple(example_args)


def _import(where: str) -> Any:
    """The module `where` names: a .py file by its path (its directory put first on
    sys.path, as running it would) or a dotted name importable from the current
    directory (which the `jaxwap` console script, unlike `python -m`, does not put on
    sys.path by itself)."""
    if where.endswith(".py") or os.sep in where or (os.altsep and os.altsep in where):
        path = Path(where).resolve()
        if not path.is_file():
            raise ValueError(f"no such file: {where!r}")
        sys.path.insert(0, str(path.parent))
        name = f"_jaxwap_target_{path.stem}"
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ValueError(f"cannot load {where!r} as a Python module")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses and pickling look the module up
        try:
            spec.loader.exec_module(module)
        except Exception as e:  # noqa: BLE001 - the user's code: say what it raised
            del sys.modules[name]
            raise ValueError(f"importing {where!r} raised {type(e).__name__}: {e}") from e
        return module
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as e:
        if e.name is not None and where.startswith(e.name):
            raise ValueError(f"cannot import module {where!r} ({e}): run from the directory "
                             f"that holds it, or give the path of its .py file") from e
        raise ValueError(f"importing {where!r} raised {type(e).__name__}: {e}") from e
    except Exception as e:  # noqa: BLE001 - the user's code: say what it raised
        raise ValueError(f"importing {where!r} raised {type(e).__name__}: {e}") from e


def _cluster(args: argparse.Namespace, p: argparse.ArgumentParser) -> Cluster | None:
    """The described cluster, or None (plan for the devices present); misuse is `p`'s
    error naming the argument."""
    described = {"--devices": args.devices, "--devices-per-node": args.devices_per_node,
                 "--link-bandwidth": args.link_bandwidth,
                 "--link-latency": args.link_latency,
                 "--inter-node-bandwidth": args.inter_node_bandwidth,
                 "--inter-node-latency": args.inter_node_latency}
    if args.hardware is None:
        given = [k for k, v in described.items() if v is not None]
        if given:
            p.error(f"argument {given[0]}: describes a cluster, so it needs --hardware")
        return None
    if args.devices is None:
        p.error("argument --hardware: needs --devices N, the cluster's device count")
    if args.devices_per_node is not None and args.devices % args.devices_per_node:
        p.error(f"argument --devices-per-node: {args.devices_per_node} does not divide "
                f"--devices {args.devices}: nodes must be whole")
    if args.num_devices is not None and args.num_devices > args.devices:
        p.error(f"argument --num-devices: {args.num_devices} is more than the cluster's "
                f"--devices {args.devices}")
    try:
        return Cluster(args.hardware, args.devices, args.link_bandwidth, args.link_latency,
                       devices_per_node=args.devices_per_node,
                       inter_node_bandwidth=args.inter_node_bandwidth,
                       inter_node_latency=args.inter_node_latency)
    except ValueError as e:
        p.error(f"argument --hardware: {e}")


def run_plan(args: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    """`jaxwap plan`: load the target, plan, print explain(), save the JSON."""
    hardware = _cluster(args, p)
    options: dict[str, Any] = {
        "objective": args.objective, "hardware": hardware,
        "memory_budget": args.memory_budget, "batch_size": args.batch_size,
        "num_devices": args.num_devices}
    # a described cluster is planned analytically: verification compiles on the devices
    if args.verify is not None or hardware is not None:
        options["verify"] = 0 if args.verify is None else args.verify
    if args.no_pipeline:
        options["pipeline"] = False
    if args.no_cache:
        options["cache"] = False
    try:
        opts = PlanOptions(**options)
    except (ValueError, TypeError) as e:
        p.error(str(e))
    try:
        step, example_args = load_target(args.target)
    except ValueError as e:
        p.error(f"argument {TARGET}: {e}")
    if args.json is not None and not args.json.parent.is_dir():
        p.error(f"argument --json: no such directory {str(args.json.parent)!r}")
    try:
        plan = plan_step(step, *example_args, options=opts)
    except (ValueError, TypeError, MemoryError, RuntimeError) as e:
        print(f"jaxwap plan: planning {args.target} failed: {type(e).__name__}: {e}",
              file=sys.stderr)
        return 1
    print(plan.explain(max_params=args.max_params))
    if args.json is not None:
        args.json.write_text(plan.to_json())
        print(f"saved: {args.json}")
    return 0


# --------------------------------------------------------------------------- explain
def run_explain(args: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    """`jaxwap explain`: a saved plan's explain()."""
    try:
        plan = Plan.from_json(args.plan.read_text())
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        p.error(f"argument PLAN_JSON: cannot read {str(args.plan)!r} as a jaxwap plan: "
                f"{type(e).__name__}: {e}")
    print(plan.explain(max_params=args.max_params))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """The `jaxwap` console script and `python -m jaxwap`: parse `argv` (default: the
    process's) and run the command; returns the exit status."""
    return run_command(build_parser().parse_args(argv))


__all__ = ["build_parser", "load_target", "main", "run_explain", "run_plan"]
