"""Shared fixtures; sets AutoDist's and TensorFlow's environment before TF is imported."""
import os

# The front reads the thread counts when it opens a session; small pools keep
# two or four replicas from oversubscribing the test machine.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("AUTODIST_INTRA_OP_THREADS", "1")
os.environ.setdefault("AUTODIST_INTER_OP_THREADS", "2")

# pytest.ini runs the suite in two xdist workers. Each worker's one-node searches take
# the machine-wide search lock of their own TensorFlow port (the multi-node jobs run in
# their own network namespaces, where the port is theirs alone).
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if _WORKER.startswith("gw") and _WORKER[2:].isdigit():
    from autodist.cluster import runtime  # noqa: E402  (after the settings above)
    os.environ.setdefault(runtime.TF_PORT_ENV,
                          str(runtime.DEFAULT_TF_PORT + 10 * int(_WORKER[2:])))

import pathlib  # noqa: E402

import pytest  # noqa: E402

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(items) -> None:
    """Gives the xdist workers whole files, so that a file's shared set-up (its module
    fixtures and cached single-device runs) is made once; and keeps the tests on
    emulated clusters in one worker, one at a time: they share the machine's namespaces
    and look for their jobs' processes by name."""
    for item in items:
        group = ("emulated_clusters" if item.get_closest_marker("multinode")
                 else item.nodeid.split("::")[0])
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture
def spec_path() -> str:
    """The repository's two-replica local spec (configs/local_2cpu.yml)."""
    return str(REPO_ROOT / "configs" / "local_2cpu.yml")


@pytest.fixture
def spec_path_4cpu(tmp_path) -> str:
    """A one-node spec with four CPU replicas."""
    path = tmp_path / "local_4cpu.yml"
    path.write_text("nodes:\n  - address: localhost\n    cpus: [0, 1, 2, 3]\n    chief: true\n")
    return str(path)
