"""``ad.function``: a Keras / TF2 training step run data-parallel by AutoDist.

The step is traced once, lifted into a graph (``step.py``) and distributed
like any ``tf.compat.v1`` graph. AutoDist's copies of the variables are then
the ones that train; after every call their values are copied back into the
eager variables (the model's weights, the optimizer's state, the metrics), so
that Keras code run between steps (``evaluate``, ``predict``, ``save``,
callbacks) sees the trained values in the single-device layout. Values that
Keras code changes between steps (``set_weights``, ``load_weights``) are copied
the other way before the next step.
"""
from __future__ import annotations

import functools
import inspect
from typing import Callable, Iterator, Optional, Tuple

import numpy as np
import tensorflow as tf

from autodist._tf_compat import DeferredVariable, EagerVariables, eager_snapshot
from autodist.kernels import partitioner
from autodist.kernels.locations import Locator
from autodist.keras.step import STATE_OP, LiftedStep, StepCache, is_static
from autodist.session import DistributedSession


_IN_PLACE_BYTES = 2 ** 20  # below this, a copy costs less than DLPack's wrapping
# A save of a variable AutoDist keeps (deferred) fetches it in pieces of this size.
PIECE_BYTES = 64 << 20


class DistributedStep:
    """A lifted step and the session running it.

    Args:
        lifted: the step as a graph.
        session: AutoDist's session on its distributed graph.
    """

    def __init__(self, lifted: LiftedStep, session: DistributedSession):
        self._lifted = lifted
        self._session = session
        distributed = session.distributed
        locator = Locator(distributed)
        self._reads, self._writes = [], []
        # id of an eager variable -> its Location, and (index in the value, its read)
        # per piece, built when a deferred one is first saved
        self._locations, self._pieces = {}, {}
        # Small state, copied both ways at every step: what the forward pass writes
        # (metrics, batch-norm statistics, seeds; reset by Keras between epochs) and
        # the optimizer's own scalars (its iteration count, a learning rate that a
        # callback may set between two batches).
        self._small = set()
        # The optimizer's slots: as large as the weights (Adam: twice), read by
        # Keras code between epochs rather than between batches.
        self._slots = set()
        slots = lifted.item.slot_names()
        non_slots = {name for call in lifted.item.optimizer_calls
                     for name in call.non_slot_names()}
        with distributed.graph.as_default(), tf.device(distributed.ctx.shared_device):
            for name, variable in lifted.variables.items():
                location = locator.find(name)
                if location is None:
                    continue
                if name in distributed.shared_variables or name in non_slots:
                    self._small.add(id(variable))
                if name in slots:
                    self._slots.add(id(variable))
                if location.readable:
                    self._reads.append((variable, location.value()))
                    self._locations[id(variable)] = location
                placeholder = tf.compat.v1.placeholder(variable.dtype, variable.shape)
                self._writes.append((variable, placeholder, location.restore(placeholder)))
        # id of an eager variable -> its snapshot (``eager_snapshot``) when last copied
        # either way: no bytes of its own until Keras code writes the variable. A
        # variable of few bytes keeps the array last copied, and is read and written
        # with the others of its kind in one call (``EagerVariables``).
        self._synced = {}
        self._few_bytes = {id(v) for v in lifted.variables.values() if _few_bytes(v)}
        self._batches = {}  # ids of variables of few bytes -> their EagerVariables
        self._fetch_outputs = [o for o in lifted.outputs if isinstance(o, tf.Tensor)]
        self._step_fetches = [lifted.item.optimizer_calls[0].result_op_name, STATE_OP]
        # The small state is read in the step's own run, after its writes, where that
        # run ends the step; else (gradient accumulation), and for a deferred
        # variable (``_copy``), in a run of its own.
        small = [(variable, tensor) for variable, tensor in self._reads
                 if id(variable) in self._small]
        in_step = [variable for variable, _ in small if not isinstance(variable, DeferredVariable)]
        reads = session.built_after(self._step_fetches,
                                    functools.partial(self._reads_again, in_step))
        if reads is None:
            in_step, reads = [], []
        self._small_in_step, self._small_reads_in_step = in_step, reads
        read_in_step = set(map(id, in_step))
        self._small_reads_alone = [(variable, tensor) for variable, tensor in small
                                   if id(variable) not in read_in_step]
        # What ``fetch_after_step`` adds to every run: its tensors, their structure, and
        # their values in the last run.
        self._after_fetches, self._after_structure = [], None
        self.after_step_values = None
        self._pending_small = None  # the last run's small state, not yet copied (``run``)
        self._fetches = (self._step_fetches + self._fetch_outputs
                         + self._small_reads_in_step)

    def fetch_after_step(self, build: Callable[[Callable], object]) -> bool:
        """Fetches, in every later run, a structure of tensors that ``build`` computes in
        AutoDist's graph from the small state's values after the step's writes (the
        run's ``after_step_values``), as an eager call would after the copy back, with
        no eager call.

        Args:
            build: ``build(read)`` -> the structure, or None if it cannot; ``read(eager
                variable)`` is the variable's value after the step, or None.

        Returns:
            whether the structure is fetched: False where a run reads the small state
            apart (``_small_reads_alone``), or ``build`` returned None.
        """
        reads = {id(v): t for v, t in zip(self._small_in_step, self._small_reads_in_step)}
        if not reads or self._small_reads_alone:
            return False
        distributed = self._session.distributed
        with distributed.graph.as_default(), tf.device(distributed.ctx.shared_device):
            built = build(lambda variable: reads.get(id(variable)))
        if built is None:
            return False
        self._after_structure, self._after_fetches = built, tf.nest.flatten(built)
        self._fetches = self._fetches + self._after_fetches
        return True

    @property
    def session(self) -> DistributedSession:
        return self._session

    @property
    def fetches_after_step(self) -> bool:
        """Whether ``fetch_after_step`` took a structure."""
        return bool(self._after_fetches)

    def run(self, args: tuple, copy_small: bool = True):
        """One training step on the global batch ``args``; returns the step's outputs.

        The small state (what the forward pass writes, the optimizer's scalars)
        is copied into the eager variables before it returns, or, with
        ``copy_small=False``, kept until ``copy_small_state`` (or any other copy)
        where no Keras code reads it before the next step: its copy costs one
        eager op per variable.

        Args:
            args: the step's arguments, as traced.
            copy_small: copy the small state now. A run reading it apart
                (``_small_reads_alone``) copies it now regardless.
        """
        values = [a for a in tf.nest.flatten(args) if not is_static(a)]
        feeds = dict(zip(self._lifted.inputs, [_as_numpy(v) for v in values]))
        fetched = self._session.run(self._fetches, feed_dict=feeds)
        if self._after_fetches:
            after = len(fetched) - len(self._after_fetches)
            self.after_step_values = tf.nest.pack_sequence_as(self._after_structure,
                                                              fetched[after:])
            fetched = fetched[:after]
        small_start = len(fetched) - len(self._small_reads_in_step)
        outputs = fetched[len(self._step_fetches):small_start]
        self._pending_small = fetched[small_start:]
        if copy_small or self._small_reads_alone:
            self.copy_small_state()
            self._copy(self._small_reads_alone)
        results = iter(outputs)
        flat = [next(results) if isinstance(o, tf.Tensor) else o for o in self._lifted.outputs]
        return tf.nest.pack_sequence_as(self._lifted.structure, flat)

    def copy_small_state(self) -> None:
        """Copies the small state of the last run into the eager variables, if ``run``
        kept it."""
        if self._pending_small is not None:
            values, self._pending_small = self._pending_small, None
            self._assign_fetched(self._small_in_step, values)

    def _reads_again(self, variables: list) -> list:
        """New reads of the (readable) ``variables``' values in AutoDist's graph."""
        with tf.device(self._session.distributed.ctx.shared_device):
            return [self._locations[id(variable)].value() for variable in variables]

    def _selected(self, variable, weights: bool, slots: bool) -> bool:
        """Whether a copy covering ``weights`` and ``slots`` (small state always) takes it."""
        if id(variable) in self._small:
            return True
        return slots if id(variable) in self._slots else weights

    def copy_to_eager(self, weights: bool = True, slots: bool = True) -> None:
        """Copies AutoDist's weights, optimizer slots or both into the eager variables
        (``run`` copies the small state).

        Args:
            weights: copy the model's weights.
            slots: copy the optimizer's slots.
        """
        self.copy_small_state()
        self._copy([(variable, tensor) for variable, tensor in self._reads
                    if id(variable) not in self._small
                    and self._selected(variable, weights, slots)])

    def _copy(self, reads: list) -> None:
        """Copies the values of ``reads`` (eager variable, AutoDist's read) into the
        eager variables; a deferred variable gets its value at its first use."""
        fetched = []
        for variable, tensor in reads:
            if getattr(variable, "deferred", False):
                # No value yet (a table other nodes hold in parts): it gets AutoDist's at
                # its first use, if any; fetching it now would put the whole table here.
                variable.defer(functools.partial(self._session.tf_session.run, tensor),
                               on_set=self._synced_now,
                               pieces=functools.partial(self._fetched_in_pieces, variable))
            else:
                fetched.append((variable, tensor))
        if fetched:
            self._assign_fetched([variable for variable, _ in fetched],
                                 self._session.tf_session.run([t for _, t in fetched]))

    def _assign_fetched(self, variables: list, values: list) -> None:
        """Assigns fetched ``values`` to the eager ``variables`` and records them as copied."""
        few = [(variable, np.asarray(value)) for variable, value in zip(variables, values)
               if id(variable) in self._few_bytes]
        if few:
            self._batch([variable for variable, _ in few]).assign([value for _, value in few])
            for variable, value in few:
                self._synced[id(variable)] = value  # what it holds; nothing else writes it
        for variable, value in zip(variables, values):
            if id(variable) in self._few_bytes:
                continue
            # Without the old snapshot the variable's buffer is its own, written in place
            # (a shared one would get a fresh buffer, and a fresh gigabyte costs seconds).
            self._synced.pop(id(variable), None)
            variable.assign(_as_tensor_in_place(value))
            self._synced[id(variable)] = eager_snapshot(variable)

    def _batch(self, variables: list) -> EagerVariables:
        """``variables`` (of few bytes) read or assigned together, traced once per list."""
        key = tuple(map(id, variables))
        if key not in self._batches:
            self._batches[key] = EagerVariables(variables)
        return self._batches[key]

    def _piece_reads(self, variable) -> list:
        """``(index, read)`` per piece of at most ``PIECE_BYTES`` of the variable, each read
        where its part is stored (``partitioner.pieces``)."""
        if id(variable) not in self._pieces:
            location, shape = self._locations[id(variable)], variable.shape.as_list()
            row_bytes = max(1, int(np.prod(shape[1:], dtype=np.int64)) * variable.dtype.size)
            with self._session.distributed.graph.as_default():
                self._pieces[id(variable)] = [
                    (index, location.reads[part](rows))
                    for part, rows, index in partitioner.pieces(
                        location.plan, shape, max(1, PIECE_BYTES // row_bytes))]
        return self._pieces[id(variable)]

    def _fetched_in_pieces(self, variable) -> Iterator[Tuple[tuple, np.ndarray]]:
        """AutoDist's value of ``variable`` as ``(index, value)`` pieces, fetched one at a time."""
        for index, tensor in self._piece_reads(variable):
            yield index, self._session.tf_session.run(tensor)

    def _synced_now(self, variable) -> None:
        """Records a deferred variable's value, just fetched, as copied."""
        self._synced[id(variable)] = eager_snapshot(variable)

    def copy_from_eager_if_changed(self, weights: bool = True, slots: bool = True) -> None:
        """Copies the eager variables' values to AutoDist's where Keras code changed them.

        Only values copied out before are compared: until the first copy,
        AutoDist's values are those the eager variables had when traced. The
        small state (metrics reset between epochs, a learning rate set by a
        callback) is always checked.

        Args:
            weights: also check the model's weights.
            slots: also check the optimizer's slots.
        """
        self.copy_small_state()  # compared below as the values Keras code last saw
        checked = [(variable, placeholder, restore) for variable, placeholder, restore
                   in self._writes if self._selected(variable, weights, slots)
                   and id(variable) in self._synced]
        few = [variable for variable, _, _ in checked if id(variable) in self._few_bytes]
        now = dict(zip(map(id, few), self._batch(few).read())) if few else {}
        feeds, ops = {}, []
        for variable, placeholder, restore in checked:
            synced = self._synced[id(variable)]
            value = now[id(variable)] if id(variable) in now else eager_snapshot(variable)
            if _same_buffer(synced, value) or _equal(synced, value):
                continue
            feeds[placeholder] = value
            ops.append(restore)
            self._synced[id(variable)] = value
        if ops:
            self._session.tf_session.run(ops, feed_dict=feeds)


COPY_BACK = ("every_call", "on_request")


class DistributedFunction:
    """What ``ad.function(fn)`` returns: call it with the global batch.

    Args:
        open_session: opens AutoDist's session on a lifted step's graph.
        fn: the training step.
        replicas: the number of replicas on this node.
        copy_back: when the eager model gets the trained weights and optimizer
            slots: after ``"every_call"``, or ``"on_request"`` (``copy_to_model``).
            The small state (metrics, the optimizer's scalars) is copied after
            every call either way.

    Raises:
        ValueError: for a ``copy_back`` not in ``COPY_BACK``.
    """

    def __init__(self, open_session: Callable[[LiftedStep], DistributedSession], fn: Callable,
                 replicas: int, copy_back: str = "every_call"):
        if copy_back not in COPY_BACK:
            raise ValueError(f"ad.function: copy_back must be one of {list(COPY_BACK)}, not "
                             f"{copy_back!r}.")
        functools.update_wrapper(self, fn)
        self._signature = inspect.signature(getattr(fn, "python_function", fn))
        self._made_with = (open_session, fn, replicas, copy_back)  # to bind it to an instance
        self._attribute = None  # the name it has in a class body (``__set_name__``)
        self._steps = StepCache(fn, replicas,
                                lambda lifted: DistributedStep(lifted, open_session(lifted)))
        self._step: Optional[DistributedStep] = None  # the step that ran last
        self._every_call = copy_back == "every_call"
        self._stale = False  # trained weights and slots not yet copied to the model

    @property
    def step(self) -> Optional[DistributedStep]:
        """The distributed step that ran last, once the function has been called."""
        return self._step

    def __set_name__(self, owner: type, name: str) -> None:
        self._attribute = name

    def __get__(self, instance, owner: Optional[type] = None) -> "DistributedFunction":
        """The step as a method of ``instance``, as ``tf.function`` binds one: a
        distributed function of its own per instance, made at the first access and
        kept in the instance's ``__dict__`` (as ``functools.cached_property`` keeps
        its value), so that it lives as long as the instance.

        Raises:
            TypeError: when ``instance`` has no ``__dict__`` to keep it in.
        """
        if instance is None:
            return self
        key = self._attribute or f"_autodist_bound_{id(self)}"
        cache = getattr(instance, "__dict__", None)
        if cache is None:
            raise TypeError(
                f"ad.function: {type(instance).__name__}.{self._name} is a method of a class "
                f"whose instances have no __dict__ (it defines __slots__), where AutoDist "
                f"keeps each instance's distributed step. Add '__dict__' to "
                f"{type(instance).__name__}.__slots__, or decorate a function instead.")
        bound = cache.get(key)
        if not isinstance(bound, DistributedFunction):
            open_session, fn, replicas, copy_back = self._made_with
            bound = DistributedFunction(open_session, fn.__get__(instance, owner), replicas,
                                        copy_back)
            cache[key] = bound  # not setattr: a Keras object would track it
        return bound

    @property
    def _name(self) -> str:
        return getattr(self, "__name__", "the step")

    def __call__(self, *args, **kwargs):
        _check_eager_call(self._name, args, kwargs)
        if kwargs:
            args = self._positional(args, kwargs)
        step = self._steps.find(args)
        if step is not self._step:
            self.copy_to_model()  # another step goes on from the values trained so far
        if step is None:  # traced for these arguments' structure and dtypes
            step = self._steps.add(args)
        else:
            step.copy_from_eager_if_changed()
        self._step = step
        outputs = step.run(args)
        if self._every_call:
            step.copy_to_eager()
        self._stale = not self._every_call
        return outputs

    def copy_to_model(self) -> None:
        """Copies the trained weights and optimizer slots into the eager model, if it
        does not hold them yet (with ``copy_back="on_request"``)."""
        if self._stale:
            self._step.copy_to_eager()
            self._stale = False

    def _positional(self, args: tuple, kwargs: dict) -> tuple:
        """The call's arguments by position, bound as ``tf.function`` binds keywords.

        Raises:
            TypeError: when they do not fit the step's signature, or name a
                keyword-only parameter (the traced step takes positions only).
        """
        name = getattr(self, "__name__", "the step")
        try:
            bound = self._signature.bind(*args, **kwargs)
        except TypeError as err:
            raise TypeError(f"{name}(): {err}") from None
        parameters = list(self._signature.parameters.values())
        keyword_only = [p.name for p in parameters if p.name in bound.arguments
                        and p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD)]
        if keyword_only:
            raise TypeError(
                f"AutoDist passes the arguments of {name} by position, but {keyword_only} "
                "are keyword-only: make them positional parameters.")
        positional = [p for p in parameters
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        last = max(i for i, p in enumerate(positional) if p.name in bound.arguments)
        values = [bound.arguments.get(p.name, p.default)  # defaults fill the gaps
                  for p in positional[:last + 1]]
        rest = [bound.arguments[p.name] for p in parameters
                if p.kind == p.VAR_POSITIONAL and p.name in bound.arguments]
        return tuple(values) + (tuple(rest[0]) if rest else ())


def _check_eager_call(name: str, args: tuple, kwargs: dict) -> None:
    """Refuses a call of the step ``name`` that AutoDist cannot run eagerly from Python.

    Raises:
        RuntimeError: when TensorFlow is building a graph (the original AutoDist's
            graph-mode ``autodist.function``), or an argument is a graph's tensor or op.
        ValueError: when an argument is a ``tf.data`` dataset or iterator, whose
            batches have no size until drawn.
    """
    graph_mode_fix = (
        "ad.function runs a TF2 step eagerly, called from Python with eager tensors or "
        "numpy arrays. For a tf.compat.v1 graph, build the model and its train op inside "
        "ad.scope() without ad.function and run them in ad.create_distributed_session() "
        "(sess.run(fetches, feed_dict)); for TF2, call the step outside any "
        "tf.Graph().as_default() block, with the model built in ad.scope().")
    if not tf.executing_eagerly():
        raise RuntimeError(
            f"ad.function: {name} was called while TensorFlow builds a graph (inside "
            f"tf.Graph().as_default() or a tf.function), as the original AutoDist's "
            f"graph-mode autodist.function was. {graph_mode_fix}")
    for leaf in tf.nest.flatten((args, kwargs)):
        if isinstance(leaf, tf.Operation) or (isinstance(leaf, tf.Tensor)
                                              and tf.is_symbolic_tensor(leaf)):
            kind = "op" if isinstance(leaf, tf.Operation) else "tensor (e.g. a placeholder)"
            raise RuntimeError(
                f"ad.function: {name} was passed {leaf.name}, a graph's {kind}, not a "
                f"value. {graph_mode_fix}")
        if isinstance(leaf, (tf.data.Dataset, tf.data.Iterator)):
            raise ValueError(
                f"ad.function: {name} was passed a tf.data dataset or iterator "
                f"({type(leaf).__name__}), whose batches have no size until drawn, but "
                f"AutoDist splits each batch it is passed "
                f"across the replicas. Pass the batches one by one: "
                f"for x, y in dataset: {name}(x, y).")


def _as_tensor_in_place(value):
    """A large fetched array as a tensor on its own memory (DLPack), sparing the copy
    ``assign`` would make; AutoDist drops the array, so nothing else writes it."""
    if (not isinstance(value, np.ndarray) or value.nbytes < _IN_PLACE_BYTES
            or not value.flags.writeable or not value.flags.c_contiguous):
        return value
    try:
        return tf.experimental.dlpack.from_dlpack(value.__dlpack__())
    except (BufferError, TypeError, ValueError, tf.errors.InvalidArgumentError):
        return value  # a dtype DLPack does not carry


def _few_bytes(variable) -> bool:
    """Whether copying ``variable``'s value costs less than an eager op's overhead."""
    return (not isinstance(variable, DeferredVariable) and variable.shape.is_fully_defined()
            and variable.shape.num_elements() * variable.dtype.size < _IN_PLACE_BYTES)


def _equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two snapshots hold the same values (a NaN equal to a NaN)."""
    return np.array_equal(a, b, equal_nan=a.dtype.kind in "fc")


def _same_buffer(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two snapshots are views of one buffer: the variable was not written."""
    return a.__array_interface__["data"][0] == b.__array_interface__["data"][0]


def _as_numpy(value):
    return value.numpy() if hasattr(value, "numpy") else np.asarray(value)
