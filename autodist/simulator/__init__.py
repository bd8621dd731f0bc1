"""Simulators of strategies: the predefined cost model and the learned ranking simulator.

``cost_model`` (with ``traffic``) predicts a strategy's synchronization time from
named components; ``features`` turns a strategy into the per-variable sequence
that ``ranking.RankingSimulator`` (an RNN refined by measured trials) scores;
``calibration`` refits the components' weights to the trials, the RNN's prior;
``fidelity`` says how far a ranking can be trusted. The ranking simulator needs
Keras and is imported from its module, so importing this package stays light.
"""
from autodist.simulator.cost_model import COMPONENTS, CostBreakdown, CostModel, CostRow, CostWeights
from autodist.simulator.explain import format_breakdown, format_rows_touched
from autodist.simulator.traffic import sparse_grad_bytes

__all__ = ["COMPONENTS", "CostBreakdown", "CostModel", "CostRow", "CostWeights",
           "format_breakdown", "format_rows_touched", "sparse_grad_bytes"]
