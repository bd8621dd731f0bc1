"""Runs one script of the Keras corpus (or the library corpus) on every node of an
emulated cluster.

The chief starts this script; AutoDist starts it on the other nodes. Every
node runs the corpus script with its own rows of each global batch
(``Env.shard``) and writes what it trained to ``OUT.node-K.pkl``.

    python keras_corpus_cluster_job.py SPEC SCRIPT BUILDER OUT
"""
import dataclasses
import os
import pickle
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras_corpus as kc  # noqa: E402


def main() -> None:
    from autodist import AutoDist
    from autodist.strategy import get_builder

    spec, script, builder, out = sys.argv[1:5]
    if script in kc.SCRIPTS:
        scripts = kc.SCRIPTS
    else:  # the library corpus's, which imports KerasHub and KerasRS
        import library_corpus
        scripts = library_corpus.SCRIPTS
    ad = AutoDist(spec, get_builder(builder))
    result = scripts[script](kc.Env(scope=ad.scope, function=ad.function, name=builder,
                                       node=ad.node_index, nodes=len(ad.resource_spec.nodes)))
    with open(f"{out}.node-{ad.node_index}.pkl", "wb") as target:
        pickle.dump(dataclasses.asdict(result), target)


if __name__ == "__main__":
    main()
