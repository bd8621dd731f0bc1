"""AutoDist: the user's entry point, coordinating spec -> strategy -> graph -> session."""
from __future__ import annotations

import contextlib
import functools
import numbers
import os
import warnings
from typing import Callable, Iterator, Optional, Union

import numpy as np
import tensorflow as tf

from autodist import _keras_compat, _tf_compat
from autodist.cluster import runtime
from autodist.graph_item import GraphItem
from autodist.keras import step as keras_step
from autodist.keras.fit import distribute_fit
from autodist.keras.function import DistributedFunction
from autodist.keras.saving import save_grace
from autodist.kernel_context import KernelContext
from autodist.kernels.transformer import transform
from autodist.resource_spec import DeviceSpec, ResourceSpec
from autodist.session import DistributedSession
from autodist.search import trial
from autodist.strategy.all_reduce_builders import AllReduce
from autodist.strategy.base import Strategy, StrategyBuilder
from autodist.strategy.compiler import CompiledStrategy, check_graph, compile_strategy

THREADS_ENV = ("AUTODIST_INTRA_OP_THREADS", "AUTODIST_INTER_OP_THREADS")
JOIN_TIMEOUT_S = 300.0
# Each run of a cycle but the last keeps its sparse gradients in a stash of its own.
MAX_ACCUMULATION_STEPS = 1024


class AutoDist:
    """Distributes a single-device TensorFlow model per a strategy.

    Example:
        ad = AutoDist(resource_spec_file="configs/local_2cpu.yml", strategy_builder=PS())
        with ad.scope():
            model = keras.Sequential([...])
            model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
        model.fit(x, y, batch_size=64)        # or: step = ad.function(train_step)

        with tf.Graph().as_default(), ad.scope():   # tf.compat.v1 graphs
            ...  # the single-device model and a tf.compat.v1.train optimizer
            sess = ad.create_distributed_session()

    Note:
        A Keras model must be compiled inside ``ad.scope()`` (``fit`` may follow
        outside it); a graph's model, including the optimizer's
        ``minimize``/``apply_gradients``, must be built inside it and the session
        created there too. On a cluster the chief starts this same script on
        every other node; each node must build the same model and feeds its own
        data. A process runs one multi-node job: a second AutoDist on a cluster
        is refused when it is made after the first one trained, else before it
        builds a strategy or launches a worker. Start each such job in a new process.

    Warning:
        On a cluster the chief installs process-wide handlers: SIGTERM stops the
        job (status 143) and an uncaught error ends the process right after it is
        printed, having stopped the workers. A worker ends with its chief.
        Saves of a Keras model compiled in ``ad.scope()`` hold SIGTERM and SIGINT
        until they finish, for at most ``AUTODIST_SAVE_GRACE_S`` seconds (20);
        on a cluster only the chief's write a file.

    Args:
        resource_spec_file: path of the cluster's YAML resource spec.
        strategy_builder: a builder (``PS()``, ``AllReduce()``, ...) or a saved
            ``Strategy`` to reuse; by default ``AllReduce()``, the fastest
            hand-written builder on most of the benchmarks' models.
        trial_hooks: what a strategy search changes in this job (its spec, a
            capture of the graph, a timed trial of a candidate); by default the
            ones ``autodist search`` set for this process, none outside a search.
        accumulation_steps: runs of the train op (``fit`` batches, ``ad.function``
            calls) per update. Each run computes its gradients and keeps them on
            its replicas, with no communication; every ``accumulation_steps``-th
            run averages the kept gradients across replicas and nodes and
            applies them once, as single-device training on the concatenation
            of those runs' batches would.

    Raises:
        ResourceSpecError: when the spec is missing or invalid.
        RuntimeError: on a cluster, when this process already joined a multi-node job.
        TypeError: when ``strategy_builder`` is neither a builder nor a Strategy.
        ValueError: when ``accumulation_steps`` is not an int from 1 to
            ``MAX_ACCUMULATION_STEPS``, or an ``AUTODIST_*`` variable is set to a
            bad value.
    """

    def __init__(self, resource_spec_file: str,
                 strategy_builder: Union[StrategyBuilder, Strategy, None] = None,
                 trial_hooks: Optional[trial.TrialHooks] = None, accumulation_steps: int = 1):
        # Any integer type (numpy's too: a count read from a config array), not a bool.
        if (isinstance(accumulation_steps, (bool, np.bool_))
                or not isinstance(accumulation_steps, numbers.Integral)
                or not 1 <= accumulation_steps <= MAX_ACCUMULATION_STEPS):
            raise ValueError(
                f"AutoDist: accumulation_steps must be an int from 1 to "
                f"{MAX_ACCUMULATION_STEPS}, not {str(accumulation_steps)[:40]!r}.")
        self._accumulation_steps = int(accumulation_steps)
        self._trial = trial_hooks if trial_hooks is not None else trial.TrialHooks.from_environment()
        self._resource_spec = ResourceSpec(self._trial.resource_spec_file(resource_spec_file))
        if strategy_builder is None:
            strategy_builder = AllReduce()
        if not isinstance(strategy_builder, (StrategyBuilder, Strategy)):
            raise TypeError(
                f"AutoDist: strategy_builder must be a StrategyBuilder such as PS() or a "
                f"Strategy from Strategy.load(), not {type(strategy_builder).__name__}.")
        self._builder = strategy_builder
        self._role = runtime.current_role(self._resource_spec)
        runtime.check_this_node(self._resource_spec, self._role)
        self._trial.bind_to_search(self._role.is_chief)
        self._threads = [_threads(name) for name in THREADS_ENV]  # bad counts refused here
        save_grace()  # a bad value is refused here, not at the first save
        self._optimizer_calls = []
        self._strategy: Optional[Strategy] = None
        self._joined = False  # a cluster job runs one graph
        self._warned_eager = False

    @property
    def resource_spec(self) -> ResourceSpec:
        return self._resource_spec

    @property
    def is_chief(self) -> bool:
        """Whether this process is the chief (the one the user started)."""
        return self._role.is_chief

    @property
    def node_index(self) -> int:
        """This node's position in the cluster, the chief being 0 (e.g. to shard data)."""
        return self._role.task_index

    @property
    def strategy(self) -> Optional[Strategy]:
        """The strategy in use, once ``create_distributed_session`` has run."""
        return self._strategy

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """Build the model in here; AutoDist records what the optimizer applies.

        A Keras model compiled in here trains through AutoDist in ``fit`` (also
        when ``fit`` is called after the block). A Keras optimizer applied
        eagerly in here (a training loop without ``@ad.function``) trains on
        one device; AutoDist warns once when it does. A large weight made in
        here gets its value when first used (``keras.step.DEFERRED_VARIABLE_BYTES``),
        so a node that trains it only in parts held elsewhere never holds it whole.

        Warning:
            AutoDist distributes Keras 3 models. A tf_keras (Keras 2) model, which
            ``tf.keras`` builds under ``TF_USE_LEGACY_KERAS=1`` (TensorFlow
            Recommenders, TF-Ranking, the Model Garden), is refused at its
            ``compile`` in here with a NotImplementedError, since its ``fit`` would
            train on one device. Its layers can still be called in a
            ``tf.compat.v1`` graph trained by a ``tf.compat.v1.train`` optimizer
            through ``create_distributed_session``.
        """
        with _tf_compat.capture_apply_gradients(self._optimizer_calls.append), \
                _keras_compat.capture_compile(self._distribute_fit), \
                _keras_compat.refuse_tf_keras_compile(self._refuse_tf_keras_model,
                                                      self._warn_tf_keras_imported), \
                _keras_compat.report_eager_apply(self._warn_eager_step), \
                _keras_compat.defer_large_variables(keras_step.DEFERRED_VARIABLE_BYTES):
            yield

    def _warn_eager_step(self, optimizer) -> None:
        """Says once that an eager training loop in the scope runs on one device."""
        if self._warned_eager:
            return
        self._warned_eager = True
        warnings.warn(
            f"AutoDist: {type(optimizer).__name__}.apply ran eagerly inside ad.scope(), so "
            "this training step runs on one device, undistributed. Decorate the step "
            "function with @ad.function (or train with model.fit) to distribute it.",
            stacklevel=4)

    @staticmethod
    def _refuse_tf_keras_model(model) -> None:
        """Refuses a tf_keras (Keras 2) model compiled in the scope, whose ``fit`` would
        run tf_keras's own loop on one device."""
        setting = _keras_compat.legacy_keras_setting()
        why = (f"tf.keras is tf_keras because {setting} is set" if setting
               else "built from tf_keras")
        raise NotImplementedError(
            f"AutoDist distributes Keras 3 models, and {type(model).__name__} is a tf_keras "
            f"(Keras 2) model ({why}): compiled inside ad.scope(), its fit would train on "
            f"one device, undistributed. {keras_step.TF_KERAS_WAYS_OUT}")

    @staticmethod
    def _warn_tf_keras_imported() -> None:
        """Says that tf_keras, first imported inside the scope, was not watched there."""
        warnings.warn(
            "AutoDist: tf_keras was first imported inside ad.scope(), so AutoDist could not "
            "check the models compiled there: a tf_keras (Keras 2) model's fit trains on "
            "one device, undistributed. Import tf_keras before entering ad.scope() to have "
            "such a model refused by name, and build models with Keras 3 to distribute them.",
            stacklevel=3)

    def function(self, fn: Optional[Callable] = None, *, copy_back: str = "every_call"
                 ) -> Union[DistributedFunction, Callable[[Callable], DistributedFunction]]:
        """Distributes a Keras / TF2 training step (also usable as ``@ad.function`` and
        ``@ad.function(copy_back=...)``).

        ``fn`` computes gradients (``tf.GradientTape``) and applies them with
        one Keras optimizer; create the model and the optimizer in
        ``ad.scope()``. The returned function takes the global batch (tensors,
        numpy arrays or dataset elements), splits it along axis 0 across the
        replicas and returns ``fn``'s outputs combined as the session's fetches
        are: a float scalar is the replicas' mean, a batch-major tensor their
        concatenation, anything else replica 0's value.

        Note:
            ``fn`` is traced at the first call for arguments of that call's
            structure and dtypes (any batch size), and again for arguments of
            another structure or dtype. After every call the metrics and the
            optimizer's scalars (its iteration count, learning rate) hold the
            trained values, and so do the model's weights and the optimizer's
            slots with ``copy_back="every_call"`` (the default). With
            ``copy_back="on_request"`` they reach the model when you call the
            returned function's ``copy_to_model()``, before Keras code reads them
            (evaluating, saving): a large model's copy can cost more than its step.
            Values changed between calls (``set_weights``, ``load_weights``) are
            picked up by the next call either way.

        Raises:
            ValueError: for another ``copy_back``.
        """
        if fn is None:
            return functools.partial(self.function, copy_back=copy_back)
        return DistributedFunction(self._open_lifted_session, fn, self._local_replicas,
                                   copy_back)

    def create_distributed_session(self, config: Optional[tf.compat.v1.ConfigProto] = None
                                   ) -> DistributedSession:
        """Builds (or fetches, or reuses) the strategy, rewrites the graph, opens a session.

        Args:
            config: optional session config merged over AutoDist's.

        Returns:
            DistributedSession taking the arguments of ``tf.compat.v1.Session.run``.
        """
        return self._open_session(self._graph_item(), config)

    @property
    def _local_replicas(self) -> int:
        """The replicas on this node, which split each batch it feeds."""
        return len(self._resource_spec.node_replicas(self._role.address))

    def _open_lifted_session(self, lifted) -> DistributedSession:
        return self._open_session(lifted.item)

    def _distribute_fit(self, model) -> None:
        distribute_fit(model, self._open_lifted_session, self._local_replicas,
                       on_cluster=len(self._resource_spec.nodes) > 1,
                       writes_saves=self.is_chief)

    def _open_session(self, item: GraphItem, config: Optional[tf.compat.v1.ConfigProto] = None
                      ) -> DistributedSession:
        # Before anything reads the item: the fingerprint and the search count it.
        item.accumulation_steps = self._accumulation_steps
        check_graph(item, self._resource_spec)
        self._trial.before_session(item, self._resource_spec.source, self.is_chief)
        if len(self._resource_spec.nodes) == 1:
            strategy = self._build_strategy(item)
            compiled = compile_strategy(strategy, item, self._resource_spec)
            ctx = self._kernel_context(item, compiled, self._local_devices())
            session = DistributedSession(transform(item, compiled, ctx),
                                         config=self._config(config),
                                         on_step=self._trial.step_timer(self.is_chief))
        else:
            strategy, session = self._join_cluster(item, config)
        self._strategy = strategy
        return session

    def _graph_item(self) -> GraphItem:
        graph = tf.compat.v1.get_default_graph()
        return GraphItem(graph, [c for c in self._optimizer_calls if c.graph is graph])

    def _build_strategy(self, item: GraphItem) -> Strategy:
        trial_strategy = self._trial.strategy()
        if trial_strategy is not None:
            return trial_strategy
        if isinstance(self._builder, Strategy):
            return self._builder
        return self._builder.build(item, self._resource_spec)

    def _join_cluster(self, item: GraphItem, config):
        """The chief serves the strategy and launches workers; a worker fetches it."""
        spec, role = self._resource_spec, self._role
        if self._joined:
            raise NotImplementedError(
                "On a cluster AutoDist runs one graph per AutoDist instance; this one already "
                "trains another (a Keras step traced again: for data of another structure, "
                "e.g. train_on_batch after fit, or sample weights in one call only, or for a "
                "model compiled again). Feed data of one structure and compile once.")
        # Before a search or a launch: another instance's job may already hold this process.
        runtime.check_no_job_joined()
        self._joined = True
        if role.is_chief:
            strategy = self._build_strategy(item)
            compiled = compile_strategy(strategy, item, spec)
            peer = runtime.ChiefCoordinator(spec, strategy, item.fingerprint,
                                            worker_env=self._trial.worker_env())
            peer.start()
            monitor = peer.check_workers
        else:
            peer = runtime.WorkerAgent(role)
            try:
                strategy = peer.fetch_strategy(item.fingerprint)
                compiled = compile_strategy(strategy, item, spec)
            except Exception as err:
                peer.report_failed(f"{type(err).__name__}: {err}")
                raise
            monitor = None
        node_config = runtime.session_config(self._config(config))
        server = runtime.start_tf_server(spec, role, node_config)
        runtime.wait_until_tf_servers_listen(spec, JOIN_TIMEOUT_S, check=monitor)
        ctx = self._kernel_context(item, compiled, runtime.tf_devices(spec))
        timer = self._trial.step_timer(role.is_chief)
        stuck_nodes = peer.stuck_nodes if role.is_chief else None

        def on_step():
            peer.step_done()
            if timer is not None:
                timer()
        session = DistributedSession(transform(item, compiled, ctx), config=node_config,
                                     target=server.target, monitor=monitor, on_step=on_step,
                                     stuck_nodes=stuck_nodes, check_not_left=peer.check_not_left,
                                     on_training_end=peer.training_ended)
        if role.is_chief:
            peer.wait_ready(JOIN_TIMEOUT_S)  # every node has initialized its copies
            session.release_start_state()
        else:
            peer.report_ready()
        return strategy, session

    def _local_devices(self) -> dict:
        devices = self._resource_spec.cpu_devices + self._resource_spec.replica_devices
        return {d.name_string(): f"/device:{d.device_type}:{d.device_index}" for d in devices}

    def _kernel_context(self, item: GraphItem, compiled: CompiledStrategy,
                        tf_devices: dict) -> KernelContext:
        spec, role, strategy = self._resource_spec, self._role, compiled.strategy
        local = tuple(r for r in strategy.replicas
                      if DeviceSpec.from_string(r).host_address == role.address)
        cpu = {d.host_address: d.name_string() for d in spec.ps_devices}
        return KernelContext(replica_devices=local, tf_devices=tf_devices,
                             shared_device=tf_devices[cpu[role.address]],
                             chief_device=tf_devices[cpu[spec.chief]],
                             node_index=role.task_index, num_nodes=len(spec.nodes),
                             group_size=len(strategy.replicas),
                             all_replicas=tuple(strategy.replicas),
                             node_devices=tuple(tf_devices[cpu[node]]
                                                for node in runtime.ordered_nodes(spec)),
                             has_collectives=compiled.has_collectives,
                             has_remote_ops=compiled.has_remote_ops,
                             state_per_node=item.state_per_node,
                             updates_on_every_node=all(p.kind.updates_on_every_node
                                                       for p in compiled.synchronized_parts))

    def _config(self, user_config) -> tf.compat.v1.ConfigProto:
        cpus = max(self._resource_spec.node(self._role.address).cpus) + 1
        config = tf.compat.v1.ConfigProto(device_count={"CPU": cpus}, allow_soft_placement=True)
        # TensorFlow's older graph optimizer evaluates every op with constant inputs
        # before it runs a graph, whatever the output's size, and its allocator keeps
        # those bytes: a large table's seeded random initial value cost its size twice
        # over. Grappler (on) still folds constants, within a size bound.
        options = config.graph_options.optimizer_options
        options.opt_level = tf.compat.v1.OptimizerOptions.L0
        options.do_common_subexpression_elimination = True
        intra, inter = self._threads
        intra = intra or _intra_op_threads(self._resource_spec.node_replicas(self._role.address))
        if intra:
            config.intra_op_parallelism_threads = intra
        if inter:
            config.inter_op_parallelism_threads = inter
        if user_config is not None:
            config.MergeFrom(user_config)
        return config


def _intra_op_threads(replicas: list) -> Optional[int]:
    """The intra-op threads of each CPU device when a node's ``replicas`` are several of
    its CPUs: its cores split between them (each device has a pool of its own,
    ``_startup.own_thread_pools``). Replicas that all split every small product over
    every core wait on each other's halves. None (TensorFlow's default, every core)
    for one replica or GPU replicas."""
    cpu_replicas = [d for d in replicas if d.device_type == "CPU"]
    if len(cpu_replicas) < 2:
        return None
    return max(1, len(os.sched_getaffinity(0)) // len(cpu_replicas))


def _threads(name: str) -> Optional[int]:
    """A thread count from the environment variable ``name``, or None when unset.

    Raises:
        ValueError: when it is set but not an integer from 1 to 1024.
    """
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    try:
        count = int(text)
    except ValueError:  # not a number; isdigit() passed "²" and 5000 digits, which int() refuses
        count = 0
    if not 1 <= count <= 1024:
        raise ValueError(f"{name}={text[:40]!r} is not a thread count: set it to an integer "
                         "from 1 to 1024, or unset it to let TensorFlow choose.")
    return count
