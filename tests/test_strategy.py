"""Tests of the Strategy wrapper: ids, save/load, text form, equality."""
import os
import random

import pytest

from autodist.proto import strategy_pb2
from autodist.strategy import Strategy, StrategyBuilder, StrategyError
from autodist.strategy import common

pytestmark = pytest.mark.timeout(60)


def _sample_strategy() -> Strategy:
    strategy = Strategy()
    strategy.proto.graph_config.replicas.extend(["localhost:CPU:0", "localhost:CPU:1"])
    strategy.node_config.append(common.ps_node_config("dense/kernel", "localhost:CPU:0",
                                                      local_replication=True, sync=False,
                                                      staleness=3))
    parts = [common.ar_node_config("emb/part_0", 0), common.ar_node_config("emb/part_1", 1)]
    strategy.node_config.append(common.partitioned_node_config("emb", 0, 2, parts))
    return strategy


def test_fresh_ids_are_unique_and_kept_from_proto():
    ids = {Strategy().id for _ in range(200)}
    assert len(ids) == 200
    assert all(len(i) > 10 for i in ids)
    assert Strategy(strategy_pb2.Strategy(id="fixed")).id == "fixed"


def test_constructor_copies_proto_and_rejects_other_types():
    proto = strategy_pb2.Strategy(id="a")
    strategy = Strategy(proto)
    proto.id = "changed"
    assert strategy.id == "a"
    with pytest.raises(TypeError, match="strategy_pb2.Strategy"):
        Strategy("not a proto")


def test_properties():
    strategy = _sample_strategy()
    assert strategy.replicas == ["localhost:CPU:0", "localhost:CPU:1"]
    assert len(strategy.node_config) == 2
    by_name = strategy.node_config_by_name()
    assert sorted(by_name) == ["dense/kernel", "emb"]
    assert by_name["dense/kernel"].PSSynchronizer.staleness == 3
    assert by_name["emb"].partitioner == "2,1"
    assert [p.AllReduceSynchronizer.group for p in by_name["emb"].part_config] == [0, 1]


def test_node_config_by_name_rejects_duplicates():
    strategy = _sample_strategy()
    strategy.node_config.append(common.ps_node_config("emb", "localhost:CPU:0"))
    with pytest.raises(StrategyError, match="'emb'"):
        strategy.node_config_by_name()


def test_save_load_round_trip(tmp_path):
    strategy = _sample_strategy()
    path = tmp_path / "nested" / "dir" / strategy.id
    written = strategy.save(path)
    assert written == str(path)
    assert os.listdir(path.parent) == [strategy.id]  # no temp file left behind
    loaded = Strategy.load(written)
    assert loaded == strategy
    assert loaded.id == strategy.id
    assert loaded.proto.node_config[0].PSSynchronizer.sync is False


def test_save_overwrites_atomically(tmp_path):
    path = tmp_path / "s"
    first = _sample_strategy()
    first.save(path)
    second = Strategy()
    second.proto.graph_config.replicas.append("localhost:CPU:0")
    second.save(path)
    assert Strategy.load(path) == second
    assert os.listdir(tmp_path) == ["s"]


def test_load_missing_file_names_path(tmp_path):
    path = tmp_path / "missing"
    with pytest.raises(StrategyError, match="not found") as info:
        Strategy.load(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("seed", range(5))
def test_load_random_bytes_names_path(tmp_path, seed):
    path = tmp_path / f"random{seed}"
    path.write_bytes(random.Random(seed).randbytes(256))
    with pytest.raises(StrategyError) as info:
        Strategy.load(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("content", [
    b"",
    b"id: 'abc'\ngraph_config { replicas: 'localhost:CPU:0' }\n",
    b"this is just some text\n",
    b"\n\x03abc",  # a valid id and nothing else
    b"\x1a\x00",  # an empty node_config and no id
])
def test_load_empty_or_garbage_names_path(tmp_path, content):
    path = tmp_path / "bad"
    path.write_bytes(content)
    with pytest.raises(StrategyError) as info:
        Strategy.load(path)
    assert str(path) in str(info.value)


def test_load_directory_is_an_error(tmp_path):
    with pytest.raises(StrategyError, match="not found"):
        Strategy.load(tmp_path)


def test_str_is_text_format_with_var_names():
    text = str(_sample_strategy())
    assert 'var_name: "dense/kernel"' in text
    assert 'var_name: "emb/part_1"' in text
    assert 'partitioner: "2,1"' in text
    assert "reduction_destination" in text


def test_equality_and_copy():
    strategy = _sample_strategy()
    clone = strategy.copy()
    assert clone == strategy and clone is not strategy
    clone.node_config[0].PSSynchronizer.staleness = 9
    assert clone != strategy
    assert strategy.node_config[0].PSSynchronizer.staleness == 3
    assert strategy != "something else"


def test_builder_is_abstract():
    with pytest.raises(TypeError):
        StrategyBuilder()
