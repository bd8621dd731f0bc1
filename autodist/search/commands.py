"""``autodist search`` and ``autodist explain``: the strategy search from the command line.

    autodist search train.py --spec spec.yml --trials 30 [-- train.py's arguments]
    autodist explain best.strategy --script train.py --spec spec.yml [-- arguments]

Both run the script once to read its graph (it stops when it would create its
session). TensorFlow and the simulator load only when a command runs.
"""
from __future__ import annotations

import argparse
import os
import sys

from autodist.usage import check_output_path, options_checked

INTERRUPTED_STATUS = 130  # a shell's status for a command a Ctrl-C (SIGINT) ended


def _runner(args: argparse.Namespace, workdir: str):
    """The script's runner, once the script and ``--spec`` are known to be usable."""
    from autodist.resource_spec import ResourceSpec
    from autodist.search.trial import ScriptRunner
    if not os.path.isfile(args.script):
        raise ValueError(f"The training script '{args.script}' does not exist.")
    if args.spec:
        ResourceSpec(args.spec)  # a bad spec is named here, not in the script's log
    return ScriptRunner([args.script, *args.passthrough], workdir, spec_path=args.spec,
                        timeout=args.trial_timeout)


def _search(args: argparse.Namespace) -> int:
    from autodist.resource_spec import ResourceSpec
    from autodist.search.builder import SearchSettings, search_strategy

    with options_checked():  # before the script runs to read its graph
        settings = SearchSettings(trials=args.trials, candidates=args.candidates,
                                  per_round=args.per_round, batch_size=args.batch_size,
                                  allow_lossy=args.allow_lossy, with_builders=not args.no_builders,
                                  warmup=args.warmup, steps=args.steps,
                                  trial_timeout=args.trial_timeout, log_dir=args.log_dir,
                                  seed=args.seed, min_timed_seconds=args.min_timed_seconds)
        check_output_path(args.out, "--out")
    runner = _runner(args, os.path.join(args.log_dir, "trials"))
    print(f"Reading the graph of {args.script} ...", flush=True)
    captured = runner.capture()
    spec = ResourceSpec(captured.spec)
    print(f"{len(captured.trainable_variables)} trainable variables; cluster {captured.spec} "
          f"({len(spec.nodes)} nodes, {spec.num_replicas} replicas).", flush=True)
    try:
        result = search_strategy(captured, spec, runner, settings, out=args.out)
    except KeyboardInterrupt:  # a search keeps what any trial found: here none had finished
        print(f"\nInterrupted (Ctrl-C) before any trial finished: nothing is saved, "
              f"{args.out} was not written.", file=sys.stderr)
        return INTERRUPTED_STATUS
    path = args.out
    print()
    if result.interrupted:
        print(f"Interrupted (Ctrl-C) after {len(result.trials)} trials; the best so far:")
    if result.best_seconds is not None:
        line = f"Best: {result.best.id}, {1e3 * result.best_seconds:.1f} ms per step"
        if result.baseline_seconds:
            line += (f"; best hand-written builder {1e3 * result.baseline_seconds:.1f} ms "
                     f"({result.baseline_seconds / result.best_seconds:.2f}x)")
        print(line)
    else:
        print(f"Best predicted (no trials): {result.best.id}")
    print(f"Saved to {path}; log and simulator in {args.log_dir}/.")
    if result.plot_path:
        print(f"Plot: {result.plot_path}")
    elif result.plot_skipped:
        print("No plot: Ctrl-C came before it was drawn.")
    else:
        print("No plot: matplotlib is not installed (python3 -m pip install matplotlib).")
    print(f"Reuse it: AutoDist(..., strategy_builder=Strategy.load({path!r}))")
    return 0


def _explain(args: argparse.Namespace) -> int:
    from autodist.resource_spec import ResourceSpec
    from autodist.simulator import CostModel, format_breakdown, format_rows_touched
    from autodist.strategy import Strategy
    from autodist.search.builder import SearchSettings
    from autodist.strategy.common import check_int
    from autodist.strategy.compiler import compile_strategy
    import tempfile

    with options_checked():
        # The options shared with search (see _common) are checked where search checks them.
        SearchSettings(batch_size=args.batch_size, trial_timeout=args.trial_timeout)
        check_int("top", args.top, least=0)
    with tempfile.TemporaryDirectory() as workdir:
        runner = _runner(args, workdir)
        strategy = Strategy.load(args.strategy)
        captured = runner.capture()
    spec = ResourceSpec(captured.spec)
    compiled = compile_strategy(strategy, captured, spec)
    breakdown = CostModel().breakdown(compiled, captured, spec, batch_size=args.batch_size,
                                      accumulation_steps=captured.accumulation_steps)
    print(f"Strategy {strategy.id} on {captured.spec}: predicted "
          f"{1e3 * breakdown.total:.2f} ms of synchronization per step\n")
    print(format_breakdown(breakdown, top=args.top), end="")
    rows = format_rows_touched([v.info for v in compiled.variables.values()], args.batch_size)
    print("\n" + rows if rows else "", end="")
    return 0


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--spec", help="resource spec to run the script on (default: its own)")
    parser.add_argument("--batch-size", type=int, default=32,
                        help="examples per replica and step, for sparse traffic (default: 32)")
    parser.add_argument("--trial-timeout", type=float, default=600.0,
                        help="seconds one run of the script may take (default: 600)")


def add_search_subcommand(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "search", help="search for the fastest strategy of a training script",
        description="Samples strategies, scores them with a simulator and runs the most promising "
                    "as trials of the script; arguments after '--' go to the script.")
    parser.add_argument("script", help="the training script (it uses AutoDist)")
    parser.add_argument("--trials", type=int, default=30, help="real runs to spend (default: 30)")
    parser.add_argument("--candidates", type=int, default=2000,
                        help="strategies sampled per round (default: 2000)")
    parser.add_argument("--per-round", type=int, default=4, help="trials per round (default: 4)")
    parser.add_argument("--warmup", type=int, default=3, help="steps before timing (default: 3)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (default: 10)")
    parser.add_argument("--min-timed-seconds", type=float, default=0.0,
                        help="time more steps, to last this long at the fastest step time so "
                             "far; the script must train that many (default: 0, off)")
    parser.add_argument("--allow-lossy", action="store_true",
                        help="allow fp16 compression and bounded staleness")
    parser.add_argument("--no-builders", action="store_true",
                        help="do not open with the hand-written builders as trials")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", default="autodist_search",
                        help="trials.jsonl, search.png, simulator (default: autodist_search)")
    parser.add_argument("--out", default="best.strategy",
                        help="where to save the best strategy (default: best.strategy)")
    _common(parser)
    parser.set_defaults(func=_search, usage_parser=parser)


def add_explain_subcommand(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "explain", help="break a strategy's predicted time down per variable and component",
        description="Prints the cost model's per-variable breakdown of a saved strategy for the "
                    "graph of a training script; arguments after '--' go to the script.")
    parser.add_argument("strategy", help="a saved strategy file")
    parser.add_argument("--script", required=True, help="the training script the strategy is for")
    parser.add_argument("--top", type=int, default=20, help="variables to list (default: 20)")
    _common(parser)
    parser.set_defaults(func=_explain, usage_parser=parser)
