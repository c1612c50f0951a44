"""ddl on Spark: one ddl job per barrier stage, with ddl.spark.run.

    python examples/spark_allreduce.py              # a local Spark (needs Java)
    python examples/spark_allreduce.py --num-proc 4

Each task is one rank; the ranks average a vector and gather their ranks.
"""

import argparse


def work(scale: float):
    import numpy as np
    import ddl
    mean = ddl.allreduce(np.full(4, scale * ddl.rank()), op=ddl.Average, name="mean")
    ranks = ddl.allgather(np.array([ddl.rank()]), name="ranks")
    return {"rank": ddl.rank(), "mean": mean.tolist(), "ranks": ranks.tolist()}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-proc", type=int, default=2)
    args = p.parse_args()
    from pyspark.sql import SparkSession
    import ddl.spark
    spark = (SparkSession.builder.master(f"local[{args.num_proc}]").appName("ddl-example")
             .config("spark.ui.enabled", "false").getOrCreate())
    try:
        results = ddl.spark.run(work, args=(2.0,), num_proc=args.num_proc,
                                spark_context=spark.sparkContext)
    finally:
        spark.stop()
    for r in results:
        print(f"rank {r['rank']}: mean {r['mean']} ranks {r['ranks']}")
    n = args.num_proc
    assert all(r["mean"] == [2.0 * (n - 1) / 2] * 4 and r["ranks"] == list(range(n))
               for r in results)
    print("OK")


if __name__ == "__main__":
    main()
