"""A Keras ``model.fit`` job run by the multi-node tests on an emulated cluster.

Every node runs this script (the chief starts the workers) and fits its own
rows of every global batch, as many per replica on every node, so synchronous
training must equal single-device ``fit`` on the whole global batch, which
``reference`` computes.

    python keras_cluster_job.py SPEC BUILDER OUT [--epochs N] [--die-at STEP]
                                [--checkpoint PATH [--stop-in-save N]] [--defer-bytes N]
                                [--stop-on NODE[,NODE...] --stop-at BATCH]
"""
import argparse
import json
import os
import signal
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

ROWS_PER_REPLICA = 4
BATCHES = 3


def data(num_replicas: int):
    """``BATCHES`` global batches of ``ROWS_PER_REPLICA`` rows per replica, batch-major."""
    rng = np.random.RandomState(0)
    rows = ROWS_PER_REPLICA * num_replicas * BATCHES
    return (rng.randint(0, 12, size=(rows, 3)).astype(np.int32),
            rng.randn(rows, 5).astype(np.float32), rng.randn(rows, 2).astype(np.float32))


class StopsInSave(keras.Model):
    """Sends its own process SIGTERM in the middle of its ``stop_at``-th weights save."""

    stop_at = 0
    saves = 0

    def save_weights(self, filepath, *args, **kwargs):
        StopsInSave.saves += 1
        if StopsInSave.saves == self.stop_at:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1.0)  # the signal's handler has run; the save is still to come
        return super().save_weights(filepath, *args, **kwargs)


def build_model(model_class=keras.Model, optimizer: str = "Adam") -> keras.Model:
    """An embedding (sparse gradient) and two dense layers, compiled with ``optimizer``
    (a Keras optimizer's class name) at learning rate 0.05."""
    keras.utils.set_random_seed(7)
    ids = keras.Input((3,), dtype="int32")
    x = keras.Input((5,))
    embedded = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(12, 4)(ids))
    hidden = keras.layers.Dense(6, activation="tanh")(keras.layers.Concatenate()([embedded, x]))
    model = model_class([ids, x], keras.layers.Dense(2)(hidden))
    model.compile(optimizer=keras.optimizers.get({"class_name": optimizer,
                                                  "config": {"learning_rate": 0.05}}),
                  loss="mse", metrics=["mae"])
    return model


def reference(num_replicas: int, epochs: int, stop_at: int = -1,
              optimizer: str = "Adam") -> tuple:
    """Single-device ``fit`` on the global batches, stopped after batch ``stop_at`` of the
    first epoch if given: (weights, history)."""
    model, history = reference_model(num_replicas, epochs, stop_at, optimizer)
    return model.get_weights(), history.history


def reference_model(num_replicas: int, epochs: int, stop_at: int = -1,
                    optimizer: str = "Adam") -> tuple:
    """As ``reference``: (the trained model, its History)."""
    ids, x, y = data(num_replicas)
    model = build_model(optimizer=optimizer)
    history = model.fit([ids, x], y, batch_size=ROWS_PER_REPLICA * num_replicas,
                        epochs=epochs, shuffle=False, verbose=0,
                        callbacks=[_StopAt(None, stop_at)] if stop_at >= 0 else [])
    return model, history


class _DieAt(keras.callbacks.Callback):
    """Kills this process (a worker) when it starts batch ``step`` of the first epoch."""

    def __init__(self, step: int):
        super().__init__()
        self._step = step

    def on_train_batch_begin(self, batch, logs=None):
        if batch == self._step:
            print(f"worker dies at {time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


class _StopAt(keras.callbacks.Callback):
    """Stops training (``model.stop_training``) after batch ``batch`` of the first epoch,
    deciding on its node alone; on a cluster job's node ``node`` it says when."""

    autodist_reads_weights = False  # it reads no weights: no copy per batch

    def __init__(self, node, batch: int):
        super().__init__()
        self._node, self._batch, self._epoch = node, batch, 0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self._epoch == 0 and batch == self._batch:
            if self._node is not None:
                print(f"node {self._node} stops training at {time.time():.3f}", flush=True)
            self.model.stop_training = True


def main() -> None:
    from autodist import AutoDist
    from autodist.cluster.runtime import ordered_nodes
    from autodist.strategy import get_builder

    parser = argparse.ArgumentParser()
    parser.add_argument("spec")
    parser.add_argument("builder")
    parser.add_argument("out")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--optimizer", default="Adam", help="a Keras optimizer's class name")
    parser.add_argument("--die-at", type=int, default=-1, help="a worker dies at this batch")
    parser.add_argument("--checkpoint", help="every node saves its weights here each epoch")
    parser.add_argument("--stop-in-save", type=int, default=0,
                        help="the chief gets SIGTERM in the middle of this save")
    parser.add_argument("--defer-bytes", type=int,
                        help="weights this large get no eager value until read")
    parser.add_argument("--stop-on", default="",
                        help="a callback stops training on these nodes (indices, comma-separated)")
    parser.add_argument("--stop-at", type=int, default=0,
                        help="after this batch of the first epoch (with --stop-on)")
    args = parser.parse_args()
    if args.defer_bytes is not None:
        from autodist.keras import step
        step.DEFERRED_VARIABLE_BYTES = args.defer_bytes

    ad = AutoDist(args.spec, get_builder(args.builder))
    replicas = ad.resource_spec.replica_devices
    nodes = ordered_nodes(ad.resource_spec)
    mine = nodes[ad.node_index]
    start = sum(1 for r in replicas if nodes.index(r.host_address) < ad.node_index)
    count = sum(1 for r in replicas if r.host_address == mine)
    ids, x, y = data(len(replicas))
    # This node's rows of every global batch.
    per_batch = ROWS_PER_REPLICA * len(replicas)
    rows = np.concatenate([np.arange(b * per_batch + start * ROWS_PER_REPLICA,
                                     b * per_batch + (start + count) * ROWS_PER_REPLICA)
                           for b in range(BATCHES)])
    StopsInSave.stop_at = args.stop_in_save if ad.is_chief else 0
    with ad.scope():
        model = build_model(StopsInSave, args.optimizer)
    callbacks = [_DieAt(args.die_at)] if args.die_at >= 0 and not ad.is_chief else []
    if str(ad.node_index) in args.stop_on.split(","):
        callbacks.append(_StopAt(ad.node_index, args.stop_at))
    if args.checkpoint:
        callbacks.append(keras.callbacks.ModelCheckpoint(args.checkpoint,
                                                         save_weights_only=True))
    history = model.fit([ids[rows], x[rows]], y[rows], batch_size=ROWS_PER_REPLICA * count,
                        epochs=args.epochs, shuffle=False, verbose=0, callbacks=callbacks)
    without_value = sorted(
        [v.path for v in model.variables if getattr(v.value, "deferred", False)]
        + [v.path.split("/", 1)[-1] for v in model.optimizer.variables  # no "adam_1/"
           if getattr(v.value, "deferred", False)])
    print(f"node {ad.node_index} holds no value of {without_value}", flush=True)
    modes = {v.name: v.update_mode for v in model._autodist_fit.step.session.distributed.item
             .trainable_variables if v.update_mode}
    print(f"node {ad.node_index} updates {modes}", flush=True)
    # Each node writes its own file: the nodes' printed lines may interleave.
    with open(f"{args.out}.history-{ad.node_index}.json", "w") as target:
        json.dump(history.history, target)
    if ad.is_chief:  # the weights, then the optimizer's variables, in their own orders
        np.savez(args.out, *model.get_weights(),
                 **{f"optimizer_{i}": v.numpy() for i, v in enumerate(model.optimizer.variables)})


if __name__ == "__main__":
    main()
