"""A gradient-like step (many tensors, mostly small) for comparing settings and --autotune.

    ddlrun -np 2 python examples/bench_autotune.py [--steps 400] [--last 100]
    ddlrun -np 2 --autotune --autotune-log-file tune.csv python examples/bench_autotune.py

Each step allreduces (asynchronously, then waits for all) the gradients of a synthetic
model: ``--layers`` blocks of a weight of ``--width``x``--width`` float32 and three
small vectors (bias, norm scale and shift), like a convolutional network's parameters.
Rank 0 prints the step rate and the reduced bytes per second over the last ``--last``
steps (with --autotune: after the tuner has kept its best setting), and the setting the
ranks ran at the end.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import ddl


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=50)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--last", type=int, default=100, help="steps timed at the end")
    args = parser.parse_args()
    ddl.init()
    rng = np.random.default_rng(ddl.rank())
    grads = []
    for i in range(args.layers):
        grads.append((f"l{i}/w", rng.standard_normal((args.width, args.width), np.float32)))
        for part in ("b", "scale", "shift"):
            grads.append((f"l{i}/{part}", rng.standard_normal(args.width, np.float32)))
    nbytes = sum(g.nbytes for _, g in grads)
    start = None
    for step in range(args.steps):
        if step == args.steps - args.last:
            start = time.perf_counter()
        handles = [ddl.allreduce_async(g, name=name) for name, g in grads]
        for h in handles:
            h.wait()
    seconds = time.perf_counter() - start
    if ddl.rank() == 0:
        from ddl.runtime.runtime import runtime
        cfg = runtime().config
        print(f"{len(grads)} tensors, {nbytes / 2**20:.1f} MiB per step: "
              f"{args.last / seconds:.1f} steps/s, {args.last * nbytes / seconds / 1e6:.0f} MB/s "
              f"(last {args.last} of {args.steps} steps); setting: fusion_threshold="
              f"{cfg.fusion_threshold} shm_allreduce_algorithm={cfg.shm_allreduce_algorithm} "
              f"small_message_bytes={cfg.small_message_bytes} "
              f"tcp_chunk_bytes={cfg.tcp_chunk_bytes}", flush=True)
    ddl.shutdown()


if __name__ == "__main__":
    main()
