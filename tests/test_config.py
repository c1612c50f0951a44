"""The configuration table: strict parsing, one place for every DDL_* variable."""

import os

import pytest

from ddl.core import config as _config
from ddl.core.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_defaults_parse_from_an_empty_environment():
    cfg = _config.load({})
    assert cfg.fusion_threshold == 64 * 1024 * 1024
    assert cfg.stall_check_time == 60.0 and cfg.stall_shutdown_time == 600.0
    assert cfg.rank is None and cfg.allreduce_algorithm == "auto"


@pytest.mark.parametrize("name,value,needle", [
    ("DDL_FUSION_THRESHOLD", "abc", "DDL_FUSION_THRESHOLD='abc' is not valid"),
    ("DDL_FUSION_THRESHOLD", "-1", "must be >= 0"),
    ("DDL_FUSION_THRESHOLD", "1.5", "DDL_FUSION_THRESHOLD"),
    ("DDL_START_TIMEOUT", "nan", "not a finite number"),
    ("DDL_STALL_CHECK_TIME_SECONDS", "", "DDL_STALL_CHECK_TIME_SECONDS"),
    ("DDL_VERBOSE", "maybe", "expected one of 1/0"),
    ("DDL_ALLREDUCE_ALGORITHM", "tree", "expected one of auto, ring, recursive_doubling"),
    ("DDL_RANK", "-2", "must be >= 0"),
])
def test_bad_values_raise_config_error_naming_the_variable(name, value, needle):
    with pytest.raises(ConfigError) as info:
        _config.load({name: value})
    assert needle in str(info.value)
    assert info.value.variable == name and info.value.value == value


def test_unknown_ddl_variables_are_rejected():
    with pytest.raises(ConfigError, match="unknown configuration variable DDL_FUSION_TRESHOLD; "
                       "did you mean DDL_FUSION_THRESHOLD\\?"):
        _config.load({"DDL_FUSION_TRESHOLD": "1"})
    with pytest.raises(ConfigError) as info:  # nothing close: no guess
        _config.load({"DDL_BANANA": "1"})
    assert "did you mean" not in str(info.value) and "DDL_BANANA" in str(info.value)


def test_every_flag_is_unique_and_every_variable_documented():
    flags = [v.flag for v in _config.VARIABLES if v.flag]
    assert len(flags) == len(set(flags))
    for v in _config.VARIABLES:
        assert v.name.startswith("DDL_") and v.doc.endswith(".")


def test_readme_configuration_table_is_generated_from_the_config_module():
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert _config.markdown_table() in readme, (
        "README's configuration table is stale: paste ddl.core.config.markdown_table()")


def test_to_env_renders_values_for_child_processes():
    env = _config.to_env({"verbose": True, "fusion_threshold": 1024, "rank": None})
    assert env == {"DDL_VERBOSE": "1", "DDL_FUSION_THRESHOLD": "1024"}
    assert _config.load(env).fusion_threshold == 1024


def test_horovod_variables_are_read_as_their_ddl_twins_and_the_rest_reported():
    cfg = _config.load({"HOROVOD_FUSION_THRESHOLD": "1024", "HOROVOD_CYCLE_TIME": "5",
                        "HOROVOD_HIERARCHICAL_ALLREDUCE": "1", "HOROVOD_CACHE_CAPACITY": "7",
                        "DDL_CACHE_CAPACITY": "5", "HOROVOD_STALL_CHECK_DISABLE": "1",
                        "HOROVOD_GPU_OPERATIONS": "NCCL", "HOROVOD_LOG_LEVEL": "trace"})
    assert (cfg.fusion_threshold, cfg.hierarchical_allreduce, cfg.cache_capacity,
            cfg.stall_check_time, cfg.stall_shutdown_time) == (1024, "1", 5, 0.0, 0.0)
    assert "HOROVOD_CACHE_CAPACITY=7 is overridden by DDL_CACHE_CAPACITY=5" in cfg.notes
    assert any(n.startswith("read as ddl settings: HOROVOD_CYCLE_TIME as DDL_CYCLE_TIME_MS, "
                            "HOROVOD_FUSION_THRESHOLD as DDL_FUSION_THRESHOLD")
               for n in cfg.notes), cfg.notes
    assert cfg.cycle_time_ms == 5.0
    assert "ignored (no meaning in ddl): HOROVOD_GPU_OPERATIONS" in cfg.notes
    import logging
    assert cfg.log_level == "trace" and _config.log_level(cfg) == logging.DEBUG
    assert _config.log_level(_config.load({"DDL_VERBOSE": "1"})) == logging.INFO
    assert _config.log_level(_config.load({"DDL_LOG_LEVEL": "error"})) == logging.ERROR
    assert _config.load({}).notes == []
    with pytest.raises(ConfigError, match="HOROVOD_FUSION_THRESHOLD='big' \\(read as "
                       "DDL_FUSION_THRESHOLD\\) is not valid") as info:
        _config.load({"HOROVOD_FUSION_THRESHOLD": "big"})
    assert info.value.variable == "HOROVOD_FUSION_THRESHOLD"
    # Horovod's HOROVOD_TIMELINE=DYNAMIC: no file now (one can be started later), not a
    # timeline written to a file named DYNAMIC
    dynamic = _config.load({"HOROVOD_TIMELINE": "DYNAMIC"})
    assert dynamic.timeline == "" and any("HOROVOD_TIMELINE=DYNAMIC" in n
                                          for n in dynamic.notes), dynamic.notes
    assert _config.load({"HOROVOD_TIMELINE": "/tmp/t.json"}).timeline == "/tmp/t.json"
