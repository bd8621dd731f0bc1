"""DistributedSession: runs the user's fetches and feeds on the distributed graph."""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import statistics
import threading
import time
from typing import Callable, Optional

import numpy as np
import tensorflow as tf

from autodist import _tf_compat
from autodist.kernels import gradient_processing
from autodist.kernels.locations import Locator
from autodist.kernels.transformer import DistributedGraph

_MONITOR_INTERVAL_S = 0.5
_FAILURE_ATTRIBUTION_S = 3.0
# A training step counts as stuck after this many times the median of the steps
# before it, and never sooner than STUCK_MIN_S; the first step (tracing, warm-up)
# after STUCK_FIRST_S.
STUCK_FACTOR = 20.0
STUCK_MIN_S = 30.0
STUCK_FIRST_S = 300.0
_STEP_HISTORY = 50


class StuckStepError(RuntimeError):
    """A training step made no progress for longer than its bound (e.g. a network partition).

    Attributes:
        nodes: the nodes still in the step.
    """

    def __init__(self, step: int, seconds: float, bound: float, nodes: list):
        self.nodes = nodes
        super().__init__(
            f"AutoDist: training step {step} has made no progress for {seconds:.0f} s (bound "
            f"{bound:.0f} s: {STUCK_FACTOR:g} times the median step, at least "
            f"{STUCK_MIN_S:g} s); nodes still in it: {nodes}. Nodes that cannot reach each "
            "other (a network partition) or a node stuck in its step; stopping the job.")


@functools.lru_cache(maxsize=None)
def heap_trimmer() -> Optional[Callable[[], None]]:
    """glibc's ``malloc_trim(0)``, which hands the C heap's free pages back to the
    system; None where the C library has no such call.

    A step of a multi-node session receives tensors through gRPC, whose buffers
    come from the C heap; freed, they stay in the process's resident memory, up
    to the largest step's worth. Returning them after each run keeps a node's peak
    at what one step needs (``docs/notes/model_scale.md``). A call with nothing
    to return takes microseconds.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        trim = libc.malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: trim(0)


# What a step dies of when another node goes away.
_PEER_ERRORS = (tf.errors.UnavailableError, tf.errors.AbortedError, tf.errors.CancelledError,
                tf.errors.DeadlineExceededError, tf.errors.InternalError)


class DistributedSession:
    """Takes ``tf.compat.v1.Session.run`` arguments naming the original graph.

    Fetching a trainable variable returns its full synchronized value; fetching an
    op of the model runs it on every replica; a fetched tensor computed per
    replica comes back as the replicas' mean (float scalars, e.g. a loss), their
    concatenation (batch-major tensors) or replica 0's value (anything else).
    Feeds of batched placeholders are split across the local replicas. Each
    optimizer call's train op (``minimize``'s result) runs that call's
    synchronization and update; with gradient accumulation over ``k`` runs, a
    run fetching it only keeps its gradients, but every ``k``-th, which
    applies the update.

    Args:
        distributed: the transformed graph.
        config: the ``tf.compat.v1.ConfigProto`` for the underlying session.
        target: the TensorFlow server to connect to ('' in-process).
        init_timeout: how long a worker waits for the chief's variables, in seconds.
        monitor: called about twice a second while a step runs; raises to abort
            it (the chief uses it to stop waiting for a dead worker).
        on_step: called after every run that trains (fetches the train op).
        stuck_nodes: with a monitor, the nodes still in a step after the given
            number of finished steps; a training run that takes longer than its
            bound (``STUCK_FACTOR``) then raises ``StuckStepError`` naming them.
        check_not_left: called with the number of finished steps about twice a
            second while a training run waits; raises when a node it needs has
            already left the job (its script ended, or a callback stopped its
            training).
        on_training_end: called by :meth:`training_ended` with the number of
            finished steps.
    """

    def __init__(self, distributed: DistributedGraph, config=None, target: str = "",
                 init_timeout: float = 120.0, monitor: Optional[Callable[[], None]] = None,
                 on_step: Optional[Callable[[], None]] = None,
                 stuck_nodes: Optional[Callable[[int], list]] = None,
                 check_not_left: Optional[Callable[[int], None]] = None,
                 on_training_end: Optional[Callable[[int, bool], None]] = None):
        self._distributed = distributed
        self._graph = distributed.graph
        self._cache = {}
        # (ids of a flat list of fetches, ids of the fed tensors) -> a callable running
        # them, and the elements (kept alive, so no id is reused)
        self._callables = {}
        # What a fetch or fed key maps to, and a fed tensor's (numpy dtype, dimensions):
        # each looked up once (``_remembered``)
        self._fetch_of, self._feed_of, self._feed_specs = {}, {}, {}
        item = distributed.item
        self._variable_fetches = {}
        for name, variable in item.variables.items():
            self._variable_fetches[variable.handle.name] = name
            self._variable_fetches[_tf_compat.graph_element_name(variable)] = name
        # The optimizer's own variables (slots, Adam's powers), recreated per stored copy.
        self._state_fetches = {}
        for variable in item.graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES):
            if variable.op.name in item.update_op_names:
                for element in (variable.handle.name, _tf_compat.graph_element_name(variable)):
                    self._state_fetches[element] = variable.op.name
        self._locator = None
        self._monitor = monitor
        self._on_step = on_step
        self._stuck_nodes = stuck_nodes
        self._check_not_left = check_not_left
        self._on_training_end = on_training_end
        self._step_seconds = []  # the latest updating runs' durations
        self._steps_done = 0  # training runs, accumulating ones included
        self._runs_of = [0] * len(distributed.updates)  # per optimizer call, its training runs
        # Only a session spanning nodes receives through gRPC: nothing to trim on one node.
        self._trim_heap = (distributed.ctx.multi_node and heap_trimmer()) or (lambda: None)
        self._session = self._watched(tf.compat.v1.Session, target=target, graph=self._graph,
                                      config=config)
        self._watched(self._initialize, init_timeout)
        self._trim_heap()

    def _watched(self, function, *args, training: bool = False,
                 stuck_after: Optional[float] = None, **kwargs):
        """Calls ``function``; with a monitor (or, training, ``check_not_left``), in a
        thread so a failure elsewhere aborts it.

        Args:
            training: the call is a training run.
            stuck_after: seconds after which the call counts as a stuck step.
        """
        check_left = self._check_not_left if training else None
        if self._monitor is None and check_left is None:
            return function(*args, **kwargs)
        outcome = {}

        def call():
            try:
                outcome["value"] = function(*args, **kwargs)
            except BaseException as err:  # re-raised in the caller's thread
                outcome["error"] = err

        thread = threading.Thread(target=call, daemon=True)
        started = time.monotonic()
        thread.start()
        while thread.is_alive():
            thread.join(_MONITOR_INTERVAL_S)
            if thread.is_alive():
                if self._monitor is not None:
                    self._monitor()
                if check_left is not None:
                    check_left(self._steps_done)
                elapsed = time.monotonic() - started
                if stuck_after is not None and elapsed > stuck_after:
                    raise StuckStepError(self._steps_done + 1, elapsed, stuck_after,
                                         self._stuck_nodes(self._steps_done))
        if self._monitor is not None and isinstance(outcome.get("error"), _PEER_ERRORS):
            # A step failing because a peer vanished says so in TF's words; the
            # monitor names the node, once the dead process has been noticed.
            deadline = time.monotonic() + _FAILURE_ATTRIBUTION_S
            while time.monotonic() < deadline:
                try:
                    self._monitor()
                except Exception as failure:
                    raise failure from outcome["error"]
                time.sleep(_MONITOR_INTERVAL_S)
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    def _initialize(self, timeout: float) -> None:
        """Initializes this node's variables, on a worker after the chief's."""
        first, copies = self._distributed.init_ops
        feeds = self._initial_value_feeds()
        self._session.run(first, feed_dict=feeds)
        pending = self._distributed.chief_uninitialized
        deadline = time.monotonic() + timeout
        while pending is not None:
            missing = self._session.run(pending)
            if not len(missing):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"The chief did not initialize {len(missing)} variables within "
                    f"{timeout:.0f} s (e.g. {missing[0].decode()}); is it running?")
            time.sleep(0.2)
        self._session.run(copies, feed_dict=feeds)

    def release_start_state(self) -> None:
        """Drops what only start-up needed (the chief's origins of the nodes' copies);
        call once every node has initialized."""
        if self._distributed.release_after_start is not None:
            self._session.run(self._distributed.release_after_start)
            self._trim_heap()

    def _initial_value_feeds(self) -> dict:
        """The starting values held outside the graph, for the placeholders of them
        this node's graph kept."""
        feeds = {}
        for name, value_of in self._distributed.initial_values.items():
            try:
                placeholder = self._graph.get_tensor_by_name(name)
            except KeyError:  # no variable of this node starts from it
                continue
            feeds[placeholder] = value_of()
        return feeds

    @property
    def graph(self) -> tf.Graph:
        """The distributed graph this session runs."""
        return self._graph

    @property
    def distributed(self) -> DistributedGraph:
        """The rewritten graph and where every original variable lives in it."""
        return self._distributed

    @property
    def tf_session(self) -> tf.compat.v1.Session:
        """The plain session on the distributed graph (for AutoDist's own ops)."""
        return self._session

    def run(self, fetches, feed_dict=None, options=None, run_metadata=None):
        """Like ``tf.compat.v1.Session.run``, on the original graph's elements."""
        if type(fetches) is list and not any(isinstance(f, _NESTED) for f in fetches):
            mapped = [self._map_fetch(f) for f in fetches]  # a step's own list: no tf.nest
            flat = mapped
        else:
            mapped = tf.nest.map_structure(self._map_fetch, fetches)
            flat = tf.nest.flatten(mapped)
        feeds = {}
        for key, value in (feed_dict or {}).items():
            targets, batched = self._map_feed(key)
            if batched:
                self._check_rows(key, value)
            for target in targets:
                feeds[target] = value
        fetched = {id(f) for f in flat}
        trained = [index for index, update in enumerate(self._distributed.updates)
                   if id(update.train_op) in fetched]
        instead, seconds = {}, []  # train op -> what runs in its place; split steps' second runs
        for index in trained:
            update = self._distributed.updates[index]
            # Runs 0 .. k-2 of a cycle keep their gradients; run k-1 updates.
            cycle_run = self._runs_of[index] % (len(update.accumulate_ops) + 1)
            if cycle_run < len(update.accumulate_ops):
                instead[id(update.train_op)] = update.accumulate_ops[cycle_run]
            elif update.remote_step_op is not None:
                seconds.append(update.remote_step_op)
        if instead:
            mapped = tf.nest.map_structure(lambda f: instead.get(id(f), f), mapped)
        updated = len(instead) < len(trained)
        bound = self._stuck_bound() if trained else None
        started = time.monotonic()
        callable_run = (self._callable(mapped, feeds)
                        if options is None and run_metadata is None else None)
        if callable_run is not None:
            result = self._watched(callable_run, *feeds.values(), training=bool(trained),
                                   stuck_after=bound)
        else:
            result = self._watched(self._session.run, mapped, feed_dict=feeds, options=options,
                                   run_metadata=run_metadata, training=bool(trained),
                                   stuck_after=bound)
        if seconds:
            left = None if bound is None else max(0.0, bound - (time.monotonic() - started))
            self._watched(self._session.run, seconds, training=True, stuck_after=left)
        self._trim_heap()
        for index in trained:
            self._runs_of[index] += 1
        if trained:
            self._steps_done += 1
            if updated:
                self._step_seconds = (self._step_seconds + [time.monotonic() - started])[
                    -_STEP_HISTORY:]
            if self._on_step is not None:
                self._on_step()
        return result

    def training_ended(self, early: bool) -> None:
        """The caller's training loop (a Keras ``fit``) ended after the steps run so far.

        On a cluster every node must run the same steps: the other nodes learn where
        this one's training ended. After an early stop this returns once every node
        stopped at the same step; a node that went on into the next step fails
        naming this one, and so does this call.

        Args:
            early: stopped before its planned end (a callback set ``stop_training``).

        Raises:
            StoppedEarlyError: see above (``autodist.cluster.runtime``).
        """
        if self._on_training_end is not None:
            self._on_training_end(self._steps_done, early)

    def _callable(self, fetches, feeds: dict) -> Optional[Callable]:
        """A callable running a flat list of ``fetches`` on ``feeds``' values, in their
        order (``_tf_compat.session_callable``), made once per list. None where
        ``Session.run`` must convert a value or name a mismatch: a fetch structure
        other than a list, a value that is not an array of its tensor's dtype and a
        compatible shape."""
        if not isinstance(fetches, list) or not all(
                isinstance(f, (tf.Tensor, tf.Operation)) for f in fetches):
            return None
        for target, value in feeds.items():
            dtype, dims = self._feed_spec(target)
            if not isinstance(value, np.ndarray) or value.dtype != dtype:
                return None
            if dims is not None and (len(dims) != value.ndim or any(
                    d is not None and d != v for d, v in zip(dims, value.shape))):
                return None
        key = (tuple(map(id, fetches)), tuple(map(id, feeds)))
        if key not in self._callables:
            made = _tf_compat.session_callable(self._session, fetches, list(feeds))
            self._callables[key] = (made, list(fetches), list(feeds))
        return self._callables[key][0]

    def _feed_spec(self, target: tf.Tensor) -> tuple:
        """A fed tensor's numpy dtype and dimensions (None: any rank), looked up once."""
        return _remembered(self._feed_specs, target, lambda: (
            target.dtype.as_numpy_dtype,
            target.shape.as_list() if target.shape.rank is not None else None))

    def _stuck_bound(self) -> Optional[float]:
        """How long the next training run may take before it counts as stuck, or None."""
        if self._stuck_nodes is None:
            return None
        if not self._step_seconds:
            return STUCK_FIRST_S
        return max(STUCK_MIN_S, STUCK_FACTOR * statistics.median(self._step_seconds))

    def close(self) -> None:
        self._session.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def built_after(self, fetches: list, build: Callable[[], list]) -> Optional[list]:
        """What ``build()`` makes in the distributed graph, to fetch in a run of ``fetches``
        after all they run: their training and their writes.

        Returns:
            the tensors built, or None when a run of ``fetches`` does not end the
            step (gradient accumulation, a step in two runs): fetch such reads
            in a run of their own.
        """
        mapped = [self._map_fetch(fetch) for fetch in fetches]
        ids = {id(element) for element in mapped}
        if any(id(update.train_op) in ids
               and (update.accumulate_ops or update.remote_step_op is not None)
               for update in self._distributed.updates):
            return None
        with self._graph.as_default(), tf.device(self._distributed.ctx.shared_device):
            # A new op waits for them: control_dependencies would mark each (an
            # attribute) after the session ran the graph, which TensorFlow warns about.
            after = tf.no_op(name="autodist_after_step")
            _tf_compat.add_control_inputs(after, [
                element.op if isinstance(element, tf.Tensor) else element for element in mapped])
            with tf.control_dependencies([after]):
                return build()

    def _map_fetch(self, fetch):
        if isinstance(fetch, str):  # names are looked up by name (a new string each run)
            return self._mapped_fetch(fetch)
        return _remembered(self._fetch_of, fetch, lambda: self._mapped_fetch(fetch))

    def _mapped_fetch(self, fetch):
        if getattr(fetch, "graph", None) is self._graph:
            return fetch  # built in the distributed graph (``built_after``)
        name = _element_name(fetch)
        if name not in self._cache:
            # Ops combining replicas stay on this node (a step must not reach others).
            with self._graph.as_default(), tf.device(self._distributed.ctx.shared_device):
                self._cache[name] = self._resolve(name)
        return self._cache[name]

    def _resolve(self, name: str):
        distributed, item = self._distributed, self._distributed.item
        if name in self._variable_fetches:
            return self._location(self._variable_fetches[name]).value()
        if name in self._state_fetches:
            return self._optimizer_state(self._state_fetches[name])
        op_name = name.split(":")[0]
        call = item.call_of_op(op_name)
        if call is not None:
            if ":" in name:
                raise ValueError(f"AutoDist cannot fetch '{name}', an output of the "
                                 "optimizer's update; fetch the train op instead.")
            return distributed.updates[call].train_op
        if op_name in item.initializer_of:
            return distributed.storage[item.initializer_of[op_name]].initializer()
        processed = next((call for call, processing in item.processing.items()
                          if op_name in processing.ops), None)
        if processed is not None:
            return self._processed(name, processed)
        if op_name in item.excluded:
            raise ValueError(f"AutoDist cannot fetch '{name}': it belongs to a variable that "
                             "the strategy recreated; fetch the variable itself.")
        if not item.is_replicated(name):
            return (self._graph.get_tensor_by_name(name) if ":" in name
                    else self._graph.get_operation_by_name(name))
        copies = [distributed.replica_element(name, r)
                  for r in range(distributed.ctx.num_replicas)]
        if ":" not in name:
            # tf.group would mark each copy (an attribute) after the session ran it,
            # which TensorFlow warns about; a new op waiting for them changes none.
            waiting = tf.no_op(name=f"{op_name}/all_replicas")
            _tf_compat.add_control_inputs(waiting, copies)
            return waiting
        return _combine(copies)

    def _processed(self, name: str, call: int):
        """A tensor (or op) of the gradient processing: its one run on the averaged gradients."""
        scoped = f"{gradient_processing.scope(call)}/{name}"
        try:
            return (self._graph.get_tensor_by_name(scoped) if ":" in name
                    else self._graph.get_operation_by_name(scoped))
        except KeyError:
            raise ValueError(f"AutoDist cannot fetch '{name}' on this node: the gradient "
                             "processing it belongs to runs where the updates run (fetch it "
                             "on the chief).") from None

    def _location(self, variable: str):
        """Where the original variable ``variable`` lives on this node, or None."""
        if self._locator is None:
            self._locator = Locator(self._distributed)
        return self._locator.find(variable)

    def _optimizer_state(self, variable: str) -> tf.Tensor:
        """The single-device value of one of the optimizer's variables (a slot stitched)."""
        location = self._location(variable)
        if location is None or not location.readable:
            raise ValueError(f"AutoDist cannot fetch the optimizer's '{variable}' on this node: "
                             "under this strategy it lives on another node (fetch it on the "
                             "chief).")
        return location.value()

    def _check_rows(self, key, value) -> None:
        """Refuses a batch (a value fed to a batched input) with fewer rows than
        replicas: some replica would get none."""
        replicas = self._distributed.ctx.num_replicas
        if len(value) < replicas:
            name = _element_name(key).split(":")[0]
            raise ValueError(
                f"AutoDist splits the batch fed to '{name}' across {replicas} replicas, but "
                f"it has {len(value)} rows; feed at least {replicas} rows (e.g. drop or pad "
                "a short last batch).")

    def _map_feed(self, key) -> tuple:
        """What a value fed for ``key`` feeds in the distributed graph, and whether
        ``key`` is a batch the replicas split (``_check_rows``); looked up once."""
        if isinstance(key, str):  # a new string each run, perhaps: by name only
            return self._feed_targets(key)
        return _remembered(self._feed_of, key, lambda: self._feed_targets(_element_name(key)))

    def _feed_targets(self, name: str) -> tuple:
        if self._distributed.item.is_replicated(name):
            targets = [self._distributed.replica_element(name, r)
                       for r in range(self._distributed.ctx.num_replicas)]
        else:
            targets = [self._graph.get_tensor_by_name(name)]
        return targets, name.split(":")[0] in self._distributed.item.batched_inputs


_NESTED = (list, tuple, dict)


def _remembered(cache: dict, key, compute: Callable):
    """``compute()`` for the object ``key``, computed once: ``cache`` keeps ``key`` alive
    beside it, so that no other object takes its id."""
    known = cache.get(id(key))
    if known is None or known[0] is not key:
        known = cache[id(key)] = (key, compute())
    return known[1]


def as_tf_variable(element):
    """The ``tf.Variable`` behind a Keras 3 variable; anything else unchanged."""
    value = getattr(element, "value", None)
    return value if isinstance(value, tf.Variable) else element


def _element_name(element) -> str:
    if isinstance(element, str):
        return element
    element = as_tf_variable(element)
    if isinstance(element, tf.Variable):
        return _tf_compat.graph_element_name(element)
    return element.name


def _combine(copies: list) -> tf.Tensor:
    first = copies[0]
    if len(copies) == 1:
        return first
    if first.shape.rank == 0 and first.dtype.is_floating:
        return tf.add_n(copies) / float(len(copies))
    if first.shape.rank and first.shape[0] is None:
        return tf.concat(copies, axis=0)
    return first
