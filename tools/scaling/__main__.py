"""python -m tools.scaling {measure,profiles,report}: see tools/scaling/__init__.py."""

import argparse

from . import measure, profiles, report

parser = argparse.ArgumentParser(prog="python -m tools.scaling", description=__doc__)
sub = parser.add_subparsers(dest="command", required=True)
m = sub.add_parser("measure", help="run the benchmarks the fit uses (docs/scaling/data)")
m.add_argument("which", nargs="*", default=["shm_np2", "tcp_np2", "link_np2"])
sub.add_parser("profiles", help="rebuild docs/scaling/profiles.json (needs TensorFlow)")
sub.add_parser("report", help="rewrite docs/scaling.md's tables and the plot")
sub.add_parser("tables", help="print the tables")
p = sub.add_parser("predict", help="predict the efficiency of your own model and cluster")
p.add_argument("--params", type=float, required=True, help="parameters, e.g. 25e6")
p.add_argument("--compute-ms", type=float, required=True,
               help="one GPU's forward+backward time per step, ms")
p.add_argument("--hosts", type=int, required=True)
p.add_argument("--gpus-per-host", type=int, default=4)
p.add_argument("--link-gbit", type=float, default=25.0)
p.add_argument("--layers", type=int, default=50, help="gradients spread over this many layers")
p.add_argument("--link-efficiency", type=float, default=0.0,
               help="share of the link reached (default: fitted to the published run)")
args = parser.parse_args()
if args.command == "measure":
    measure.run(tuple(args.which))
elif args.command == "profiles":
    import os
    profiles.write(os.path.join(report.ROOT, "docs", "scaling", "profiles.json"))
elif args.command == "report":
    report.write_doc()
    report.plot()
elif args.command == "predict":
    print(report.predict(args.params, args.compute_ms, args.hosts, args.gpus_per_host,
                         args.link_gbit, args.layers, args.link_efficiency), end="")
else:
    print(report.tables(), end="")
