"""All-reduce buckets: filled by bytes in the order the backward pass computes gradients,
and each bucket's collective free to start before the backward pass ends."""
import numpy as np
import pytest
import tensorflow as tf

from autodist import AutoDist
from autodist.strategy import AllReduce, Parallax, PartitionedAR, ShardedUpdateAR, common
from test_builders import ONE_NODE

tf1 = tf.compat.v1
pytestmark = pytest.mark.timeout(120)

# A chain of four dense layers; layer i's kernel and bias, and their bytes.
WIDTHS = (64, 256, 256, 64, 1)
BYTES = {f"layer{i}/{kind}": 4 * (WIDTHS[i] * WIDTHS[i + 1] if kind == "kernel" else WIDTHS[i + 1])
         for i in range(4) for kind in ("kernel", "bias")}
CAP = 100_000  # layer 1's kernel (262144 B) is larger than a bucket; the others are not


# ----------------------------------------------------------------------------- the helpers

def test_byte_buckets_fill_in_ready_order_up_to_the_caps():
    units = [("a", 10, 3), ("b", 30, 0), ("c", 25, 1), ("d", 100, 2), ("e", 5, 3)]
    # Ready order b, c, d, a, e (a tie keeps the given order).
    assert common.byte_buckets(units, 60) == {"b": 0, "c": 0, "d": 1, "a": 2, "e": 2}
    assert common.byte_buckets(units, 55) == {"b": 0, "c": 0, "d": 1, "a": 2, "e": 2}
    assert common.byte_buckets(units, 54) == {"b": 0, "c": 1, "d": 2, "a": 3, "e": 3}
    assert common.byte_buckets(units, None) == dict.fromkeys("abcde", 0)
    assert common.byte_buckets(units, None, max_units=2) == {"b": 0, "c": 0, "d": 1, "a": 1,
                                                              "e": 2}
    assert common.byte_buckets(units, 1000, max_units=1) == {"b": 0, "c": 1, "d": 2, "a": 3,
                                                             "e": 4}
    # A gathered (sparse) unit has no bytes: it joins the bucket being filled.
    assert common.byte_buckets([("x", 50, 0), ("s", 0, 1), ("y", 50, 2)], 50) == {
        "x": 0, "s": 0, "y": 1}


def test_even_buckets_cut_the_bytes_in_equal_lengths_in_ready_order():
    four = [(k, 10, r) for r, k in enumerate("abcd")]
    assert common.even_buckets(four, 2) == {"a": 0, "b": 0, "c": 1, "d": 1}
    assert common.even_buckets(four, 3) == {"a": 0, "b": 1, "c": 1, "d": 2}
    assert common.even_buckets(four, 8) == {"a": 0, "b": 1, "c": 2, "d": 3}
    assert common.even_buckets(four, 1) == dict.fromkeys("abcd", 0)
    # A unit spanning several cuts leaves no empty bucket behind.
    assert common.even_buckets([("big", 100, 0), ("x", 1, 1), ("y", 1, 2)], 3) == {
        "big": 0, "x": 1, "y": 1}
    assert common.even_buckets(list(reversed(four)), 2) == {"a": 0, "b": 0, "c": 1, "d": 1}


# ----------------------------------------------------------------------------- a real graph

def _chain_model():
    """The dense chain in the default graph; returns (x, loss, train op)."""
    x = tf1.placeholder(tf.float32, [None, WIDTHS[0]], name="x")
    h = x
    for i in range(4):
        with tf1.variable_scope(f"layer{i}"):
            w = tf1.get_variable("kernel", [WIDTHS[i], WIDTHS[i + 1]], use_resource=True,
                                 initializer=tf1.random_normal_initializer(stddev=0.05, seed=i))
            b = tf1.get_variable("bias", [WIDTHS[i + 1]], use_resource=True,
                                 initializer=tf1.zeros_initializer())
            h = tf.matmul(h, w) + b
            h = tf.tanh(h) if i < 3 else h
    loss = tf.reduce_mean(tf.square(h))
    return x, loss, tf1.train.GradientDescentOptimizer(0.01).minimize(loss)


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """(session, strategy, GraphItem) of the chain under AllReduce(bucket_bytes=CAP), its
    buckets reduced by TensorFlow's collective (one op per bucket to look for)."""
    spec = tmp_path_factory.mktemp("spec") / "spec.yml"
    spec.write_text("nodes:\n  - address: localhost\n    cpus: [0, 1]\n    chief: true\n")
    ad = AutoDist(str(spec), AllReduce(bucket_bytes=CAP, all_reduce_spec="AUTO"))
    with tf.Graph().as_default(), ad.scope():
        x, loss, train = _chain_model()
        session = ad.create_distributed_session()
        batch = np.random.RandomState(0).rand(8, WIDTHS[0]).astype(np.float32)
        before = session.run(loss, {x: batch})
        session.run(train, {x: batch})
        assert session.run(loss, {x: batch}) < before
        yield session, ad.strategy, session.distributed.item
        session.close()


def test_gradients_are_ranked_from_the_last_layer_to_the_first(chain):
    _, _, item = chain
    rank = {v.name: v.ready_rank for v in item.trainable_variables}
    assert sorted(rank.values()) == list(range(8))
    for later, earlier in ((3, 2), (2, 1), (1, 0)):
        assert max(rank[f"layer{later}/{k}"] for k in ("kernel", "bias")) \
            < min(rank[f"layer{earlier}/{k}"] for k in ("kernel", "bias"))


def test_buckets_are_capped_by_bytes_and_filled_in_backward_order(chain):
    _, strategy, item = chain
    group = {n.var_name: n.AllReduceSynchronizer.group for n in strategy.node_config}
    ordered = sorted(item.trainable_variables, key=lambda v: v.ready_rank)
    groups = [group[v.name] for v in ordered]
    assert groups == sorted(groups) and groups[0] == 0
    loads = {}
    for var in ordered:
        loads.setdefault(group[var.name], []).append(BYTES[var.name])
    for g, sizes in loads.items():
        # At most the cap, unless a single unit is larger; and full: the next unit did not fit.
        assert sum(sizes) <= CAP or len(sizes) == 1, (g, sizes)
        if g + 1 in loads:
            assert sum(sizes) + loads[g + 1][0] > CAP, (g, sizes, loads[g + 1])
    assert loads[group["layer1/kernel"]] == [BYTES["layer1/kernel"]]  # larger than a bucket
    assert group["layer3/kernel"] == group["layer3/bias"] == group["layer2/kernel"] == 0
    assert group["layer0/kernel"] == max(groups)


def _collectives(graph: tf.Graph, replica: int = 0) -> list:
    """Replica ``replica``'s all-reduce collectives as (instance key, elements, op), by key."""
    found = []
    for op in graph.get_operations():
        if op.type == "CollectiveReduceV2" and op.device.endswith(f"CPU:{replica}"):
            key = int(tf.get_static_value(op.inputs[3]))
            found.append((key, op.inputs[0].shape.num_elements(), op))
    return sorted(found, key=lambda c: c[0])


def test_each_bucket_is_one_collective_launched_in_backward_order(chain):
    session, strategy, _ = chain
    group = {n.var_name: n.AllReduceSynchronizer.group for n in strategy.node_config}
    elements = {}
    for name, g in group.items():
        elements[g] = elements.get(g, 0) + BYTES[name] // 4
    for replica in (0, 1):
        collectives = _collectives(session.distributed.graph, replica)
        assert [size for _, size, _ in collectives] == [elements[g] for g in sorted(elements)]


def _ancestors(op: tf.Operation) -> set:
    seen, todo = set(), [op]
    while todo:
        current = todo.pop()
        for parent in [t.op for t in current.inputs] + list(current.control_inputs):
            if parent.name not in seen:
                seen.add(parent.name)
                todo.append(parent)
    return seen


def test_the_first_bucket_does_not_wait_for_the_first_layers_gradients(chain):
    """Its collective needs only the last layers' gradients, so it can run while the
    backward pass still computes the first layers' (TensorFlow runs an op once its
    inputs exist)."""
    session, _, item = chain
    distributed = session.distributed
    for replica in (0, 1):
        collectives = _collectives(distributed.graph, replica)
        first_layer = {distributed.replica_element(item.gradients[f"layer0/{k}"].values,
                                                   replica).op.name for k in ("kernel", "bias")}
        assert first_layer <= _ancestors(collectives[-1][2])
        assert not first_layer & _ancestors(collectives[0][2])


@pytest.mark.parametrize("builder", [PartitionedAR(bucket_bytes=CAP), Parallax(bucket_bytes=CAP),
                                     ShardedUpdateAR(bucket_bytes=CAP)])
def test_every_all_reduce_builder_buckets_in_backward_order(chain, builder):
    _, _, item = chain
    strategy = builder.build(item, ONE_NODE)
    rank = {v.name: v.ready_rank for v in item.trainable_variables}
    pairs = []
    for node in strategy.node_config:
        for part in (node.part_config or [node]):
            pairs.append((rank[node.var_name], getattr(part, part.WhichOneof("synchronizer")).group))
    groups = [g for _, g in sorted(pairs, key=lambda p: p[0])]
    assert groups == sorted(groups) and max(groups) >= 2
