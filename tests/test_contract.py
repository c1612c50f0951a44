"""One contract suite over every backend and every array library (tests/arrayimpl.py):
one world per backend, each running ``_contract_checks.run_world`` (every collective x
reduce op x dtype x size 0/1/7/big, for NumPy, torch, TensorFlow and any other library of
``arrayimpl.IMPLS`` that imports, or the libraries a world names; a process set; dtype and shape mismatches) after
asserting which backend carries each collective, plus the NumPy world checks of
``_checks`` (shapes, strides, fusion, pytrees, join of every op), in the 4-rank world every mismatch
of ``_error_checks``, and in the 2-rank world the torch and TensorFlow clients' own checks
(``_torch_checks``, ``_tf_checks``). MXNet runs the contract in its own environment
(tests/test_mxnet.py).

To add a backend (CUDA IPC, NCCL: tests/gpu/ on a GPU machine), add one :class:`World`
with its environment and the backend names it must pick, and pass it to
:func:`run_contract`; to add an array library, add one entry to ``arrayimpl.IMPLS``.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from typing import Dict, List, Optional, Tuple

import pytest

import ddl
import arrayimpl
import _contract_checks

ALL_KINDS = tuple(_contract_checks.KINDS)
# Libraries the dev environment (``make test``, what CI runs) installs: never skipped there.
REQUIRED_IN_DEV = ("numpy", "torch", "tensorflow")


def _on(name: str, kinds=ALL_KINDS) -> Dict[str, str]:
    return {k: name for k in kinds}


@dataclasses.dataclass(frozen=True)
class World:
    """One backend's world: ``np`` ranks with ``env``; ``expect``: the backend name each
    collective kind must run on in the global set; ``subset`` (optional): a process set
    checked too, whose collectives must run on ``subset_expect``; ``extra``: checks run
    after the contract, as ``module.function`` (of tests/), or ``library:module.function``
    for one that runs only where that library of ``arrayimpl`` ran."""

    name: str
    np: int
    env: Tuple[Tuple[str, str], ...]
    expect: Tuple[Tuple[str, str], ...]
    subset: Optional[Tuple[int, ...]] = None
    subset_expect: Tuple[Tuple[str, str], ...] = ()
    extra: Tuple[str, ...] = ()
    libs: Optional[Tuple[str, ...]] = None   # only these libraries of arrayimpl


STANDIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "standin")


def _device_world(name: str, np_: int, expect: str, subset=None, standin: bool = True,
                  **env: str) -> World:
    """A world of CuPy arrays on the device data plane, over the CuPy stand-in
    (tests/standin: host memory behind CuPy's interface, CUDA IPC as POSIX shared memory,
    NCCL over /dev/shm; ``standin=False``: the real CuPy, on a GPU: tests/gpu), with 1 MiB
    device slots so that large calls take several rounds; ``expect``: the device plan's
    path and the backend every collective must take (tests/_device_checks.py)."""
    if standin:
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (STANDIN, os.environ.get("PYTHONPATH")) if p)
    env = dict(DDL_CUDA_IPC_SLOT_MB="1", DDL_TEST_DEVICE_EXPECT=expect, **env)
    # (the host backends' picks are the host worlds' to check)
    return World(name, np_, tuple(env.items()), (), subset=subset,
                 extra=("_device_checks.check_device_plan", "_device_checks.check_device_forms",
                        "_device_checks.check_device_memory_mismatch",
                        "_device_checks.check_device_process_set_cached",
                        "_device_checks.check_device_result_release",
                        "_device_checks.check_device_fast_lane",
                        "_device_checks.check_device_join"),
                 libs=("cupy",))


WORLDS: List[World] = [
    World("shm", 3, (), tuple(_on("shm").items()), subset=(0, 2),
          subset_expect=tuple(_on("shm").items()),
          extra=("_checks.check_collectives", "_checks.check_process_sets",
                 "_checks.check_join", "_checks.check_join_ops", "_checks.check_adasum",
                 # Horovod's process-set calls on every rank, members or not (3 ranks)
                 "torch:_torch_checks.check_process_sets_every_rank",
                 "tensorflow:_keras_checks.check_optimizer_outside_its_process_set")),
    # two simulated nodes of two ranks: the global set runs hierarchically where the
    # backend offers it (allreduce, allgather), TCP otherwise; {0, 2} (one rank per
    # node) and the even/odd sets of check_process_sets run flat TCP
    World("hierarchical", 4,
          (("DDL_TEST_LOCAL_NODES", "2,2"), ("DDL_HIERARCHICAL_ALLREDUCE", "on"),
           ("DDL_HIERARCHICAL_ALLGATHER", "on")),
          tuple(dict(_on("shm+tcp", ("allreduce", "allgather")),
                     **_on("tcp", ("broadcast", "alltoall", "reducescatter"))).items()),
          subset=(0, 2), subset_expect=tuple(_on("tcp").items()),
          extra=("_error_checks.check_mismatches", "_checks.check_collectives",
                 "_checks.check_process_sets", "_checks.check_join",
                 "_checks.check_join_ops", "_checks.check_adasum"),
          # NumPy only: torch and TensorFlow arrays become the same host buffers before
          # any backend sees them, and the other two worlds run them (4 ranks importing
          # both frameworks on 2 cores cost this world a third of its time)
          libs=("numpy",)),
    # no process set here (one of two ranks would be one rank): sets over flat TCP run in
    # the hierarchical world. Also the framework clients' own checks (autograd, in-place
    # and async forms, optimizers, Keras, tf.function and v1 graphs), written for 2 ranks
    World("tcp", 2, (("DDL_TRANSPORT", "tcp"), ("DDL_STALL_CHECK_TIME_SECONDS", "15"),
                     ("DDL_STALL_SHUTDOWN_TIME_SECONDS", "60")), tuple(_on("tcp").items()),
          extra=("_checks.check_collectives", "_checks.check_adasum")
          + tuple(f"torch:_torch_checks.{name}" for name in (
              "check_collectives", "check_autograd", "check_state_broadcast",
              "check_sync_batch_norm", "check_optimizer_misuse", "check_optimizer_features",
              "check_numerical_contract", "check_join_uneven", "check_adasum_optimizer",
              "check_scheduler_made_before_wrapping"))
          + tuple(f"tensorflow:_tf_checks.{name}" for name in (
              "check_collectives_in_three_modes", "check_gradients", "check_tape_contract",
              "check_keras_fit", "check_v1_monitored_session", "check_sparse_gradients",
              "check_sparse_allreduce_like_horovod", "check_alltoall_split_dtypes",
              "check_inplace_broadcast",
              "check_tape_options", "check_adasum_gradients", "check_backward_passes",
              "check_partial_distributed", "check_sync_batch_norm",
              "check_best_model_checkpoint"))
          # Horovod's own Keras tests, as checks
          + tuple(f"tensorflow:_keras_checks.{name}" for name in (
              "check_broadcast_callback", "check_lr_schedule",
              "check_load_model_like_horovod", "check_no_xla",
              "check_mixed_precision_overflow"))),
]


def _extra(names, libraries):
    """The functions named in ``names`` whose library is among ``libraries``."""
    out = []
    for name in names:
        library, _, name = name.rpartition(":")
        if library and library not in libraries:
            continue
        module, fn = name.split(".")
        out.append(getattr(importlib.import_module(module), fn))
    return out


def _rank(world: World) -> dict:
    return _contract_checks.run_world(
        dict(world.expect), subset=list(world.subset) if world.subset else None,
        subset_expect=dict(world.subset_expect),
        libs=list(world.libs) if world.libs else None,
        extra=lambda libraries: _extra(world.extra, libraries))


def run_contract(world: World) -> None:
    """Run ``world`` and fail on any failure of any rank (tests/gpu/ calls this with its
    worlds)."""
    env = dict(_contract_checks.ENV, TF_CPP_MIN_LOG_LEVEL="3", **dict(world.env))
    results = ddl.run(_rank, args=(world,), np=world.np, env=env)
    print(f"{world.name}: seconds per part on rank 0: {results[0]['seconds']}")
    failures = [f for r in results for f in r["failures"]]
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:60])
    # every library that imports here ran in every rank (a world's own libraries there)
    here = (list(world.libs) if world.libs else
            [i.name for i in arrayimpl.IMPLS if i.installed() is None])
    for rank, r in enumerate(results):
        assert r["ran"] == here, f"rank {rank} ran {r['ran']}, this process has {here}"


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world", WORLDS, ids=[w.name for w in WORLDS])
def test_contract(world):
    run_contract(world)


# The device data plane on every CI run, over the CuPy stand-in: 3 ranks on one GPU (CUDA
# IPC, and a process set of 2 of them); 2 ranks on GPUs of their own with peer access
# (CUDA IPC between devices); without peer access (NCCL), and without NCCL either
# (staged through the host).
DEVICE_WORLDS: List[World] = [
    _device_world("cuda_ipc", 3, "ipc:cuda_ipc", subset=(0, 2)),
    _device_world("cuda_ipc_peers", 2, "ipc:cuda_ipc", DDL_TEST_GPUS="2",
                  DDL_TEST_PEER_ACCESS="1"),
    _device_world("nccl", 2, "nccl:nccl", DDL_TEST_GPUS="2"),
    _device_world("staged", 2, "host:staged", DDL_TEST_GPUS="2", DDL_NCCL="off"),
    # two simulated nodes of two peer GPUs each, a rank per GPU (a GPU cluster's layout):
    # one flat NCCL communicator, and a second one for a process set of a rank per node;
    # with both ranks of a node on one GPU, IPC islands joined
    # by NCCL ("hierarchical": allreduce and broadcast; the rest staged through the host)
    _device_world("nccl_two_nodes", 4, "nccl:nccl", subset=(0, 2),
                  DDL_TEST_LOCAL_NODES="2,2", DDL_TEST_GPUS="2", DDL_TEST_PEER_ACCESS="1"),
    # streams that run nothing until something waits for them (DDL_TEST_LAZY_STREAMS):
    # work that ddl forgot to order reads stale memory
    _device_world("cuda_ipc_lazy", 3, "ipc:cuda_ipc", subset=(0, 2),
                  DDL_TEST_LAZY_STREAMS="1"),
    _device_world("nccl_lazy", 2, "nccl:nccl", DDL_TEST_GPUS="2", DDL_TEST_LAZY_STREAMS="1"),
    _device_world("hierarchical_two_nodes", 4, "hierarchical:staged,allreduce=cuda_ipc+nccl,"
                  "broadcast=cuda_ipc+nccl",
                  DDL_TEST_LOCAL_NODES="2,2"),
]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world", DEVICE_WORLDS, ids=[w.name for w in DEVICE_WORLDS])
def test_device_contract(world):
    """The whole contract on CuPy arrays through the device data plane (the plan's
    exchange, device execution, the device backends), in real processes; the stand-in
    makes it run here (tests/standin), tests/gpu runs it on a GPU."""
    run_contract(world)


@pytest.mark.parametrize("impl", arrayimpl.IMPLS, ids=[i.name for i in arrayimpl.IMPLS])
def test_array_library_is_there(impl):
    """Says which libraries the contract leaves out here, and why; in the dev environment
    (``make test``, CI) NumPy, torch and TensorFlow must all be there."""
    why = impl.installed()
    if why is None:
        return
    if impl.name == "cupy":   # without a GPU, the device worlds run it over the stand-in
        assert os.path.isfile(os.path.join(STANDIN, "cupy", "__init__.py")), STANDIN
        return
    dev = os.environ.get("CI") or os.path.exists(os.path.join(sys.prefix, ".installed-dev"))
    if dev and impl.name in REQUIRED_IN_DEV:
        pytest.fail(f"{why}: the contract must run over {impl.name} in the dev environment")
    own_env = {"mxnet": (".venv-mxnet", "make setup-mxnet", "tests/test_mxnet.py"),
               "jax": (".venv-jax", "make setup-jax", "tests/test_jax.py")}
    if dev and impl.name in own_env:
        # MXNet and JAX run the contract in their own environments: those must be there
        # in the dev environment
        venv, make, test = own_env[impl.name]
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        if os.path.exists(os.path.join(root, venv, ".unavailable")):
            pytest.skip(f"{why}; {venv} could not be made here: "
                        + open(os.path.join(root, venv, ".unavailable")).read().strip())
        assert os.path.exists(os.path.join(root, venv, ".installed")), (
            f"{why}, and {venv} ({make}) is missing: the contract must run over "
            f"{impl.name} in the dev environment ({test})")
        return
    pytest.skip(why)
