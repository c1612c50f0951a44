"""Test configuration shared by every test module.

Worlds of real processes are started with ``ddl.run`` (the product's own launcher, with a
real coordinator). Child processes import helper modules from this folder, so it is put
on their PYTHONPATH.
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

_paths = [HERE] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(_paths))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
