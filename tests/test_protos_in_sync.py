"""Checks that the checked-in ``autodist/proto/*_pb2*.py`` match ``proto/*.proto``."""
import importlib.util
import pathlib

import pytest

pytestmark = pytest.mark.timeout(120)

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent


def _load_gen_protos():
    path = REPO_ROOT / "scripts" / "gen_protos.py"
    spec = importlib.util.spec_from_file_location("gen_protos", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_checked_in_protos_match_sources(tmp_path):
    gen_protos = _load_gen_protos()
    generated = gen_protos.generate(tmp_path)
    assert sorted(p.name for p in generated) == gen_protos.module_names()
    stale = []
    for fresh in generated:
        checked_in = REPO_ROOT / "autodist" / "proto" / fresh.name
        if not checked_in.exists() or checked_in.read_bytes() != fresh.read_bytes():
            stale.append(str(checked_in.relative_to(REPO_ROOT)))
    assert not stale, (
        f"Generated proto modules are missing or out of date: {stale}. "
        "Run `python scripts/gen_protos.py` and commit the result.")


def test_no_orphan_generated_modules():
    gen_protos = _load_gen_protos()
    expected = set(gen_protos.module_names())
    proto_pkg = REPO_ROOT / "autodist" / "proto"
    present = {p.name for pattern in ("*_pb2.py", "*_pb2_grpc.py") for p in proto_pkg.glob(pattern)}
    orphans = sorted(present - expected)
    assert not orphans, (
        f"Generated modules without a .proto source: {orphans}. Delete them or "
        "restore their sources, then run `python scripts/gen_protos.py`.")


def test_grpc_stubs_only_for_sources_with_a_service():
    gen_protos = _load_gen_protos()
    assert "service_pb2_grpc.py" in gen_protos.module_names()
    assert "strategy_pb2_grpc.py" not in gen_protos.module_names()
