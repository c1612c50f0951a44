"""Packaging: fresh generated stubs, and a built wheel that imports every module."""

import filecmp
import os
import shutil
import subprocess
import sys
import venv

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


PROTO_VENV = os.path.join(ROOT, ".venv-proto")


@pytest.mark.skipif(not os.path.exists(os.path.join(PROTO_VENV, ".installed")),
                    reason="the stub generator's environment is not there: make setup-proto")
def test_generated_stubs_match_the_proto(tmp_path):
    # the pinned generator (Makefile: PROTO_GENERATOR) in its own environment: it needs an
    # older protobuf than the one the suite runs on
    r = subprocess.run([os.path.join(PROTO_VENV, "bin", "python"), "-m", "grpc_tools.protoc",
                        f"-I{os.path.join(ROOT, 'proto')}", f"--python_out={tmp_path}",
                        f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}",
                        os.path.join(ROOT, "proto", "ddl", "v1", "coordinator.proto")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    for name in ("coordinator_pb2.py", "coordinator_pb2.pyi", "coordinator_pb2_grpc.py"):
        fresh = tmp_path / "ddl" / "v1" / name
        checked_in = os.path.join(ROOT, "ddl", "v1", name)
        assert filecmp.cmp(fresh, checked_in, shallow=False), (
            f"ddl/v1/{name} is stale; run `make proto`")


@pytest.mark.timeout(600)
def test_wheel_installs_into_a_fresh_venv_and_imports_every_module(tmp_path):
    dist = tmp_path / "dist"
    # built from a copy of the tree's files: a build/ folder left by an earlier build
    # would put packages into the wheel that the configuration no longer lists
    src = tmp_path / "src"
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, text=True)
    if listed.returncode == 0:
        for rel in listed.stdout.splitlines():
            if os.path.isfile(os.path.join(ROOT, rel)):
                os.makedirs(os.path.dirname(src / rel), exist_ok=True)
                shutil.copy2(os.path.join(ROOT, rel), src / rel)
    else:  # not a git checkout
        src = ROOT
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir",
                    str(dist), str(src)], check=True, capture_output=True, timeout=300)
    wheels = list(dist.glob("ddl_train-*.whl"))
    assert len(wheels) == 1
    # its own name (PyPI's "ddl" is another project), and what ddl.run needs for lambdas
    import zipfile
    with zipfile.ZipFile(wheels[0]) as whl:
        meta = whl.read(next(n for n in whl.namelist() if n.endswith("/METADATA"))).decode()
    assert "\nName: ddl-train\n" in meta and "\nRequires-Dist: cloudpickle" in meta, meta[:600]
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = str(env_dir / "bin" / "python")
    # the dependencies come from this interpreter's site-packages (a .pth line adds the
    # directory but runs none of its .pth files, so the editable ddl there stays out)
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    deps = [p for p in sys.path if p.endswith("site-packages")]
    with open(os.path.join(site, "_test_deps.pth"), "w") as f:
        f.write("\n".join(deps) + "\n")
    subprocess.run([py, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                    str(wheels[0])], check=True, timeout=300)
    # every package of the source tree (ddl/, server/, clients/*) is in the wheel
    packages = []
    for top, name in [("ddl", "ddl"), ("server", "ddl.server")] + [
            (os.path.join("clients", c), f"ddl.{c}")
            for c in sorted(os.listdir(os.path.join(ROOT, "clients")))]:
        for dirpath, dirnames, files in os.walk(os.path.join(ROOT, top)):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            if "__init__.py" in files:
                rel = os.path.relpath(dirpath, os.path.join(ROOT, top))
                packages.append(".".join([name] + ([] if rel == "." else rel.split(os.sep))))
    code = (
        f"import importlib.util\n"
        f"missing = [p for p in {packages!r} if importlib.util.find_spec(p) is None]\n"
        f"assert not missing, ('packages of the tree missing from the wheel', missing)\n"
        "import importlib, pkgutil, ddl, os\n"
        "assert 'site-packages' in ddl.__file__, ddl.__file__\n"
        "mods = [m.name for m in pkgutil.walk_packages(ddl.__path__, 'ddl.')]\n"
        "for m in mods:\n"
        "    try:\n"
        "        importlib.import_module(m)\n"
        "    except ImportError as e:  # a framework client without its framework\n"
        "        assert m.split('.')[1] in ('torch', 'tensorflow', 'keras', 'mxnet', 'jax'), (m, e)\n"
        "        assert 'pip install' in str(e), (m, e)\n"
        "for m in ('ddl.server', 'ddl.v1.coordinator_pb2_grpc', 'ddl.launcher.cli',\n"
        "          'ddl.dataplane.transports.tcp', 'ddl.dataplane.algorithms'):\n"
        "    assert m in mods or m == 'ddl.server', m\n"
        "import ddl.server\n"
        "print(len(mods))\n")
    out = subprocess.run([py, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip()) >= 15
    for script in ("ddlrun", "ddl-coordinator"):
        assert (env_dir / "bin" / script).exists(), script
    # a job started from the root of a checkout (whose ddl/ has no server/: only the
    # installed package maps it in) runs on the installed ddl, its coordinator included
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDL_")}
    out = subprocess.run([str(env_dir / "bin" / "ddlrun"), "-np", "2", py,
                          "examples/numpy_allreduce.py"], capture_output=True, text=True,
                         timeout=120, cwd=str(src), env=env, stdin=subprocess.DEVNULL)
    assert out.returncode == 0 and out.stdout.count("-> OK") == 2, out.stdout + out.stderr
