#!/usr/bin/env bash
# The multi-node path on one machine: bash launch/multinode_check.sh [COMMAND ...]
# Two "nodes", 127.0.0.1 and 127.0.0.2, reached through a real sshd and the `deepspeed` runner's pdsh
# (HOSTFILE=... launch/train.sh), exactly as on a cluster. Everything it makes lives in one temporary
# directory (sshd's config and host key, a client key, known_hosts, an ssh config) and goes on exit,
# sshd included; ~/.ssh and /etc are not touched (sshd's privilege-separation directory /run/sshd is
# created if missing and removed again). Then runs COMMAND with HOSTFILE, MASTER_ADDR and an `ssh` on
# PATH that uses the check's key; default: the check itself (tests/e2e/multinode.py: 2 nodes x 1 rank
# equal a 1-node 2-rank run, resume across nodes, a killed node ends the job).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SSHD=/usr/sbin/sshd

missing=()
[ -x "$SSHD" ] || missing+=(openssh-server)
command -v ssh >/dev/null || missing+=(openssh-client)
command -v pdsh >/dev/null || missing+=(pdsh)
if [ "${#missing[@]}" -gt 0 ]; then
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "error: multinode_check: needs ${missing[*]} (Debian: apt-get install ${missing[*]}; as root this script installs them)" >&2
    exit 2
  fi
  echo "[multinode] installing ${missing[*]}" >&2
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"; } >/dev/null
fi
if [ "$(id -u)" != 0 ]; then  # sshd drops privileges per login: only root can run one that logs in as itself
  echo "error: multinode_check: sshd must run as root (this is uid $(id -u))" >&2
  exit 2
fi

source "$ROOT/launch/env.sh"
dir="$(mktemp -d -t verl-ds-multinode.XXXXXX)"
sshd_pid=""
made_run_sshd=""
cleanup() {
  if [ -n "$sshd_pid" ]; then kill "$sshd_pid" 2>/dev/null || true; wait "$sshd_pid" 2>/dev/null || true; fi
  rm -rf "$dir"
  if [ -n "$made_run_sshd" ]; then rmdir /run/sshd 2>/dev/null || true; fi
}
trap cleanup EXIT

# a port free on both addresses (sshd listens on 127.0.0.1 and 127.0.0.2 only)
port="$(python - <<'EOF'
import socket
while True:
    a = socket.socket(); a.bind(("127.0.0.1", 0)); port = a.getsockname()[1]
    b = socket.socket()
    try:
        b.bind(("127.0.0.2", port)); break
    except OSError:
        continue
print(port)
EOF
)"
ssh-keygen -q -t ed25519 -N "" -C verl-ds-multinode-host -f "$dir/host_key"
ssh-keygen -q -t ed25519 -N "" -C verl-ds-multinode -f "$dir/id"
cp "$dir/id.pub" "$dir/authorized_keys"
echo "[127.0.0.1]:$port,[127.0.0.2]:$port $(cat "$dir/host_key.pub")" > "$dir/known_hosts"
cat > "$dir/sshd_config" <<EOF
ListenAddress 127.0.0.1:$port
ListenAddress 127.0.0.2:$port
HostKey $dir/host_key
PidFile $dir/sshd.pid
AuthorizedKeysFile $dir/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
# the key and its directory live under a temporary directory, not a home directory
StrictModes no
PrintMotd no
LogLevel ERROR
EOF
cat > "$dir/ssh_config" <<EOF
Host 127.0.0.1 127.0.0.2
  Port $port
  IdentityFile $dir/id
  IdentitiesOnly yes
  UserKnownHostsFile $dir/known_hosts
  GlobalKnownHostsFile /dev/null
  StrictHostKeyChecking yes
  BatchMode yes
  LogLevel ERROR
EOF
# The deepspeed runner calls a plain `ssh HOST` (its reachability check) and pdsh's ssh module calls
# `ssh` from PATH: this one reads only the check's config (-F: not ~/.ssh/config, no default keys).
mkdir "$dir/bin"
printf '#!/bin/sh\nexec /usr/bin/ssh -F %s "$@"\n' "$dir/ssh_config" > "$dir/bin/ssh"
chmod +x "$dir/bin/ssh"
export PATH="$dir/bin:$PATH"

if [ ! -d /run/sshd ]; then mkdir -m 0755 /run/sshd; made_run_sshd=1; fi
"$SSHD" -D -e -f "$dir/sshd_config" &
sshd_pid=$!
for host in 127.0.0.1 127.0.0.2; do
  for _ in $(seq 50); do ssh "$host" true 2>/dev/null && break; sleep 0.1; done
  ssh "$host" true || { echo "error: multinode_check: sshd on $host:$port does not answer" >&2; exit 1; }
done

printf '127.0.0.1 slots=1\n127.0.0.2 slots=1\n' > "$dir/hostfile"
export HOSTFILE="$dir/hostfile" MASTER_ADDR=127.0.0.1
echo "[multinode] sshd on 127.0.0.1:$port and 127.0.0.2:$port, hostfile $HOSTFILE" >&2
cd "$ROOT"
if [ "$#" -gt 0 ]; then
  "$@"
else
  python -m tests.e2e.multinode
fi
