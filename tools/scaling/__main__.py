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
args = parser.parse_args()
if args.command == "measure":
    measure.run(tuple(args.which))
elif args.command == "profiles":
    import os
    profiles.write(os.path.join(report.ROOT, "docs", "scaling", "profiles.json"))
elif args.command == "report":
    report.write_doc()
    report.plot()
else:
    print(report.tables(), end="")
