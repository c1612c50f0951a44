"""A scaling model of data-parallel training with ddl: α-β costs of ddl's algorithms,
fitted from ddl's own benchmark runs, checked against published figures, and used to
predict efficiency at many GPUs. Run ``python -m tools.scaling --help`` from the
repository root; docs/scaling.md is its report.

Modules: :mod:`.model` (the cost formulas and the step model), :mod:`.fit` (α and β from
``ddl-bench --csv`` rows), :mod:`.inputs` (published figures and every assumption, with
sources), :mod:`.profiles` (per-layer parameters and FLOPs of the benchmark models, from
``keras.applications``), :mod:`.measure` (the benchmark runs the fit uses),
:mod:`.report` (the tables and the plot of docs/scaling.md).
"""
