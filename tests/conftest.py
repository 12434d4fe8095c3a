"""Shared fixtures: one tiny char-level Llama (and tokenizer) per test session, built offline."""

import glob
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_SILENT", "true")

import pytest  # noqa: E402

SHM_BUFFERS = "/dev/shm/deepspeed_allreduce_buffer_*"


@pytest.fixture(scope="session", autouse=True)
def _remove_leftover_shm_buffers():
    """Runs the resume tests kill with SIGKILL cannot remove DeepSpeed's ~66 MB /dev/shm all-reduce
    buffer per rank (it lives in RAM until removed): remove the ones this session created. A run
    still going keeps its mapping; only the name goes."""
    before = set(glob.glob(SHM_BUFFERS))
    yield
    for f in set(glob.glob(SHM_BUFFERS)) - before:
        try:
            os.remove(f)
        except OSError:
            pass


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from verl_ds.data.tiny import build_tiny_llama

    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", hidden=64, layers=2, heads=2, ffn=128))


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    from verl_ds.data.tiny import load_tokenizer

    return load_tokenizer(tiny_model_dir)
