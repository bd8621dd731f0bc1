"""The predefined cost model on hand-computed cases, and its explanation."""
import dataclasses
import subprocess
import sys
import types

import pytest

from autodist import partition
from autodist.graph_item import VariableInfo
from autodist.resource_spec import ResourceSpec
from autodist.simulator import COMPONENTS, CostModel, CostWeights, format_breakdown
from autodist.strategy import PS, Parallax, PartitionedAR, PartitionedPS, StrategyError, common
from autodist.strategy.compiler import compile_strategy
from test_builders import GRAPH, THREE_NODES

pytestmark = pytest.mark.timeout(60)

A, B, C = "10.0.0.1", "10.0.0.2", "10.0.0.3"
MB4 = 4_000_000  # bytes of a (1_000_000,) float32 variable
LATENCY = CostWeights().collective_latency
AR_PART = CostWeights().all_reduce_part_overhead  # seconds per all-reduced part
OVERHEAD = CostWeights().ps_part_overhead
SERVING = CostWeights().ps_serving_nodes
SPLIT = CostWeights().split_step
UPDATE = CostWeights().optimizer_update  # seconds per GB updated on the busiest node
# The hand-computed totals below are of the transfer and count components; the
# optimizer update, which every multi-node case would add, has a test of its own.
MODEL = CostModel(dataclasses.replace(CostWeights(), optimizer_update=0.0))


def spec(*nodes):
    """nodes: (address, number of CPU replicas, Gbit/s or None); the first is the chief."""
    return ResourceSpec.from_dict({"nodes": [
        dict({"address": addr, "cpus": list(range(cpus)), "chief": i == 0},
             **({"network_bandwidth": gbps} if gbps else {}))
        for i, (addr, cpus, gbps) in enumerate(nodes)]})


def vec(name, elements=1_000_000, **kwargs):
    return VariableInfo(name, (elements,), "float32", **kwargs)


def strategy_of(resource_spec, *nodes):
    strategy = common.new_strategy(resource_spec)
    strategy.node_config.extend(nodes)
    return strategy


def seconds(num_bytes, gbps):
    return num_bytes * 8 / (gbps * 1e9)


def predict(strategy, variables, resource_spec, batch_size=10, model=MODEL, **kwargs):
    """Predicts from the Strategy and from its compiled form; both must agree."""
    direct = model.predict(strategy, variables, resource_spec, batch_size=batch_size, **kwargs)
    item = types.SimpleNamespace(sums_over_replicas=False, trainable_variables=variables)
    compiled = compile_strategy(strategy, item, resource_spec)
    assert model.predict(compiled, None, resource_spec, batch_size=batch_size,
                         **kwargs) == pytest.approx(direct, rel=1e-12)
    return direct


def breakdown(strategy, variables, resource_spec, batch_size=10, **kwargs):
    return MODEL.breakdown(strategy, variables, resource_spec, batch_size=batch_size, **kwargs)


TWO_BY_TWO = spec((A, 2, 1), (B, 2, 1))     # 4 replicas on 2 nodes at 1 Gbit/s
ONE_PLUS_THREE = spec((A, 1, 1), (B, 3, 1))  # a server node with 1 replica, 3 remote replicas


# ----------------------------------------------------------------------------- all-reduce

def test_ring_all_reduce_of_one_variable_on_four_replicas_across_two_nodes():
    v = vec("v")
    got = predict(strategy_of(TWO_BY_TWO, common.ar_node_config("v", 0)), [v], TWO_BY_TWO)
    ring = 2 * 3 / 4 * MB4 * 8 / 1e9
    assert ring == pytest.approx(0.048)
    assert got == pytest.approx(ring + LATENCY + AR_PART)


@pytest.mark.parametrize("compressor", ["HorovodCompressor", "HorovodCompressorEF"])
def test_fp16_compressors_halve_the_ring_bytes(compressor):
    node = common.ar_node_config("v", 0, compressor=compressor)
    got = predict(strategy_of(TWO_BY_TWO, node), [vec("v")], TWO_BY_TWO)
    assert got == pytest.approx(0.024 + LATENCY + AR_PART)


def test_the_slowest_nic_on_the_ring_binds():
    slow = spec((A, 2, 1), (B, 2, 0.5))
    got = predict(strategy_of(slow, common.ar_node_config("v", 0)), [vec("v")], slow)
    assert got == pytest.approx(0.096 + LATENCY + AR_PART)


def test_a_ring_within_one_node_runs_at_the_local_bandwidth():
    one = spec((A, 2, None))
    got = predict(strategy_of(one, common.ar_node_config("v", 0)), [vec("v")], one)
    assert got == pytest.approx(2 * 1 / 2 * seconds(MB4, 50) + LATENCY + AR_PART)
    fast_bus = CostModel(local_bandwidth_gbps=100)
    assert predict(strategy_of(one, common.ar_node_config("v", 0)), [vec("v")], one,
                   model=fast_bus) == pytest.approx(seconds(MB4, 100) + LATENCY + AR_PART)


def test_merging_two_variables_into_one_group_removes_one_latency_term():
    variables = [vec("v"), vec("w")]
    apart = predict(strategy_of(TWO_BY_TWO, common.ar_node_config("v", 0),
                                common.ar_node_config("w", 1)), variables, TWO_BY_TWO)
    merged = predict(strategy_of(TWO_BY_TWO, common.ar_node_config("v", 0),
                                 common.ar_node_config("w", 0)), variables, TWO_BY_TWO)
    assert apart == pytest.approx(2 * 0.048 + 2 * LATENCY + 2 * AR_PART)
    assert apart - merged == pytest.approx(LATENCY)


def test_each_all_reduced_part_adds_its_fixed_overhead():
    # PartitionedAR(num_partitions=4) cuts v into four parts of one group: the ring moves
    # the same bytes through the same single collective, and each part adds its overhead.
    graph = types.SimpleNamespace(sums_over_replicas=False, trainable_variables=[vec("v")])
    whole = breakdown(strategy_of(TWO_BY_TWO, common.ar_node_config("v", 0)), [vec("v")],
                      TWO_BY_TWO)
    cut = breakdown(PartitionedAR(chunk_size=128, num_partitions=4).build(graph, TWO_BY_TWO),
                    [vec("v")], TWO_BY_TWO)
    assert (whole.features["all_reduce_part_overhead"], cut.features["all_reduce_part_overhead"]
            ) == (1, 4)
    assert cut.features["ring_all_reduce"] == pytest.approx(whole.features["ring_all_reduce"])
    assert cut.features["collective_latency"] == whole.features["collective_latency"] == 1
    assert cut.total - whole.total == pytest.approx(3 * AR_PART)


def test_a_group_mixing_dtypes_launches_one_collective_per_dtype():
    # Two float32 variables and a float16 one in group 0: the kernel reduces each dtype in
    # a buffer of its own, so two collectives; the ring moves the same bytes in all.
    variables = [vec("a"), VariableInfo("h", (1_000_000,), "float16"), vec("b")]
    nodes = [common.ar_node_config(v.name, 0) for v in variables]
    got = breakdown(strategy_of(TWO_BY_TWO, *nodes), variables, TWO_BY_TWO)
    ring = 2 * 3 / 4 * (MB4 + MB4 // 2 + MB4) * 8 / 1e9
    assert got.features["collective_latency"] == 2
    assert got.features["ring_all_reduce"] == pytest.approx(ring)
    assert predict(strategy_of(TWO_BY_TWO, *nodes), variables, TWO_BY_TWO) == pytest.approx(
        ring + 2 * LATENCY + 3 * AR_PART)
    # A launch is shared evenly by the members of its dtype: a half each, the whole to h.
    latency = {row.variable: row.seconds for row in got.rows
               if row.component == "collective_latency"}
    assert latency == pytest.approx({"a": LATENCY / 2, "h": LATENCY, "b": LATENCY / 2})


def test_sparse_all_reduce_is_an_all_gather_of_the_touched_rows():
    emb = VariableInfo("emb", (1000, 64), "float32", sparse_grad=True)  # 256 B per row
    node = common.ar_node_config("emb", 0, compressor="HorovodCompressor")  # no effect on gathers
    strategy = strategy_of(TWO_BY_TWO, node)
    got = predict(strategy, [emb], TWO_BY_TWO, batch_size=10)
    assert got == pytest.approx(3 * 10 * 256 * 8 / 1e9 + 3 * LATENCY + AR_PART)
    more_rows = predict(strategy, [emb], TWO_BY_TWO, batch_size=10, rows_touched={"emb": 100})
    assert more_rows == pytest.approx(3 * 100 * 256 * 8 / 1e9 + 3 * LATENCY + AR_PART)
    capped = predict(strategy, [emb], TWO_BY_TWO, batch_size=5000)  # at most every row
    assert capped == pytest.approx(3 * 1000 * 256 * 8 / 1e9 + 3 * LATENCY + AR_PART)


SG_WEIGHT = CostWeights().scatter_gather
OVERLAP = CostWeights().overlap


def test_scatter_gather_moves_each_nodes_sum_across_the_nodes_not_the_replicas():
    v = vec("v")
    ring = breakdown(strategy_of(TWO_BY_TWO, common.ar_node_config("v", 0)), [v], TWO_BY_TWO)
    sg_node = common.ar_node_config("v", 0, "SCATTER_GATHER")
    sg = breakdown(strategy_of(TWO_BY_TWO, sg_node), [v], TWO_BY_TWO)
    # The ring passes 2 * 3/4 of the buffer through 4 replicas; scatter-gather sums each
    # node's 2 replicas first, then moves 2 * 1/2 of it across the 2 nodes.
    assert ring.features["ring_all_reduce"] == pytest.approx(seconds(1.5 * MB4, 1))
    assert sg.features["scatter_gather"] == pytest.approx(seconds(MB4, 1))
    assert ring.features["scatter_gather"] == sg.features["ring_all_reduce"] == 0
    assert sg.features["collective_latency"] == 1
    assert predict(strategy_of(TWO_BY_TWO, sg_node), [v], TWO_BY_TWO) == pytest.approx(
        SG_WEIGHT * seconds(MB4, 1) + LATENCY + AR_PART)
    # Across 3 nodes the slowest NIC binds; on one node the local sum reads 3 more buffers.
    three = spec((A, 1, 1), (B, 1, 1), (C, 1, 0.5))
    assert breakdown(strategy_of(three, sg_node), [v], three).features["scatter_gather"] == (
        pytest.approx(seconds(2 * 2 / 3 * MB4, 0.5)))
    one = spec((A, 4, None))
    assert breakdown(strategy_of(one, sg_node), [v], one).features["scatter_gather"] == (
        pytest.approx(seconds(3 * MB4, MODEL.local_bandwidth_gbps)))


def test_overlap_credits_a_bucket_with_the_backward_pass_left_after_it():
    # Gradients ready in the order d, c, b, a. Bucket {d, c} is complete at rank 1, with
    # 2 of 4 gradients still to compute: half its transfer overlaps. Bucket {b, a} is
    # launched last and overlaps nothing.
    variables = [vec(n, ready_rank=r) for n, r in (("a", 3), ("b", 2), ("c", 1), ("d", 0))]
    ring = seconds(1.5 * MB4, 1)  # per variable on 2 x 2 replicas
    two = strategy_of(TWO_BY_TWO, *(common.ar_node_config(n, 0 if n in "cd" else 1)
                                    for n in "abcd"))
    got = breakdown(two, variables, TWO_BY_TWO)
    assert got.features["overlap"] == pytest.approx(2 * ring / 2)
    hidden = {row.variable: row.seconds for row in got.rows if row.component == "overlap"}
    assert hidden == pytest.approx({"c": OVERLAP * ring / 2, "d": OVERLAP * ring / 2})
    assert sum(r.seconds for r in got.rows) == pytest.approx(got.total)
    one = strategy_of(TWO_BY_TWO, *(common.ar_node_config(n, 0) for n in "abcd"))
    assert breakdown(one, variables, TWO_BY_TWO).features["overlap"] == 0
    assert predict(two, variables, TWO_BY_TWO) - predict(one, variables, TWO_BY_TWO) == (
        pytest.approx(LATENCY + OVERLAP * ring))
    # A bucket holding the first and the last gradient waits for the whole backward pass.
    mixed = strategy_of(TWO_BY_TWO, *(common.ar_node_config(n, 0 if n in "ad" else 1)
                                      for n in "abcd"))
    assert breakdown(mixed, variables, TWO_BY_TWO).features["overlap"] == pytest.approx(
        2 * ring / 4)  # {c, b} is complete at rank 2, a quarter left


def test_a_split_step_overlaps_nothing():
    # PS parts next to collectives on a cluster: the collectives wait for the second run.
    variables = [vec("a", ready_rank=1), vec("b", ready_rank=0), vec("p", ready_rank=2)]
    strategy = strategy_of(TWO_BY_TWO, common.ar_node_config("a", 1),
                           common.ar_node_config("b", 0),
                           common.ps_node_config("p", f"{A}:CPU:0"))
    got = breakdown(strategy, variables, TWO_BY_TWO)
    assert got.features["split_step"] == 1 and got.features["overlap"] == 0


def test_the_cost_model_trades_bucket_count_against_overlap():
    # Eight layers of equal size in backward order. k even buckets overlap
    # (k - 1) / (2k) of the transfer and pay a launch each: large gradients are best in
    # many buckets, tiny ones in one.
    def best_buckets(elements):
        variables = [vec(f"l{i}", elements, ready_rank=i) for i in range(8)]

        def total(k):
            nodes = [common.ar_node_config(v.name, i * k // 8) for i, v in enumerate(variables)]
            return predict(strategy_of(TWO_BY_TWO, *nodes), variables, TWO_BY_TWO)
        return min((1, 2, 4, 8), key=total)

    assert best_buckets(1_000_000) == 8
    assert best_buckets(1_000) == 1


def test_accumulation_pays_one_sync_per_cycle_carrying_every_runs_rows():
    emb = VariableInfo("emb", (1000, 64), "float32", sparse_grad=True)  # 256 B per row
    variables = [vec("v"), emb]
    strategy = strategy_of(TWO_BY_TWO, common.ar_node_config("v", 0),
                           common.ar_node_config("emb", 0))
    once = breakdown(strategy, variables, TWO_BY_TWO, batch_size=10)
    cycle = breakdown(strategy, variables, TWO_BY_TWO, batch_size=10, accumulation_steps=4)
    # The dense ring runs once per 4 runs; the sparse gather carries 4 runs' rows once.
    assert cycle.totals["ring_all_reduce"] == pytest.approx(once.totals["ring_all_reduce"] / 4)
    assert cycle.totals["all_gather"] == pytest.approx(once.totals["all_gather"])
    assert cycle.totals["collective_latency"] == pytest.approx(
        once.totals["collective_latency"] / 4)
    assert sum(r.seconds for r in cycle.rows) == pytest.approx(cycle.total)
    with pytest.raises(ValueError, match="accumulation_steps must be an int >= 1, got 0"):
        MODEL.predict(strategy, variables, TWO_BY_TWO, batch_size=1, accumulation_steps=0)


# ----------------------------------------------------------------------------- parameter servers

def test_ps_with_three_remote_replicas_loads_the_server_nic_three_times_per_phase():
    node = common.ps_node_config("v", f"{A}:CPU:0")
    result = breakdown(strategy_of(ONE_PLUS_THREE, node), [vec("v")], ONE_PLUS_THREE)
    # Three pushes into A (0.096 s), then three pulls out of A (0.096 s): the phases add.
    assert result.total == pytest.approx(2 * seconds(3 * MB4, 1) + OVERHEAD + SERVING)
    assert result.total == pytest.approx(0.192 + OVERHEAD + SERVING)


def test_a_local_proxy_pulls_once_per_node_and_staleness_divides_the_pulls():
    # A variable without a gradient only moves by pulls.
    frozen = [vec("v", has_grad=False)]
    dest = f"{A}:CPU:0"
    per_replica = predict(strategy_of(ONE_PLUS_THREE, common.ps_node_config("v", dest)),
                          frozen, ONE_PLUS_THREE)
    proxy = predict(strategy_of(ONE_PLUS_THREE, common.ps_node_config("v", dest, True)),
                    frozen, ONE_PLUS_THREE)
    stale = predict(strategy_of(ONE_PLUS_THREE, common.ps_node_config(
        "v", dest, True, sync=False, staleness=1)), frozen, ONE_PLUS_THREE)
    assert per_replica == pytest.approx(0.096)
    assert proxy == pytest.approx(0.032)
    assert stale == pytest.approx(0.016)


def test_a_proxy_pulls_once_per_node_a_transfer_destination_pushes_once():
    v = [vec("v")]
    proxy = common.ps_node_config("v", f"{A}:CPU:0", local_replication=True)
    # Three pushes (0.096 s), one pull for B's three replicas (0.032 s).
    assert predict(strategy_of(ONE_PLUS_THREE, proxy), v, ONE_PLUS_THREE) == pytest.approx(
        0.096 + 0.032 + OVERHEAD + SERVING)
    summed = common.ps_node_config("v", f"{A}:CPU:0", local_replication=True)
    summed.PSSynchronizer.transfer_destination = f"{B}:CPU:0"
    assert predict(strategy_of(ONE_PLUS_THREE, summed), v, ONE_PLUS_THREE) == pytest.approx(
        0.032 + 0.032 + OVERHEAD + SERVING)


def test_the_busiest_nic_of_each_phase_binds():
    # Push: server A at 2 Gbit/s receives 3 pushes (0.048 s); B at 1 Gbit/s sends them
    # (0.096 s). Refresh, with a proxy, after the push: A sends one copy (0.016 s), B
    # receives it (0.032 s).
    lopsided = spec((A, 1, 2), (B, 3, 1))
    node = common.ps_node_config("v", f"{A}:CPU:0", local_replication=True)
    result = breakdown(strategy_of(lopsided, node), [vec("v")], lopsided)
    assert result.binding_resource == f"{B} out (push), {B} in (last refreshes)"
    assert result.totals["ps_transfer"] == pytest.approx(0.096 + 0.032)
    # Two servers, B at 0.5 Gbit/s serves w (8 MB). Push: B sends v to A (0.064 s) and
    # receives w (0.128 s). Pull: B sends w (0.128 s) and receives v (0.064 s).
    two = spec((A, 1, 1), (B, 1, 0.5))
    nodes = [common.ps_node_config("v", f"{A}:CPU:0"), common.ps_node_config("w", f"{B}:CPU:0")]
    result = breakdown(strategy_of(two, *nodes), [vec("v"), vec("w", 2_000_000)], two)
    assert result.binding_resource == f"{B} in (push), {B} out (read)"
    assert result.totals["ps_transfer"] == pytest.approx(2 * seconds(2 * MB4, 0.5))  # 0.256 s


@pytest.mark.parametrize("num_parts", [1, 2, 4])
def test_refreshes_overlap_the_other_parts_pushes(num_parts):
    # B pushes 8 MB to A (0.064 s) and refreshes 8 MB of proxies (0.064 s, inbound).
    # A part's refresh follows its own push, so the last part's refresh adds.
    # (Measured: docs/notes/auto_strategy.md, "Proxies refreshed part by part".)
    pair = spec((A, 1, 1), (B, 1, 1))
    names = [f"v{i}" for i in range(num_parts)]
    variables = [vec(n, 2_000_000 // num_parts) for n in names]
    proxies = [common.ps_node_config(n, f"{A}:CPU:0", local_replication=True) for n in names]
    result = breakdown(strategy_of(pair, *proxies), variables, pair)
    assert result.totals["ps_transfer"] == pytest.approx(0.064 + 0.064 / num_parts)
    # Read directly by the next step instead, the values add up in full.
    direct = [common.ps_node_config(n, f"{A}:CPU:0") for n in names]
    result = breakdown(strategy_of(pair, *direct), variables, pair)
    assert result.totals["ps_transfer"] == pytest.approx(0.064 + 0.064)


def test_a_nic_carries_its_nodes_pushes_and_refreshes_together():
    # v on A, w on B, 4 MB each, with proxies. A's outbound NIC sends w's gradient (push)
    # and v's new value (refresh), 0.064 s together; B's likewise.
    pair = spec((A, 1, 1), (B, 1, 1))
    nodes = [common.ps_node_config("v", f"{A}:CPU:0", local_replication=True),
             common.ps_node_config("w", f"{B}:CPU:0", local_replication=True)]
    result = breakdown(strategy_of(pair, *nodes), [vec("v"), vec("w")], pair)
    assert result.totals["ps_transfer"] == pytest.approx(0.064)
    assert result.binding_resource.endswith("(push, refresh)")


def test_each_servers_last_refresh_comes_after_the_pushes():
    # On a 0.5 Gbit/s node B, 16 MB of parts pushed to two fast servers (0.256 s) and
    # refreshed (0.256 s, inbound). Each server's pushes arrive together, so its largest
    # part, 2 MB, is refreshed last: 2 x 0.032 s more.
    three = spec((A, 1, 10), (C, 1, 10), (B, 1, 0.5))
    nodes = [common.ps_node_config(f"v{i}", f"{A if i % 2 else C}:CPU:0", local_replication=True)
             for i in range(8)]
    variables = [vec(f"v{i}", 500_000) for i in range(8)]
    result = breakdown(strategy_of(three, *nodes), variables, three)
    assert result.binding_resource == f"{B} out (push), {B} in (last refreshes)"
    assert result.totals["ps_transfer"] == pytest.approx(0.256 + 2 * 0.032)


def test_replicas_next_to_the_server_use_the_local_bus():
    one = spec((A, 2, None))
    got = predict(strategy_of(one, common.ps_node_config("v", f"{A}:CPU:0")), [vec("v")], one)
    assert got == pytest.approx(seconds(2 * MB4 + 2 * MB4, 50) + OVERHEAD)


def test_sparse_ps_moves_touched_rows_but_a_proxy_copies_the_whole_part_unless_rows():
    emb = [VariableInfo("emb", (1000, 64), "float32", sparse_grad=True)]
    dest = f"{A}:CPU:0"
    rows = predict(strategy_of(ONE_PLUS_THREE, common.ps_node_config("emb", dest)),
                   emb, ONE_PLUS_THREE, batch_size=10)
    touched = 3 * 10 * 256  # three replicas' 10 rows of 64 floats
    assert rows == pytest.approx(2 * seconds(touched, 1) + OVERHEAD + SERVING)
    proxy = predict(strategy_of(ONE_PLUS_THREE, common.ps_node_config("emb", dest, True)),
                    emb, ONE_PLUS_THREE, batch_size=10)
    assert proxy == pytest.approx(seconds(touched, 1) + seconds(1000 * 256, 1) + OVERHEAD
                                  + SERVING)
    # An update writing only the gradient's rows (SGD's scatter): B's proxy copies those,
    # every replica's, A's too.
    scattered = [VariableInfo("emb", (1000, 64), "float32", sparse_grad=True, updates_rows=True)]
    by_rows = predict(strategy_of(ONE_PLUS_THREE, common.ps_node_config("emb", dest, True)),
                      scattered, ONE_PLUS_THREE, batch_size=10)
    assert by_rows == pytest.approx(seconds(touched, 1) + seconds(4 * 10 * 256, 1) + OVERHEAD
                                    + SERVING)


def test_a_table_touches_its_ids_per_example_times_the_batch():
    strategy = strategy_of(ONE_PLUS_THREE, common.ps_node_config("emb", f"{A}:CPU:0"))
    plain = VariableInfo("emb", (1000, 64), "float32", sparse_grad=True)
    eight_ids = dataclasses.replace(plain, rows_gathered_per_example=8)
    assert predict(strategy, [eight_ids], ONE_PLUS_THREE, batch_size=10) == pytest.approx(
        predict(strategy, [plain], ONE_PLUS_THREE, batch_size=10, rows_touched={"emb": 80}))
    assert predict(strategy, [eight_ids], ONE_PLUS_THREE, batch_size=10) > predict(
        strategy, [plain], ONE_PLUS_THREE, batch_size=10)


@pytest.mark.parametrize("read_whole", [False, True], ids=["gathered", "also read whole"])
def test_a_partitioned_table_is_pulled_by_its_touched_rows_unless_read_whole(read_whole):
    # The replicas gather their rows from the parts, 5 of each replica's 10 per part,
    # as the pushes carry them; a table something also reads whole (a tied output
    # embedding) is stitched from its parts, every part read whole.
    emb = [VariableInfo("emb", (1000, 64), "float32", sparse_grad=True, read_whole=read_whole)]
    parts = [common.ps_node_config(partition.part_name("emb", i), f"{A}:CPU:0") for i in range(2)]
    split = predict(strategy_of(ONE_PLUS_THREE, common.partitioned_node_config("emb", 0, 2, parts)),
                    emb, ONE_PLUS_THREE, batch_size=10)
    pulled = 3 * 1000 * 256 if read_whole else 3 * 10 * 256
    assert split == pytest.approx(seconds(3 * 10 * 256, 1) + seconds(pulled, 1)
                                  + 2 * OVERHEAD + SERVING)


def test_many_parts_on_one_server_cost_their_overhead_not_more_bytes():
    v = vec("v")
    whole = predict(strategy_of(ONE_PLUS_THREE, common.ps_node_config("v", f"{A}:CPU:0")),
                    [v], ONE_PLUS_THREE)
    parts = [common.ps_node_config(partition.part_name("v", i), f"{A}:CPU:0") for i in range(4)]
    split = predict(strategy_of(ONE_PLUS_THREE, common.partitioned_node_config("v", 0, 1, parts)),
                    [v], ONE_PLUS_THREE)
    assert split - whole == pytest.approx(3 * OVERHEAD)


def test_mixing_ps_and_all_reduce_on_several_nodes_sums_and_proxies_per_node():
    variables = [vec("v"), vec("w", 10)]
    ps_only = predict(strategy_of(ONE_PLUS_THREE, common.ps_node_config("v", f"{A}:CPU:0"),
                                  common.ps_node_config("w", f"{A}:CPU:0")),
                      variables, ONE_PLUS_THREE)
    mixed = breakdown(strategy_of(ONE_PLUS_THREE, common.ps_node_config("v", f"{A}:CPU:0"),
                                  common.ar_node_config("w", 0)), variables, ONE_PLUS_THREE)
    assert ps_only == pytest.approx(2 * seconds(3 * (MB4 + 40), 1) + 2 * OVERHEAD + SERVING)
    # B sums its replicas' gradients and its proxy pulls once: one push, then one pull.
    assert mixed.totals["ps_transfer"] == pytest.approx(2 * seconds(MB4, 1))
    assert mixed.totals["split_step"] == pytest.approx(SPLIT)


def test_each_node_serving_ps_parts_costs_once_per_step_shared_by_its_parts():
    variables = [vec("v"), vec("w"), vec("x"), vec("frozen", has_grad=False)]

    def serving(resource_spec, *servers):
        configs = [common.ps_node_config(var.name, f"{server}:CPU:0")
                   for var, server in zip(variables, servers)]
        return breakdown(strategy_of(resource_spec, *configs), variables, resource_spec)

    one = serving(TWO_BY_TWO, A, A, A, B)  # B holds only a variable without a gradient
    assert one.features["ps_serving_nodes"] == 1
    assert one.totals["ps_serving_nodes"] == pytest.approx(SERVING)
    shares = {r.variable: r.seconds for r in one.rows if r.component == "ps_serving_nodes"}
    assert shares == pytest.approx({"v": SERVING / 3, "w": SERVING / 3, "x": SERVING / 3})
    two = serving(TWO_BY_TWO, A, B, B, A)
    assert two.features["ps_serving_nodes"] == 2
    shares = {r.variable: r.seconds for r in two.rows if r.component == "ps_serving_nodes"}
    assert shares == pytest.approx({"v": SERVING, "w": SERVING / 2, "x": SERVING / 2})
    # One node: no call leaves it, so serving costs nothing extra.
    alone = spec((A, 2, None))
    assert serving(alone, A, A, A, A).features["ps_serving_nodes"] == 0


def test_a_split_step_costs_once_when_a_cluster_mixes_ps_and_all_reduce():
    variables = [vec("v"), vec("w"), vec("frozen", has_grad=False)]

    def split(resource_spec, *synchronizers):
        configs = [common.ps_node_config(var.name, f"{A}:CPU:0") if kind == "ps"
                   else common.ar_node_config(var.name, 0,
                                              "SCATTER_GATHER" if kind == "sg" else "AUTO")
                   for var, kind in zip(variables, synchronizers)]
        return breakdown(strategy_of(resource_spec, *configs), variables, resource_spec)

    mixed = split(TWO_BY_TWO, "ps", "ar", "ps")
    assert mixed.features["split_step"] == 1
    shares = {r.variable: r.seconds for r in mixed.rows if r.component == "split_step"}
    assert shares == pytest.approx({"v": SPLIT / 2, "w": SPLIT / 2})  # parts with a gradient
    assert split(TWO_BY_TWO, "ps", "ps", "ar").features["split_step"] == 0
    assert split(TWO_BY_TWO, "ar", "ar", "ps").features["split_step"] == 0  # PS reads only
    assert split(spec((A, 2, None)), "ps", "ar", "ps").features["split_step"] == 0  # one run
    # A scatter-gather all-reduce runs no collective: PS and it share one run ...
    assert split(TWO_BY_TWO, "ps", "sg", "ps").features["split_step"] == 0
    # ... unless a collective all-reduce joins them.
    assert split(TWO_BY_TWO, "sg", "ar", "ps").features["split_step"] == 1


def test_the_busiest_node_pays_for_the_updates_it_runs():
    variables = [vec("v"), vec("w"), vec("x", 10), vec("frozen", has_grad=False)]

    def updates(resource_spec, *placements):
        configs = [common.ar_node_config(var.name, 0) if where == "ar"
                   else common.ps_node_config(var.name, f"{where}:CPU:0")
                   for var, where in zip(variables, placements)]
        return CostModel().breakdown(strategy_of(resource_spec, *configs), variables,
                                     resource_spec, batch_size=10)

    # Every node updates its copy of each all-reduced variable: nothing to spread.
    all_reduced = updates(TWO_BY_TWO, "ar", "ar", "ar", "ar")
    assert all_reduced.features["optimizer_update"] == pytest.approx((2 * MB4 + 40) / 1e9)
    assert all_reduced.totals["optimizer_update"] == pytest.approx(UPDATE * (2 * MB4 + 40) / 1e9)
    # Servers on two nodes halve it; on one node they do not; a frozen variable costs nothing.
    spread = updates(TWO_BY_TWO, A, B, A, B)
    assert spread.features["optimizer_update"] == pytest.approx((MB4 + 40) / 1e9)
    shares = {r.variable: r.seconds for r in spread.rows if r.component == "optimizer_update"}
    assert shares == pytest.approx({"v": UPDATE * MB4 / 1e9, "x": UPDATE * 40 / 1e9})
    assert updates(TWO_BY_TWO, A, A, A, B).features["optimizer_update"] == pytest.approx(
        (2 * MB4 + 40) / 1e9)
    # Mixed: B updates the all-reduced w and its own v; A only w.
    mixed = updates(TWO_BY_TWO, B, "ar", A, A)
    assert mixed.features["optimizer_update"] == pytest.approx(2 * MB4 / 1e9)
    # One node updates everything whatever the strategy, so the component ranks nothing.
    alone = spec((A, 2, None))
    assert updates(alone, "ar", A, A, A).features["optimizer_update"] == 0


# ----------------------------------------------------------------------------- explanation

@pytest.mark.parametrize("builder", [PS(local_proxy_variable=True), PartitionedPS(),
                                     PartitionedAR(chunk_size=2), Parallax(chunk_size=3)])
def test_the_breakdown_adds_up_per_row_and_per_component(builder):
    strategy = builder.build(GRAPH, THREE_NODES)
    result = breakdown(strategy, GRAPH.trainable_variables, THREE_NODES, batch_size=4)
    assert result.total == pytest.approx(predict(strategy, GRAPH.trainable_variables,
                                                 THREE_NODES, batch_size=4), rel=1e-12)
    assert sum(row.seconds for row in result.rows) == pytest.approx(result.total, rel=1e-12)
    for name in COMPONENTS:
        assert sum(r.seconds for r in result.rows if r.component == name) == pytest.approx(
            result.totals[name], rel=1e-12, abs=1e-15)
        assert result.totals[name] == pytest.approx(result.weights[name] * result.features[name])
    assert sum(result.per_variable().values()) == pytest.approx(result.total, rel=1e-12)
    assert result.total > 0


def test_weights_scale_their_component_only():
    strategy = strategy_of(TWO_BY_TWO, common.ar_node_config("v", 0), common.ar_node_config("w", 1))
    heavy = CostModel(CostWeights(collective_latency=1e-3, ring_all_reduce=2.0))
    got = heavy.predict(strategy, [vec("v"), vec("w")], TWO_BY_TWO, batch_size=1)
    assert got == pytest.approx(2 * 2 * 0.048 + 2 * 1e-3 + 2 * AR_PART + UPDATE * 2 * MB4 / 1e9)


def test_format_breakdown_lists_variables_by_time_and_the_component_totals():
    strategy = strategy_of(TWO_BY_TWO, common.ar_node_config("big", 0),
                           common.ar_node_config("small", 1), common.ar_node_config("tiny", 1))
    variables = [vec("big"), vec("small", 1000), vec("tiny", 10)]
    text = format_breakdown(breakdown(strategy, variables, TWO_BY_TWO))
    # Rings of 48, 0.048 and 0.00048 ms, two groups of 0.2 ms latency, three parts of 1 ms.
    assert AR_PART == 1e-3
    assert text.startswith("Predicted 51.448 ms per iteration.")
    lines = text.splitlines()
    body = [line.split()[0] for line in lines[4:7]]
    assert body == ["big", "small", "tiny"]
    assert any(line.split()[:2] == ["collective_latency", "2"] for line in lines)
    assert any(line.split()[:2] == ["all_reduce_part_overhead", "3"] for line in lines)
    assert lines[-1].split() == ["total", "51.448"]
    short = format_breakdown(breakdown(strategy, variables, TWO_BY_TWO), top=1)
    assert "(others)" in short and "(2 variables)" in short


# ----------------------------------------------------------------------------- errors and imports

def test_bad_arguments_are_named():
    strategy = strategy_of(TWO_BY_TWO, common.ar_node_config("v", 0))
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        MODEL.predict(strategy, [vec("v")], TWO_BY_TWO, batch_size=0)
    with pytest.raises(StrategyError, match=r"without a config: \['w'\]"):
        MODEL.predict(strategy, [vec("v"), vec("w")], TWO_BY_TWO, batch_size=1)
    with pytest.raises(ValueError, match="local_bandwidth_gbps"):
        CostModel(local_bandwidth_gbps=0)


def test_the_command_line_starts_without_tensorflow():
    # The synchronizer kinds, which the simulator and the sampler ask, build graphs too.
    code = "import sys, autodist.cli; sys.exit('tensorflow' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_fp16_features_count_only_the_parts_that_travel_compressed():
    # Sparse gradients of a compressed group are gathered in their own dtype.
    from autodist.simulator.features import FEATURE_NAMES, strategy_features
    cluster = spec((A, 1, None), (B, 1, None))
    variables = [vec("dense"), vec("emb", sparse_grad=True)]
    strategy = strategy_of(cluster, *(common.ar_node_config(v.name, 0,
                                                            compressor="HorovodCompressorEF")
                                      for v in variables))
    table = strategy_features(strategy, variables, cluster, batch_size=10)
    fp16, error_feedback = (FEATURE_NAMES.index(n) for n in ("fp16_share",
                                                             "error_feedback_share"))
    assert table[:, fp16].tolist() == [1.0, 0.0]
    assert table[:, error_feedback].tolist() == [1.0, 0.0]


def test_every_compressor_enum_value_has_a_class_that_states_its_wire_bytes():
    from autodist.synchronizers import compressor
    enum = compressor._ENUM
    assert sorted(compressor.COMPRESSORS) == sorted(enum.values())
    fp16 = compressor.compressor_class(enum.Value("HorovodCompressor"))
    assert fp16.lossy and fp16.wire_bytes(400.0, "float32", sparse=False) == 200.0
    assert fp16.wire_bytes(400.0, "float32", sparse=True) == 400.0  # gathered as it is
    assert fp16.wire_bytes(400.0, "int32", sparse=False) == 400.0
    exact = compressor.compressor_class(enum.Value("NoneCompressor"))
    assert not exact.lossy and exact.wire_bytes(400.0, "float32", sparse=False) == 400.0
    assert compressor.LOSSY == ("HorovodCompressor", "HorovodCompressorEF")
    with pytest.raises(ImportError, match=r"enum values without a class \['HorovodCompressor'"):
        compressor._registry([compressor.NoneCompressor])
    with pytest.raises(ValueError, match="Unknown compressor 7"):
        compressor.compressor_class(7)
