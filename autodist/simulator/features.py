"""Per-part feature sequences of a strategy, the learned simulator's input.

A strategy becomes one row per trainable variable, in graph order: raw facts
(bytes, sparsity, synchronizer, proxy, compressor, partitions, the bandwidth it
meets, what it shares a server or a collective with), what the cost model charges
it per component, and the strategy's totals repeated on every row, so a row can
be judged in its context.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Optional

import numpy as np

from autodist.simulator.cost_model import COMPONENTS, CostModel
from autodist.simulator.traffic import KIND_NUMBERS
from autodist.synchronizers.compressor import COMPRESSORS

_KIND_SHARES = tuple(f"{kind.feature_name}_share" for kind in KIND_NUMBERS)
FEATURE_NAMES = (
    "log_value_bytes", "log_grad_bytes", "log_wire_bytes", "sparse", "has_grad", *_KIND_SHARES,
    "proxy_share", "staleness", "fp16_share", "error_feedback_share", "log2_parts",
    "log_link_gbps", "log_shared_bytes", "log_shared_parts",
    *(f"{name}_ms" for name in COMPONENTS),
    "log_total_ms", "total_ps_transfer_ms", "total_ring_ms")
_COLUMN = {name: column for column, name in enumerate(FEATURE_NAMES)}
# Per compressor enum value (dense and contiguous from 0): is it lossy, does it feed errors back.
_LOSSY = np.array([COMPRESSORS[v].lossy for v in range(len(COMPRESSORS))])
_ERROR_FEEDBACK = np.array([COMPRESSORS[v].error_feedback for v in range(len(COMPRESSORS))])
_FIRST_COMPONENT_COLUMN = FEATURE_NAMES.index(f"{COMPONENTS[0]}_ms")
_TOTAL_MS = FEATURE_NAMES.index("log_total_ms")

FEATURES_VERSION = 10
"""Changes when a feature's meaning does (2: PS pushes and pulls add up as phases; 3: the
serving-node and split-step components; 4: proxy refreshes overlap pushes; 5: a collective
per dtype of an all-reduce group; 6: the optimizer-update component; 7: the all-reduce
part-overhead component; 8: sparse parts never count as fp16; 9: a share column per
synchronizer kind; 10: the scatter-gather and overlap components), so that a simulator
saved for the old features is not reused."""


def strategy_features(strategy: Any, variables: Any, resource_spec: Any, *, batch_size: int,
                      cost_model: Optional[CostModel] = None,
                      rows_touched: Optional[Mapping[str, float]] = None,
                      accumulation_steps: int = 1) -> np.ndarray:
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
        accumulation_steps: runs per sync (``AutoDist(accumulation_steps=...)``).
    """
    model = cost_model or CostModel()
    variables = getattr(variables, "trainable_variables", variables)
    charges = model.charges(strategy, variables, resource_spec, batch_size=batch_size,
                            rows_touched=rows_touched, accumulation_steps=accumulation_steps)
    parts = charges.parts
    row = parts.row
    table = np.zeros((len(parts.variables), len(FEATURE_NAMES)))

    def column(name: str) -> np.ndarray:
        return table[:, _COLUMN[name]]

    def per_row(values: np.ndarray) -> np.ndarray:  # sums in part order, as a loop would
        return np.bincount(row, values, minlength=len(table))

    column("log_value_bytes")[:] = per_row(parts.value_bytes)
    column("log_grad_bytes")[:] = per_row(parts.grad_bytes)
    column("log_wire_bytes")[:] = per_row(parts.wire_bytes)
    column("sparse")[row] = parts.sparse
    column("has_grad")[row] = parts.has_grad
    column("proxy_share")[:] = per_row(parts.proxy)
    np.maximum.at(column("staleness"), row, parts.staleness)
    # Sparse gradients are gathered uncompressed, whatever their group's compressor.
    compressed = ~parts.sparse
    column("fp16_share")[:] = per_row(compressed & _LOSSY[parts.compressor])
    column("error_feedback_share")[:] = per_row(compressed & _ERROR_FEEDBACK[parts.compressor])
    counts = np.bincount(row, minlength=len(table))
    column("log2_parts")[:] = counts
    # Per kind: the link its parts meet, and what each shares its traffic with
    # (numbered per kind, then apart from the other kinds').
    gbps = np.zeros(len(parts.names))
    key = np.zeros(len(parts.names), dtype=np.intp)
    for kind, name in zip(KIND_NUMBERS, _KIND_SHARES):
        index = parts.of_kind(kind)
        column(name)[:] = np.bincount(row[index], minlength=len(table))
        if index.size:
            gbps[index] = kind.link_gbps(parts, index, charges.cluster)
            local = kind.traffic_keys(parts, index)
            key[index] = key.max(initial=-1) + 1 + local
    link = column("log_link_gbps")
    link[:] = np.inf
    np.minimum.at(link, row, gbps)
    np.maximum.at(column("log_shared_bytes"), row, np.bincount(key, parts.wire_bytes)[key])
    np.maximum.at(column("log_shared_parts"), row, np.bincount(key)[key])
    # Charges summed per cell in charge order (bincount adds in input order, as a loop would).
    scale = 1e3 * np.array([getattr(model.weights, name) for name in COMPONENTS])
    cells = row[charges.part] * len(FEATURE_NAMES) + _FIRST_COMPONENT_COLUMN + charges.component
    table += np.bincount(cells, scale[charges.component] * charges.value,
                         minlength=table.size).reshape(table.shape)
    # A partitioned variable without part configs has no parts, hence no row.
    table, counts = table[counts > 0], counts[counts > 0]
    shares = [_COLUMN[name] for name in (*_KIND_SHARES, "proxy_share", "fp16_share",
                                         "error_feedback_share")]
    table[:, shares] /= counts[:, None]
    logged = [_COLUMN[name] for name in ("log_value_bytes", "log_grad_bytes", "log_wire_bytes",
                                         "log_shared_bytes", "log_shared_parts")]
    table[:, logged] = np.log1p(table[:, logged])
    column("log2_parts")[:] = np.log2(counts)
    column("log_link_gbps")[:] = np.log(column("log_link_gbps"))
    totals = {name: getattr(model.weights, name) * value
              for name, value in charges.features.items()}
    table[:, -3:] = (math.log1p(1e3 * sum(totals.values())), 1e3 * totals["ps_transfer"],
                     1e3 * totals["ring_all_reduce"])
    return table.astype(np.float32)


def cost_model_seconds(features: np.ndarray) -> float:
    """The cost model's prediction, read back from a feature sequence (every row carries it)."""
    return float(math.expm1(features[0, _TOTAL_MS]) / 1e3) if len(features) else 0.0
