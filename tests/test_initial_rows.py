"""A partitioned variable's initial value is computed part by part, on the parts' devices.

``initial_rows`` rebuilds rows of an initial value from its ops; each case is
checked against the rows cut from the whole value, so a TensorFlow whose
generators change fails here.
"""
from __future__ import annotations

import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from autodist import _tf_compat
from autodist.graph_item import GraphItem
from autodist.kernels import initial_rows
from autodist.kernels.transformer import transform
from autodist.kernel_context import KernelContext
from autodist.resource_spec import ResourceSpec
from autodist.strategy import PartitionedPS
from autodist.strategy.compiler import compile_strategy

tf1 = tf.compat.v1

RANGES = [(0, 7), (4, 23), (22, 400), (399, 400)]


def keras_value(initializer, shape=(400, 8), dtype="float32"):
    return lambda: keras.initializers.get(initializer)(shape, dtype=dtype)


def v1_value(initializer, shape=(400, 8), dtype=tf.float32):
    return lambda: initializer(shape, dtype=dtype)


CASES = {
    "keras uniform": keras_value({"class_name": "RandomUniform",
                                  "config": {"minval": -2.0, "maxval": 3.0, "seed": 5}}),
    "keras normal": keras_value({"class_name": "RandomNormal",
                                 "config": {"mean": 1.0, "stddev": 0.5, "seed": 6}}),
    "keras glorot uniform": keras_value({"class_name": "GlorotUniform", "config": {"seed": 7}}),
    "keras unseeded uniform": keras_value("uniform"),
    "keras zeros": keras_value("zeros"),
    "keras ones float64": keras_value("ones", dtype="float64"),
    "keras normal float64": keras_value({"class_name": "RandomNormal", "config": {"seed": 8}},
                                        dtype="float64"),
    "v1 uniform": v1_value(tf1.random_uniform_initializer(-1.0, 2.0, seed=9)),
    "v1 normal": v1_value(tf1.random_normal_initializer(0.5, 2.0, seed=10)),
    "v1 glorot uniform": v1_value(tf1.glorot_uniform_initializer(seed=11)),
    "v1 uniform float64": v1_value(tf1.random_uniform_initializer(seed=12), dtype=tf.float64),
    "v1 stateless uniform, odd rows": lambda: tf.random.stateless_uniform([400, 3], seed=[1, 2]),
    "constant array": lambda: tf.constant(np.arange(400 * 8, dtype=np.float32).reshape(400, 8)),
    "small zeros": lambda: tf.zeros([400, 2]) + 1.5,
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_rows_equal_the_rows_of_the_whole_value(case):
    with tf.Graph().as_default():
        tf1.set_random_seed(3)
        value = CASES[case]()
        built = {}
        for begin, end in RANGES:
            rows = initial_rows.rows_of(value, begin, end)
            if rows is not None:
                built[begin, end] = rows()
        with tf1.Session() as session:
            whole, parts = session.run([value, built])
    # Rows of 3 float32s start on a generator step only every 4 rows.
    expected = {r for r in RANGES if "odd rows" not in case or r[0] % 4 == 0}
    assert set(parts) == expected
    for (begin, end), rows in parts.items():
        np.testing.assert_array_equal(rows, whole[begin:end])


def test_a_counter_near_its_64_bit_end_carries_into_the_high_word():
    with tf.Graph().as_default():
        counter = tf.constant(np.array([2 ** 64 - 3, 41], np.uint64))
        value = tf.raw_ops.StatelessRandomUniformV2(
            shape=[40, 8], key=tf.constant([77], tf.uint64), counter=counter, alg=1,
            dtype=tf.float32)
        rows = initial_rows.rows_of(value, 4, 23)()
        with tf1.Session() as session:
            whole, part = session.run([value, rows])
    np.testing.assert_array_equal(part, whole[4:23])


@pytest.mark.parametrize("make", [
    lambda: tf1.truncated_normal_initializer(seed=1)([40, 8]),
    lambda: tf1.random_uniform_initializer()([40, 8]),  # unseeded: TF seeds it at run time
    lambda: tf.random.stateless_uniform([40, 8], seed=[1, 2]) @ tf.ones([8, 8]),
], ids=["truncated normal", "unseeded", "matmul"])
def test_other_values_are_not_computed_by_rows(make):
    with tf.Graph().as_default():
        assert initial_rows.rows_of(make(), 4, 23) is None


def test_each_part_of_a_table_starts_from_its_own_rows_on_its_server():
    """Under PartitionedPS over two nodes, no op of the whole table's shape runs: each
    server draws its part's rows, and the values are those of the single-device table."""
    calls = []
    with tf.Graph().as_default() as graph, _tf_compat.capture_apply_gradients(calls.append):
        ids = tf1.placeholder(tf.int32, [None])
        table = tf1.get_variable("table", [64, 8], use_resource=True,
                                 initializer=tf1.random_uniform_initializer(seed=4))
        tf1.train.GradientDescentOptimizer(0.1).minimize(tf.reduce_sum(tf.gather(table, ids)))
        with tf1.Session() as session:
            session.run(table.initializer)
            single = session.run(table)
    item = GraphItem(graph, calls)
    spec = ResourceSpec.from_dict({"nodes": [{"address": "10.0.0.1", "cpus": [0], "chief": True},
                                             {"address": "10.0.0.2", "cpus": [0]}]})
    compiled = compile_strategy(PartitionedPS().build(item, spec), item, spec)
    plan = compiled.variables["table"].plan
    assert plan is not None and len(plan.sizes) == 2
    servers = ("/job:worker/task:0/device:CPU:0", "/job:worker/task:1/device:CPU:0")
    ctx = KernelContext(replica_devices=("10.0.0.1:CPU:0",), tf_devices={
        "10.0.0.1:CPU:0": servers[0], "10.0.0.2:CPU:0": servers[1]},
        shared_device=servers[0], chief_device=servers[0], node_index=0, num_nodes=2,
        group_size=2, has_remote_ops=True)
    distributed = transform(item, compiled, ctx)
    parts = [v for v in distributed.graph.get_collection(tf1.GraphKeys.GLOBAL_VARIABLES)
             if v.op.name.startswith("table") and v.shape[0] in plan.sizes
             and v.shape[0] != 64]
    draws = {}
    with distributed.graph.as_default():
        for part in parts:
            source = part.initial_value.op
            while source.type not in ("StatelessRandomUniformV2", "Split", "SplitV"):
                source = source.inputs[0].op
            draws[part.op.name] = (source.type, source.device, part.device)
    assert sorted(d[0] for d in draws.values()) == ["StatelessRandomUniformV2"] * 2, draws
    assert {d[1] for d in draws.values()} == {tf.DeviceSpec.from_string(s).to_string()
                                              for s in servers}, draws
    assert all(device == part_device for _, device, part_device in draws.values()), draws
    # Run here, on this process's CPU.
    with distributed.graph.as_default():
        names = [p.initial_value.name for p in sorted(parts, key=lambda p: p.op.name)]
    with tf.Graph().as_default() as local:
        tf1.train.import_meta_graph(tf1.train.export_meta_graph(
            graph=distributed.graph, clear_devices=True))
        with tf1.Session(graph=local) as session:
            values = session.run(names)
    np.testing.assert_array_equal(np.concatenate(values), single)


_INIT_MEMORY_JOB = """
import sys
import tensorflow as tf
from autodist import AutoDist
from autodist.strategy import PartitionedPS
tf1 = tf.compat.v1

def peak_gib():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmHWM")) / 2 ** 20

ad = AutoDist(sys.argv[1], PartitionedPS())
with tf.Graph().as_default(), ad.scope():
    table = tf1.get_variable("table", [ROWS, 64], use_resource=True,
                             initializer=tf1.random_uniform_initializer(-0.05, 0.05, seed=3))
    ids = tf1.placeholder(tf.int32, [None])
    train = tf1.train.GradientDescentOptimizer(0.1).minimize(
        tf.reduce_sum(tf.gather(table, ids)))
    before = peak_gib()
    sess = ad.create_distributed_session()
    print("GROWTH", peak_gib() - before)
"""


def run_memory_job(source: str, directory, spec_path: str, timeout: float) -> dict:
    """Runs the job ``source`` (its own process, so that its memory is its own) on the
    spec; returns what it printed as ``NAME value`` lines, name -> value."""
    script = directory / "memory_job.py"
    script.write_text(source)
    # With oneDNN's optimisations on (TensorFlow's default), a Xeon with AVX512-FP16 kept
    # a step's freed buffers resident, and a job counted the step's temporaries as held
    # state (6 copies where 3 are held); other CPUs gave the memory back.
    done = subprocess.run([sys.executable, str(script), spec_path], capture_output=True,
                          text=True, timeout=timeout,
                          env=dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0"))
    assert done.returncode == 0, done.stderr[-2000:]
    figures = (line.split(" ") for line in done.stdout.splitlines() if line.count(" ") == 1)
    return {name: float(value) for name, value in figures if name.isupper()}


def test_starting_a_table_costs_its_size_once(spec_path, tmp_path):
    """TensorFlow's older graph optimizer would evaluate a seeded random initial value
    before the run, and keep its bytes: a table's start cost twice its size."""
    rows = 2 ** 20  # 256 MiB of float32
    growth = run_memory_job(_INIT_MEMORY_JOB.replace("ROWS", str(rows)), tmp_path, spec_path,
                            timeout=120)["GROWTH"]
    table_gib = rows * 64 * 4 / 2 ** 30
    assert table_gib * 0.9 < growth < table_gib * 1.4, (growth, table_gib)
