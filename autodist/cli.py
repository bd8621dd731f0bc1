"""The ``autodist`` command line (also ``python -m autodist.cli``).

Each subcommand is one entry of ``SUBCOMMANDS``: a function that adds its
parser to the top-level subparsers and sets ``func`` (the handler, taking the
parsed arguments and returning an exit status) with ``set_defaults``. A handler
reports a user-facing failure by raising ``ValueError``, ``RuntimeError`` or
``OSError``; ``main`` prints the message and exits with status 1. An option value
out of range is a usage error instead (``autodist.usage``): the handler checks its
options inside ``options_checked()`` and sets ``usage_parser`` (its parser) with
``set_defaults``, and ``main`` exits with status 2, as for a value that does not parse.

    autodist emulate up --nodes 2 --bandwidth 1gbit --out spec.yml
    autodist emulate down
    autodist search train.py --spec spec.yml --trials 30 -- --steps 100

Arguments after a bare ``--`` are passed on (``args.passthrough``): to the
training script, for ``search`` and ``explain``.
"""

import argparse
import shlex
import sys
from typing import Callable, Sequence

import yaml

from autodist.cluster import emulate, probe
from autodist.search import commands as search_commands
from autodist.usage import UsageError, options_checked


def _split(values: Sequence[str] | None) -> list[str]:
    """Flattens repeated and comma-separated option values: ``["1gbit,2gbit", "3gbit"]`` -> three."""
    return [v.strip() for value in values or () for v in value.split(",") if v.strip()]


def _emulate_up(args: argparse.Namespace) -> int:
    bandwidth = _split(args.bandwidth) or ["1gbit"]
    cpus_text = _split(args.cpus) or ["1"]
    with options_checked():
        try:
            cpus = [int(c) for c in cpus_text]
        except ValueError:
            raise ValueError(f"--cpus is {','.join(cpus_text)!r}, but it must be a positive integer or a "
                             "comma list with one per node, e.g. '--cpus 2'.") from None
        memory = _split(args.memory) or None
        emulate.check_arguments(args.nodes, bandwidth, args.name, cpus, args.latency, memory)
    cluster = emulate.up(args.nodes, bandwidth, name=args.name, cpus_per_node=cpus, latency=args.latency,
                         memory=memory)
    try:
        with open(args.out, "w", encoding="utf-8") as f:
            yaml.safe_dump(emulate.spec_dict(cluster), f, sort_keys=False, default_flow_style=None)
    except OSError:
        emulate.down(args.name)
        raise
    print(f"Emulated cluster {cluster.name!r}: {len(cluster.hosts)} hosts on {emulate.SUBNET}.0/"
          f"{emulate.PREFIX_LEN}, bridge in namespace {cluster.bridge_namespace}"
          + (f", latency {cluster.latency} per host link" if cluster.latency else ""))
    for host in cluster.hosts:
        cap = "" if host.memory_bytes is None else f"  memory {host.memory_bytes / 2 ** 30:g} GiB"
        print(f"  {host.name:<5} {host.namespace:<12} {host.address:<14} {host.bandwidth_gbit:g} Gbit/s  "
              f"{host.num_cpus} cpu(s){cap}")
    chief = cluster.hosts[0]
    print(f"Resource spec written to {args.out}. Run the chief inside its namespace, e.g.\n"
          f"  {shlex.join(chief.launch_prefix)} python train.py\n"
          f"Remove the cluster with: autodist emulate down --name {cluster.name}")
    return 0


def _emulate_down(args: argparse.Namespace) -> int:
    with options_checked():
        emulate.check_name(args.name)
    removed = emulate.down(args.name)
    if removed:
        print(f"Removed emulated cluster {args.name!r}: namespaces {', '.join(removed)}.")
    else:
        print(f"No emulated cluster {args.name!r} was running; nothing to remove.")
    return 0


def _add_emulate(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "emulate", help="build or remove an emulated multi-host cluster on this machine (needs root)",
        description="Emulates a cluster with network namespaces joined by a bridge, each host's link "
                    "shaped with tc, and writes a resource spec that runs each node in its namespace.")
    actions = parser.add_subparsers(dest="action", required=True, metavar="{up,down}")

    up = actions.add_parser("up", help="create the cluster and write its resource spec")
    up.add_argument("--nodes", type=int, required=True, help="number of hosts")
    up.add_argument("--bandwidth", action="append", metavar="RATE",
                    help="link rate in tc syntax (e.g. 1gbit, 500mbit); one for all hosts, or one per "
                         "host, repeated or comma-separated (default: 1gbit)")
    up.add_argument("--cpus", action="append", metavar="K",
                    help="CPU replicas per host; one for all, or one per host (default: 1)")
    up.add_argument("--latency", help="one-way delay per host link, e.g. 1ms (needs the kernel's sch_netem)")
    up.add_argument("--memory", action="append", metavar="SIZE",
                    help="memory cap of each host's processes together, e.g. 3g (a memory cgroup; "
                         "the kernel kills a process that would exceed it); one for all hosts, or one "
                         "per host (default: none)")
    up.add_argument("--name", default="ad", help="cluster name, the prefix of its namespaces (default: ad)")
    up.add_argument("--out", required=True, help="path of the resource spec YAML to write")
    up.set_defaults(func=_emulate_up, usage_parser=up)

    down = actions.add_parser("down", help="remove the cluster")
    down.add_argument("--name", default="ad", help="cluster name given to 'up' (default: ad)")
    down.set_defaults(func=_emulate_down, usage_parser=down)


SUBCOMMANDS: dict[str, Callable[[argparse._SubParsersAction], None]] = {
    "emulate": _add_emulate,
    "probe": probe.add_subcommand,
    "search": search_commands.add_search_subcommand,
    "explain": search_commands.add_explain_subcommand,
}
"""Subcommand name -> function that registers its parser (see the module docstring)."""


def build_parser() -> argparse.ArgumentParser:
    """Returns the ``autodist`` parser with every subcommand of ``SUBCOMMANDS``.

    Returns:
        argparse.ArgumentParser: The parser.
    """
    parser = argparse.ArgumentParser(prog="autodist", description="AutoDist command-line tools.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(SUBCOMMANDS) + "}")
    for add in SUBCOMMANDS.values():
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line.

    Args:
        argv: Arguments without the program name; ``sys.argv[1:]`` if None.

    Returns:
        int: The exit status (0 on success, 1 on a reported error; usage
        errors, option values out of range included, exit with status 2 through argparse).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough = []
    if "--" in argv:
        argv, passthrough = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    args = build_parser().parse_args(argv)
    args.passthrough = passthrough
    try:
        return args.func(args)
    except UsageError as e:
        args.usage_parser.error(str(e))
    except (ValueError, RuntimeError, OSError) as e:
        print(f"autodist {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
