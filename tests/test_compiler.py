"""compile_strategy: the checks that run before any graph rewrite."""
import pytest

from autodist.resource_spec import ResourceSpec
from autodist.strategy import AllReduce, PartitionedPS, Strategy, StrategyError
from autodist.strategy.compiler import compile_strategy
from test_builders import GRAPH, ONE_NODE, THREE_NODES

pytestmark = pytest.mark.timeout(60)


def test_partitioned_variables_compile_to_their_parts():
    compiled = compile_strategy(PartitionedPS().build(GRAPH, THREE_NODES), GRAPH, THREE_NODES)
    emb = compiled.variables["emb"]
    assert emb.plan.axis == 0 and sum(emb.plan.sizes) == 1000
    assert [p.name for p in emb.parts] == [f"emb/part_{i}" for i in range(emb.plan.num_parts)]
    assert sum(p.shape[0] for p in emb.parts) == 1000


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
