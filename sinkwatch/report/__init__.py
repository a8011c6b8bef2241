"""``sinkwatch report STORE [STORE ...]``: markdown + PNG figures from replay stores or live runs.

Several stores overlay in one set of figures (the paper compares three models side by side). For a
store whose model has published figures, the paper's trajectory is drawn beside ours (dashed) and
the findings table flags every mismatch.

One module per idea: ``store`` (loading records), ``axes`` and ``figures`` (the trajectory figures),
``markdown`` and ``tables`` (the per-revision tables), ``paper`` and ``heads`` (the comparison with the
paper), ``build`` (the markdown), ``published`` (the paper's data alone).
"""

from .axes import _x_label as _x_label  # the tests draw an axis as the report does
from .axes import _xaxis as _xaxis
from .build import build_report
from .figures import figure_final_layers, figure_heatmaps, figure_prefix, figure_sink_heads, figure_sink_rate, figure_stages
from .heads import figure_head_comparison, head_comparisons
from .markdown import _fmt as _fmt  # the tests format numbers as the report does
from .paper import PROTOCOL_NOTE
from .published import build_paper_report
from .store import Store, split_segments

__all__ = [
    "PROTOCOL_NOTE",
    "Store",
    "build_paper_report",
    "build_report",
    "figure_final_layers",
    "figure_head_comparison",
    "figure_heatmaps",
    "figure_prefix",
    "figure_sink_heads",
    "figure_sink_rate",
    "figure_stages",
    "head_comparisons",
    "split_segments",
]
