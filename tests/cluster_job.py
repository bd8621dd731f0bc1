"""A training job run by the multi-node tests on an emulated cluster.

Every node runs this script (the chief starts the workers). Node k feeds its
own rows of a global batch, as many per replica on every node, so synchronous
training must equal single-device training on the whole global batch, which
``reference`` computes.

With ``--accumulation-steps K`` each run feeds another global batch, and one
update applies K runs' gradients: single-device training on the
concatenation of those K batches.

With ``--gan`` the model is ``models.gan`` instead: each step runs the
discriminator's train op, then the generator's. With ``--gan`` or
``--all-variables`` OUT gets every global variable (slots, Adam's powers, the
global step) by name, ``/`` written ``|``.

    python cluster_job.py SPEC BUILDER OUT [--steps N] [--die-at STEP] [--mismatch]
                          [--restore CHECKPOINT] [--save CHECKPOINT] [--optimizer NAME]
                          [--accumulation-steps K] [--gan] [--clip NORM] [--all-variables]
                          [--token-file PATH]
"""
import argparse
import os
import signal
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from autodist.strategy import AllReduce, PartitionedPS  # noqa: E402
from autodist.strategy.base import StrategyBuilder  # noqa: E402

ROWS_PER_REPLICA = 4
tf1 = tf.compat.v1


def global_batch(num_replicas: int, run: int = 0):
    """The global batch of one run: the same every run unless runs are accumulated."""
    rng = np.random.RandomState(run)
    rows = ROWS_PER_REPLICA * num_replicas
    return (rng.randint(0, 12, size=(rows, 3)).astype(np.int32),
            rng.randn(rows, 5).astype(np.float32), rng.randn(rows, 2).astype(np.float32))


OPTIMIZERS = {
    "adam": lambda: tf1.train.AdamOptimizer(0.05),
    "sgd": lambda: tf1.train.GradientDescentOptimizer(0.1),
    "momentum": lambda: tf1.train.MomentumOptimizer(0.1, momentum=0.9),
    "adagrad": lambda: tf1.train.AdagradOptimizer(0.1),
    "ftrl": lambda: tf1.train.FtrlOptimizer(0.1),
}


def build_model(extra_op: bool = False, optimizer: str = "adam", clip: float = 0.0):
    """An embedding (sparse gradient) plus two dense layers; returns feeds and fetches.

    With ``clip``, the gradients are clipped by their global norm between
    ``compute_gradients`` and ``apply_gradients``.
    """
    tf1.set_random_seed(7)
    ids = tf1.placeholder(tf.int32, [None, 3], name="ids")
    x = tf1.placeholder(tf.float32, [None, 5], name="x")
    y = tf1.placeholder(tf.float32, [None, 2], name="y")
    embedding = tf1.get_variable("embedding", [12, 4], use_resource=True,
                                 initializer=tf1.random_normal_initializer(seed=1))
    w1 = tf1.get_variable("w1", [9, 6], use_resource=True,
                          initializer=tf1.random_normal_initializer(seed=2))
    w2 = tf1.get_variable("w2", [6, 2], use_resource=True,
                          initializer=tf1.random_normal_initializer(seed=3))
    features = tf.concat([tf.reduce_mean(tf.gather(embedding, ids), axis=1), x], axis=1)
    if extra_op:
        features = features * 1.0
    loss = tf.reduce_mean(tf.square(tf.matmul(tf.tanh(tf.matmul(features, w1)), w2) - y))
    global_step = tf1.train.get_or_create_global_step()
    if not clip:
        train = OPTIMIZERS[optimizer]().minimize(loss, global_step=global_step)
    else:
        opt = OPTIMIZERS[optimizer]()
        grads, variables = zip(*opt.compute_gradients(loss))
        clipped, _ = tf.clip_by_global_norm(grads, clip)
        train = opt.apply_gradients(zip(clipped, variables), global_step=global_step)
    return (ids, x, y), loss, train, [embedding, w1, w2]


def run_batch(num_replicas: int, run: int, accumulation_steps: int):
    """What run ``run`` of the job feeds, as a global batch."""
    return global_batch(num_replicas, run if accumulation_steps > 1 else 0)


def single_device_state(num_replicas: int, steps: int, optimizer: str = "adam",
                        accumulation_steps: int = 1, clip: float = 0.0) -> dict:
    """Every global variable (slots included) after single-device training on the global batch.

    With accumulation, each of the ``steps // accumulation_steps`` updates trains
    on the concatenation of its runs' batches.
    """
    with tf.Graph().as_default():
        inputs, _, train, _ = build_model(optimizer=optimizer, clip=clip)
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            for update in range(steps // accumulation_steps):
                runs = [run_batch(num_replicas, update * accumulation_steps + j,
                                  accumulation_steps) for j in range(accumulation_steps)]
                sess.run(train, {t: np.concatenate(column)
                                 for t, column in zip(inputs, zip(*runs))})
            return {v.op.name: sess.run(v) for v in tf1.global_variables()}


def reference(num_replicas: int, steps: int) -> list:
    """Single-device training on the global batch: the values every strategy must reach."""
    state = single_device_state(num_replicas, steps)
    return [state[name] for name in ("embedding", "w1", "w2")]


class SummedPerNodePS(StrategyBuilder):
    """PartitionedPS whose nodes sum their replicas' gradients before the push."""

    def build(self, graph_item, resource_spec):
        strategy = PartitionedPS(local_proxy_variable=True).build(graph_item, resource_spec)
        for node in strategy.node_config:
            for unit in node.part_config if node.partitioner else [node]:
                sync = unit.PSSynchronizer
                sync.transfer_destination = sync.reduction_destination
        return strategy


class HalfScatterGather(StrategyBuilder):
    """AllReduce, one variable per group, every other group meeting by scatter-gather: a
    step with collectives and sends to other nodes, which runs in two runs."""

    def build(self, graph_item, resource_spec):
        from autodist.proto import synchronizers_pb2
        strategy = AllReduce(chunk_size=1).build(graph_item, resource_spec)
        for node in strategy.node_config:
            sync = node.AllReduceSynchronizer
            if sync.group % 2:
                sync.spec = synchronizers_pb2.AllReduceSynchronizer.SCATTER_GATHER
        return strategy


SCATTER_GATHER_SUFFIX = "-scatter_gather"
"""A builder name with this suffix: the builder with ``all_reduce_spec="SCATTER_GATHER"``."""


def main() -> None:
    from autodist import AutoDist
    from autodist.checkpoint import Saver
    from autodist.cluster.runtime import ordered_nodes
    from autodist.strategy import get_builder

    parser = argparse.ArgumentParser()
    parser.add_argument("spec")
    parser.add_argument("builder")
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--die-at", type=int, default=-1, help="a worker kills itself at this step")
    parser.add_argument("--worker-steps", type=int, default=-1,
                        help="workers run this many steps (as if their data ran out)")
    parser.add_argument("--chief-steps", type=int, default=-1,
                        help="the chief runs this many steps (as if its data ran out)")
    parser.add_argument("--mismatch", action="store_true", help="workers build another graph")
    parser.add_argument("--restore", help="checkpoint to start from")
    parser.add_argument("--save", help="checkpoint to write after training")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adam")
    parser.add_argument("--accumulation-steps", type=int, default=1)
    parser.add_argument("--gan", action="store_true", help="train models.gan's two train ops")
    parser.add_argument("--clip", type=float, default=0.0,
                        help="clip the gradients by this global norm before applying them")
    parser.add_argument("--token-file", help="the chief writes the job's token here")
    parser.add_argument("--all-variables", action="store_true",
                        help="save every global variable by name, as fetched on the chief")
    args = parser.parse_args()
    if args.token_file:  # for the test that looks for the token in every command line
        from autodist.cluster import runtime
        make_token = runtime.new_token

        def recorded_token():
            token = make_token()
            with open(args.token_file, "w") as f:
                f.write(token)
            return token
        runtime.new_token = recorded_token

    if args.builder == "AutoStrategy":  # a small search: trials time 1 + 2 of this job's steps
        from autodist.search import AutoStrategy
        builder = AutoStrategy(trials=4, candidates=100, per_round=2, warmup=1, steps=2,
                               log_dir=os.path.join(os.path.dirname(args.out), "search"),
                               progress=False)
    elif args.builder == "SummedPerNodePS":
        builder = SummedPerNodePS()
    elif args.builder == "HalfScatterGather":
        builder = HalfScatterGather()
    elif args.builder.endswith(SCATTER_GATHER_SUFFIX):
        builder = get_builder(args.builder[:-len(SCATTER_GATHER_SUFFIX)],
                              all_reduce_spec="SCATTER_GATHER")
    else:
        builder = get_builder(args.builder)
    ad = AutoDist(args.spec, builder, accumulation_steps=args.accumulation_steps)
    replicas = ad.resource_spec.replica_devices
    nodes = ordered_nodes(ad.resource_spec)
    mine = nodes[ad.node_index]
    start = sum(1 for r in replicas if nodes.index(r.host_address) < ad.node_index)
    count = sum(1 for r in replicas if r.host_address == mine)
    rows = slice(start * ROWS_PER_REPLICA, (start + count) * ROWS_PER_REPLICA)
    if args.gan:
        train_gan(ad, args, rows)
        return
    with tf.Graph().as_default(), ad.scope():
        inputs, loss, train, variables = build_model(extra_op=args.mismatch and not ad.is_chief,
                                                     optimizer=args.optimizer, clip=args.clip)
        saver = Saver()
        sess = ad.create_distributed_session()
        if args.restore:
            saver.restore(sess, args.restore)
        own_steps = args.chief_steps if ad.is_chief else args.worker_steps
        steps = own_steps if own_steps >= 0 else args.steps
        for step in range(steps):
            if step == args.die_at and not ad.is_chief:
                print(f"node {ad.node_index} dies at {time.time():.3f}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            batch = run_batch(len(replicas), step, args.accumulation_steps)
            value, _ = sess.run([loss, train], {t: b[rows] for t, b in zip(inputs, batch)})
            print(f"node {ad.node_index} step {step} loss {value:.6f}", flush=True)
        values = sess.run(variables)
        if ad.is_chief:
            print(f"node 0 dropped {dropped_start_copies(sess)} of "
                  f"{len(sess.distributed.start_only)} start-up copies", flush=True)
        rows, whole = proxy_refreshes(sess.distributed.graph, "embedding")
        print(f"node {ad.node_index} refreshes the embedding's proxies by rows {rows} "
              f"whole {whole}", flush=True)
        if args.save:
            saver.save(sess, args.save)
        if args.all_variables and ad.is_chief:
            save_by_name(args.out, sess, tf1.global_variables())
    if ad.is_chief and not args.all_variables:
        np.savez(args.out, *values)


def train_gan(ad, args, rows: slice) -> None:
    import models  # beside this script

    with tf.Graph().as_default(), ad.scope():
        gan = models.gan(OPTIMIZERS[args.optimizer])
        assert len(ad.resource_spec.replica_devices) * ROWS_PER_REPLICA == models.BATCH_SIZE
        feeds = {placeholder: batch[rows] for placeholder, batch in gan.feeds.items()}
        variables = tf1.global_variables()
        sess = ad.create_distributed_session()
        for step in range(args.steps):
            sess.run(gan.d_train, feeds)
            sess.run(gan.g_train, feeds)
            print(f"node {ad.node_index} step {step} done", flush=True)
        if ad.is_chief:
            save_by_name(args.out, sess, variables)


def dropped_start_copies(sess) -> int:
    """How many of the chief's start-up copies (the origins of the nodes' copies) are gone."""
    start_only = sess.distributed.start_only
    if not start_only:
        return 0
    with sess.graph.as_default():
        missing = tf1.report_uninitialized_variables(start_only)
    return len(sess.tf_session.run(missing))


def proxy_refreshes(graph, variable: str) -> tuple:
    """(scatters of given rows, assigns of the whole value) into ``variable``'s proxies after
    initialization, in a node's distributed graph."""
    rows = whole = 0
    for op in graph.get_operations():
        target = op.inputs[0].op.name if op.inputs else ""
        if variable not in target or not target.endswith("/proxy"):
            continue
        if op.type == "ResourceScatterUpdate":
            rows += 1
        elif op.type == "AssignVariableOp" and not op.name.endswith("/Assign"):
            whole += 1
    return rows, whole


def save_by_name(path: str, sess, variables: list) -> None:
    """Fetches ``variables`` (on the chief: a worker holds no PS variable's slots) into ``path``."""
    np.savez(path, **{v.op.name.replace("/", "|"): value
                      for v, value in zip(variables, sess.run(variables))})


if __name__ == "__main__":
    main()
