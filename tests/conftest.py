"""Test configuration shared by every test module.

Worlds of real processes are started with ``ddl.run`` (the product's own launcher, with a
real coordinator). Child processes import helper modules from this folder, so it is put
on their PYTHONPATH.

Every test runs under a leak check (:func:`_leak_check`): nothing it started may outlive
it. See that fixture for what counts.
"""

import os
import shutil
import signal
import sys
import tempfile
import time
import uuid

import pytest

import ddl  # noqa: F401  (first, before a test module loads gRPC: see ddl/__init__.py)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

_paths = [HERE] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(_paths))
if HERE not in sys.path:
    sys.path.insert(0, HERE)


# -- leak check --------------------------------------------------------------------------

# The processes of this session make their temp files (launcher temp dirs with the
# coordinators' sockets, embedded coordinators) in a directory of its own, so that what a
# test leaves there is known to be its own, even while other sessions run. pytest's
# tmp_path stays where it was.
_TMP_ROOT = tempfile.gettempdir()
os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", _TMP_ROOT)
SESSION_TMP = tempfile.mkdtemp(prefix="ddlt-", dir=_TMP_ROOT)
os.environ["TMPDIR"] = SESSION_TMP
tempfile.tempdir = SESSION_TMP


# Names what this session puts in shared places (the CuPy stand-in's files in /dev/shm), so
# that a test removes only its own session's: two sessions may run at once (pytest-xdist's
# workers, below).
SESSION_VAR = "DDLTEST_SESSION"
os.environ[SESSION_VAR] = os.path.basename(SESSION_TMP)


def pytest_unconfigure(config):
    shutil.rmtree(SESSION_TMP, ignore_errors=True)


# -- parallel runs (pytest-xdist) -------------------------------------------------------

# `make test` runs the suite on two pytest-xdist workers (`-n logical --maxprocesses 2
# --dist loadgroup`): much of it waits (for deadlines, for the JVM, for Ray) with a CPU
# idle. A module's tests stay on one worker, so module-scoped worlds start once; modules
# that use the same host-wide resource share a group, so that they never run at once.
XDIST_GROUPS = {
    # network namespaces with fixed names and addresses (tests/_netns.py)
    "test_multihost": "netns", "test_elastic_hosts": "netns",
}


def pytest_configure(config):
    # pytest-xdist registers the mark itself; a run without it (-p no:xdist) reads it too
    config.addinivalue_line("markers", "xdist_group(name): run on the worker of this group")


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = getattr(item, "module", None)
        module = module.__name__.rsplit(".", 1)[-1] if module else item.nodeid
        item.add_marker(pytest.mark.xdist_group(XDIST_GROUPS.get(module, module)))


MARKER_VAR = "DDL_TEST_MARKER"
# A second tag with the same value: launcher tests build their environment without the
# DDL_* variables and with a marker of their own (test_launcher_support.job_env), and
# this name is not a DDL_* variable, so it survives that.
OWNER_VAR = "DDLTEST_OWNER"
LEAK_GRACE_S = 3.0  # processes get this long to exit after the test
SHM_DIR, SHM_PREFIX = "/dev/shm", "ddl-"
# Tests that knowingly leave temp files behind: node id (suffix) -> why.
TMP_LEAKS_ALLOWED: dict = {}  # test node id suffix -> why it may leave temp files
# what frameworks leave in TMPDIR (not ddl's to remove): torch's compile cache, and
# torchrun's per-run directories of its workers' error files
FRAMEWORK_TMP_PREFIXES = ("torchinductor_", "torchelastic_")


def _read(path, mode="r"):
    with open(path, mode) as f:
        return f.read()


def _processes():
    """pid -> (ppid, state, environ bytes) of every live process but this one (environ
    empty where it cannot be read: another user's, or one inside ``execve``)."""
    me = os.getpid()
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            stat = _read(f"/proc/{entry}/stat")
        except OSError:
            continue
        try:
            environ = _read(f"/proc/{entry}/environ", "rb")
        except OSError:
            environ = b""
        fields = stat.rsplit(")", 1)[1].split()
        out[int(entry)] = (int(fields[1]), fields[0], environ)
    return out


def _descendants(procs, root):
    children = {}
    for pid, (ppid, _, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _ours(marker, before, pids_before):
    """Live (non-zombie) processes that carry the test's tag, or that descend from this
    process and were not there before the test; and whether a process new since the test
    began showed no environment (one caught inside ``execve``, whose tag cannot be read
    then: look again)."""
    procs = _processes()
    tags = {f"{MARKER_VAR}={marker}".encode(), f"{OWNER_VAR}={marker}".encode()}
    tagged = {pid for pid, (_, _, env) in procs.items() if tags & set(env.split(b"\0"))}
    mine = tagged | (_descendants(procs, os.getpid()) - before)
    # kernel threads (children of kthreadd, pid 2) have no environment at all
    unsure = any(not env and ppid not in (0, 2) and state != "Z"
                 for pid, (ppid, state, env) in procs.items() if pid not in pids_before)
    return {pid for pid in mine if pid in procs and procs[pid][1] != "Z"}, unsure


def _listening_inodes():
    """Socket inode -> address of every listening TCP or unix socket on this host."""
    out = {}
    for name in ("tcp", "tcp6"):
        try:
            lines = _read(f"/proc/net/{name}").splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) > 9 and f[3] == "0A":  # TCP_LISTEN
                out[f[9]] = f"{name} {f[1]}"
    try:
        lines = _read("/proc/net/unix").splitlines()[1:]
    except OSError:
        lines = []
    for line in lines:
        f = line.split()
        # flags __SO_ACCEPTCON (listening), state SS_UNCONNECTED
        if len(f) >= 7 and int(f[3], 16) & 0x10000 and f[5] == "01":
            out[f[6]] = "unix " + (f[7] if len(f) > 7 else "(unnamed)")
    return out


def _describe(pid, listening):
    try:
        cmd = _read(f"/proc/{pid}/cmdline", "rb").replace(b"\0", b" ").decode(
            errors="replace").strip()
    except OSError:
        cmd = "?"
    socks = []
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:[") and link[8:-1] in listening:
                socks.append(listening[link[8:-1]])
    except OSError:
        pass
    listens = f", listening on {', '.join(sorted(socks))}" if socks else ""
    return f"pid {pid} ({cmd[:200]}){listens}"


def _held(paths):
    """The subset of ``paths`` that some live process has open or mapped."""
    paths = set(paths)
    held = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or held == paths:
            continue
        try:
            for fd in os.listdir(f"/proc/{entry}/fd"):
                try:
                    link = os.readlink(f"/proc/{entry}/fd/{fd}")
                except OSError:
                    continue
                if link in paths:
                    held.add(link)
            maps = _read(f"/proc/{entry}/maps")
        except OSError:
            continue
        held.update(p for p in paths if p in maps)
    return held


def _entries(directory, prefix=""):
    try:
        return {e for e in os.listdir(directory) if e.startswith(prefix)}
    except OSError:
        return set()


STANDIN_PREFIX = "ddl-standin-"


def _this_sessions(name: str) -> bool:
    """Whether a new ``/dev/shm`` entry may be this session's: the CuPy stand-in's files
    carry their session's name (tests/standin), ddl's own segments carry none."""
    return (not name.startswith(STANDIN_PREFIX)
            or name.split("-", 3)[-1].startswith(os.environ[SESSION_VAR] + "-"))


@pytest.fixture(autouse=True)
def _leak_check(request):
    """Fail a test that leaves something behind.

    Before the test: a fresh ``DDL_TEST_MARKER`` (and ``DDLTEST_OWNER``) in
    ``os.environ``, inherited by every process the test starts. After it, with up to
    ``LEAK_GRACE_S`` for processes to finish exiting, it is an error if:

    * a live process carries the tag (launcher tests with their own ``DDL_TEST_MARKER``
      still carry ``DDLTEST_OWNER``) or is a new descendant of this process; the message
      names each one with the sockets it listens on; they are killed so that one leak
      does not spill into the next test;
    * a new ddl segment (``ddl-*``) is left in ``/dev/shm`` that no live process holds
      (ones that are held belong to a job still running, in this session or another
      one; Python's own ``sem.mp-*`` files are not ddl's);
    * a new entry is left in the session's temp directory (e.g. a launcher temp dir,
      ``ddl-*``, with the coordinators' unix sockets).

    This process's own sockets (in-process servers, module-scoped test transports) are
    not counted, and neither are processes that existed before the test.
    """
    marker = uuid.uuid4().hex
    saved = {k: os.environ.get(k) for k in (MARKER_VAR, OWNER_VAR)}
    os.environ[MARKER_VAR] = marker
    os.environ[OWNER_VAR] = marker
    procs = _processes()
    before, pids_before = _descendants(procs, os.getpid()), set(procs)
    shm_before = _entries(SHM_DIR, SHM_PREFIX)
    tmp_before = _entries(SESSION_TMP)
    try:
        yield marker
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    problems = []
    deadline = time.monotonic() + LEAK_GRACE_S
    left, unsure = _ours(marker, before, pids_before)
    looks = 0   # a process caught inside execve gets a second look or two
    while (left or (unsure and looks < 2)) and time.monotonic() < deadline:
        time.sleep(0.05)
        looks += 1
        left, unsure = _ours(marker, before, pids_before)
    if left:
        listening = _listening_inodes()
        problems.append("processes outlived the test: " + "; ".join(
            _describe(pid, listening) for pid in sorted(left)))
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    shm = {n for n in _entries(SHM_DIR, SHM_PREFIX) - shm_before if _this_sessions(n)}
    deadline = time.monotonic() + 1.0
    while shm and time.monotonic() < deadline:  # a rendezvous unlinks its segment soon
        time.sleep(0.05)
        shm &= _entries(SHM_DIR, SHM_PREFIX)
    if shm:
        shm -= {os.path.basename(p) for p in _held(os.path.join(SHM_DIR, n) for n in shm)}
    if shm:
        problems.append(f"ddl segments left in {SHM_DIR}: {sorted(shm)}")
    new_tmp = sorted(e for e in _entries(SESSION_TMP) - tmp_before
                     if not e.startswith(FRAMEWORK_TMP_PREFIXES))
    if new_tmp:
        # A launcher removes its temp dir as it returns: give the last one a moment.
        deadline = time.monotonic() + 1.0
        while new_tmp and time.monotonic() < deadline:
            time.sleep(0.05)
            new_tmp = sorted(e for e in _entries(SESSION_TMP) - tmp_before
                             if not e.startswith(FRAMEWORK_TMP_PREFIXES))
    if new_tmp and not any(request.node.nodeid.endswith(k) for k in TMP_LEAKS_ALLOWED):
        problems.append(f"temp files left in {SESSION_TMP}: {new_tmp}")
    if problems:
        pytest.fail("leak check: " + "\n".join(problems), pytrace=False)
