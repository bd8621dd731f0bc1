"""compile_strategy: the checks that run before any graph rewrite."""
import types

import pytest
import tensorflow as tf

import models
from autodist import _tf_compat
from autodist.graph_item import GraphItem, VariableInfo
from autodist.resource_spec import ResourceSpec
from autodist.strategy import (AllReduce, Parallax, PartitionedPS, ShardedUpdateAR, Strategy,
                               StrategyError)
from autodist.strategy.compiler import compile_strategy, stored_bytes
from test_builders import GRAPH, ONE_NODE, THREE_NODES

pytestmark = pytest.mark.timeout(60)


def test_partitioned_variables_compile_to_their_parts():
    compiled = compile_strategy(PartitionedPS().build(GRAPH, THREE_NODES), GRAPH, THREE_NODES)
    emb = compiled.variables["emb"]
    assert emb.plan.axis == 0 and sum(emb.plan.sizes) == 1000
    assert [p.name for p in emb.parts] == [f"emb/part_{i}" for i in range(emb.plan.num_parts)]
    assert sum(p.shape[0] for p in emb.parts) == 1000


@pytest.mark.parametrize("sums", (False, True))
def test_a_step_summing_over_every_replica_runs_collectives_under_any_builder(sums):
    # A masked loss's total or synchronized batch statistics are collectives in the step
    # itself: a PS strategy's step on a cluster then splits in two runs, as a mixed one's
    # does, and its PS parts keep proxies on every node (in the memory estimate too).
    graph = types.SimpleNamespace(sums_over_replicas=sums,
                                  trainable_variables=GRAPH.trainable_variables)
    compiled = compile_strategy(PartitionedPS().build(graph, THREE_NODES), graph, THREE_NODES)
    assert compiled.has_remote_ops
    assert compiled.has_collectives is sums
    assert compiled.node_layout(THREE_NODES).split_step is sums


def test_a_device_outside_the_spec_is_named():
    strategy = AllReduce().build(GRAPH, ONE_NODE)
    node = strategy.node_config_by_name()["step"]
    node.PSSynchronizer.reduction_destination = "elsewhere:CPU:0"
    with pytest.raises(StrategyError, match="reduction_destination 'elsewhere:CPU:0'"):
        compile_strategy(strategy, GRAPH, ONE_NODE)


def test_a_strategy_built_for_fewer_nodes_is_named():
    """Reused on a spec with a node more, a strategy would leave that node no replica."""
    two_nodes = ResourceSpec.from_dict({"nodes": [
        {"address": "10.0.0.1", "cpus": [0, 1], "chief": True},
        {"address": "10.0.0.2", "cpus": [0]}]})
    strategy = AllReduce().build(GRAPH, two_nodes)
    with pytest.raises(StrategyError, match=r"has no replica on \['10.0.0.3:CPU:0', "
                                            r"'10.0.0.3:CPU:1', '10.0.0.3:CPU:2'\].*built for "
                                            r"another cluster"):
        compile_strategy(strategy, GRAPH, THREE_NODES)


def test_a_synchronous_variable_with_a_staleness_bound_is_refused():
    # Bounded staleness needs sync false; true with a bound would promise fresh reads.
    strategy = AllReduce().build(GRAPH, ONE_NODE)
    strategy.node_config_by_name()["step"].PSSynchronizer.staleness = 2
    with pytest.raises(StrategyError, match="'step' has sync true and staleness 2"):
        compile_strategy(strategy, GRAPH, ONE_NODE)


def test_a_partitioner_that_does_not_fit_is_named():
    strategy = PartitionedPS().build(GRAPH, ONE_NODE)
    strategy.node_config_by_name()["emb"].partitioner = "2,2"
    with pytest.raises(StrategyError, match="'emb': partitioner '2,2' splits 2 axes"):
        compile_strategy(strategy, GRAPH, ONE_NODE)


def test_a_variable_without_synchronizer_is_named():
    strategy = AllReduce().build(GRAPH, ONE_NODE)
    strategy.node_config_by_name()["scale"].ClearField("AllReduceSynchronizer")
    with pytest.raises(StrategyError, match="'scale' has no synchronizer"):
        compile_strategy(strategy, GRAPH, ONE_NODE)


def test_an_empty_strategy_is_refused():
    with pytest.raises(StrategyError, match="no replica devices"):
        compile_strategy(Strategy(), GRAPH, ONE_NODE)


def test_a_group_mixing_compressors_is_refused_naming_them():
    strategy = AllReduce(chunk_size=2).build(GRAPH, ONE_NODE)  # dense/bias, out/kernel: group 1
    nodes = strategy.node_config_by_name()
    assert {nodes[name].AllReduceSynchronizer.group for name in ("dense/bias", "out/kernel")} == {1}
    bias = nodes["dense/bias"].AllReduceSynchronizer
    bias.compressor = bias.HorovodCompressor
    with pytest.raises(StrategyError, match=r"group 1 mixes compressors \('out/kernel' "
                                            r"NoneCompressor, 'dense/bias' HorovodCompressor\)"):
        compile_strategy(strategy, GRAPH, ONE_NODE)


def test_sparse_gradients_in_a_compressed_group_are_allowed():
    """Sparse gradients are gathered uncompressed whatever their group's compressor."""
    strategy = AllReduce(chunk_size=2, compressor="HorovodCompressor").build(GRAPH, ONE_NODE)
    emb = strategy.node_config_by_name()["emb"].AllReduceSynchronizer
    emb.compressor = emb.NoneCompressor  # emb and dense/kernel share group 0
    compile_strategy(strategy, GRAPH, ONE_NODE)


def test_unbounded_asynchrony_is_refused():
    # sync false with staleness 0 (also proto3's default when sync is left out).
    strategy = AllReduce().build(GRAPH, ONE_NODE)
    strategy.node_config_by_name()["step"].PSSynchronizer.sync = False
    with pytest.raises(StrategyError, match="'step' has sync false \\(or unset\\) and staleness 0"):
        compile_strategy(strategy, GRAPH, ONE_NODE)


@pytest.mark.parametrize("field", ["compressor", "spec"])
def test_an_enum_value_outside_the_proto_is_named(tmp_path, field):
    strategy = AllReduce().build(GRAPH, ONE_NODE)
    setattr(strategy.node_config_by_name()["dense/bias"].AllReduceSynchronizer, field, 7)
    path = strategy.save(str(tmp_path / "hand_edited.strategy"))
    with pytest.raises(StrategyError, match=f"'dense/bias' has {field} 7, which is not one of"):
        compile_strategy(Strategy.load(path), GRAPH, ONE_NODE)


# ------------------------------------------------------------ what each node stores

MiB = 2 ** 20
TABLE = VariableInfo("table", (2 ** 20, 64), "float32", sparse_grad=True,
                     slot_bytes=2 * 256 * MiB)  # 256 MiB, with Adam's two moments
DENSE = VariableInfo("dense/kernel", (64, 2 ** 14), "float32", slot_bytes=8 * MiB)  # 4 MiB
TABLE_GRAPH = types.SimpleNamespace(sums_over_replicas=False, trainable_variables=[TABLE, DENSE])


def _capped(memory, *replicas):
    """A spec of nodes with ``replicas[i]`` CPU replicas each and ``memory`` per node."""
    return ResourceSpec.from_dict({"nodes": [
        {"address": f"10.0.0.{i}", "cpus": list(range(count)), "chief": i == 1,
         "memory": memory} for i, count in enumerate(replicas, start=1)]})


def _table_bytes(builder, spec) -> list:
    held = stored_bytes(compile_strategy(builder.build(TABLE_GRAPH, spec), TABLE_GRAPH, spec),
                        spec)
    return [held[address].get("table", 0) / MiB for address in spec.node_addresses]


def test_each_kind_counts_the_copies_it_stores_on_every_node():
    spec = _capped(None, 2, 1, 3)
    # A parameter server's parts, each with its slots, on their servers only: the table once.
    partitioned = _table_bytes(PartitionedPS(), spec)
    assert sum(partitioned) == pytest.approx(3 * 256) and max(partitioned) < 2 * 256
    # A copy with slots on every node; the chief also holds the copy the others start from.
    assert _table_bytes(AllReduce(), spec) == [4 * 256, 3 * 256, 3 * 256]
    # Parallax mixes collectives and servers, so replicas read parts through proxies: a
    # copy of the table per replica of every node, besides the node's own parts.
    proxied = _table_bytes(Parallax(), spec)
    assert [p - s for p, s in zip(proxied, partitioned)] == [2 * 256, 256, 3 * 256]
    # ShardedUpdate keeps AllReduce's copies and adds each replica's shard, slots sharded.
    held = stored_bytes(compile_strategy(ShardedUpdateAR().build(TABLE_GRAPH, spec),
                                         TABLE_GRAPH, spec), spec)
    shares = [2 / 6, 1 / 6, 3 / 6]
    assert [held[a]["dense/kernel"] / MiB for a in spec.node_addresses] == pytest.approx(
        [4 * (1 + (a == "10.0.0.1") + s) + 8 * s for a, s in zip(spec.node_addresses, shares)])


def test_a_partitioned_variable_read_whole_is_stitched_once_per_node():
    """An op reads a partitioned kernel whole as one tensor (a loop taking it): each
    node's CPU replicas share one copy stitched from the parts, besides the parts the
    node stores. Multiplied by (a matmul), it is read part by part: no copy."""
    def held_mib(**reads):
        kernel = VariableInfo("kernel", (64, 2 ** 14), "float32", **reads)  # 4 MiB
        graph = types.SimpleNamespace(sums_over_replicas=False, trainable_variables=[kernel])
        compiled = compile_strategy(PartitionedPS().build(graph, spec), graph, spec)
        return [v.get("kernel", 0) / MiB for v in stored_bytes(compiled, spec).values()]

    spec = _capped(None, 2, 1, 3)
    stitched = held_mib(read_whole=True, needs_stitching=True)
    assert sum(stitched) == pytest.approx(4 + 3 * 4)
    assert min(stitched) >= 4
    assert sum(held_mib(read_whole=True)) == pytest.approx(4)


def test_copies_on_gpus_are_not_in_the_nodes_memory():
    """With GPU replicas, Parallax's proxies sit on the GPUs: the node's memory holds only
    its parameter server's parts, as under PartitionedPS; AllReduce's copy is on the CPU."""
    spec = ResourceSpec.from_dict({"nodes": [
        {"address": f"10.0.0.{i}", "cpus": [0], "gpus": [0, 1], "chief": i == 1}
        for i in (1, 2)]})
    assert _table_bytes(Parallax(), spec) == _table_bytes(PartitionedPS(), spec)
    assert _table_bytes(AllReduce(), spec) == [4 * 256, 3 * 256]


def test_a_strategy_a_node_cannot_hold_is_refused_naming_node_and_variable():
    spec = _capped("600m", 1, 1, 1, 1)
    with pytest.raises(StrategyError) as refused:
        compile_strategy(AllReduce().build(TABLE_GRAPH, spec), TABLE_GRAPH, spec)
    message = str(refused.value)
    assert "does not fit node '10.0.0.1'" in message and "at least 1.02 GiB" in message
    assert "memory 0.59 GiB" in message and "'table' 1.00 GiB (AllReduceSynchronizer)" in message
    assert "PartitionedPS" in message
    # Partitioned over the four servers, each node holds a quarter of the table and slots.
    compiled = compile_strategy(PartitionedPS().build(TABLE_GRAPH, spec), TABLE_GRAPH, spec)
    assert max(sum(v.values()) for v in stored_bytes(compiled, spec).values()) < 600 * MiB
    # Without a memory, nothing is refused.
    roomy = _capped(None, 1, 1, 1, 1)
    compile_strategy(AllReduce().build(TABLE_GRAPH, roomy), TABLE_GRAPH, roomy)


@pytest.mark.parametrize("optimizer, slots", [
    (lambda: tf.compat.v1.train.GradientDescentOptimizer(0.1), 0),
    (lambda: tf.compat.v1.train.MomentumOptimizer(0.1, 0.9), 1),
    (lambda: tf.compat.v1.train.AdamOptimizer(0.1), 2)])
def test_a_graph_counts_its_variables_optimizer_slots(optimizer, slots):
    calls = []
    with tf.Graph().as_default() as graph, _tf_compat.capture_apply_gradients(calls.append):
        models.dense_mlp(optimizer)
    infos = {v.name: v for v in GraphItem(graph, calls).trainable_variables}
    assert {name: v.slot_bytes for name, v in infos.items()} == {
        name: slots * v.size_bytes for name, v in infos.items()}
