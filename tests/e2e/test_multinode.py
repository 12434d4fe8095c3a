"""launch/multinode_check.sh end to end: a real sshd on 127.0.0.1 and 127.0.0.2, the `deepspeed`
runner with a hostfile (pdsh, ssh), 2 nodes x 1 rank equal to 1 node x 2 ranks, a killed node ending
the job, resume across nodes (tests/e2e/multinode.py) and nothing of the check left behind."""

import glob
import os
import re
import shutil
import subprocess

import psutil
import pytest

from tests.conftest import SHM_BUFFERS
from tests.e2e.helpers import ROOT
from tests.subprocess_env import child_env

pytestmark = pytest.mark.e2e


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "sshd must run as root to log in as this user (the check runs as root in CI)"
    have = {"openssh-server": os.path.exists("/usr/sbin/sshd"), "pdsh": shutil.which("pdsh") is not None}
    missing = [name for name, ok in have.items() if not ok]
    if missing and not shutil.which("apt-get"):
        return f"{' and '.join(missing)} missing and no apt-get to install them"
    return None


def _check_processes() -> list[str]:
    out = []
    for p in psutil.process_iter():
        try:
            if any("verl-ds-multinode" in a for a in p.cmdline()):
                out.append(f"{p.pid} {' '.join(p.cmdline())}")
        except psutil.Error:
            continue
    return out


WHY_NOT = _why_not()  # a platform limit: sshd needs root, and its packages or apt to install them


@pytest.mark.skipif(WHY_NOT is not None, reason=str(WHY_NOT))
def test_multinode_check_two_loopback_nodes_leaves_nothing_behind():
    home_ssh = os.path.expanduser("~/.ssh")
    before = {
        "~/.ssh": sorted(os.listdir(home_ssh)) if os.path.isdir(home_ssh) else None,
        "/run/sshd": os.path.isdir("/run/sshd"),
        "shm": set(glob.glob(SHM_BUFFERS)),
    }
    out = subprocess.run(
        ["bash", str(ROOT / "launch" / "multinode_check.sh")],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=ROOT,
    )
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-6000:]
    results = [line for line in log.splitlines() if line.startswith("[multinode]")]
    print("\n".join(results))
    assert any("bitwise equal" in line and "2 nodes x 1 rank" in line for line in results), results
    assert any("error: rank 1 is gone" in line for line in results), results
    assert any(line.startswith("[multinode] passed in") for line in results), results

    tmp = re.search(r"hostfile (\S+)/hostfile", log).group(1)
    assert not os.path.exists(tmp), f"the check's directory (keys, sshd config) is left: {tmp}"
    assert not _check_processes(), _check_processes()  # sshd and the runs' processes are gone
    assert (sorted(os.listdir(home_ssh)) if os.path.isdir(home_ssh) else None) == before["~/.ssh"]
    assert os.path.isdir("/run/sshd") == before["/run/sshd"]
    assert set(glob.glob(SHM_BUFFERS)) <= before["shm"] | _live_buffers()


def _live_buffers() -> set[str]:
    """Buffers of jobs running beside this test (another session's): not the check's to remove."""
    from verl_ds.process import DS_SHM_BUFFERS, held_by_live_processes

    return held_by_live_processes(set(glob.glob(DS_SHM_BUFFERS)))
