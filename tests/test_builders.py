"""Tests of the strategy builders on a fake graph item and small clusters."""
import types

import pytest

from autodist import partition
from autodist.graph_item import VariableInfo
from autodist.proto import synchronizers_pb2
from autodist.resource_spec import ResourceSpec
from autodist.strategy import (BUILDERS, PS, AllReduce, Parallax, PartitionedAR, PartitionedPS,
                               PSLoadBalancing, RandomAxisPartitionAR, ShardedUpdateAR,
                               StrategyBuilder, UnevenPartitionedPS, get_builder)
from autodist.strategy import common

pytestmark = pytest.mark.timeout(60)

AR = synchronizers_pb2.AllReduceSynchronizer

VARIABLES = [
    VariableInfo("emb", (1000, 16), "float32", sparse_grad=True),   # 64000 B
    VariableInfo("dense/kernel", (16, 8), "float32"),               # 512 B
    VariableInfo("dense/bias", (8,), "float32"),                    # 32 B
    VariableInfo("out/kernel", (8, 3, 5), "float32"),               # 480 B
    VariableInfo("scale", (), "float32"),                           # 4 B
    VariableInfo("odd", (7, 4), "float32"),                         # 112 B
    VariableInfo("row", (1, 10), "float32"),                        # 40 B
    VariableInfo("proj", (12, 4), "float32"),                       # 192 B
    VariableInfo("step", (), "int64", has_grad=False),              # 8 B
]
BY_NAME = {v.name: v for v in VARIABLES}
GRAPH = types.SimpleNamespace(sums_over_replicas=False, trainable_variables=VARIABLES)

ONE_NODE = ResourceSpec.from_dict({"nodes": [{"address": "localhost", "cpus": [0, 1], "chief": True}]})
THREE_NODES = ResourceSpec.from_dict({"nodes": [
    {"address": "10.0.0.1", "cpus": [0, 1], "chief": True},
    {"address": "10.0.0.2", "cpus": [0]},
    {"address": "10.0.0.3", "cpus": [0, 1, 2]},
]})
PS1, PS2, PS3 = "10.0.0.1:CPU:0", "10.0.0.2:CPU:0", "10.0.0.3:CPU:0"

ALL_BUILDERS = [PS(), PSLoadBalancing(), PartitionedPS(), UnevenPartitionedPS(), AllReduce(),
                PartitionedAR(), RandomAxisPartitionAR(seed=3), Parallax(), ShardedUpdateAR()]


# ----------------------------------------------------------------------------- helpers

def split_axis_and_parts(node):
    """Returns (axis, k) from a partitioner string, (None, 1) when not partitioned."""
    if not node.partitioner:
        return None, 1
    counts = [int(c) for c in node.partitioner.split(",")]
    split = [i for i, c in enumerate(counts) if c != 1]
    assert len(split) == 1, node.partitioner
    return split[0], counts[split[0]]


def leaf_units(strategy, variables=VARIABLES):
    """Yields (var, unit_name, unit_bytes, unit_node) for every synchronized unit."""
    by_name = {v.name: v for v in variables}
    for node in strategy.node_config:
        var = by_name[node.var_name]
        axis, k = split_axis_and_parts(node)
        if k == 1:
            yield var, node.var_name, var.size_bytes, node
            continue
        row_bytes = var.size_bytes // var.shape[axis]
        base, extra = divmod(var.shape[axis], k)
        for i, part in enumerate(node.part_config):
            yield var, part.var_name, row_bytes * (base + (1 if i < extra else 0)), part


def ps_loads(strategy, variables=VARIABLES):
    loads = {}
    for _, _, size, node in leaf_units(strategy, variables):
        if node.WhichOneof("synchronizer") == "PSSynchronizer":
            dest = node.PSSynchronizer.reduction_destination
            loads[dest] = loads.get(dest, 0) + size
    return loads


def ar_groups(strategy):
    return [(name, node.AllReduceSynchronizer.group) for _, name, _, node in leaf_units(strategy)
            if node.WhichOneof("synchronizer") == "AllReduceSynchronizer"]


def check_well_formed(strategy, spec):
    """Structure every builder must satisfy."""
    assert strategy.replicas == [d.name_string() for d in spec.replica_devices]
    assert [n.var_name for n in strategy.node_config] == [v.name for v in VARIABLES]
    for node in strategy.node_config:
        axis, k = split_axis_and_parts(node)
        if k == 1:
            assert not node.part_config
            assert node.WhichOneof("synchronizer") is not None
        else:
            assert node.WhichOneof("synchronizer") is None
            assert [p.var_name for p in node.part_config] == [
                f"{node.var_name}/part_{i}" for i in range(k)]
            assert all(p.WhichOneof("synchronizer") for p in node.part_config)
            assert len(node.partitioner.split(",")) == len(BY_NAME[node.var_name].shape)
    total = sum(size for _, _, size, _ in leaf_units(strategy))
    assert total == sum(v.size_bytes for v in VARIABLES)


def parts_of(strategy):
    return {n.var_name: split_axis_and_parts(n) for n in strategy.node_config}


# ----------------------------------------------------------------------------- shared helpers

def test_common_helpers_numbers():
    assert partition.partitioner_string(3, 1, 3) == "1,3,1"
    assert partition.partitioner_string(2, 0, 1) == "2"
    assert partition.part_name("a/b", 4) == "a/b/part_4"
    assert partition.partition_sizes(1000, 3) == [334, 333, 333]
    assert partition.partition_sizes(16, 3) == [6, 5, 5]
    assert partition.part_shapes((7, 4), 0, 3) == [(3, 4), (2, 4), (2, 4)]
    assert partition.part_shapes((8, 3, 5), 2, 2) == [(8, 3, 3), (8, 3, 2)]
    assert common.largest_divisor_at_most(1000, 3) == 2
    assert common.largest_divisor_at_most(7, 3) == 1
    assert common.num_shards_even((12, 4), 1) == 2
    assert common.num_shards_even((12, 4), 3) == 3
    assert common.num_shards_even((), 3) == 1
    assert common.num_shards_even((1, 9), 3) == 1
    assert common.num_shards_uneven((7,), 3) == 3
    assert common.num_shards_uneven((2,), 5) == 2
    assert common.num_ar_partitions(8, None, 6) == 6
    assert common.num_ar_partitions(8, 16, 6) == 8
    with pytest.raises(ValueError, match="axis=3"):
        partition.partitioner_string(2, 3, 2)


def test_balanced_placement_is_least_loaded_first_with_device_order_ties():
    placement, loads = common.balanced_placement(
        [("a", 10), ("b", 7), ("c", 5), ("d", 5), ("e", 3)], ["x", "y", "z"], {"z": 4})
    # Largest first, each to the least loaded (x/y tie at 0 goes to x):
    # a->x (x10 y0 z4), b->y (x10 y7 z4), c->z (z9), d->y (y12), e->z (z12).
    assert placement == {"a": "x", "b": "y", "c": "z", "d": "y", "e": "z"}
    assert loads == {"x": 10, "y": 12, "z": 12}


# ----------------------------------------------------------------------------- every builder

@pytest.mark.parametrize("spec", [ONE_NODE, THREE_NODES], ids=["1node", "3nodes"])
@pytest.mark.parametrize("builder", ALL_BUILDERS, ids=lambda b: type(b).__name__)
def test_every_builder_is_well_formed_and_pure(builder, spec):
    first = builder.build(GRAPH, spec)
    second = builder.build(GRAPH, spec)
    check_well_formed(first, spec)
    assert first.id != second.id
    assert list(first.node_config) == list(second.node_config)
    step = first.node_config_by_name()["step"]
    assert step.PSSynchronizer.reduction_destination == spec.ps_devices[0].name_string()


def test_registry():
    assert sorted(BUILDERS) == sorted(type(b).__name__ for b in ALL_BUILDERS)
    assert isinstance(get_builder("PartitionedPS", sync=False, staleness=2), StrategyBuilder)
    with pytest.raises(ValueError, match="'Nope'.*PartitionedPS"):
        get_builder("Nope")


# ----------------------------------------------------------------------------- PS family

def test_ps_puts_everything_on_chief_cpu_with_settings():
    strategy = PS(local_proxy_variable=True, sync=False, staleness=2).build(GRAPH, THREE_NODES)
    for node in strategy.node_config:
        ps = node.PSSynchronizer
        assert (ps.reduction_destination, ps.local_replication, ps.sync, ps.staleness) == (
            PS1, True, False, 2)
    assert ps_loads(strategy) == {PS1: 65380}


@pytest.mark.parametrize("kwargs, match", [
    ({"staleness": -1}, "staleness must be an integer >= 0, got -1"),
    ({"sync": "yes"}, "sync='yes'"),
    # Unbounded asynchrony is not built, and a staleness bound is not synchronous.
    ({"sync": False}, "sync=False needs staleness >= 1"),
    ({"staleness": 2}, "staleness=2 needs sync=False"),
    ({"local_proxy_variable": 1}, "local_proxy_variable=1"),
])
def test_ps_argument_errors(kwargs, match):
    for cls in (PS, PSLoadBalancing, PartitionedPS, UnevenPartitionedPS, Parallax):
        with pytest.raises(ValueError, match=match):
            cls(**kwargs)


def test_ps_load_balancing_exact_placement():
    strategy = PSLoadBalancing().build(GRAPH, THREE_NODES)
    dest = {n.var_name: n.PSSynchronizer.reduction_destination for n in strategy.node_config}
    assert dest == {"emb": PS2, "dense/kernel": PS3, "out/kernel": PS1, "proj": PS1,
                    "odd": PS3, "row": PS3, "dense/bias": PS3, "scale": PS1, "step": PS1}
    assert ps_loads(strategy) == {PS1: 684, PS2: 64000, PS3: 696}
    assert all(not n.partitioner for n in strategy.node_config)


def test_ps_load_balancing_balances_equal_variables():
    variables = [VariableInfo(f"v{i}", (10, 10), "float32") for i in range(7)]
    graph = types.SimpleNamespace(sums_over_replicas=False, trainable_variables=variables)
    strategy = PSLoadBalancing().build(graph, THREE_NODES)
    assert ps_loads(strategy, variables) == {PS1: 1200, PS2: 800, PS3: 800}


def test_partitioned_ps_one_node_still_partitions_in_two():
    strategy = PartitionedPS().build(GRAPH, ONE_NODE)
    assert parts_of(strategy) == {
        "emb": (0, 2), "dense/kernel": (0, 2), "dense/bias": (0, 2), "out/kernel": (0, 2),
        "scale": (None, 1), "odd": (None, 1), "row": (None, 1), "proj": (0, 2), "step": (None, 1)}
    by_name = strategy.node_config_by_name()
    assert by_name["out/kernel"].partitioner == "2,1,1"
    assert set(ps_loads(strategy)) == {"localhost:CPU:0"}


def test_partitioned_ps_three_nodes_divisors_and_balance():
    strategy = PartitionedPS(sync=False, staleness=1).build(GRAPH, THREE_NODES)
    assert parts_of(strategy) == {
        "emb": (0, 2), "dense/kernel": (0, 2), "dense/bias": (0, 2), "out/kernel": (0, 2),
        "scale": (None, 1), "odd": (None, 1), "row": (None, 1), "proj": (0, 3), "step": (None, 1)}
    # emb halves (32000 B) take the two empty servers; everything else then
    # fills PS1 (8 B pinned) before either half-loaded server.
    loads = ps_loads(strategy)
    assert loads == {PS1: 1380, PS2: 32000, PS3: 32000}
    emb = strategy.node_config_by_name()["emb"]
    assert [p.PSSynchronizer.reduction_destination for p in emb.part_config] == [PS2, PS3]
    assert all(p.PSSynchronizer.sync is False and p.PSSynchronizer.staleness == 1
               for p in emb.part_config)


def test_uneven_partitioned_ps_counts_and_balance():
    one = UnevenPartitionedPS().build(GRAPH, ONE_NODE)
    assert parts_of(one)["odd"] == (0, 2)
    three = UnevenPartitionedPS().build(GRAPH, THREE_NODES)
    assert parts_of(three) == {
        "emb": (0, 3), "dense/kernel": (0, 3), "dense/bias": (0, 3), "out/kernel": (0, 3),
        "scale": (None, 1), "odd": (0, 3), "row": (None, 1), "proj": (0, 3), "step": (None, 1)}
    loads = ps_loads(three)
    assert sum(loads.values()) == 65380
    # Largest shard is an emb third (334 rows * 64 B); greedy keeps the spread below it.
    assert max(loads.values()) - min(loads.values()) <= 334 * 64
    emb = three.node_config_by_name()["emb"]
    assert sorted(p.PSSynchronizer.reduction_destination for p in emb.part_config) == [PS1, PS2, PS3]


# ----------------------------------------------------------------------------- all-reduce family

def test_all_reduce_groups_by_chunk_and_enums():
    strategy = AllReduce(chunk_size=3, all_reduce_spec="RING",
                         compressor="HorovodCompressorEF").build(GRAPH, THREE_NODES)
    assert ar_groups(strategy) == [("emb", 0), ("dense/kernel", 0), ("dense/bias", 0),
                                   ("out/kernel", 1), ("scale", 1), ("odd", 1),
                                   ("row", 2), ("proj", 2)]
    node = strategy.node_config_by_name()["emb"].AllReduceSynchronizer
    assert node.spec == AR.RING and node.compressor == AR.HorovodCompressorEF
    assert AllReduce().build(GRAPH, ONE_NODE).node_config[7].AllReduceSynchronizer.group == 0


def _specs(strategy) -> set:
    return {unit.AllReduceSynchronizer.spec for node in strategy.node_config
            for unit in (node.part_config or [node]) if unit.HasField("AllReduceSynchronizer")}


@pytest.mark.parametrize("links, want", [
    (None, AR.SCATTER_GATHER),             # one node: a sum in one process
    ([1, 1, 1], AR.AUTO),                  # the ring pipelines slow links better
    ([10, 2, 10], AR.AUTO),                # the slowest link decides
    ([10, 2.5, 10], AR.SCATTER_GATHER),    # fast links: CPU per byte decides
])
def test_the_default_spec_follows_the_clusters_slowest_link(links, want):
    if links is None:
        spec = ONE_NODE
    else:
        spec = ResourceSpec.from_dict({"nodes": [
            {"address": f"10.0.0.{i + 1}", "cpus": [0], "chief": i == 0, "network_bandwidth": rate}
            for i, rate in enumerate(links)]})
    for builder in (AllReduce(), PartitionedAR(), RandomAxisPartitionAR(), Parallax()):
        assert _specs(builder.build(GRAPH, spec)) == {want}, builder
    # Named, it is kept; the sharded update's all-reduced variables stay collective.
    assert _specs(AllReduce(all_reduce_spec="RING").build(GRAPH, spec)) == {AR.RING}
    assert _specs(ShardedUpdateAR().build(GRAPH, spec)) == {AR.AUTO}


@pytest.mark.parametrize("kwargs, match", [
    ({"compressor": "Gzip"}, r"compressor='Gzip'.*HorovodCompressor"),
    ({"all_reduce_spec": "MPI"}, r"all_reduce_spec='MPI'.*NCCL"),
    ({"chunk_size": 0}, "chunk_size must be an integer >= 1 or None, got 0"),
    ({"bucket_bytes": 0}, "bucket_bytes must be an integer >= 1 or None, got 0"),
    ({"bucket_bytes": 2.5e6}, "bucket_bytes must be an integer >= 1 or None, got 2500000.0"),
])
def test_all_reduce_argument_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AllReduce(**kwargs)


def test_partitioned_ar_counts_and_groups():
    one = PartitionedAR(chunk_size=4).build(GRAPH, ONE_NODE)  # 2 replicas -> 2 parts
    assert parts_of(one) == {
        "emb": (0, 2), "dense/kernel": (0, 2), "dense/bias": (0, 2), "out/kernel": (0, 2),
        "scale": (None, 1), "odd": (0, 2), "row": (None, 1), "proj": (0, 2), "step": (None, 1)}
    groups = [g for _, g in ar_groups(one)]
    assert groups == [i // 4 for i in range(14)]
    three = PartitionedAR(chunk_size=5).build(GRAPH, THREE_NODES)  # 6 replicas
    assert parts_of(three)["emb"] == (0, 6) and parts_of(three)["odd"] == (0, 6)
    assert [g for _, g in ar_groups(three)] == [i // 5 for i in range(38)]
    capped = PartitionedAR(num_partitions=10).build(GRAPH, ONE_NODE)
    assert parts_of(capped)["dense/bias"] == (0, 8) and parts_of(capped)["emb"] == (0, 10)
    with pytest.raises(ValueError, match="num_partitions must be an integer >= 1 or None, got 0"):
        PartitionedAR(num_partitions=0)


def test_random_axis_is_deterministic_and_valid():
    a = RandomAxisPartitionAR(seed=7).build(GRAPH, THREE_NODES)
    b = RandomAxisPartitionAR(seed=7).build(GRAPH, THREE_NODES)
    assert list(a.node_config) == list(b.node_config)
    layouts = {seed: parts_of(RandomAxisPartitionAR(seed=seed).build(GRAPH, THREE_NODES))
               for seed in range(10)}
    assert len({tuple(sorted(l.items())) for l in layouts.values()}) > 1
    for layout in layouts.values():
        assert layout["row"] == (1, 6)  # only axis 1 has size >= 2
        assert layout["scale"] == (None, 1)
        for name, (axis, k) in layout.items():
            if axis is not None:
                assert k == min(6, BY_NAME[name].shape[axis])
    axes_seen = {layout["out/kernel"][0] for layout in layouts.values()}
    assert axes_seen == {0, 1, 2}


# ----------------------------------------------------------------------------- Parallax

def test_parallax_splits_sparse_and_dense():
    variables = VARIABLES + [VariableInfo("emb2", (6, 4), "float32", sparse_grad=True)]
    graph = types.SimpleNamespace(sums_over_replicas=False, trainable_variables=variables)
    strategy = Parallax(chunk_size=2, local_proxy_variable=True).build(graph, THREE_NODES)
    by_name = strategy.node_config_by_name()
    assert len(by_name) == len(variables)
    emb, emb2 = by_name["emb"], by_name["emb2"]
    assert (emb.partitioner, emb2.partitioner) == ("2,1", "3,1")
    assert [p.PSSynchronizer.reduction_destination for p in emb.part_config] == [PS2, PS3]
    assert [p.PSSynchronizer.reduction_destination for p in emb2.part_config] == [PS1] * 3
    assert all(p.PSSynchronizer.local_replication for p in emb.part_config)
    dense = [(n.var_name, n.AllReduceSynchronizer.group) for n in strategy.node_config
             if n.WhichOneof("synchronizer") == "AllReduceSynchronizer"]
    assert dense == [("dense/kernel", 0), ("dense/bias", 0), ("out/kernel", 1), ("scale", 1),
                     ("odd", 2), ("row", 2), ("proj", 3)]
    assert by_name["step"].PSSynchronizer.reduction_destination == PS1
