"""Models built with KerasHub and KerasRS (``tests/library_corpus.py``) through AutoDist.

Every script runs twice from the same seed: on a single device, and with its
model built and compiled inside ``ad.scope()`` under a builder, on
configs/local_2cpu.yml (two CPU replicas). The two runs must leave the same
weights, optimizer variables, History and per-step losses (and extras), to 1e-5,
and the AutoDist run must have been distributed over the two replicas.

Every script runs under AllReduce; the ones with embedding tables (sparse
gradients: Parallax treats them apart) also under PartitionedPS and Parallax.
Cases marked xfail differ from a single device today; each reason names its bug
or the documented difference (the marks are strict: a fix makes them fail).
"""
from __future__ import annotations

import functools

import pytest

import keras_corpus as kc
import library_corpus as lc
from autodist import AutoDist
from autodist.strategy import AllReduce, Parallax, PartitionedPS
from test_keras_corpus import EXACT, assert_same, corpus_cases

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300),
              # KerasHub tasks hand fit a tf.data.Dataset, with fit's default shuffle=True
              pytest.mark.filterwarnings("ignore:`shuffle=True` was passed"),
              # KerasHub's embeddings pass their padding mask to sublayers that drop it
              pytest.mark.filterwarnings("ignore:Layer '.*' .* was passed an input with a mask")]

BUILDERS = {"AllReduce": AllReduce, "PartitionedPS": PartitionedPS, "Parallax": Parallax}
ALL = tuple(BUILDERS)
REPLICAS = 2  # configs/local_2cpu.yml

# script -> the builders it runs under.
SCRIPT_BUILDERS = {name: ("AllReduce",) for name in lc.SCRIPTS}
SCRIPT_BUILDERS.update({name: ALL for name in (
    "gpt2_causal_lm", "dcn_feature_cross", "dlrm_dot_interaction", "two_tower_retrieval",
    "two_tower_retrieval_gathered")})

# Scripts that train differently from a single device, each with why.
DIFFERS = {
    "resnet_image_classifier": (
        "documented (README, Quick start: Keras): batch normalization normalizes each replica's "
        "half batch with its own statistics"),
    "two_tower_retrieval": (
        "documented (README, Quick start: Keras): in-batch negatives left per replica score "
        "each replica's queries against its own rows' candidates only (B/2 x B/2 scores "
        "instead of B x B); two_tower_retrieval_gathered gathers them and is exact"),
}


CASES = corpus_cases(SCRIPT_BUILDERS, DIFFERS)


@functools.lru_cache(maxsize=None)
def single(script: str) -> kc.Result:
    """The script on a single device (no-op scope)."""
    return lc.SCRIPTS[script](kc.Env())


@pytest.mark.parametrize("script, builder", CASES)
def test_script_matches_single_device(spec_path, tmp_path, script, builder):
    ad = AutoDist(resource_spec_file=spec_path, strategy_builder=BUILDERS[builder]())
    got = lc.SCRIPTS[script](kc.Env(scope=ad.scope, function=ad.function, workdir=tmp_path,
                                    name=builder))
    mismatch = None
    try:
        assert_same(got, single(script), f"{script} under {builder}", EXACT)
    except AssertionError as error:
        mismatch = error
    # Not a distribution of the model (fit ran on one device, or not at all through
    # AutoDist) is a failure of its own, never the expected difference of an xfail.
    if ad.strategy is None or len(ad.strategy.replicas) != REPLICAS:
        replicas = None if ad.strategy is None else len(ad.strategy.replicas)
        pytest.fail(f"{script} under {builder}: not distributed (strategy "
                    f"{'None' if ad.strategy is None else 'set'}, replicas {replicas}); "
                    f"comparison: {str(mismatch).splitlines()[0] if mismatch else 'same'}")
    if mismatch is not None:
        raise mismatch


# script -> a property of its single-device run that shows the pattern took effect,
# so that matching it under AutoDist means something.
EXERCISED = {
    # the two halves of each batch (one a replica) hold different numbers of real tokens
    "gpt2_causal_lm": lambda r: all(long > 2 * short for long, short
                                    in r.extras["real_tokens_per_half_batch"]),
    "two_tower_retrieval": lambda r: r.history["loss"][-1] < r.history["loss"][0],
    "two_tower_retrieval_gathered": lambda r: r.history["loss"][-1] < r.history["loss"][0],
    "listwise_pairwise_hinge": lambda r: r.history["ndcg"][-1] > r.history["ndcg"][0],
    "dcn_feature_cross": lambda r: r.history["loss"][-1] < r.history["loss"][0],
}


@pytest.mark.parametrize("script", sorted(EXERCISED))
def test_single_device_run_exercises_the_pattern(script):
    assert EXERCISED[script](single(script))
