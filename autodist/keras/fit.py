"""``model.fit`` through AutoDist, for a Keras model compiled inside ``ad.scope()``.

The model keeps every Keras feature built around its train function (epochs,
callbacks, validation, the progress bar, ``History``): AutoDist replaces only
the function that runs one training step, with the model's own ``train_step``
traced, lifted and distributed (``function.py``). The step's logs are the
metrics' results, copied back after each step; the trained weights and the
optimizer's state are copied back whenever Keras code may read them (see
``_FitRunner``), so ``evaluate``, ``predict``, callbacks and ``save`` see the
trained model.
"""
from __future__ import annotations

import inspect
import warnings
from typing import Callable, Optional

import keras
import tensorflow as tf

from autodist import _keras_compat, _tf_compat
from autodist.keras import saving
from autodist.keras.function import DistributedStep
from autodist.keras.step import LiftedStep, StepCache
from autodist.session import DistributedSession, as_tf_variable


def check_distributable(model: keras.Model) -> None:
    """Refuses the compile settings AutoDist cannot distribute, naming them.

    Raises:
        NotImplementedError: for ``steps_per_execution > 1``, ``jit_compile=True``
            or ``run_eagerly=True``.
    """
    name = type(model).__name__
    if model.steps_per_execution != 1:
        raise NotImplementedError(
            f"AutoDist runs one step per call: {name} is compiled with "
            f"steps_per_execution={model.steps_per_execution}; use 1.")
    if model.jit_compile:
        raise NotImplementedError(
            f"AutoDist does not compile steps with XLA: {name} is compiled with "
            "jit_compile=True; use jit_compile=False.")
    if model.run_eagerly:
        raise NotImplementedError(
            f"AutoDist traces the training step: {name} is compiled with "
            "run_eagerly=True; use run_eagerly=False.")


# Callbacks that decide from the logs, which on a cluster are each node's own rows'.
_PER_NODE_DECISIONS = {
    keras.callbacks.EarlyStopping: "stops training",
    keras.callbacks.ReduceLROnPlateau: "sets the learning rate",
}


def check_callbacks(callbacks: list) -> None:
    """Refuses, on a cluster, callbacks whose decision would differ from node to node.

    Each node logs the metrics of its own rows, so such a callback would stop
    one node and not another (which then waits for it for ever), or train the
    nodes' copies of the weights with different learning rates.

    Raises:
        NotImplementedError: naming the callback.
    """
    for callback in callbacks:
        for kind, decision in _PER_NODE_DECISIONS.items():
            if isinstance(callback, kind):
                raise NotImplementedError(
                    f"On a cluster each node logs the metrics of its own rows, so "
                    f"{type(callback).__name__} (monitor={callback.monitor!r}) would decide "
                    f"per node: it {decision} from this node's logs only, and the nodes "
                    "would train apart. Use a fixed number of epochs or a schedule "
                    "(LearningRateScheduler, a learning-rate schedule) on a cluster, or "
                    "train on one node.")


class _FitRunner:
    """Runs ``fit``'s steps through AutoDist and keeps the model in sync with them.

    Each step copies back only the small state: what the forward pass writes
    (the metrics) and the optimizer's scalars (its iteration count and
    learning rate); after every step where a callback has batch hooks, else
    when Keras reads it (``get_metrics_result`` at an epoch's end, callbacks
    at its end, validation). The logs' metric results are computed in the
    step's run. It copies in what Keras code changed of the small
    state (metrics reset at an epoch's start, a learning rate a callback set:
    it takes effect at the next step) when Keras code ran since the last
    step: at an epoch's start, or after every batch when a callback has batch
    hooks; and of the weights and slots too after fit's or an epoch's start
    (a backup loaded by a callback). The trained weights and the optimizer's
    slots are copied back whenever Keras code may read them: before
    validation, at the end of every epoch and of ``fit``, and after every batch
    when a callback acts per batch (then the weights, not the slots), unless it
    says its batch hooks read no weights (``autodist_reads_weights = False``).
    """

    def __init__(self, model: keras.Model,
                 open_session: Callable[[LiftedStep], DistributedSession], replicas: int,
                 on_cluster: bool):
        self._model = model
        self._on_cluster = on_cluster
        self._keras_metrics_result = model.get_metrics_result  # Keras's, before ours
        self._open_session = open_session
        self._replicas = replicas
        self._step: Optional[DistributedStep] = None  # the step that ran last
        self._trace_for_compile_state()
        self._stale = False  # trained values not yet copied into the model
        self._slots_stale = False  # the optimizer's slots not yet copied
        self._in_fit = False  # else a step is train_on_batch's, copied back at once
        self._keras_code_ran = True  # since the last step: it may have changed the state
        self._weights_may_have_changed = False  # the same for the weights and slots
        self._sync: Optional[_SyncCallback] = None  # the running fit's callback

    @property
    def step(self) -> Optional[DistributedStep]:
        return self._step

    def _trace_for_compile_state(self) -> None:
        """Starts the steps for the model as compiled now: one per structure of the data
        (see ``StepCache``), traced without autograph, as Keras traces ``train_step``;
        and the logs' metric results, computed in one traced call as in Keras's step."""
        self._compiled = _keras_compat.compile_state(self._model)
        self._steps = StepCache(self._model.train_step, self._replicas,
                                lambda lifted: DistributedStep(lifted, self._open_session(lifted)),
                                autograph=False)
        self._metrics_traced = tf.function(self._keras_metrics_result)
        self._metrics_call = None  # traced after the first step, which builds the metrics

    def fit(self, *args, **kwargs):
        """``model.fit``, with a callback that copies the trained values back first; on a
        cluster the other nodes then learn where its training ended
        (``DistributedSession.training_ended``)."""
        fit = type(self._model).fit
        bound, arguments = _bind_fit(fit, self._model, args, kwargs)
        callbacks = arguments.get("callbacks")
        if self._on_cluster:
            check_callbacks(callbacks.callbacks if isinstance(
                callbacks, keras.callbacks.CallbackList) else list(callbacks or []))
        sync = _SyncCallback(self)
        if isinstance(callbacks, keras.callbacks.CallbackList):
            sync.watch(callbacks.callbacks)
            callbacks.callbacks.insert(0, sync)
            sync.set_model(self._model)
        else:
            callbacks = list(callbacks or [])
            sync.watch(callbacks)
            arguments["callbacks"] = [sync] + callbacks
        self._in_fit, self._sync = True, sync
        try:
            history = fit(*bound.args, **bound.kwargs)
            if self._on_cluster and self._step is not None:
                # Every node must run the same steps: a callback that stopped this node
                # alone must be named on every node, not leave the others waiting.
                self._step.session.training_ended(early=bool(self._model.stop_training))
            return history
        except BaseException:
            self._copy_back_after_failure()
            raise
        finally:
            self._in_fit, self._sync = False, None

    def _copy_back_after_failure(self) -> None:
        """Copies the values trained before ``fit`` failed (a callback's error, Ctrl-C)
        into the model, which holds them on one device; a ``save``, or the next
        ``fit`` with ``BackupAndRestore``, starts from them. Not on a cluster, where
        the failure may be a node's that the copy would wait for."""
        if self._on_cluster or self._step is None:
            return
        try:
            self.copy_to_model()
        except Exception as error:  # pylint: disable=broad-except
            warnings.warn(f"AutoDist could not copy the values trained before fit failed "
                          f"into the model ({type(error).__name__}: {error}); it holds "
                          "those of the last epoch's end.", stacklevel=3)

    def make_train_function(self, force: bool = False):
        """What ``fit`` calls before its first epoch: syncs in values Keras code changed."""
        del force
        check_distributable(self._model)
        if _keras_compat.compile_state(self._model) != self._compiled:
            # Compiled again outside ad.scope(): train with the new optimizer and loss,
            # from the values trained so far.
            if self._step is not None:
                self.copy_to_model()
            self._step = None
            self._trace_for_compile_state()
        if self._step is not None:
            self._step.copy_from_eager_if_changed()
        self._model.train_function = self.train_function
        return self.train_function

    def train_function(self, iterator) -> dict:
        if self._sync is not None and not self._sync.began:
            raise NotImplementedError(
                f"{type(self._model).__name__}.fit does not pass its callbacks on to "
                "keras.Model.fit, so AutoDist could not add the callback that copies the "
                "trained values into the model. Pass `callbacks` (or **kwargs) through "
                "to super().fit().")
        data = next(iterator)
        step = self._steps.find((data,))
        if step is None or step is not self._step:
            # Data of another structure (train_on_batch after fit, sample weights
            # in one call only) runs another traced step, from the values so far.
            self.copy_to_model()
            if step is None:
                step = self._steps.add((data,))
                step.fetch_after_step(self._metrics_in_graph)
            else:
                step.copy_from_eager_if_changed()
            self._step = step
        elif self._keras_code_ran or not self._in_fit:
            # Metrics reset by Keras, a learning rate set by a callback; weights a
            # callback loaded at fit's or an epoch's start.
            step.copy_from_eager_if_changed(weights=self._weights_may_have_changed,
                                            slots=self._weights_may_have_changed)
        self._keras_code_ran = self._weights_may_have_changed = False
        # Between two batches of fit only callbacks with batch hooks run Keras code;
        # without them the small state is copied when Keras reads it (get_metrics_result
        # at the epoch's end, callbacks), not at every step.
        outputs = step.run((data,), copy_small=not (
            self._in_fit and not self._sync.batch_hooks and step.fetches_after_step))
        self._stale = self._slots_stale = True
        if not self._in_fit:
            self.copy_to_model()
        metrics = step.after_step_values
        return _logs(outputs, self._metrics_result() if metrics is None else metrics)

    def _metrics_in_graph(self, read: Callable) -> Optional[dict]:
        """The model's metric results computed in AutoDist's graph from ``read``'s values
        of the metric variables (``DistributedStep.fetch_after_step``): the logs then
        come with the step's run, with no eager call. None where a variable has none."""
        variables = self._model.metrics_variables
        reads = [read(as_tf_variable(variable)) for variable in variables]
        if any(value is None for value in reads):
            return None
        with keras.StatelessScope(state_mapping=list(zip(variables, reads))):
            return self._keras_metrics_result()

    def get_metrics_result(self) -> dict:
        """``model.get_metrics_result``: Keras's, on the metrics of the last step (which
        Keras's ``fit`` reads at an epoch's end, before the callbacks)."""
        if self._step is not None:
            self._step.copy_small_state()
        return self._keras_metrics_result()

    def _metrics_result(self) -> dict:
        """The model's metric results, in one flat call (``_tf_compat.called_flat``)."""
        if self._metrics_call is None:
            self._metrics_call = _tf_compat.called_flat(
                self._metrics_traced.get_concrete_function())
        return self._metrics_call()

    def keras_code_runs(self, weights: bool = False) -> None:
        """Keras code runs before the next step: it may change the small state.

        Args:
            weights: it may change the weights and slots too (callbacks at fit's or
                an epoch's start: ``BackupAndRestore`` loads its backup there).
        """
        self._keras_code_ran = True
        self._weights_may_have_changed |= weights

    def copy_to_model(self, slots: bool = True) -> None:
        """Copies the trained weights and optimizer state into the model, if stale.

        Args:
            slots: also the optimizer's slots (not needed between batches).
        """
        if self._step is not None:
            self._step.copy_small_state()
        if self._stale or (slots and self._slots_stale):
            self._step.copy_to_eager(slots=slots)
            self._stale = False
            self._slots_stale = self._slots_stale and not slots


def _bind_fit(fit: Callable, model: keras.Model, args: tuple, kwargs: dict) -> tuple:
    """Binds a call of ``fit`` (Keras's own or a subclass's override) to its signature.

    Returns:
        the bound arguments, and the dict where ``callbacks`` is or goes: the
        bound arguments themselves, or the keyword arguments an override such
        as ``fit(self, x=None, y=None, **kwargs)`` passes on to Keras's ``fit``
        (KerasHub's task models).

    Raises:
        NotImplementedError: when ``fit`` takes neither ``callbacks`` nor ``**kwargs``.
    """
    signature = inspect.signature(fit)
    bound = signature.bind(model, *args, **kwargs)
    if "callbacks" in signature.parameters:
        return bound, bound.arguments
    rest = next((p.name for p in signature.parameters.values()
                 if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    if rest is None:
        raise NotImplementedError(
            f"{type(model).__name__}.fit takes no `callbacks` argument and no **kwargs, so "
            "AutoDist cannot add the callback that copies the trained values into the "
            "model. Add **kwargs to the override and pass them on to super().fit().")
    return bound, bound.arguments.setdefault(rest, {})


def _logs(outputs, metrics: dict):
    """A step's logs: what ``train_step`` returned, each metric's value taken from the model.

    A metric's result computed inside the step reads one replica's view of its
    variables; the model's metric, copied back after the step, holds the value
    merged over the replicas. Anything else the step returns (a loss it
    computed) is the value AutoDist's session fetched for it.
    """
    if not isinstance(outputs, dict):
        return metrics
    return {key: metrics.get(key, value) for key, value in _flat_logs(outputs).items()}


def _flat_logs(outputs: dict) -> dict:
    """Nested dicts of logs merged into one, as Keras shows them (``compile_metrics``)."""
    flat = {}
    for key, value in outputs.items():
        if isinstance(value, dict):
            flat.update(_flat_logs(value))
        else:
            flat[key] = value
    return flat


class _SyncCallback(keras.callbacks.Callback):
    """Copies the trained values into the model before Keras code reads them.

    It runs first among ``fit``'s callbacks.
    """

    def __init__(self, runner: _FitRunner):
        super().__init__()
        self._runner = runner
        self._per_batch = False  # a callback may read the weights after a batch
        self.batch_hooks = False  # a callback's code runs between batches
        self.began = False  # Keras's fit called it: an override passed it on

    def watch(self, callbacks: list) -> None:
        """Copies after every batch too if one of ``callbacks`` acts per batch."""
        self._per_batch = any(_acts_per_batch(c) for c in callbacks)
        self.batch_hooks = any(_has_batch_hooks(c) for c in callbacks)

    def on_train_begin(self, logs=None):
        self.began = True
        self._runner.keras_code_runs(weights=True)  # the callbacks after this one

    def on_epoch_begin(self, epoch, logs=None):
        # Keras reset the metrics; callbacks follow, after the last epoch's ends.
        self._runner.keras_code_runs(weights=True)

    def on_train_batch_end(self, batch, logs=None):
        if self._per_batch:
            self._runner.copy_to_model(slots=False)
        if self.batch_hooks:
            self._runner.keras_code_runs()

    def on_test_begin(self, logs=None):
        self._runner.copy_to_model()  # validation inside fit

    def on_epoch_end(self, epoch, logs=None):
        self._runner.copy_to_model()

    def on_train_end(self, logs=None):
        self._runner.copy_to_model()


def _acts_per_batch(callback: keras.callbacks.Callback) -> bool:
    """Whether ``callback`` may read the weights after a batch."""
    if not getattr(callback, "autodist_reads_weights", True):
        return False
    if isinstance(callback, keras.callbacks.ModelCheckpoint):
        return callback.save_freq != "epoch"
    return _has_batch_hooks(callback)


def _has_batch_hooks(callback: keras.callbacks.Callback) -> bool:
    """Whether ``callback`` runs code between two training batches."""
    hooks = ("on_train_batch_begin", "on_train_batch_end", "on_batch_begin", "on_batch_end")
    return any(getattr(type(callback), hook) is not getattr(keras.callbacks.Callback, hook)
               for hook in hooks)


def distribute_fit(model: keras.Model,
                   open_session: Callable[[LiftedStep], DistributedSession],
                   replicas: int, on_cluster: bool = False, writes_saves: bool = True) -> None:
    """Makes ``model.fit`` train through AutoDist (called right after ``compile``).

    Args:
        model: the model just compiled.
        open_session: opens AutoDist's session on a lifted step's graph.
        replicas: the number of replicas on this node.
        on_cluster: whether other nodes train the model too (see ``check_callbacks``).
        writes_saves: whether this node writes the model's saves: not a cluster's
            workers (see ``saving.guard_saves``).
    """
    check_distributable(model)
    saving.guard_saves(model, writes_saves)  # ModelCheckpoint's saves too
    runner = _FitRunner(model, open_session, replicas, on_cluster)
    # Instance attributes: only this model changes, and Keras looks them up first.
    model.fit = runner.fit
    model.make_train_function = runner.make_train_function
    model.get_metrics_result = runner.get_metrics_result
    model.train_function = None
    model._autodist_fit = runner  # pylint: disable=protected-access
