"""process.remove_orphaned_deepspeed_shm: only the /dev/shm buffers that no live process holds go."""

import os
import subprocess
import sys
import textwrap
import uuid

import pytest

from verl_ds.process import remove_orphaned_deepspeed_shm

# a live rank keeps its buffer open from creation (shm_open + write) and mapped after (DeepSpeed's shm.cpp)
HOLD = textwrap.dedent(
    """
    import mmap, sys, time
    f = open(sys.argv[1], "r+b")
    if sys.argv[2] == "map":
        m = mmap.mmap(f.fileno(), 0)
        f.close()  # held by the mapping alone
    print("ready", flush=True)
    time.sleep(600)
    """
)


@pytest.fixture
def buffers():
    tag = uuid.uuid4().hex[:8]
    paths = {kind: f"/dev/shm/deepspeed_allreduce_buffer_0_127.0.0.1_{tag}{kind}_0" for kind in ("dead", "map", "fd")}
    for p in paths.values():
        with open(p, "wb") as f:
            f.write(b"\0" * 4096)
    yield paths
    for p in paths.values():
        if os.path.exists(p):
            os.remove(p)


def test_removes_only_the_buffers_no_live_process_has_mapped_or_open(buffers):
    holders = [
        subprocess.Popen([sys.executable, "-c", HOLD, buffers[kind], kind], stdout=subprocess.PIPE, text=True)
        for kind in ("map", "fd")
    ]
    try:
        for h in holders:
            assert h.stdout.readline().strip() == "ready"
        removed = remove_orphaned_deepspeed_shm()
        assert buffers["dead"] in removed and not os.path.exists(buffers["dead"])
        assert os.path.exists(buffers["map"]) and os.path.exists(buffers["fd"])  # their jobs still run
    finally:
        for h in holders:
            h.kill()
            h.wait()
    # the holders are gone (as after a kill -9): now nobody holds them
    removed = remove_orphaned_deepspeed_shm()
    assert {buffers["map"], buffers["fd"]} <= set(removed)
    assert not any(os.path.exists(p) for p in buffers.values())


def test_the_launch_scripts_find_tcmalloc_and_a_preloaded_process_runs_on_it():
    """launch/install.sh installs libtcmalloc-minimal4 (Debian's) where it can and env.sh finds it for
    train.sh to preload (the e2e quickstart checks a rank's log says so); `allocator` tells a process
    on it from one on glibc's malloc."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    find = "source launch/env.sh >/dev/null 2>&1; echo $VERL_DS_TCMALLOC"
    lib = subprocess.run(["bash", "-c", find], cwd=root, capture_output=True, text=True).stdout.strip()
    assert lib and os.path.exists(lib), "env.sh found no libtcmalloc_minimal.so.4"
    code = "from verl_ds.process import allocator; print(allocator())"
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    plain = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    preloaded = subprocess.run(
        [sys.executable, "-c", code], env={**env, "LD_PRELOAD": lib}, capture_output=True, text=True, check=True
    )
    assert (plain.stdout.strip(), preloaded.stdout.strip()) == ("glibc", "tcmalloc")
