"""Checkpoints in the single-device layout: AutoDist <-> plain TensorFlow, and resuming.

A checkpoint written under any strategy must hold exactly what a plain
``tf.compat.v1.train.Saver`` of the single-device model would (same names, full
shapes, optimizer slots), and restore in either direction.
"""
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import tensorflow as tf

import models
from autodist import partition
from autodist import AutoDist
from autodist.checkpoint import CheckpointError, SavedModelBuilder, Saver, latest_checkpoint
from autodist.checkpoint import saver as saver_module
from autodist.strategy import AllReduce, PartitionedPS, Strategy, common
from test_equivalence import BUILDERS, OPTIMIZERS, axis_one_strategy
from test_ps_synchronizer import _ancestors

tf1 = tf.compat.v1

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

MODEL = "partitionable"  # odd shapes, a sparse table, several partitionable axes
ATOL = RTOL = 1e-5


def adam():
    return OPTIMIZERS["adam"]()


def single_device(steps: int, restore_from: str = None, save_to: str = None,
                  restore_slots: bool = True) -> dict:
    """Plain TF on the global batch: every global variable after ``steps`` steps."""
    with tf.Graph().as_default():
        built = models.MODELS[MODEL](adam)
        saver = tf1.train.Saver()
        with tf1.Session() as sess:
            sess.run(tf1.global_variables_initializer())
            if restore_from:
                restored = (saver if restore_slots else tf1.train.Saver(
                    tf1.trainable_variables() + [tf1.train.get_global_step()]))
                restored.restore(sess, restore_from)
            for _ in range(steps):
                sess.run(built.train_op, built.feeds)
            if save_to:
                saver.save(sess, save_to)
            return {v.op.name: sess.run(v) for v in tf1.global_variables()}


def autodist_job(spec: str, builder, steps: int, restore_from: str = None,
                 save_to: str = None, model: str = MODEL):
    """One AutoDist job: (its variables as fetched after training, the saved path)."""
    ad = AutoDist(spec, builder)
    with tf.Graph().as_default(), ad.scope():
        built = models.MODELS[model](adam)
        saver = Saver()
        with ad.create_distributed_session() as sess:
            if restore_from:
                saver.restore(sess, restore_from)
            for _ in range(steps):
                sess.run(built.train_op, built.feeds)
            names = [models.as_tf_variable(v).op.name for v in built.variables]
            values = dict(zip(names, sess.run(built.variables)))
            path = saver.save(sess, save_to) if save_to else None
    return values, path


def checkpoint_values(path: str) -> dict:
    reader = tf.train.load_checkpoint(path)
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()}


def plain_restore(path: str) -> dict:
    """Restores ``path`` into the plain single-device graph with TF's own Saver."""
    with tf.Graph().as_default():
        models.MODELS[MODEL](adam)
        with tf1.Session() as sess:
            tf1.train.Saver().restore(sess, path)
            return {v.op.name: sess.run(v) for v in tf1.global_variables()}


def ps_axis_one_strategy(replicas) -> Strategy:
    """Every matrix cut "1,2" with both parts on the PS; vectors whole on the PS."""
    strategy = axis_one_strategy(MODEL, replicas)
    for node in strategy.node_config:
        if node.part_config:
            for i, part in enumerate(node.part_config):
                part.CopyFrom(common.ps_node_config(partition.part_name(node.var_name, i),
                                                    replicas[0]))
        else:
            node.CopyFrom(common.ps_node_config(node.var_name, replicas[0]))
    return strategy


REPLICAS = ["localhost:CPU:0", "localhost:CPU:1"]
STRATEGIES = dict(BUILDERS, **{
    "PS-axis-1": lambda: ps_axis_one_strategy(REPLICAS),
    "PS-and-AllReduce-axis-1": lambda: axis_one_strategy(MODEL, REPLICAS),
})


def assert_restores_like_single_device(path: str, trained: dict, steps: int) -> dict:
    """``path`` restores in plain TF to ``trained`` bit for bit, and holds what
    single-device training holds after ``steps`` steps; returns its entries."""
    restored = plain_restore(path)
    # The variables come back bit for bit as the AutoDist session had them ...
    for name, value in trained.items():
        np.testing.assert_array_equal(restored[name], value, err_msg=name)
    # ... and every entry, slots and Adam's powers included, is what single-device
    # training holds under the same name and shape.
    want = single_device(steps)
    saved = checkpoint_values(path)
    assert sorted(saved) == sorted(want)
    for name, value in want.items():
        np.testing.assert_allclose(saved[name], value, rtol=RTOL, atol=ATOL, err_msg=name)
    return saved


@pytest.mark.parametrize("builder", sorted(STRATEGIES))
def test_a_strategy_checkpoint_restores_in_plain_tensorflow(spec_path, tmp_path, builder):
    trained, path = autodist_job(spec_path, STRATEGIES[builder](), 3,
                                 save_to=str(tmp_path / "model"))
    assert_restores_like_single_device(path, trained, 3)


@pytest.mark.parametrize("builder", ["PS", "PartitionedPS", "AllReduce", "PartitionedAR",
                                     "RandomAxisPartitionAR", "Parallax-local_proxy",
                                     "PS-and-AllReduce-axis-1"])
def test_a_plain_checkpoint_restores_under_a_strategy(spec_path, tmp_path, builder):
    start = str(tmp_path / "plain")
    single_device(2, save_to=start)
    trained, _ = autodist_job(spec_path, STRATEGIES[builder](), 2, restore_from=start)
    want = single_device(4)
    for name, value in trained.items():
        np.testing.assert_allclose(value, want[name], rtol=RTOL, atol=ATOL, err_msg=name)


def test_partitioned_variables_are_saved_and_restored_part_by_part(spec_path, tmp_path,
                                                                    monkeypatch):
    """Each part is written as its slice of the single-device variable, one shard
    after the other (here one entry per shard), and read back so; the files are
    an ordinary checkpoint of the single-device model."""
    monkeypatch.setattr(saver_module, "SHARD_BYTES", 1)
    ad = AutoDist(spec_path, PartitionedPS())
    with tf.Graph().as_default(), ad.scope():
        built = models.MODELS[MODEL](adam)
        saver = Saver()
        with ad.create_distributed_session() as sess:
            for _ in range(2):
                sess.run(built.train_op, built.feeds)
            names = [models.as_tf_variable(v).op.name for v in built.variables]
            trained = dict(zip(names, sess.run(built.variables)))
            path = saver.save(sess, str(tmp_path / "model"))
            plans = {name: s.compiled.plan for name, s in sess.distributed.storage.items()}
            graph = sess.distributed.graph
            saves = [op for op in graph.get_operations() if op.type == "SaveV2"]
            restores = [op for op in graph.get_operations() if op.type == "RestoreV2"]
            sess.run(built.train_op, built.feeds)
            saver.restore(sess, path)
            np.testing.assert_array_equal(sess.run(built.variables[0]), trained["odd"])
    partitioned = {name: plan for name, plan in plans.items() if plan is not None}
    assert {"proj", "table"} <= set(partitioned), plans
    # One shard per entry, each waiting for the one before it.
    assert len(saves) == len(restores) > len(trained)
    for earlier, later in zip(saves, saves[1:]):
        assert earlier in _ancestors(later), (earlier.name, later.name)
    # No save reads a partitioned variable (or its Adam slots) whole: each saves its
    # parts, with the part's shape, under the variable's name with a slice spec.
    written = {}
    for save in saves:
        keys, slices = (tf.get_static_value(save.inputs[i]) for i in (1, 2))
        for key, spec, tensor in zip(keys, slices, save.inputs[3:]):
            written.setdefault(key.decode(), []).append((spec.decode(), tuple(tensor.shape)))
    for name, plan in partitioned.items():
        for key in (name, f"{name}/Adam", f"{name}/Adam_1"):
            assert sorted(shape for _, shape in written[key]) == sorted(
                plan.part_shape(i) for i in range(plan.num_parts)), key
            assert all(spec.startswith(" ".join(map(str, plan.shape)) + " ")
                       for spec, _ in written[key]), written[key]
    assert_restores_like_single_device(path, trained, 2)


def test_resuming_under_another_strategy_and_replica_count(spec_path, spec_path_4cpu, tmp_path):
    """2 steps with PartitionedPS on 2 replicas, then 2 with AllReduce on 4 = 4 steps."""
    _, path = autodist_job(spec_path, PartitionedPS(), 2, save_to=str(tmp_path / "first"))
    resumed, _ = autodist_job(spec_path_4cpu, AllReduce(), 2, restore_from=path)
    want = single_device(4)
    for name, value in resumed.items():
        np.testing.assert_allclose(value, want[name], rtol=RTOL, atol=ATOL, err_msg=name)
    # The slots matter: resuming from the variables alone ends elsewhere.
    without_slots = single_device(2, restore_from=path, restore_slots=False)
    assert not np.allclose(without_slots["odd"], want["odd"], rtol=RTOL, atol=1e-3)


def test_max_to_keep_latest_checkpoint_and_meta_graph(spec_path, tmp_path):
    ad = AutoDist(spec_path, PartitionedPS())
    prefix = str(tmp_path / "run" / "model")
    with tf.Graph().as_default(), ad.scope():
        built = models.MODELS[MODEL](adam)
        saver = Saver(max_to_keep=2)
        with ad.create_distributed_session() as sess:
            paths = []
            for _ in range(3):
                sess.run(built.train_op, built.feeds)
                paths.append(saver.save(sess, prefix, global_step=tf1.train.get_global_step()))
            odd = sess.run(built.variables[0])
    assert paths == [f"{prefix}-{step}" for step in (1, 2, 3)]
    assert latest_checkpoint(str(tmp_path / "run")) == paths[-1]
    assert saver.last_checkpoints == paths[1:]
    assert not tf.io.gfile.glob(paths[0] + ".*")
    # The .meta file is the single-device graph: import it anywhere and restore.
    with tf.Graph().as_default():
        plain_saver = tf1.train.import_meta_graph(paths[-1] + ".meta")
        assert not [op for op in tf1.get_default_graph().get_operations()
                    if "AutoDist" in op.name]
        with tf1.Session() as sess:
            plain_saver.restore(sess, paths[-1])
            variables = {v.op.name: v for v in tf1.global_variables()}
            np.testing.assert_array_equal(sess.run(variables["odd"]), odd)


def test_restore_errors_name_the_problem(spec_path, tmp_path):
    ad = AutoDist(spec_path, AllReduce())
    with tf.Graph().as_default(), ad.scope():
        built = models.MODELS["dense"](adam)
        saver = Saver()
        with ad.create_distributed_session() as sess:
            with pytest.raises(CheckpointError, match="no checkpoint at .*nowhere'"):
                saver.restore(sess, str(tmp_path / "nowhere"))
            other = str(tmp_path / "other")
            single_device(1, save_to=other)  # the partitionable model: other variables
            with pytest.raises(ValueError, match=r"missing \[.*'w1'"):
                saver.restore(sess, other)
            with tf1.Session(graph=tf.Graph()) as plain:
                with pytest.raises(TypeError, match="create_distributed_session"):
                    saver.save(plain, str(tmp_path / "x"))
            sess.run(built.train_op, built.feeds)


def test_saved_model_serves_the_trained_predictions(spec_path, tmp_path):
    import keras
    rng = np.random.RandomState(0)
    features = rng.randn(8, 6).astype(np.float32)
    targets = rng.randn(8, 2).astype(np.float32)
    ad = AutoDist(spec_path, AllReduce())
    export = str(tmp_path / "served")
    with tf.Graph().as_default(), ad.scope():
        x = tf1.placeholder(tf.float32, [None, 6], name="x")
        y = tf1.placeholder(tf.float32, [None, 2], name="y")
        prediction = keras.layers.Dense(2, name="out")(keras.layers.Dense(5, "tanh")(x))
        loss = tf.reduce_mean(tf.square(prediction - y))
        train_op = tf1.train.AdamOptimizer(0.05).minimize(loss)
        with ad.create_distributed_session() as sess:
            initial_prediction = sess.run(prediction, {x: features})
            for _ in range(3):
                sess.run(train_op, {x: features, y: targets})
            trained_prediction = sess.run(prediction, {x: features})
            builder = SavedModelBuilder(export)
            builder.add_meta_graph_and_variables(
                sess, [tf.saved_model.SERVING],
                signature_def_map={"predict": tf1.saved_model.predict_signature_def(
                    inputs={"x": x}, outputs={"y": prediction})})
            builder.save()
    with tf.Graph().as_default(), tf1.Session() as served:
        meta = tf1.saved_model.load(served, [tf.saved_model.SERVING], export)
        signature = meta.signature_def["predict"]
        assert not [op for op in served.graph.get_operations() if "AutoDist" in op.name]
        got = served.run(signature.outputs["y"].name, {signature.inputs["x"].name: features})
    np.testing.assert_allclose(got, trained_prediction, rtol=1e-6, atol=1e-6)
    # It is the trained model, not the initial one.
    assert np.abs(got - initial_prediction).max() > 1e-3


SAVE_AND_DIE = textwrap.dedent("""
    import os, sys, time
    import numpy as np, tensorflow as tf
    from autodist import AutoDist
    from autodist.checkpoint import Saver
    from autodist.strategy import PartitionedPS
    tf1 = tf.compat.v1
    ad = AutoDist(sys.argv[1], PartitionedPS())
    with tf.Graph().as_default(), ad.scope():
        # Large enough that writing it takes a while: the kill lands mid-save.
        big = tf1.get_variable("big", [8192, 8192], initializer=tf1.ones_initializer(),
                               use_resource=True)
        loss = tf.reduce_sum(big[:2, :2])
        train_op = tf1.train.GradientDescentOptimizer(1.0).minimize(
            loss, global_step=tf1.train.get_or_create_global_step())
        saver = Saver()
        sess = ad.create_distributed_session()
        sess.run(train_op)
        saver.save(sess, sys.argv[2], global_step=1)
        sess.run(train_op)
        print("second save starts", flush=True)
        saver.save(sess, sys.argv[2], global_step=2)
        print("second save done", flush=True)
""")


@pytest.mark.timeout(180)
def test_a_save_killed_midway_leaves_the_previous_checkpoint(spec_path, tmp_path):
    script = tmp_path / "save_and_die.py"
    script.write_text(SAVE_AND_DIE)
    prefix = str(tmp_path / "ckpt" / "model")
    process = subprocess.Popen([sys.executable, str(script), spec_path, prefix],
                               stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "second save starts"
        # Wait until the second save is writing its files, then kill it.
        deadline = time.monotonic() + 60
        while not [f for f in os.listdir(tmp_path / "ckpt") if "-2" in f]:
            assert time.monotonic() < deadline, "the second save never started writing"
            time.sleep(0.005)
        process.send_signal(signal.SIGKILL)
        assert "second save done" not in process.stdout.read()
    finally:
        process.kill()
        process.wait()
    written = sorted(os.listdir(tmp_path / "ckpt"))
    assert "model-2.index" not in written, written  # the kill did land mid-save
    assert latest_checkpoint(str(tmp_path / "ckpt")) == f"{prefix}-1"
    reader = tf.train.load_checkpoint(f"{prefix}-1")
    assert reader.get_tensor("global_step") == 1
    big = reader.get_tensor("big")
    assert big[0, 0] == 0.0 and big[5, 5] == 1.0  # one SGD step of lr 1 on the corner


# --- Crash safety: a save killed anywhere leaves the previous checkpoint usable -----------------

SAVE_JOB = os.path.join(os.path.dirname(__file__), "checkpoint_save_job.py")
REPO = os.path.join(os.path.dirname(__file__), "..")
# The files of checkpoint_save_job.py's second save: what their paths contain
# (temporary and final names alike), and which file of that name is the second
# save's (the state file is written by the first save too).
SECOND_SAVE_FILES = {"data": ("model-2.data", 1), "index": ("model-2.index", 1),
                     "meta": ("model-2.meta", 1), "state": ("/checkpoint", 2)}
# Kills the process at the KILL_COUNT-th file whose path contains KILL_FILE:
# KILL_AT=write half-way through the first write to it (its temporary file holds
# part of its bytes), KILL_AT=rename as it is about to get its final name (it is
# written in full under its temporary name). TensorFlow writes files with
# fwrite, Python with write.
_KILL_INJECTOR = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
static int renames, files;
static char last[4096];
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int armed(const char *moment) {
    const char *at = getenv("KILL_AT");
    return at && getenv("KILL_FILE") && strcmp(at, moment) == 0;
}
static int wanted(void) {
    const char *count = getenv("KILL_COUNT");
    return atoi(count ? count : "1");
}
int rename(const char *old_path, const char *new_path) {
    if (armed("rename") && new_path && strstr(new_path, getenv("KILL_FILE"))
            && __atomic_add_fetch(&renames, 1, __ATOMIC_SEQ_CST) == wanted())
        kill(getpid(), SIGKILL);
    int (*real)(const char *, const char *) =
        (int (*)(const char *, const char *))dlsym(RTLD_NEXT, "rename");
    return real(old_path, new_path);
}
/* Whether a write to fd is the first to the file to die in. */
static int dies_writing(int fd) {
    char link[64], path[4096];
    if (!armed("write") || fd < 0)
        return 0;
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t length = readlink(link, path, sizeof path - 1);
    if (length < 0)
        return 0;
    path[length] = 0;
    if (!strstr(path, getenv("KILL_FILE")))
        return 0;
    int dies = 0;
    pthread_mutex_lock(&lock);
    if (strcmp(path, last) != 0) {
        strcpy(last, path);
        dies = ++files == wanted();
    }
    pthread_mutex_unlock(&lock);
    return dies;
}
ssize_t write(int fd, const void *data, size_t size) {
    ssize_t (*real)(int, const void *, size_t) =
        (ssize_t (*)(int, const void *, size_t))dlsym(RTLD_NEXT, "write");
    if (dies_writing(fd)) {
        real(fd, data, size / 2);
        kill(getpid(), SIGKILL);
    }
    return real(fd, data, size);
}
size_t fwrite(const void *data, size_t size, size_t items, FILE *stream) {
    size_t (*real)(const void *, size_t, size_t, FILE *) =
        (size_t (*)(const void *, size_t, size_t, FILE *))dlsym(RTLD_NEXT, "fwrite");
    if (dies_writing(fileno(stream))) {
        real(data, 1, size * items / 2, stream);
        fflush(stream);
        kill(getpid(), SIGKILL);
    }
    return real(data, size, items, stream);
}
"""


@pytest.fixture(scope="module")
def kill_injector(tmp_path_factory) -> str:
    """A preload library killing the process in a chosen file (needs a C compiler)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the crash injector")
    directory = tmp_path_factory.mktemp("inject")
    (directory / "kill_injector.c").write_text(_KILL_INJECTOR)
    library = directory / "kill_injector.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(library),
                    str(directory / "kill_injector.c"), "-ldl", "-lpthread"], check=True)
    return str(library)


def _leftovers(directory) -> list:
    return sorted(name for name in os.listdir(directory)
                  if ".tempstate" in name or ".tmp" in name or "autodist-tmp" in name)


def _run_save_job(directory, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SAVE_JOB, str(directory)], capture_output=True,
                          text=True, timeout=100, env=dict(os.environ, **env), cwd=REPO)


def _killed_in_second_save(directory, library: str, file: str, moment: str) -> None:
    """Runs checkpoint_save_job.py, killed at ``moment`` of ``file`` of its second save."""
    name, count = SECOND_SAVE_FILES[file]
    done = _run_save_job(directory, LD_PRELOAD=library, KILL_AT=moment, KILL_FILE=name,
                         KILL_COUNT=str(count))
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    assert "saving 2" in done.stdout and "saved 2" not in done.stdout
    # It died in that file: its temporary is left, under the name it was written as.
    left = _leftovers(directory)
    assert [n for n in left if n.startswith(name.lstrip("/"))], (left, os.listdir(directory))


def _restored_plainly(path: str) -> dict:
    """The checkpoint's variables, restored in plain TensorFlow through its meta graph."""
    with tf.Graph().as_default():
        saver = tf.compat.v1.train.import_meta_graph(f"{path}.meta")
        with tf.compat.v1.Session() as sess:
            saver.restore(sess, path)
            variables = {v.op.name: v for v in tf.compat.v1.global_variables()}
            return {name: sess.run(variables[name]) for name in ("table", "w")}


def _restored_by_autodist(path: str) -> dict:
    """The checkpoint's variables, restored by AutoDist's Saver under another strategy."""
    import checkpoint_save_job as job
    ad = AutoDist(os.path.join(REPO, "configs", "local_2cpu.yml"), AllReduce())
    with tf.Graph().as_default(), ad.scope():
        _, _, variables = job.build()
        saver = Saver()
        with ad.create_distributed_session() as sess:
            saver.restore(sess, path)
            return dict(zip(("table", "w"), sess.run(variables)))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("moment", ["write", "rename"])
@pytest.mark.parametrize("file", list(SECOND_SAVE_FILES))
def test_a_save_killed_in_any_file_leaves_the_previous_checkpoint_restorable(
        tmp_path, kill_injector, file, moment):
    _killed_in_second_save(tmp_path, kill_injector, file, moment)
    path = latest_checkpoint(str(tmp_path))
    assert path == str(tmp_path / "model-1")
    saved = checkpoint_values(path)
    assert not np.all(saved["w"] == 1.0)  # trained for a step: not the initial values
    for restored in (_restored_plainly(path), _restored_by_autodist(path)):
        for name in ("table", "w"):
            np.testing.assert_array_equal(restored[name], saved[name], err_msg=name)
    # The next save removes what the killed one left, and writes both checkpoints again.
    again = _run_save_job(tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    assert _leftovers(tmp_path) == []
    assert latest_checkpoint(str(tmp_path)) == str(tmp_path / "model-2")


# --- Checkpoint errors name the path and the cause ------------------------------------------------

def _saved_once(tmp_path, dtype=tf.float32):
    """A session of checkpoint_save_job's model (in ``dtype``), its saver and one checkpoint."""
    import checkpoint_save_job as job
    ad = AutoDist(os.path.join(REPO, "configs", "local_2cpu.yml"), AllReduce())
    graph = tf.Graph()
    with graph.as_default(), ad.scope():
        job.build(dtype)
        saver = Saver()
        sess = ad.create_distributed_session()
        path = saver.save(sess, str(tmp_path / "model"))
    return graph, sess, saver, path


def _restore_error(graph, sess, saver, path) -> str:
    with graph.as_default(), pytest.raises(CheckpointError) as info:
        saver.restore(sess, path)
    assert path in str(info.value)
    return str(info.value)


def _garble(file: str) -> None:
    """Inverts 64 bytes in the middle of ``file``; its length stays."""
    with open(file, "r+b") as target:
        target.seek(os.path.getsize(file) // 2)
        bytes_ = target.read(64)
        target.seek(-len(bytes_), os.SEEK_CUR)
        target.write(bytes(b ^ 0xFF for b in bytes_))


def _truncate(file: str) -> None:
    with open(file, "r+b") as target:
        target.truncate(os.path.getsize(file) // 2)


# What is done to which file of the checkpoint, and what the error must say of it
# ({data} and {index} stand for the files' paths).
DAMAGES = {
    "data deleted": ("data", os.unlink, "its data file '{data}' is missing"),
    "data truncated": ("data", _truncate, "the files are cut short"),
    "data garbled": ("data", _garble, "the files are corrupt (TensorBundle at"),
    "index deleted": ("index", os.unlink, "its .index file is missing"),
    "index truncated": ("index", _truncate, "its index file '{index}' is corrupt or cut short"),
    "index garbled": ("index", _garble, "its index file '{index}' is corrupt or cut short"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_checkpoint_is_named_with_its_cause(tmp_path, damage):
    graph, sess, saver, path = _saved_once(tmp_path)
    files = {"data": f"{path}.data-00000-of-00001", "index": f"{path}.index"}
    target, spoil, cause = DAMAGES[damage]
    spoil(files[target])
    message = _restore_error(graph, sess, saver, path)
    assert cause.format(**files) in message, message
    if damage == "data garbled":
        assert "Checksum does not match" in message, message
    sess.close()


def test_a_checkpoint_of_another_dtype_is_named_by_variable(tmp_path):
    _, first, _, path = _saved_once(tmp_path / "f32")
    first.close()
    graph, sess, saver, _ = _saved_once(tmp_path / "f64", dtype=tf.float64)
    message = _restore_error(graph, sess, saver, path)
    assert "other dtypes: table float32 (the model has float64)" in message
    sess.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tiny file system")
def test_a_full_disk_is_named_and_leaves_no_partial_files(tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    graph, sess, saver, _ = _saved_once(tmp_path)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(small)], check=True)
    try:
        with graph.as_default(), pytest.raises(CheckpointError) as info:
            saver.save(sess, str(small / "model"))
        assert str(small / "model") in str(info.value) and "the disk is full" in str(info.value)
        assert os.listdir(small) == []
    finally:
        subprocess.run(["umount", str(small)], check=True)
        sess.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a read-only view of a directory")
def test_a_read_only_directory_is_named(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    graph, sess, saver, _ = _saved_once(tmp_path)
    subprocess.run(["mount", "--bind", str(locked), str(locked)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(locked)], check=True)
        with graph.as_default(), pytest.raises(CheckpointError) as info:
            saver.save(sess, str(locked / "model"))
        message = str(info.value)
        assert str(locked / "model") in message and "read-only file system" in message, message
    finally:
        subprocess.run(["umount", str(locked)], check=True)
        sess.close()
