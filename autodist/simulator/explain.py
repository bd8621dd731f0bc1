"""Readable text for a cost breakdown: where a strategy's predicted time goes."""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional

from autodist.simulator.cost_model import COMPONENTS, CostBreakdown


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def format_breakdown(breakdown: CostBreakdown, top: Optional[int] = 20) -> str:
    """Formats a breakdown as a per-variable table and per-component totals.

    Variables are listed by predicted time, largest first, one column per
    component, in milliseconds. The totals table shows each component's
    feature, weight and weighted seconds, so the arithmetic can be checked.

    Args:
        breakdown: from :meth:`CostModel.breakdown`.
        top: how many variables to list; the rest are summed on one line.
            None lists every variable.

    Returns:
        str: the text, ending with a newline.
    """
    per_variable: Dict[str, Dict[str, float]] = {}
    for row in breakdown.rows:
        cells = per_variable.setdefault(row.variable, dict.fromkeys(COMPONENTS, 0.0))
        cells[row.component] += row.seconds
    ranked = sorted(per_variable.items(), key=lambda item: (-sum(item[1].values()), item[0]))
    shown = ranked if top is None else ranked[:top]
    rest = ranked[len(shown):]

    total = breakdown.total
    binding = breakdown.binding_resource
    lines: List[str] = [f"Predicted {_ms(total)} ms per iteration"
                        + (f"; busiest PS resources: {binding}." if binding else ".")]
    name_width = max([len("variable")] + [len(name) for name, _ in shown] + [len("(others)")])
    widths = [max(len(c), 10) for c in COMPONENTS]
    header = "  ".join([f"{'variable':<{name_width}}"]
                       + [f"{c:>{w}}" for c, w in zip(COMPONENTS, widths)] + [f"{'total ms':>10}"])
    lines += ["", header, "-" * len(header)]

    def table_row(name: str, cells: Dict[str, float]) -> str:
        return "  ".join([f"{name:<{name_width}}"]
                         + [f"{_ms(cells[c]):>{w}}" for c, w in zip(COMPONENTS, widths)]
                         + [f"{_ms(sum(cells.values())):>10}"])

    for name, cells in shown:
        lines.append(table_row(name, cells))
    if rest:
        others = {c: sum(cells[c] for _, cells in rest) for c in COMPONENTS}
        lines.append(table_row("(others)", others) + f"  ({len(rest)} variables)")

    lines += ["", f"{'component':<20}{'feature':>14}{'weight':>12}{'ms':>12}{'share':>8}"]
    for name in COMPONENTS:
        seconds = breakdown.totals[name]
        share = seconds / total if total else 0.0
        lines.append(f"{name:<20}{breakdown.features[name]:>14.6g}"
                     f"{breakdown.weights[name]:>12.4g}{_ms(seconds):>12}{share:>8.1%}")
    lines.append(f"{'total':<20}{'':>14}{'':>12}{_ms(total):>12}")
    return "\n".join(lines) + "\n"


def format_rows_touched(variables: Iterable, batch_size: int) -> str:
    """Says, per variable with a sparse gradient, how many rows the cost model takes
    one replica's step to touch (its gradient's rows and, unless read whole, its reads),
    and how its optimizer update runs (by those rows, or on every row, and why).

    Args:
        variables: ``VariableInfo`` objects.
        batch_size: examples per replica and step.

    Returns:
        str: the text, ending with a newline; empty without sparse gradients.
    """
    lines = []
    for info in variables:
        if not info.sparse_grad:
            continue
        terms = ([f"{info.rows_gathered_per_example} per example x batch {batch_size}"]
                 if info.rows_gathered_per_example else [])
        terms += [f"{info.rows_gathered} fixed"] if info.rows_gathered else []
        read = "read whole" if info.read_whole else "read by rows"
        update = f"updated {info.update_mode}" if info.update_mode else ""
        update += f" ({info.update_note})" if info.update_note else ""
        lines.append(f"  {info.name}: {info.rows_touched(batch_size):,} of {int(info.shape[0]):,} "
                     f"rows ({' + '.join(terms)}); {'; '.join(filter(None, [read, update]))}")
    if not lines:
        return ""
    return "\n".join(["Rows one replica's step touches (from the gathers' ids), and how "
                      "each table's optimizer update runs:"] + lines) + "\n"
