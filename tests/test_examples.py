"""The Keras examples run as a user runs them, and AutoStrategy searches a Keras script.

Each example runs in its own process on the embedded default spec (one node,
two CPU replicas), a few epochs, and must train: its loss falls and it prints
the strategy it used.
"""
import json
import os
import re
import subprocess
import sys

import pytest

from autodist.strategy import Strategy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")


def _run(script: str, *args: str) -> str:
    done = subprocess.run([sys.executable, os.path.join(EXAMPLES, script), *args],
                          capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Strategy " in done.stdout
    return done.stdout


@pytest.mark.parametrize("script, args", [
    ("train_keras_mlp.py", ["--epochs", "3"]),
    ("train_cnn.py", ["--epochs", "2"]),
    ("train_transformer.py", ["--epochs", "2"]),
    ("train_wide_deep.py", ["--epochs", "2"]),
])
def test_a_fit_example_trains(script, args):
    out = _run(script, *args)
    # Keras prints one line per epoch (verbose=2): "... - loss: 0.1234 ...".
    losses = [float(v) for v in re.findall(r"- loss: ([0-9.e+-]+)", out)]
    assert len(losses) == int(args[1]), out
    assert losses[-1] < losses[0], out


def test_the_custom_loop_example_trains(tmp_path):
    saved = tmp_path / "loop.strategy"
    out = _run("custom_loop.py", "--steps", "20", "--save-strategy", str(saved))
    losses = [float(v) for v in re.findall(r"step +\d+ +loss ([0-9.]+)", out)]
    assert len(losses) == 20 and min(losses[-5:]) < losses[0], out
    # The saved strategy drives the same script again.
    again = _run("custom_loop.py", "--steps", "20", "--strategy", str(saved))
    assert Strategy.load(str(saved)).id in again


def test_search_command_on_a_keras_script(tmp_path, capsys):
    from autodist import cli
    log_dir, out = tmp_path / "log", tmp_path / "best.strategy"
    status = cli.main(["search", os.path.join(EXAMPLES, "train_keras_mlp.py"),
                       "--trials", "3", "--candidates", "50", "--per-round", "1",
                       "--warmup", "2", "--steps", "3", "--log-dir", str(log_dir),
                       "--out", str(out), "--", "--epochs", "2"])
    assert status == 0
    lines = [json.loads(line) for line in (log_dir / "trials.jsonl").read_text().splitlines()]
    assert len(lines) == 3 and all(t["error"] == "" and t["measured_s"] > 0 for t in lines)
    best = Strategy.load(str(out))
    assert best.id == min(lines, key=lambda t: t["measured_s"])["strategy_id"]
    # The variables the search distributed are the Keras model's.
    names = sorted(node.var_name for node in best.proto.node_config)
    assert names == ["sequential/dense/bias", "sequential/dense/kernel",
                     "sequential/dense_1/bias", "sequential/dense_1/kernel"]
