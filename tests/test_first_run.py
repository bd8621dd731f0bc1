"""What a new user sees first: quiet output, progress in human units, honest closing messages."""
import json
import os
import subprocess
import sys

import pytest
import yaml

from autodist._startup import is_cpp_log_line
from autodist.search.builder import format_progress

REPO = os.path.join(os.path.dirname(__file__), "..")
EXAMPLE = os.path.join(REPO, "examples", "train_keras_mlp.py")


def _run(argv: list, **env) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items()
                   if k not in ("TF_CPP_MIN_LOG_LEVEL", "AUTODIST_TF_LOGS")}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=240, cwd=REPO,
                          env={**environment, **env})
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _cpp_lines(done: subprocess.CompletedProcess) -> list:
    return [line for line in (done.stdout + done.stderr).splitlines() if is_cpp_log_line(line)]


def test_cpp_log_lines_are_recognised():
    assert is_cpp_log_line("WARNING: All log messages before absl::InitializeLog() is called "
                           "are written to STDERR")
    assert is_cpp_log_line("I0000 00:00:1795612527.006905    2429 port.cc:153] oneDNN custom "
                           "operations are on.")
    assert is_cpp_log_line("E0000 00:00:1795614625.171438   26940 cuda_platform.cc:52] failed "
                           "call to cuInit: INTERNAL")
    assert not is_cpp_log_line("Epoch 1/3")
    assert not is_cpp_log_line("ValueError: AutoDist splits the batch fed to 'x'")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_readme_example_prints_no_tensorflow_cpp_log():
    done = _run([sys.executable, EXAMPLE, "--epochs", "1"])
    assert _cpp_lines(done) == []
    assert "- loss: " in done.stdout.splitlines()[0]  # the user's losses come first
    # The documented switch brings TensorFlow's own start-up logs back.
    loud = _run([sys.executable, EXAMPLE, "--epochs", "1"], AUTODIST_TF_LOGS="1")
    assert _cpp_lines(loud)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_search_prints_progress_in_human_units_and_no_cpp_log(tmp_path):
    log_dir, out = tmp_path / "log", tmp_path / "best.strategy"
    done = _run([sys.executable, "-m", "autodist.cli", "search", EXAMPLE, "--trials", "2",
                 "--candidates", "50", "--per-round", "1", "--warmup", "2", "--steps", "3",
                 "--log-dir", str(log_dir), "--out", str(out), "--", "--epochs", "2"])
    assert _cpp_lines(done) == []
    progress = [line for line in done.stdout.splitlines() if line.startswith("trial ")]
    assert len(progress) == 2 and " ms" in progress[0] and "best " in progress[0], done.stdout
    trials = [json.loads(line) for line in (log_dir / "trials.jsonl").read_text().splitlines()]
    assert progress[0].split()[2] == trials[0]["source"].split(":", 1)[1]
    # After the README's install the plot is there, and the closing message says where.
    assert (log_dir / "search.png").read_bytes()[:4] == b"\x89PNG"
    assert f"Plot: {log_dir / 'search.png'}" in done.stdout


@pytest.mark.timeout(120)
def test_probe_prints_no_cpp_log(tmp_path):
    spec = tmp_path / "spec.yml"
    spec.write_text(yaml.safe_dump({"nodes": [{"address": "localhost", "chief": True},
                                              {"address": "127.0.0.1"}]}))
    done = _run([sys.executable, "-m", "autodist.cli", "probe", str(spec), "--seconds", "0.2"])
    assert _cpp_lines(done) == [] and "127.0.0.1" in done.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_search_without_matplotlib_says_what_to_install(tmp_path, capsys, monkeypatch):
    from autodist import cli
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now fails
    status = cli.main(["search", EXAMPLE, "--trials", "0", "--log-dir", str(tmp_path / "log"),
                       "--out", str(tmp_path / "best.strategy"), "--", "--epochs", "1"])
    assert status == 0
    printed = capsys.readouterr().out
    assert "No plot: matplotlib is not installed (python3 -m pip install matplotlib)." in printed
    assert not (tmp_path / "log" / "search.png").exists()


def test_progress_lines_read_in_milliseconds_and_percent():
    assert (format_progress(3, 30, "search", 0.0022, 0.0022, 0.5)
            == "trial  3/30  sampled              2.2 ms · best 2.2 ms · hit rate 50%")
    assert (format_progress(1, 30, "builder:PartitionedPS", 0.2519, 0.2519, None)
            == "trial  1/30  PartitionedPS        251.9 ms · best 251.9 ms")
    assert (format_progress(12, 12, "explore", None, 0.1, 0.25)
            == "trial 12/12  sampled at random    failed · best 100.0 ms · hit rate 25%")
