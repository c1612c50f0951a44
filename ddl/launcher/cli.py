"""``ddlrun``: start a ddl job on this host (or through ``mpirun`` with ``--mpi``).

    ddlrun -np 4 [-H localhost:4] [--start-timeout S] [--output-filename DIR]
           [--verbose] [--mpi [--mpi-args="..."]] [other flags] python train.py ...

Every flag sets one ``DDL_*`` variable of :mod:`ddl.core.config` (the flags are generated
from that table); precedence is flag > environment > default. A bad value exits 2 with a
one-line ``ddlrun: error: ...`` naming the flag or variable.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Any, Dict, List, Optional, Tuple

from ddl.core import config as _config
from ddl.core.errors import ConfigError
from ddl.launcher import _mpirun
from ddl.launcher._hosts import assign, parse_hostfile, parse_hosts
from ddl.launcher._job import Job, LaunchError, RemoteSettings
from ddl.launcher._output import write_line
from ddl.launcher._ssh import SshOptions

PROG = "ddlrun"
_MB_FLAG = "--fusion-threshold-mb"  # in MiB; DDL_FUSION_THRESHOLD is in bytes
# horovodrun's spellings
_ALIASES = {"-np": ("--np", "--num-proc"), "-H": ("--hosts",), "--hostfile": ("-hostfile",),
            "--stall-check-time-seconds": ("--stall-check-warning-time-seconds",),
            "--stall-shutdown-time-seconds": ("--stall-check-shutdown-time-seconds",)}
# horovodrun's shorthand switches: the variables each one sets
_SHORTHANDS = {
    "--disable-cache": ("Turn the response cache off (--cache-capacity 0).",
                        {"cache_capacity": "0"}),
    "--no-stall-check": ("Turn the stall check off: no stall warning, no stall shutdown "
                         "(--stall-check-time-seconds 0 --stall-shutdown-time-seconds 0).",
                         {"stall_check_time": "0", "stall_shutdown_time": "0"}),
    "--tcp": ("Move every byte over TCP, as between hosts (--transport tcp).",
              {"transport": "tcp"}),
    "--gloo": ("Accepted for horovodrun's command lines: ddl's own launcher and data planes "
               "are what it runs without --mpi.", {}),
    "--no-hierarchical-allreduce": ("--hierarchical-allreduce off.",
                                    {"hierarchical_allreduce": "off"}),
    "--no-hierarchical-allgather": ("--hierarchical-allgather off.",
                                    {"hierarchical_allgather": "off"}),
}
# horovodrun's flags for parts ddl does not have (Gloo, NCCL streams, oneCCL, MPI threads,
# thread pinning, its log format, its Gaussian process): accepted, with a note that they
# change nothing, so a horovodrun command line runs as it is. flag -> takes a value
_IGNORED = {"--num-nccl-streams": True, "--gloo-timeout-seconds": True,
            "--mpi-threads-disable": False, "--thread-affinity": True,
            "--binding-args": True, "--ccl-bgt-affinity": True, "--mlsl-bgt-affinity": True,
            "--log-hide-timestamp": False, "--log-with-timestamp": False,
            "--log-without-timestamp": False, "--autotune-gaussian-process-noise": True}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2
        self.exit(2, f"{PROG}: error: {message}\n")


def _flag_vars() -> List[_config.Var]:
    return [v for v in _config.VARIABLES if v.flag]


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, allow_abbrev=False,
                usage=f"{PROG} -np N [-H host:slots,...] [options] command [args ...]",
                description="Start a ddl job: a coordinator and N worker processes.")
    for v in _flag_vars():
        dest = v.key
        default = "" if v.default in (None, "") else f" (default: {v.default})"
        if v.name == "DDL_FUSION_THRESHOLD":
            default = f" (default: {v.default // _config.MiB})"
        help_text = f"{v.doc} [{v.name}]{default}".replace("%", "%%")
        names = [f for f in (v.short, v.flag) if f] + list(_ALIASES.get(v.flag, ()))
        if v.kind == "bool":
            p.add_argument(*names, dest=dest, action="store_const", const="1", default=None,
                           help=help_text)
        elif v.name == "DDL_BLACKLIST_COOLDOWN_RANGE":  # horovodrun's: two numbers
            p.add_argument(*names, dest=dest, metavar=("MIN", "MAX"), nargs=2, default=None,
                           help=help_text)
        elif v.repeat:
            p.add_argument(*names, dest=dest, metavar=v.key.upper(), default=None,
                           action="append", help=help_text)
        else:
            p.add_argument(*names, dest=dest, metavar=v.key.upper(), default=None,
                           help=help_text)
    for flag, (doc, _) in _SHORTHANDS.items():
        p.add_argument(flag, action="store_true", help=doc)
    for flag, takes_value in _IGNORED.items():
        p.add_argument(flag, dest=_ignored_dest(flag), default=None,
                       action="store" if takes_value else "store_const",
                       **({"metavar": "VALUE"} if takes_value else {"const": ""}),
                       help="horovodrun's; changes nothing in ddl (ddlrun says so)")
    p.add_argument("--config-file", metavar="FILE", default=None,
                   help="a YAML file of settings, as horovodrun's: flag names as keys "
                        "(fusion_threshold_mb: 32), plus horovodrun's sections (timeline: "
                        "{filename, mark_cycles}, stall_check: {enabled, "
                        "warning_time_seconds, shutdown_time_seconds}); flags on the "
                        "command line win")
    p.add_argument("-cb", "--check-build", action=_CheckBuild, nargs=0,
                   help="print which frameworks, controllers and data paths this "
                        "installation has, and exit")
    p.add_argument("-v", "--version", action=_Version, nargs=0,
                   help="print ddl's version and exit")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the program to run and its "
                   "arguments")
    return p


def _ignored_dest(flag: str) -> str:
    return "ignored_" + flag[2:].replace("-", "_")


def _ignored_note(args: argparse.Namespace) -> Optional[str]:
    """The note naming the horovodrun flags given that change nothing here, or None."""
    given = [f"{flag} {value}".rstrip() for flag in _IGNORED
             if (value := getattr(args, _ignored_dest(flag))) is not None]
    if not given:
        return None
    return f"ignored horovodrun flags (no meaning in ddl): {', '.join(given)}"


class _Version(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        from ddl import __version__  # not at import: ddl imports the launcher
        print(f"{PROG} (ddl) {__version__}")
        parser.exit(0)


class _CheckBuild(argparse.Action):
    """horovodrun's ``--check-build``: what this installation can do, found without
    importing any framework."""

    def __call__(self, parser, namespace, values, option_string=None):
        import importlib.util

        from ddl import __version__, cuda_built, nccl_built  # (CuPy, where it is installed)

        def has(module: str) -> bool:
            try:
                return importlib.util.find_spec(module) is not None
            except (ImportError, ValueError):
                return False

        def row(label: str, ok: bool) -> str:
            return f"    [{'X' if ok else ' '}] {label}"

        lines = [f"ddl v{__version__}:", "", "Available Frameworks:",
                 row("TensorFlow", has("tensorflow")), row("PyTorch", has("torch")),
                 row("MXNet", has("mxnet")), row("JAX", has("jax") and has("optax")), "",
                 "Available Controllers:", row("ddl (gRPC coordinators)", True),
                 row("MPI (mpi4py)", has("mpi4py")), "",
                 "Available Tensor Operations:", row("shared memory (one host)", True),
                 row("TCP (between hosts)", True), row("NCCL", nccl_built()),
                 row("CUDA IPC", cuda_built()), row("Gloo", False), row("oneCCL", False)]
        print("\n".join(lines))
        parser.exit(0)


# horovodrun's config-file sections: (section, key) -> ddlrun flag
_CONFIG_SECTIONS = {
    ("timeline", "filename"): "--timeline-filename",
    ("timeline", "mark_cycles"): "--timeline-mark-cycles",
    ("stall_check", "warning_time_seconds"): "--stall-check-time-seconds",
    ("stall_check", "shutdown_time_seconds"): "--stall-shutdown-time-seconds",
}


def _config_file_args(path: str, parser: argparse.ArgumentParser) -> List[str]:
    """The flags a ``--config-file`` YAML file stands for (ConfigError naming a bad key)."""
    try:
        import yaml
    except ImportError:
        raise ConfigError("--config-file needs PyYAML: pip install pyyaml",
                          variable="--config-file", value=path) from None
    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"--config-file {path}: {exc}", variable="--config-file",
                          value=path) from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config-file {path}: expected a mapping of settings, not "
                          f"{type(data).__name__}", variable="--config-file", value=path)
    known = {o for a in parser._actions for o in a.option_strings if o.startswith("--")}
    known -= {"--config-file", "--check-build", "--version", "--help"}
    flat = []
    for key, value in data.items():
        if isinstance(value, dict):
            if key == "stall_check" and value.get("enabled") is False:
                flat.append(("--no-stall-check", True))
            for sub, v in value.items():
                flag = _CONFIG_SECTIONS.get((key, sub))
                if flag is None and not (key == "stall_check" and sub == "enabled"):
                    raise ConfigError(f"--config-file {path}: unknown setting {key}.{sub}",
                                      variable="--config-file", value=f"{key}.{sub}")
                if flag is not None:
                    flat.append((flag, v))
            continue
        flag = "--" + str(key).replace("_", "-")
        if key == "verbose":  # horovodrun's verbosity is a number
            value = bool(value)
        if flag not in known:
            import difflib
            close = difflib.get_close_matches(flag, sorted(known), n=1)
            raise ConfigError(f"--config-file {path}: unknown setting {key}"
                              + (f" (did you mean {close[0][2:].replace('-', '_')}?)"
                                 if close else ""),
                              variable="--config-file", value=str(key))
        flat.append((flag, value))
    argv: List[str] = []
    bools = {o for a in parser._actions for o in a.option_strings
             if isinstance(a, (argparse._StoreConstAction, argparse._StoreTrueAction))}
    for flag, value in flat:
        if flag in bools:
            argv += [flag] if value else []
        elif isinstance(value, list):
            for v in value:
                argv += [flag, str(v)]
        else:
            argv += [flag, ("on" if value else "off") if isinstance(value, bool) else str(value)]
    return argv


def _switches(argv: List[str]) -> List[str]:
    """``argv`` with an ``on`` after each on/off flag given bare, as horovodrun's switches
    are (``--hierarchical-allreduce python train.py``); the program's own arguments, from
    the first word that is not an option or an option's value, are left alone."""
    takes_value = {f for v in _flag_vars() if v.kind != "bool"
                   for f in (v.short, v.flag, *_ALIASES.get(v.flag, ())) if f}
    takes_value |= {f for f, value in _IGNORED.items() if value} | {"--config-file"}
    switches = {v.flag: v.choices for v in _flag_vars()
                if v.kind == "choice" and "on" in v.choices}
    out, i = [], 0
    while i < len(argv):
        word = argv[i]
        out.append(word)
        i += 1
        if word == "--" or not word.startswith("-"):
            return out + argv[i:]  # the command starts here
        if word in switches:
            if i >= len(argv) or argv[i].strip().lower() not in switches[word]:
                out.append("on")
                continue
        if word in takes_value and i < len(argv):
            out.append(argv[i])
            i += 1
    return out


def _parse_mb(v: _config.Var, text: str) -> int:
    try:
        mb = float(text.strip())
        if mb != mb or mb in (float("inf"), float("-inf")):
            raise ValueError
    except ValueError:
        raise ConfigError(f"{_MB_FLAG} {text!r} is not valid: expected a number of MiB "
                          f"(it sets {v.name} in bytes)", variable=v.name, value=text) from None
    return v.parse(str(int(mb * _config.MiB)))


def _apply_shorthands(args: argparse.Namespace) -> None:
    """Set the variables of the shorthand switches given (ConfigError if a flag of the
    same line sets one of them otherwise)."""
    for flag, (_, sets) in _SHORTHANDS.items():
        if not getattr(args, flag[2:].replace("-", "_")):
            continue
        for key, value in sets.items():
            given = getattr(args, key)
            if given is not None and given != value:
                raise ConfigError(f"{flag} sets {_config.var(key).flag} {value}, but the "
                                  f"command line also gives {_config.var(key).flag} {given}",
                                  variable=_config.var(key).name, value=given)
            setattr(args, key, value)


def resolve(args: argparse.Namespace, environ) -> Dict[str, Any]:
    """Flag > environment > default for every flag variable; raises ConfigError."""
    _apply_shorthands(args)
    environ = _config.horovod_aliases(environ)[0]
    values: Dict[str, Any] = {}
    for v in _flag_vars():
        given = getattr(args, v.key)
        if isinstance(given, list):
            given = ",".join(given)
        if given is not None:
            if v.flag == _MB_FLAG:
                values[v.key] = _parse_mb(v, given)
                continue
            try:
                values[v.key] = v.parse(given)
            except ConfigError as exc:
                detail = str(exc).split(" is not valid: ", 1)[-1]
                detail = detail.replace(f" (it is also set by ddlrun {v.flag})", "")
                raise ConfigError(f"{v.flag} {given!r} is not valid: {detail} (it sets "
                                  f"{v.name})", variable=v.name, value=given) from None
        elif v.name in environ:
            values[v.key] = v.parse(environ[v.name])
        else:
            values[v.key] = v.default
    return values


def _hosts(values: Dict[str, Any], np: int) -> List[Tuple[str, int]]:
    """``(host, ranks)`` from -H or --hostfile (default: this host only)."""
    if values["hosts"] and values["hostfile"]:
        raise ConfigError("give -H or --hostfile, not both", variable="DDL_HOSTFILE",
                          value=values["hostfile"])
    if values["hostfile"]:
        return assign(parse_hostfile(values["hostfile"]), np, f"--hostfile {values['hostfile']}")
    text = values["hosts"] or f"localhost:{np}"
    return assign(parse_hosts(text), np, f"-H {text!r}")


def _remote_settings(values: Dict[str, Any]) -> RemoteSettings:
    split = lambda text: tuple(x.strip() for x in text.split(",") if x.strip())  # noqa: E731
    forward = split(values["forward_env"])
    for name in forward:
        if not name.replace("_", "").isalnum():
            raise ConfigError(f"-x {name!r} is not a variable name", variable="DDL_FORWARD_ENV",
                              value=name)
    return RemoteSettings(
        ssh=SshOptions(command=values["ssh_command"], port=values["ssh_port"],
                       identity_file=values["ssh_identity_file"],
                       connect_timeout=min(values["start_timeout"], 30.0)),
        interfaces=split(values["network_interface"]), forward=forward)


def _elastic_values(values: Dict[str, Any]) -> bool:
    """Whether this is an elastic job; if so, fill in -np, --min-np and --max-np from
    each other (-np: the workers started first; default --max-np, or --min-np when the
    hosts are discovered) and check them."""
    if values["min_np"] is None and values["max_np"] is None \
            and not values["host_discovery_script"]:
        return False
    if values["mpi"]:
        raise ConfigError("an elastic job (--min-np/--max-np/--host-discovery-script) "
                          "cannot run under --mpi: MPI fixes the processes at start",
                          variable="DDL_MPI", value="1")
    np, low, high = values["num_proc"], values["min_np"], values["max_np"]
    low = low or np or 1
    static = (parse_hostfile(values["hostfile"]) if values["hostfile"] else
              parse_hosts(values["hosts"]) if values["hosts"] else [])
    slots = sum(n for _, n in static)
    if not high:  # as many as the hosts have slots (-H, --hostfile; -np without them)
        high = (1 << 20) if values["host_discovery_script"] else max(np or low, low, slots)
    if static and slots < max(np or 0, low):
        raise ConfigError(f"the hosts have {slots} slot(s), fewer than the "
                          f"{max(np or 0, low)} workers asked for (-np, --min-np)",
                          variable="DDL_HOSTS", value=values["hosts"] or values["hostfile"])
    np = np or (min(high, slots) if static else high)
    if not low <= np <= high:
        raise ConfigError(f"an elastic job needs --min-np <= -np <= --max-np; got {low}, "
                          f"{np}, {high}", variable="DDL_MIN_NP", value=str(low))
    if values["host_discovery_script"] and (values["hosts"] or values["hostfile"]):
        raise ConfigError("give --host-discovery-script or -H/--hostfile, not both",
                          variable="DDL_HOST_DISCOVERY_SCRIPT",
                          value=values["host_discovery_script"])
    values["num_proc"], values["min_np"], values["max_np"] = np, low, high
    return True


def _run_elastic(parser, values: Dict[str, Any], command: List[str],
                 extra_env: Dict[str, str]) -> int:
    """ddlrun for an elastic job (:mod:`ddl.launcher.elastic.driver`)."""
    from ddl.launcher.elastic.discovery import Blacklist, Discovery, parse_cooldown
    from ddl.launcher.elastic.driver import ElasticJob
    try:
        slots = values["slots_per_host"] or 1
        static = []
        if not values["host_discovery_script"]:
            static = (parse_hostfile(values["hostfile"]) if values["hostfile"] else
                      parse_hosts(values["hosts"]) if values["hosts"] else
                      [("localhost", values["max_np"])])
        cooldown = parse_cooldown(values["blacklist_cooldown_range"])
        remote = _remote_settings(values)
    except ConfigError as exc:
        parser.error(str(exc))
    job = ElasticJob(command, min_np=values["min_np"], max_np=values["max_np"],
                     np=values["num_proc"],
                     discovery=Discovery(values["host_discovery_script"], slots, static),
                     blacklist=Blacklist(cooldown), elastic_timeout=values["elastic_timeout"],
                     reset_limit=values["reset_limit"], start_timeout=values["start_timeout"],
                     extra_env=extra_env, remote=remote, verbose=values["verbose"],
                     timestamps=values["prefix_output_with_timestamp"], log_prefix=PROG)
    return _run_job(job)


def _run_job(job) -> int:
    """Start ``job`` (a :class:`Job` or an elastic one), watch it to its end with our
    signal handlers, say how it ended; its exit code."""
    previous = _install_signal_handlers(job)
    try:
        try:
            job.start()
        except LaunchError as exc:
            write_line(sys.stderr, f"{PROG}: {exc}")
            return 1 if job.stop_signal is None else 128 + job.stop_signal
        result = job.wait()
    finally:
        job.close()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    sys.stdout.flush()
    for warning in result.warnings:
        write_line(sys.stderr, f"{PROG}: warning: {warning}")
    if result.summary:
        write_line(sys.stderr, f"{PROG}: {result.summary}")
    return result.exit_code


def _install_signal_handlers(job):
    previous = {}
    for signum in (signal.SIGINT, signal.SIGTERM):
        previous[signum] = signal.signal(signum, lambda s, _f: job.stop(s))
    return previous


def _check_autotune() -> None:
    """--autotune needs optuna where the leader's coordinator runs (this host)."""
    import importlib.util
    if importlib.util.find_spec("optuna") is None:
        raise ConfigError("--autotune (DDL_AUTOTUNE=1) needs optuna, which is not installed: "
                          "pip install 'ddl-train[autotune]' (or pip install optuna)",
                          variable="DDL_AUTOTUNE", value="1")


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    argv = _switches(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if args.config_file:
        try:  # the file's settings first, so that the command line's win
            args = parser.parse_args(_config_file_args(args.config_file, parser) + argv)
        except ConfigError as exc:
            parser.error(str(exc))
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    environ = dict(os.environ)
    try:
        values = resolve(args, environ)
        elastic = _elastic_values(values)
        if values["num_proc"] is None:
            raise ConfigError("-np is required (or set DDL_NUM_PROC)", variable="DDL_NUM_PROC")
        if not command:
            raise ConfigError("no command given; usage: ddlrun -np N command [args ...]")
        np = values["num_proc"]
        hosts = [] if elastic else _hosts(values, np)  # an elastic job checks its own
        # The processes inherit the environment; flags override it for them.
        extra_env = _config.to_env({v.key: values[v.key] for v in _flag_vars()
                                    if getattr(args, v.key) is not None})
        cfg = _config.load(dict(environ, **extra_env))  # a typo'd or bad DDL_* fails here
        values["ssh_command"] = cfg.ssh_command
        if cfg.autotune:
            _check_autotune()
        ignored = _ignored_note(args)
        for note in cfg.notes + ([ignored] if ignored else []):
            # HOROVOD_* variables and horovodrun's flags: said here once, not by every rank
            write_line(sys.stderr, f"{PROG}: note: {note}")
    except ConfigError as exc:
        parser.error(str(exc))

    if elastic:
        return _run_elastic(parser, values, command, extra_env)
    if values["mpi"]:
        try:
            mpi_hosts = ",".join(f"{h}:{n}" for h, n in hosts) if (
                values["hosts"] or values["hostfile"]) else ""
            return _mpirun.run(np, mpi_hosts, values["mpi_args"], command, extra_env,
                               values["verbose"], PROG)
        except ConfigError as exc:
            parser.error(str(exc))
    try:
        remote = _remote_settings(values)
    except ConfigError as exc:
        parser.error(str(exc))
    job = Job([command] * np, start_timeout=values["start_timeout"], extra_env=extra_env,
              output_dir=values["output_filename"], verbose=values["verbose"],
              timestamps=values["prefix_output_with_timestamp"],
              rank0_stdin=True, log_prefix=PROG, hosts=hosts, remote=remote)
    return _run_job(job)


if __name__ == "__main__":
    sys.exit(main())
