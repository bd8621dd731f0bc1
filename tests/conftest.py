"""Shared fixtures; sets AutoDist's and TensorFlow's environment before TF is imported."""
import os

# The front reads the thread counts when it opens a session; small pools keep
# two or four replicas from oversubscribing the test machine.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("AUTODIST_INTRA_OP_THREADS", "1")
os.environ.setdefault("AUTODIST_INTER_OP_THREADS", "2")

import pathlib  # noqa: E402

import pytest  # noqa: E402

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent


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
