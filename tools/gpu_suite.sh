#!/usr/bin/env bash
# The GPU suite and the CUDA benchmarks in one call, on a machine with a CUDA device (a lent
# GPU machine: see ../shared/GPU.md). From the root of a checkout:
#
#     bash tools/gpu_suite.sh [OUTDIR [all|suite|bench|cpu]]   (default: $OUT, else /tmp/ddl-gpu; all)
#
# It installs this checkout afresh into a folder of its own (wheels the machine lacks may
# wait in .whl/, installed first without an index), runs tests/gpu from outside the
# checkout (so that the installed ddl, with its clients, is the one imported), then the
# benchmarks: ddl-bench on CUDA tensors beside Gloo at np 2 and np 4 (and beside NCCL
# where there are two GPUs or more), and the synthetic training benchmark on CUDA at np 1
# and np 2 (beside DDP; and with DDL_CYCLE_TIME_MS=50).
# Each step has a time limit, so that "all" ends within a device call's 10 minutes.
# "cpu" runs, instead, the host rows of the performance issue on the machine's 16 cores
# (CPU tensors: ddl-bench beside Gloo and the machine's Open MPI at np 2, 4 and 8 with the
# copy floor; the synthetic training benchmarks beside DDP, no exchange and one process
# at np 2 and 4), in about 5 minutes.
# Every log lands in OUTDIR; the exit status is the suite's (or the benchmarks' with
# "bench" and "cpu").
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-${OUT:-/tmp/ddl-gpu}}
what=${2:-all}
py=${PYTHON:-python3}
site=/tmp/ddl-gpu-site
mkdir -p "$out"
cd "$root" || exit 2
if compgen -G ".whl/*.whl" >/dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/ddl-gpu-wheels .whl/*.whl || exit 2
    export PYTHONPATH=/tmp/ddl-gpu-wheels${PYTHONPATH:+:$PYTHONPATH}
fi
rm -rf "$site"
"$py" -m pip install -q --no-deps --no-build-isolation --no-compile --target "$site" . \
    >"$out/install.txt" 2>&1 || { cat "$out/install.txt"; exit 2; }
export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} PATH=$site/bin:$PATH PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false   # JAX ranks share the GPU with torch ones

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  nproc
  cd /tmp   # outside the checkout: the installed ddl, not the source tree's
  "$py" - <<'PY'
import ddl, numpy, torch
print("ddl", ddl.__file__, "torch", torch.__version__, "cuda", torch.version.cuda,
      torch.cuda.get_device_name(0), "numpy", numpy.__version__)
for name in ("cupy", "jax", "grpc"):
    try:
        print(name, __import__(name).__version__)
    except Exception as exc:
        print(name, "missing:", exc)
try:   # ddl's GPU id (CuPy cuts the UUID's bytes at a zero byte), and NCCL
    from ddl.dataplane.device import cuda, nccl
    rt = cuda.cupy().cuda.runtime
    print("gpu id", cuda.device_info(0)[0], "uuid bytes",
          len(rt.getDeviceProperties(0)["uuid"]), "nccl loads", nccl.available())
except Exception as exc:
    print("gpu id: failed:", type(exc).__name__, exc)
PY
} 2>&1 | tee "$out/env.txt"
(cd /tmp && "$py" -c "import ddl.torch") || { echo "the installed ddl.torch does not import"; exit 2; }

rc=0
if [ "$what" != bench ] && [ "$what" != cpu ]; then
    (cd /tmp && timeout 330 "$py" -m pytest -q -rs -p no:cacheprovider "$root/tests/gpu") 2>&1 \
        | tee "$out/suite.txt"
    rc=${PIPESTATUS[0]}
fi
[ "$what" = suite ] && exit "$rc"

bench() {  # SECONDS NP LOG ARGS...: a benchmark that must not hang the call
    local limit=$1 np=$2 log=$3; shift 3
    (cd /tmp && timeout "$limit" ddlrun -np "$np" "$@") >"$out/$log" 2>&1
    local status=$?
    echo "== $log: exit $status"; grep -v "^\[[0-9]*\]<stderr>" "$out/$log" | tail -40
    [ "$status" = 0 ] || brc=$status
}
brc=0
if [ "$what" = cpu ]; then
    # Open MPI refuses root without these; --mpi starts the ranks with mpirun, so that
    # --compare mpi has its COMM_WORLD
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    lscpu | grep -E "Model name|^CPU\(s\)|L3" >"$out/cpu.txt"
    bench 150 2 cpu-bench-np2.txt --mpi ddl-bench --op allreduce,broadcast,allgather \
        --sizes 4,4K,64K,1M,16M,64M,256M --compare gloo,mpi --floor -n 40
    for np in 4 8; do
        bench 90 "$np" "cpu-bench-np$np.txt" --mpi ddl-bench --op allreduce \
            --sizes 4,4K,64K,1M,16M,64M --compare gloo,mpi --floor -n 40
    done
    for np in 2 4; do
        for model in mlp cnn; do
            bench 60 "$np" "cpu-train-$model-np$np.txt" "$py" \
                "$root/examples/pytorch_synthetic_benchmark.py" --model "$model" \
                --compare ddp,local,alone --rounds 2
        done
    done
    exit "$brc"
fi
bench 90 2 bench-cuda-np2.txt ddl-bench --device cuda --op all --sizes 4,64K,1M,16M --compare gloo
if [ "$(nvidia-smi -L | grep -c '^GPU')" -ge 2 ]; then   # a GPU per rank: NCCL can run
    bench 90 2 bench-cuda-nccl-np2.txt ddl-bench --device cuda --op all \
        --sizes 4,64K,1M,16M,256M --compare gloo,nccl
fi
bench 60 2 bench-cuda-256m.txt ddl-bench --device cuda --op allreduce --sizes 256M \
    --iters 5 --warmup 1 --compare gloo
bench 60 4 bench-cuda-np4.txt ddl-bench --device cuda --op allreduce --sizes 4,64K,16M \
    --compare gloo
bench 45 1 train-cuda-np1.txt "$py" "$root/examples/pytorch_synthetic_benchmark.py" --device cuda
bench 90 2 train-cuda-np2.txt "$py" "$root/examples/pytorch_synthetic_benchmark.py" --device cuda \
    --compare ddp
# the same with asynchronous calls left to the thread that waits for them (one fused
# allreduce per step, as on a crowded host): whether the GPU's turns between the two
# processes, not the CPUs, are what to save on one shared GPU
bench 60 2 train-cuda-np2-cycle50.txt env DDL_CYCLE_TIME_MS=50 "$py" \
    "$root/examples/pytorch_synthetic_benchmark.py" --device cuda
[ "$what" = bench ] && exit "$brc"
exit "$rc"
