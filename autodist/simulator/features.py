"""Per-part feature sequences of a strategy, the learned simulator's input.

A strategy becomes one row per trainable variable, in graph order: raw facts
(bytes, sparsity, synchronizer, proxy, compressor, partitions, the bandwidth it
meets, what it shares a server or a group with), what the cost model charges
it per component, and the strategy's totals repeated on every row, so a row can
be judged in its context.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Mapping, Optional

import numpy as np

from autodist.simulator.cost_model import COMPONENTS, CostModel

FEATURE_NAMES = (
    "log_value_bytes", "log_grad_bytes", "log_wire_bytes", "sparse", "has_grad", "ps_share",
    "proxy_share", "staleness", "fp16_share", "error_feedback_share", "log2_parts",
    "log_link_gbps", "log_shared_bytes", "log_shared_parts",
    *(f"{name}_ms" for name in COMPONENTS),
    "log_total_ms", "total_ps_transfer_ms", "total_ring_ms")
_COMPONENT_COLUMN = {name: 14 + i for i, name in enumerate(COMPONENTS)}


def strategy_features(strategy: Any, variables: Any, resource_spec: Any, *, batch_size: int,
                      cost_model: Optional[CostModel] = None,
                      rows_touched: Optional[Mapping[str, float]] = None) -> np.ndarray:
    """The feature sequence of ``strategy``: float32 ``[variables, len(FEATURE_NAMES)]``.

    A partitioned variable's parts are summed (bytes, charges), averaged (shares
    of PS, proxy and fp16 parts) or take their worst case (slowest link,
    busiest server or group).

    Args:
        strategy: a ``Strategy`` (or ``CompiledStrategy``).
        variables: a ``GraphItem``, ``CapturedGraph`` or list of ``VariableInfo``.
        resource_spec: the cluster.
        batch_size: examples per replica and step.
        cost_model: whose per-part charges go in; the default model if None.
        rows_touched: variable name -> rows a replica's step touches.
    """
    model = cost_model or CostModel()
    variables = getattr(variables, "trainable_variables", variables)
    charges = model.charges(strategy, variables, resource_spec, batch_size=batch_size,
                            rows_touched=rows_touched)
    cluster = charges.cluster
    weights = {name: getattr(model.weights, name) for name in COMPONENTS}
    parts = charges.parts
    keys = [_sharing_key(part) for part in parts]
    shared_bytes: Dict[tuple, float] = {}
    shared_parts: Dict[tuple, int] = {}
    row_of: Dict[str, int] = {}
    for part, key in zip(parts, keys):
        shared_bytes[key] = shared_bytes.get(key, 0.0) + part.wire_bytes
        shared_parts[key] = shared_parts.get(key, 0) + 1
        row_of.setdefault(part.variable, len(row_of))
    # Plain lists while filling: numpy's per-element access costs more than the work.
    rows = [[0.0] * len(FEATURE_NAMES) for _ in row_of]
    for row in rows:
        row[11] = math.inf  # the slowest link: a minimum over parts
    ring_gbps = cluster.ring_gbps()
    nic_gbps = cluster.nic_gbps
    for part, key in zip(parts, keys):
        row = rows[row_of[part.variable]]
        row[0] += part.value_bytes
        row[1] += part.grad_bytes
        row[2] += part.wire_bytes
        row[3], row[4] = float(part.sparse), float(part.has_grad)
        # Comparisons rather than min()/max(): this loop runs for every part of
        # thousands of candidates, and a builtin call costs more than the test.
        if part.is_ps:
            row[5] += 1.0
            row[6] += part.proxy
            if part.staleness > row[7]:
                row[7] = part.staleness
            gbps = nic_gbps.get(part.server, ring_gbps)
        else:
            row[8] += part.compressor != 0
            row[9] += part.compressor == 2
            gbps = ring_gbps
        row[10] += 1.0
        if gbps < row[11]:
            row[11] = gbps
        if shared_bytes[key] > row[12]:
            row[12] = shared_bytes[key]
        if shared_parts[key] > row[13]:
            row[13] = shared_parts[key]
    table = np.array(rows, dtype=np.float64).reshape(len(rows), len(FEATURE_NAMES))
    # Charges summed per cell in row order (bincount adds in input order, as a loop would).
    scale = {name: 1e3 * weight for name, weight in weights.items()}
    cells = np.array([row_of[variable] * len(FEATURE_NAMES) + _COMPONENT_COLUMN[component]
                      for variable, _, component, _ in charges.rows], dtype=np.intp)
    charged = [scale[component] * value for _, _, component, value in charges.rows]
    table += np.bincount(cells, charged, minlength=table.size).reshape(table.shape)
    parts = table[:, 10].copy()
    table[:, [5, 6, 8, 9]] /= parts[:, None]
    table[:, [0, 1, 2, 12, 13]] = np.log1p(table[:, [0, 1, 2, 12, 13]])
    table[:, 10] = np.log2(parts)
    table[:, 11] = np.log(table[:, 11])
    totals = {name: weights[name] * value for name, value in charges.features.items()}
    table[:, -3:] = (math.log1p(1e3 * sum(totals.values())), 1e3 * totals["ps_transfer"],
                     1e3 * totals["ring_all_reduce"])
    return table.astype(np.float32)


def _sharing_key(part) -> tuple:
    """What a part shares its traffic with: its server, or its all-reduce group."""
    if part.is_ps:
        return ("ps", part.server)
    return ("ar", "sparse" if part.sparse else part.group)
