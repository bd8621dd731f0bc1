"""AutoDist against its peers, Horovod and MultiWorkerMirroredStrategy, on one emulated cluster.

The model is ``keras_step_time``'s: an MLP 1024 -> 3 x 2048 (ReLU) -> 10, 42 MB
of float32 weights, SGD (learning rate 0.01), sparse cross-entropy from logits,
8 rows per replica per step, trained with Keras ``fit`` on synthetic data, each
node on its own rows. The cluster: 4 emulated nodes (``autodist emulate``:
network namespaces on a bridge, every link shaped both ways with tc's tbf), one
CPU replica and one process per node.

Settings: links at ``1gbit``, at ``5gbit``, and ``unshaped``. ``emulate`` always
shapes (its rates must be positive), so the unshaped cluster is built at
``PLACEHOLDER_RATE`` and this script then deletes the tbf qdisc of every link
(both ends), leaving the veth pairs as the kernel makes them; its spec then
gets the probed rates as ``network_bandwidth``, as ``autodist probe`` writes
them for a user (the builders' default all-reduce follows them).

Systems, each run as its own fresh job on the same cluster:

* AutoDist's builders (``--builders``, default ``AllReduce PartitionedPS``) on
  Keras 3 ``fit``: ``keras_step_time``'s AutoDist job (the chief in the first
  namespace launches the other nodes);
* ``MultiWorkerMirroredStrategy`` (TensorFlow 2.21, Keras 3): ``keras_step_time``'s
  worker job, one per namespace with its ``TF_CONFIG``;
* ``Horovod`` 0.28.1 with Gloo, on TensorFlow 2.15 and its Keras 2, from a venv
  of its own (``horovod_peer.py`` says how it is built and launched).

Every process runs with 1 intra-op and 2 inter-op threads (``report.JOB_ENV``,
set through ``tf.config.threading``). Method: a fresh cluster per setting; in
it, round r runs every system once, round r + 1 again, each round starting one
system later (``run_rounds(rotate=True)``). A job times each batch after the
warm-up ones (``keras_step_time``'s timer) and reports the median; a system's
figure is the median over rounds of those medians. Each process of a job also
measures its own CPU seconds (all threads) over the timed batches; the table
gives the mean over the job's processes, per step (median over rounds).

Columns: *x ring bound* = step time / (2(n-1)/n x gradient bytes / link
rate), the least a bandwidth-optimal all-reduce needs (none when unshaped);
*vs Horovod*, *vs MWMS* = the peer's step time / the builder's, i.e. the
builder's step rate over the peer's (above 1: AutoDist is faster).

Goals (from the issue), at 1gbit and at 5gbit: ``AllReduce`` at least 1.0x
Horovod; the best AutoDist builder at least 1.15x Horovod; ``AllReduce`` at
least 1.3x MultiWorkerMirroredStrategy.

Usage (root, iproute2, cmake, g++; the first run builds Horovod's venv, about 5 minutes):
    python benchmarks/peers.py                                # set-up, all, writes docs
    python benchmarks/peers.py --setup-only                   # only build the Horovod venv
    python benchmarks/peers.py --settings 1gbit --rounds 1 --timed 5 --no-write
    python benchmarks/peers.py --settings 1gbit --systems Horovod --horovod-venv /tmp/hvd/venv

The tables are printed and, unless ``--no-write``, written into ``--out``
between ``<!-- peers:begin -->`` and ``<!-- peers:end -->``. Every job's
process groups are stopped on a timeout or Ctrl-C, and the emulated cluster is
always removed; a system that fails gives an error row.
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import report
import keras_step_time as kst
import horovod_peer
import step_time

report.use_job_environment()
REPO = report.REPO

BEGIN = "<!-- peers:begin -->"
END = "<!-- peers:end -->"
TITLE = "AutoDist vs. Horovod and MultiWorkerMirroredStrategy (`peers`)"
NOTES = "notes/peers.md"  # relative to the docs page
UNSHAPED = "unshaped"
SETTINGS = ("1gbit", "5gbit", UNSHAPED)
PLACEHOLDER_RATE = "10gbit"
"""The rate an unshaped cluster is built at, before its shaping is removed."""
HOROVOD = horovod_peer.SYSTEM
MWMS = kst.PEERS["cluster"]
PEER_SYSTEMS = (HOROVOD, MWMS)
SHORT = {HOROVOD: "Horovod", MWMS: "MWMS"}
DEFAULT_BUILDERS = ("AllReduce", "PartitionedPS")
CLUSTER_NAME = "adpeer"
NUM_NODES = kst.NUM_NODES
GRADIENT_BYTES = 4 * sum(a * b + b for a, b in zip(kst.LAYERS[:-1], kst.LAYERS[1:]))
MWMS_PORT = 15810
GOAL_SETTINGS = ("1gbit", "5gbit")
BEST = "best builder"
GOALS = (("AllReduce", HOROVOD, 1.0), (BEST, HOROVOD, 1.15), ("AllReduce", MWMS, 1.3))
"""(builder or BEST, peer, least ratio of the builder's step rate to the peer's)."""


# --------------------------------------------------------------------------- measuring

def remove_shaping(cluster) -> None:
    """Deletes the tbf qdisc at both ends of every link (``emulate`` names the bridge's
    end of host i's link ``p<i>``); raises if one is left."""
    from autodist.cluster import emulate
    tc = shutil.which("tc") or "/usr/sbin/tc"
    for i, host in enumerate(cluster.hosts, start=1):
        for ns, dev in ((host.namespace, emulate.HOST_IFACE), (cluster.bridge_namespace, f"p{i}")):
            subprocess.run([tc, "-n", ns, "qdisc", "del", "dev", dev, "root"], check=True,
                           capture_output=True, timeout=30)
            shown = subprocess.run([tc, "-n", ns, "qdisc", "show", "dev", dev], check=True,
                                   capture_output=True, text=True, timeout=30).stdout
            if "tbf" in shown:
                raise RuntimeError(f"peers: {ns}/{dev} is still shaped after deleting its qdisc: "
                                   f"{shown.strip()}")


def name_hosts(cluster) -> None:
    """Makes the machine's host name resolve, in each namespace, to that host's own address.

    On a real cluster a host's name resolves to its address; here ``/etc/hosts``
    inside a namespace is ``emulate``'s, which lists only ``h1`` .. ``hN``.
    Horovod 0.28.1 needs it: the Gloo contexts of its process sets (the global
    set included) open their device by host name, not by ``HOROVOD_GLOO_IFACE``,
    and abort with "Unable to find address for: <hostname>" when it does not
    resolve. Every system runs on the cluster after this, not only Horovod.
    """
    from autodist.cluster import emulate
    name = socket.gethostname()
    for host in cluster.hosts:
        with open(os.path.join(emulate.NETNS_ETC, host.namespace, "hosts"), "a",
                  encoding="utf-8") as f:
            f.write(f"{host.address}\t{name}\n")


def measure(setting: str, systems: list, args) -> tuple[dict, list]:
    """Runs ``args.rounds`` interleaved rounds of ``systems`` on a fresh cluster at ``setting``.

    Returns:
        (system -> list of job rows, the probed links or [])
    """
    import yaml

    from autodist.cluster import emulate
    emulate.down(CLUSTER_NAME)  # one left behind by an interrupted run of this script
    rate = PLACEHOLDER_RATE if setting == UNSHAPED else setting
    ports = iter(range(MWMS_PORT, MWMS_PORT + 1000))
    with tempfile.TemporaryDirectory() as tmp, emulate.emulated_cluster(
            NUM_NODES, rate, name=CLUSTER_NAME, cpus_per_node=[1] * NUM_NODES) as cluster:
        name_hosts(cluster)
        spec_dict = emulate.spec_dict(cluster)
        if setting == UNSHAPED:
            remove_shaping(cluster)
            for node in spec_dict["nodes"]:
                node.pop("network_bandwidth", None)
        spec = os.path.join(tmp, "spec.yml")
        with open(spec, "w", encoding="utf-8") as f:
            yaml.safe_dump(spec_dict, f)
        links = [] if args.no_probe else step_time.measure_links(spec)
        if setting == UNSHAPED and links:
            # As `autodist probe` writes them for a user: the builders' default
            # all-reduce follows the links' rate.
            from autodist.cluster import probe
            from autodist.resource_spec import ResourceSpec
            measured = probe.measured_spec(ResourceSpec(spec), links)
            with open(spec, "w", encoding="utf-8") as f:
                yaml.safe_dump(measured, f)
        for m in links:
            print(f"[{setting}] link chief<->{m.address}: {m.to_node_gbit:.2f} / "
                  f"{m.from_node_gbit:.2f} Gbit/s", flush=True)

        def run(system: str) -> dict:
            if system == HOROVOD:
                if args.horovod_error:
                    return {"system": system, "error": args.horovod_error}
                return horovod_peer.run(cluster, args.horovod_venv, args)
            return kst.run_cluster(system, spec, cluster, args, next(ports))

        return kst.run_rounds(setting, systems, run, args.rounds, rotate=True), links


# --------------------------------------------------------------------------- summarizing

def gbit(setting: str):
    """The setting's link rate in Gbit/s, or None when unshaped."""
    from autodist.cluster import emulate
    return None if setting == UNSHAPED else emulate.parse_rate(setting)


def summarize(setting: str, results: dict) -> list:
    """One row per system: medians over rounds, CPU, the bound's ratio and the peers' ratios."""
    rate = gbit(setting)
    bound = step_time.ring_bound(NUM_NODES, GRADIENT_BYTES, rate) if rate else None
    rows = []
    for system, runs in results.items():
        done = [r for r in runs if "median_s" in r]
        row = {"system": system, "peer": system in PEER_SYSTEMS,
               "rounds": [r["median_s"] for r in done],
               "errors": [r["error"] for r in runs if "error" in r],
               "job_s": statistics.median(r["job_s"] for r in runs) if runs else None}
        if done:
            row["median_s"] = statistics.median(row["rounds"])
            cpu = [statistics.mean(r["cpu_s_per_step"]) for r in done if r.get("cpu_s_per_step")]
            row["cpu_s"] = statistics.median(cpu) if cpu else None
            row["processes"] = max(len(r.get("cpu_s_per_step") or []) for r in done)
            row["bound_ratio"] = row["median_s"] / bound if bound else None
        rows.append(row)
    peers = {r["system"]: r for r in rows if r["peer"] and "median_s" in r}
    for row in rows:
        if not row["peer"] and "median_s" in row:
            row["vs"] = {p: peer["median_s"] / row["median_s"] for p, peer in peers.items()}
    return rows


def goal_verdicts(tables: dict) -> list:
    """(goal text, {setting: (met or None, cell text)}) for every goal at ``GOAL_SETTINGS``."""
    out = []
    for builder, peer, least in GOALS:
        who = "best AutoDist builder" if builder == BEST else f"`{builder}`"
        cells = {}
        for setting in GOAL_SETTINGS:
            rows = [r for r in tables.get(setting, ()) if peer in r.get("vs", {})]
            if builder != BEST:
                rows = [r for r in rows if r["system"] == builder]
            if setting not in tables or not rows:
                cells[setting] = (None, "not measured")
                continue
            row = max(rows, key=lambda r: r["vs"][peer])
            ratio = row["vs"][peer]
            name = f" (`{row['system']}`)" if builder == BEST else ""
            cells[setting] = (ratio >= least, f"{ratio:.2f}x{name}: " +
                              ("met" if ratio >= least else f"MISSED by {least - ratio:.2f}x"))
        out.append((f"{who} >= {_ratio(least)} {SHORT[peer]}", cells))
    return out


# --------------------------------------------------------------------------- reporting

def _ratio(value: float) -> str:
    """``1.0x``, ``1.15x``, ``1.3x``: a goal's ratio with the digits it has, at least one."""
    return f"{value:.2f}".rstrip("0").rstrip(".") + ("x" if value % 1 else ".0x")

_COLUMNS = ("system", "median step s", "steps/s", "x ring bound", "CPU s/step/process",
            "vs Horovod", "vs MWMS")


def _cells(row: dict) -> list:
    if "median_s" not in row:
        error = (f"failed: {row['errors'][0]}" if row["errors"] else "not run").replace("|", "/")
        return [row["system"], error] + [""] * (len(_COLUMNS) - 2)
    vs = row.get("vs", {})
    cells = [row["system"], f"{row['median_s']:.3f}", f"{1 / row['median_s']:.2f}",
             f"{row['bound_ratio']:.2f}" if row.get("bound_ratio") else "-",
             f"{row['cpu_s']:.3f}" if row.get("cpu_s") is not None else "-"]
    cells += ["" if row["peer"] else (f"{vs[p]:.2f}x" if p in vs else "-") for p in PEER_SYSTEMS]
    if row["errors"]:
        cells[1] += f" ({len(row['errors'])} failed)"
    return cells


def format_text(rows: list) -> str:
    header = list(_COLUMNS) + ["job s", "per-round medians ms"]
    body = [_cells(r) + [f"{r['job_s']:.0f}" if r.get("job_s") else "",
                         " ".join(f"{t * 1e3:.0f}" for t in r["rounds"])] for r in rows]
    # An error row is its name and its message, left out of the columns' widths.
    widths = [max(len(line[i]) for line in [header] + body) for i in range(len(header))]
    widths[1:] = [max(len(line[i]) for line, r in zip([header] + body, [{"median_s": 0}] + rows)
                      if "median_s" in r) for i in range(1, len(header))]
    return "\n".join(
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                  for i, (c, w) in enumerate(zip(line, widths)))
        if "median_s" in r else f"{line[0].ljust(widths[0])}  {line[1]}"
        for line, r in zip([header] + body, [{"median_s": 0}] + rows))


def format_table(rows: list) -> list:
    lines = ["| " + " | ".join(_COLUMNS) + " |", "|---|" + "--:|" * (len(_COLUMNS) - 1)]
    for row in rows:
        cells = _cells(row)
        cells[0] = f"`{cells[0]}`" + (" (peer)" if row["peer"] else "")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _setting_title(setting: str) -> str:
    if setting == UNSHAPED:
        return f"{NUM_NODES} nodes, unshaped links"
    bound = step_time.ring_bound(NUM_NODES, GRADIENT_BYTES, gbit(setting))
    return f"{NUM_NODES} nodes, {setting} links (ring bound {bound:.3f} s)"


def _links_text(links: dict) -> str:
    parts = []
    for setting, measured in links.items():
        rates = [g for m in measured for g in (m.to_node_gbit, m.from_node_gbit)]
        if rates:
            parts.append(f"{setting} {min(rates):.2f} to {max(rates):.2f}")
    return ("TCP between the chief and each node (`autodist probe`, Gbit/s): " +
            "; ".join(parts) + ".") if parts else ""


def _findings(tables: dict) -> list:
    out = []
    for setting, rows in tables.items():
        done = [r for r in rows if "median_s" in r]
        if not done:
            continue
        fastest = min(done, key=lambda r: r["median_s"])
        cpu = [r for r in done if r.get("cpu_s") is not None]
        leanest = min(cpu, key=lambda r: r["cpu_s"]) if cpu else None
        out.append(f"{setting}: fastest `{fastest['system']}` ({fastest['median_s']:.3f} s per "
                   "step)" + (f"; least CPU per step `{leanest['system']}` "
                              f"({leanest['cpu_s']:.3f} s per process)" if leanest else "") + ".")
    return out


def format_section(tables: dict, links: dict, verdicts: list, args, command: str, info: dict,
                   start_load: str, elapsed: float, horovod_versions: str) -> str:
    keras_version = kst.keras_version()
    outcomes = [m for _, cells in verdicts for m, _ in cells.values()]
    result = (f"{outcomes.count(True)} of the {len(outcomes)} checks (goal x setting) **met**, "
              f"{outcomes.count(False)} **missed**"
              + (f", {outcomes.count(None)} not measured" if None in outcomes else ""))
    lines = [
        BEGIN, f"## {TITLE}", "",
        f"**Measures:** the Keras `fit` step of `keras_step_time`'s MLP "
        f"({GRADIENT_BYTES / 1e6:.0f} MB of float32 gradients, SGD, {kst.ROWS_PER_REPLICA} rows "
        f"per replica) on {NUM_NODES} emulated nodes (one CPU replica and process each) under "
        "AutoDist's builders, Horovod (Gloo) and `MultiWorkerMirroredStrategy`, every run a fresh "
        "job on the same cluster, rounds interleaved; links at "
        f"{', '.join(args.settings)}.", "",
        "*vs Horovod*, *vs MWMS*: the peer's step time over the "
        "builder's (above 1: AutoDist is faster); *x ring bound*: step time over "
        "2(n-1)/n x bytes / link rate; CPU: each process's own CPU time over the timed steps, "
        "mean over the processes.", "",
        f"**Goal:** at {' and '.join(GOAL_SETTINGS)}, "
        + "; ".join(g for g, _ in verdicts) + f". **Result:** {result}.", "",
        "| goal | " + " | ".join(GOAL_SETTINGS) + " |", "|---|" + "--:|" * len(GOAL_SETTINGS),
        *["| " + goal + " | " + " | ".join(cells[s][1] for s in GOAL_SETTINGS) + " |"
          for goal, cells in verdicts], "",
        f"Measured {info['date']} on {info['cores']} cores ({info['cpu']}) shared by the "
        f"{NUM_NODES} nodes; AutoDist and MWMS on TensorFlow {info['tf']} with Keras "
        f"{keras_version}, Horovod on {horovod_versions}; Python {info['python']}; "
        f"median of {args.rounds} rounds, each job {args.warmup} warm-up + {args.timed} timed "
        "batches, 1 intra-op / 2 inter-op threads per process; 1-minute load average "
        f"{start_load} at the start, {info['load']} at the end; the run took "
        f"{elapsed / 60:.0f} min.", "", *([_links_text(links), ""] if links else []),
        f"Command (root, iproute2; the first run also builds Horovod's venv, about 5 min): "
        f"`{command}`", ""]
    for setting, rows in tables.items():
        lines += [f"**{_setting_title(setting)}**", "", *format_table(rows), ""]
    lines += [f"- {f}" for f in _findings(tables)]
    lines += ["", f"Details: [notes]({NOTES}) (how each system runs, the unshaped links, what "
              "the CPU column counts, where the CPU goes).", END]
    return "\n".join(lines)


# --------------------------------------------------------------------------- main

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS),
                        help="link settings (default: all)")
    parser.add_argument("--builders", nargs="*", default=list(DEFAULT_BUILDERS),
                        help=f"AutoDist builders (default: {' '.join(DEFAULT_BUILDERS)})")
    parser.add_argument("--systems", nargs="*", choices=PEER_SYSTEMS, default=list(PEER_SYSTEMS),
                        help="peers to run (default: both)")
    kst.add_job_args(parser)
    parser.add_argument("--no-probe", action="store_true", help="do not measure the links")
    parser.add_argument("--horovod-venv", default=horovod_peer.DEFAULT_VENV,
                        help=f"Horovod's venv, built when it does not import Horovod "
                             f"(default: {horovod_peer.DEFAULT_VENV})")
    parser.add_argument("--setup-only", action="store_true", help="only build Horovod's venv")
    parser.add_argument("--out", default=os.path.join(REPO, "docs", "benchmarks.md"),
                        help="markdown file whose peers section is rewritten")
    parser.add_argument("--no-write", action="store_true", help="only print the tables")
    args = parser.parse_args(argv)

    for builder in args.builders:
        try:
            report.parse_builder(builder)
        except ValueError as err:
            parser.error(str(err))
    kst.check_job_args(parser, args)
    if not args.builders and not args.systems and not args.setup_only:
        parser.error("nothing to run: give at least one of --builders and --systems.")
    args.settings = [s for s in SETTINGS if s in args.settings]
    return horovod_peer.run_benchmark(args, HOROVOD in args.systems,
                                      lambda: _run(parser, args), setup_only=args.setup_only)


def _run(parser, args) -> int:
    systems = list(args.builders) + [p for p in PEER_SYSTEMS if p in args.systems]
    horovod_versions = ("Horovod not run" if HOROVOD not in systems or args.horovod_error
                        else horovod_peer.versions(args.horovod_venv))
    print(f"model gradients {GRADIENT_BYTES / 1e6:.1f} MB; systems {systems}; Horovod venv: "
          f"{horovod_versions}", flush=True)
    start, start_load = time.perf_counter(), report.machine_info()["load"]
    tables, links = {}, {}
    for setting in args.settings:
        results, links[setting] = measure(setting, systems, args)
        tables[setting] = summarize(setting, results)
    elapsed = time.perf_counter() - start
    info = report.machine_info()
    for setting, rows in tables.items():
        print(f"\n{_setting_title(setting)}; median of {args.rounds} rounds; vs = peer time / time")
        print(format_text(rows))
    verdicts = goal_verdicts(tables)
    print("\nGoals:")
    for goal, cells in verdicts:
        print(f"  {goal}: " + "; ".join(f"{s} {cells[s][1]}" for s in GOAL_SETTINGS))
    print(f"\nload average {start_load} at the start, {info['load']} at the end; "
          f"run took {elapsed:.0f} s")
    if not args.no_write:
        command = report.command_line("benchmarks/peers.py", parser, args,
                                      skip=("out", "no_write", "horovod_venv", "setup_only"))
        report.write_section(args.out, format_section(tables, links, verdicts, args, command, info,
                                                      start_load, elapsed, horovod_versions),
                             BEGIN, END)
        print(f"wrote the peers section of {args.out}")
    return 1 if any(m is False for _, cells in verdicts for m, _ in cells.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
