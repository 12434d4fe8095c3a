"""What `rollout/engines/vllm_internals.py` reads still exists in the installed vLLM (no engine: cheap). The
engine-level paths (weight reload, engine-core shutdown and finalizer) run in vllm_cases.py."""

import importlib.util
import logging

import pytest

from verl_ds.rollout.engines import vllm_internals

vllm = pytest.importorskip("vllm")


def test_the_envs_cache_switch_exists():
    import vllm.envs

    assert callable(vllm.envs.disable_envs_cache), f"written for vLLM {vllm_internals.VLLM_VERSION}"
    vllm_internals.reset_envs_cache()


def test_the_reload_loggers_are_vllm_modules():
    for name in vllm_internals.RELOAD_LOGGERS:
        assert importlib.util.find_spec(name) is not None, f"{name}: moved in this vLLM"


def test_the_worker_reloads_weights_in_place():
    from vllm.v1.worker.gpu_worker import Worker

    assert callable(getattr(Worker, "reload_weights", None)), f"written for vLLM {vllm_internals.VLLM_VERSION}"


def test_quiet_partial_reload_filters_below_error_and_removes_its_filter():
    lg = logging.getLogger(vllm_internals.RELOAD_LOGGERS[0])
    with vllm_internals.quiet_partial_reload():
        assert not lg.filter(logging.LogRecord(lg.name, logging.WARNING, "", 0, "w", None, None))
        assert lg.filter(logging.LogRecord(lg.name, logging.ERROR, "", 0, "e", None, None))
    assert lg.filters == []
