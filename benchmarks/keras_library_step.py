"""AutoDist's fixed cost per step on small library models: plain Keras against AutoDist.

Issue 56, item 8: a small model is not slower for being distributed. The models
are the kinds of ``tests/library_corpus.py`` (KerasRS recommenders, KerasHub
transformers), sized as users train them rather than as the corpus's tests do:

* ``dcn``: a Deep & Cross Network: six categorical features through
  ``Embedding`` tables (16 wide) and 13 dense features, a full-rank and a
  low-rank ``keras_rs.layers.FeatureCross``, an MLP (128, 64); Adam, AUC; 256 rows a step;
* ``dlrm``: a bottom MLP (64, 16), the same six tables as
  ``keras_rs.layers.DistributedEmbedding`` (its CPU path), ``DotInteraction``, a
  top MLP (64); Adagrad; 256 rows a step;
* ``two_tower``: the corpus's ``TwoTowerRetrieval`` (user and item towers of
  2000 ids, 32 wide, in-batch negatives with ``HardNegativeMining``, the
  candidates gathered over the replicas, as exact training needs); Adam; 256 pairs a step;
* ``bert``: ``BertTextClassifier`` on a ``BertBackbone`` of 2 layers (64 wide,
  2 heads, vocabulary 2000), 3 classes; Adam; 32 sequences of 64 tokens a step;
* ``gpt2``: ``GPT2CausalLM`` on a ``GPT2Backbone`` of the same size; Adam; 32
  sequences of 64 tokens a step.

Every model is randomly initialized (nothing downloaded), dropout 0, data synthetic.

Systems, each in a process of its own with TensorFlow's default thread pools
(as a user runs it; the same as ``keras_mimo``):

* ``keras``: plain Keras on one device (the reference);
* ``AllReduce``: AutoDist, one node with two CPU replicas (``configs/local_2cpu.yml``);
* ``AllReduce, 1 replica``: AutoDist on one CPU replica: its fixed cost alone.

Method: ``lockstep`` (shared with ``keras_mimo``): for each model the three
processes train in turn, one step each, each step (the batch's ``train_function``
call; no callback in ``fit``) timed alone on the cores. A
round runs every model once with fresh processes; a system's figure in it is
the median of its steps after ``--warmup``, and AutoDist's ratio the median over
the cycles of its step over plain Keras's in the same cycle. The table gives
medians over the rounds.

Goal: AutoDist's two-replica step within ``GOAL_RATIO`` of plain Keras's (the
per-cycle ratio) for every model whose plain step is ``MIN_PLAIN_MS`` or more.

Usage:
    python benchmarks/keras_library_step.py          # writes docs/benchmarks.md
    python benchmarks/keras_library_step.py --rounds 1 --steps 2 --warmup 1 --models dcn --no-write

The table is printed and, unless ``--no-write``, written into ``--out`` between
``<!-- keras_library_step:begin -->`` and ``<!-- keras_library_step:end -->``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Dict, Tuple

import lockstep
import report

BEGIN = "<!-- keras_library_step:begin -->"
END = "<!-- keras_library_step:end -->"
HEADING, ANCHOR = next(s for s in report.SECTIONS if s[0].endswith("(`keras_library_step`)"))
SYSTEMS = ("keras", "AllReduce", "AllReduce, 1 replica")
GOAL_RATIO = 1.5
CALLBACK_FINDING = (
    "- The steps are timed with no callback in `fit` (a progress bar alone changes "
    "nothing). A callback with batch hooks makes AutoDist copy the small state (metrics, "
    "the optimizer's scalars) into the model after every step and check it for changes "
    "before the next, an eager op per variable each: about 0.8 ms a step on these "
    "models ([the note](notes/keras_mimo.md#the-small-state-when-keras-reads-it-2026-12-07)).")
MIN_PLAIN_MS = 2.0
VOCABULARIES = (1000, 1000, 500, 200, 100, 50)
DENSE_FEATURES, EMBEDDING_DIM = 13, 16
SEQUENCE, TOKENS = 64, 2000


# ----------------------------------------------------------------------------- models
# Each builder takes the rows to train on and returns (compiled model, x, y); the caller
# enters the system's scope around it.

def _click_data(rows: int, seed: int):
    """Categorical ids (one column per vocabulary), dense features and a 0/1 label."""
    import numpy as np
    rng = np.random.default_rng(seed)
    ids = {f"cat_{i}": rng.integers(0, v, size=(rows,)).astype("int32")
           for i, v in enumerate(VOCABULARIES)}
    dense = rng.normal(size=(rows, DENSE_FEATURES)).astype("float32")
    score = dense[:, 0] + sum((column % 2) - 0.5 for column in ids.values())
    return {**ids, "dense_features": dense}, (score > 0).astype("float32")[:, None]


def build_dcn(rows: int):
    """Deep & Cross Network: embeddings and dense features, two FeatureCross layers, an MLP."""
    import keras
    import keras_rs
    from keras import layers
    x, y = _click_data(rows, seed=805)
    ids = [name for name in x if name.startswith("cat_")]
    id_inputs = {name: keras.Input(shape=(), dtype="int32", name=name) for name in ids}
    dense_input = keras.Input(shape=(DENSE_FEATURES,), name="dense_features")
    embedded = [layers.Embedding(v, EMBEDDING_DIM, name=f"{name}_embedding")(id_inputs[name])
                for name, v in zip(ids, VOCABULARIES)]
    x0 = layers.Concatenate()([*embedded, dense_input])
    cross = keras_rs.layers.FeatureCross()(x0, x0)
    cross = keras_rs.layers.FeatureCross(projection_dim=32)(x0, cross)
    hidden = layers.Dense(128, activation="relu")(cross)
    hidden = layers.Dense(64, activation="relu")(hidden)
    model = keras.Model({**id_inputs, "dense_features": dense_input},
                        layers.Dense(1, activation="sigmoid")(hidden))
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=keras.losses.BinaryCrossentropy(),
                  metrics=[keras.metrics.AUC(name="auc"), "binary_accuracy"])
    return model, x, y


def build_dlrm(rows: int):
    """DLRM: a bottom MLP, DistributedEmbedding tables, DotInteraction, a top MLP."""
    import keras
    import keras_rs
    from keras import layers
    x, y = _click_data(rows, seed=806)
    ids = [name for name in x if name.startswith("cat_")]
    feature_configs = {
        name: keras_rs.layers.FeatureConfig(
            name=name,
            table=keras_rs.layers.TableConfig(name=f"{name}_table", vocabulary_size=v,
                                              embedding_dim=EMBEDDING_DIM, optimizer="adam"),
            input_shape=(None,), output_shape=(None, EMBEDDING_DIM))
        for name, v in zip(ids, VOCABULARIES)}
    id_inputs = {name: keras.Input(shape=(), dtype="int32", name=name) for name in ids}
    dense_input = keras.Input(shape=(DENSE_FEATURES,), name="dense_features")
    bottom = layers.Dense(64, activation="relu")(dense_input)
    bottom = layers.Dense(EMBEDDING_DIM, activation="relu")(bottom)
    embedded = keras_rs.layers.DistributedEmbedding(feature_configs)(id_inputs)
    interactions = keras_rs.layers.DotInteraction()([bottom, *[embedded[n] for n in ids]])
    top = layers.Dense(64, activation="relu")(layers.Concatenate()([bottom, interactions]))
    model = keras.Model({**id_inputs, "dense_features": dense_input},
                        layers.Dense(1, activation="sigmoid")(top))
    model.compile(optimizer=keras.optimizers.Adagrad(0.05),
                  loss=keras.losses.BinaryCrossentropy(), metrics=["binary_accuracy"])
    return model, x, y


def build_two_tower(rows: int, batch: int):
    """The corpus's two-tower retrieval model, every batch's items distinct, its
    candidates gathered over the replicas (``autodist.gather_batch``: exact)."""
    import keras
    import numpy as np
    from library_corpus import TwoTowerRetrieval
    users = items = 2000
    rng = np.random.default_rng(807)
    user_id = rng.integers(0, users, size=(rows,)).astype("int32")
    item_id = np.concatenate([rng.permutation(items)[:batch]
                              for _ in range(-(-rows // batch))])[:rows].astype("int32")
    model = TwoTowerRetrieval(users, items, dim=32, hard_negatives=8, gathered=True)
    model.compile(optimizer=keras.optimizers.Adam(1e-3))
    return model, {"user_id": user_id, "item_id": item_id}, None


def _tokens(rows: int, seed: int):
    """Token ids (0 pads) of rows of 48 to 64 tokens, and their padding mask."""
    import numpy as np
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, TOKENS, size=(rows, SEQUENCE + 1)).astype("int32")
    lengths = rng.integers(3 * SEQUENCE // 4, SEQUENCE + 2, size=(rows, 1))
    mask = np.arange(SEQUENCE + 1)[None, :] < lengths
    return np.where(mask, tokens, 0).astype("int32"), mask


def _backbone_size() -> dict:
    return dict(vocabulary_size=TOKENS, num_layers=2, num_heads=2, hidden_dim=64,
                intermediate_dim=128, dropout=0.0, max_sequence_length=SEQUENCE)


def build_bert(rows: int):
    """BertTextClassifier (3 classes) on a small BertBackbone, fit on packed sentence pairs."""
    import keras
    import keras_hub
    import numpy as np
    tokens, mask = _tokens(rows, seed=808)
    tokens, mask = tokens[:, :-1], mask[:, :-1]
    split = np.random.default_rng(818).integers(8, SEQUENCE // 2, size=(rows, 1))
    segment_ids = ((np.arange(SEQUENCE)[None, :] >= split) & mask).astype("int32")
    backbone = keras_hub.models.BertBackbone(**_backbone_size())
    model = keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=3,
                                                preprocessor=None, dropout=0.0)
    model.compile(optimizer=keras.optimizers.Adam(5e-4),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=[keras.metrics.SparseCategoricalAccuracy()])
    x = {"token_ids": tokens, "segment_ids": segment_ids, "padding_mask": mask}
    return model, x, (tokens[:, 0] % 3).astype("int32")


def build_gpt2(rows: int):
    """GPT2CausalLM on a small GPT2Backbone, fit on token ids / next tokens (the
    preprocessor's output, padding weighted 0)."""
    import keras
    import keras_hub
    tokens, mask = _tokens(rows, seed=809)
    backbone = keras_hub.models.GPT2Backbone(**_backbone_size())
    model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    model.compile(optimizer=keras.optimizers.Adam(5e-4),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  weighted_metrics=["accuracy"])
    x = {"token_ids": tokens[:, :-1], "padding_mask": mask[:, :-1]}
    return model, x, (tokens[:, 1:], mask[:, 1:].astype("float32"))


# name -> (builder, rows a step, what the table calls it)
MODELS: Dict[str, Tuple] = {
    "dcn": (build_dcn, 256, "KerasRS DCN (FeatureCross)"),
    "dlrm": (build_dlrm, 256, "KerasRS DLRM (DotInteraction, DistributedEmbedding)"),
    "two_tower": (build_two_tower, 256, "KerasRS two-tower retrieval"),
    "bert": (build_bert, 32, "KerasHub BertTextClassifier"),
    "gpt2": (build_gpt2, 32, "KerasHub GPT2CausalLM"),
}


# ----------------------------------------------------------------------------- a worker

def run_worker(system: str, name: str, steps: int) -> None:
    """Builds ``name`` under ``system`` in this process and fits it for ``steps`` batches,
    one per ``go`` line read from stdin (``lockstep``)."""
    import keras
    builder, batch, _ = MODELS[name]
    rows = batch * steps

    def build():
        keras.utils.set_random_seed(1)
        return builder(rows, batch) if name == "two_tower" else builder(rows)

    if system == "keras":
        model, x, y = build()
    else:
        from autodist import AutoDist
        from autodist.strategy import get_builder
        spec = (report.one_replica_spec() if system.endswith("1 replica")
                else os.path.join(report.REPO, "configs", "local_2cpu.yml"))
        with AutoDist(spec, get_builder("AllReduce")).scope():
            model, x, y = build()
    sample_weight = None
    if isinstance(y, tuple):
        y, sample_weight = y
    lockstep.time_steps(model)
    model.fit(x, y, sample_weight=sample_weight, batch_size=batch, epochs=1, shuffle=False,
              verbose=0)
    lockstep.finished()


# ----------------------------------------------------------------------------- the coordinator

def measure(args) -> list:
    """Per round, model -> (system -> its median step or None, system -> its median
    per-cycle ratio over plain Keras or None)."""
    script = os.path.abspath(__file__)
    rounds = []
    for round_index in range(args.rounds):
        results = {}
        for name in args.models:
            # A worker's --steps counts every batch it fits, the warm-up's included.
            commands = {system: [sys.executable, script, "--job", system, "--model", name,
                                 "--steps", str(args.warmup + args.steps)]
                        for system in SYSTEMS}
            steps = lockstep.run_round(commands, args.timeout)
            medians = {s: lockstep.median_step(steps[s], args.warmup) for s in SYSTEMS}
            ratios = {s: lockstep.cycle_ratio(steps[s], steps["keras"], args.warmup)
                      for s in SYSTEMS[1:]}
            results[name] = (medians, ratios)
            shown = ", ".join(f"{s} {_ms(m)} ms" for s, m in medians.items())
            print(f"round {round_index + 1}, {name}: {shown}; per cycle over keras: "
                  + ", ".join(f"{s} {_x(r)}" for s, r in ratios.items()), flush=True)
        rounds.append(results)
    return rounds


def summarize(rounds: list, models) -> dict:
    """Model -> (system -> median step over the rounds, system -> median per-cycle ratio
    over the rounds, failed rounds); a figure no round gave is None."""
    def median(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    table = {}
    for name in models:
        per_round = [results[name] for results in rounds]
        steps = {s: median(m[s] for m, _ in per_round) for s in SYSTEMS}
        ratios = {s: median(r[s] for _, r in per_round) for s in SYSTEMS[1:]}
        failed = sum(any(v is None for v in m.values()) for m, _ in per_round)
        table[name] = (steps, ratios, failed)
    return table


def _ms(value) -> str:
    return "failed" if value is None else f"{value * 1e3:.1f}"


def _x(value) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def goal(steps: dict, ratios: dict) -> str:
    """The goal's verdict for one model: met, not met, or why it does not apply."""
    plain, ratio = steps["keras"], ratios["AllReduce"]
    if plain is None or ratio is None:
        return "n/a (failed)"
    if plain * 1e3 < MIN_PLAIN_MS:
        return f"n/a (plain < {MIN_PLAIN_MS:g} ms)"
    return "met" if ratio <= GOAL_RATIO else "**not met**"


def format_table(table: dict) -> list:
    lines = ["| model | rows a step | plain Keras step ms | AutoDist step ms (2 replicas) "
             "| AutoDist / plain (per cycle) | 1 replica step ms | 1 replica / plain (per cycle) "
             f"| goal <= {GOAL_RATIO}x |",
             "|---|--:|--:|--:|--:|--:|--:|---|"]
    for name, (steps, ratios, _) in table.items():
        _, batch, title = MODELS[name]
        lines.append(f"| {title} | {batch} | {_ms(steps['keras'])} | {_ms(steps['AllReduce'])} "
                     f"| {_x(ratios['AllReduce'])} | {_ms(steps['AllReduce, 1 replica'])} "
                     f"| {_x(ratios['AllReduce, 1 replica'])} | {goal(steps, ratios)} |")
    return lines


def format_markdown(table: dict, args, command: str) -> str:
    info = report.machine_info()
    lines = [
        BEGIN, f"## {HEADING}", "",
        "**Measures:** the median `fit` step of small models of the library corpus's kinds "
        "(KerasRS DCN, DLRM and two-tower retrieval at 256 rows a step; KerasHub BERT "
        f"classifier and GPT-2 causal LM, 2 layers 64 wide, at 32 sequences of {SEQUENCE} "
        "tokens) under plain Keras and AutoDist (`AllReduce`, two CPU replicas, and one): "
        "AutoDist's fixed cost per step. The models are described in "
        "`benchmarks/keras_library_step.py`.", "",
        f"**Goal:** AutoDist with two replicas within {GOAL_RATIO}x plain Keras's step for "
        f"every model whose plain step is {MIN_PLAIN_MS:g} ms or more (issue 56, item 8).", "",
        f"Measured {info['date']} on {info['cores']} cores ({info['cpu']}), TensorFlow "
        f"{info['tf']}, Python {info['python']}; each system's default thread pools. Each "
        "system in a process of its own, one step each in turn (lockstep, as `keras_mimo`), "
        "timing `train_function` (no callback); "
        f"{args.rounds} rounds of fresh processes, {args.steps} timed steps after "
        f"{args.warmup} warm-up steps, medians over the rounds; 1-minute load {info['load']} "
        "at the end.", "",
        f"Command: `{command}`", "",
        *format_table(table), "", "Findings:", ""]
    judged = {name: goal(steps, ratios) for name, (steps, ratios, _) in table.items()}
    missed = [MODELS[n][2] for n, v in judged.items() if v == "**not met**"]
    applies = [n for n, v in judged.items() if not v.startswith("n/a")]
    if applies:
        verdict = (f"**not met** for {len(missed)} of the {len(applies)}" if missed
                   else f"met for all {len(applies)}")
        lines.append(f"- Goal {verdict} models with a plain step of {MIN_PLAIN_MS:g} ms or "
                     "more" + (f" (missed: {', '.join(missed)})." if missed else "."))
    else:
        lines.append(f"- No model's plain step was {MIN_PLAIN_MS:g} ms or more: the goal "
                     "applies to none.")
    fixed = [(MODELS[n][2], (s["AllReduce, 1 replica"] - s["keras"]) * 1e3)
             for n, (s, _, _) in table.items()
             if s["AllReduce, 1 replica"] is not None and s["keras"] is not None]
    if fixed:
        lines.append("- AutoDist's fixed cost on one replica (its step minus plain Keras's): "
                     + "; ".join(f"{title} {cost:+.1f} ms" for title, cost in fixed) + ".")
    lines.append(CALLBACK_FINDING)
    failed = {MODELS[n][2]: f for n, (_, _, f) in table.items() if f}
    if failed:
        lines.append("- Rounds with a failed process: "
                     + "; ".join(f"{title} {f}" for title, f in failed.items()) + ".")
    lines.append(END)
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS),
                        help="models to time (default: all)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of fresh processes for every model (default: 3)")
    parser.add_argument("--steps", type=int, default=100,
                        help="timed steps per system, model and round (default: 100)")
    parser.add_argument("--warmup", type=int, default=30,
                        help="untimed steps first (default: 30)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds a process may take for one step or its start "
                             "(default: 300)")
    parser.add_argument("--out", default=os.path.join(report.REPO, "docs", "benchmarks.md"),
                        help="markdown file whose keras_library_step section is rewritten")
    parser.add_argument("--no-write", action="store_true", help="only print the table")
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.job:
        for path in (report.REPO, os.path.join(report.REPO, "tests")):
            if path not in sys.path:
                sys.path.insert(0, path)
        run_worker(args.job, args.model, args.steps)
        return 0
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        parser.error("--steps and --rounds must be at least 1 and --warmup at least 0.")
    table = summarize(measure(args), args.models)
    print("\n".join(format_table(table)))
    if not args.no_write:
        command = report.command_line("benchmarks/keras_library_step.py", parser, args)
        report.write_section(args.out, format_markdown(table, args, command), BEGIN, END)
        report.add_contents_entry(args.out, HEADING, ANCHOR)
        print(f"wrote the keras_library_step section of {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
