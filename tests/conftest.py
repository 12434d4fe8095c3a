"""Shared fixtures: one tiny char-level Llama (and tokenizer) per test session, built offline."""

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_SILENT", "true")

import pytest  # noqa: E402

from verl_ds.process import DS_SHM_BUFFERS as SHM_BUFFERS  # noqa: E402,F401  (tests glob the same names)


@pytest.fixture(scope="session", autouse=True)
def _remove_leftover_shm_buffers():
    """Runs the resume tests kill with SIGKILL cannot remove DeepSpeed's ~66 MB /dev/shm all-reduce
    buffer per rank (it lives in RAM until removed): at the end, remove every buffer no live process
    holds (a job running beside this session, another test session's included, keeps its own)."""
    yield
    from verl_ds.process import remove_orphaned_deepspeed_shm

    remove_orphaned_deepspeed_shm()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from verl_ds.data.tiny import build_tiny_llama

    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", hidden=64, layers=2, heads=2, ffn=128))


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    from verl_ds.data.tiny import load_tokenizer

    return load_tokenizer(tiny_model_dir)
