#!/usr/bin/env bash
# Reruns the tests marked `numerics` (they assert numbers) with AVX2 kernels forced in ATen, MKL and
# oneDNN, so a host with AVX-512 also checks the summation orders an AVX2-only CPU uses. On an
# AVX2-only host the normal run already is that run, and this script says so and exits 0.
# First it checks that the switch took: ATen reports AVX2 and a bf16 matmul slows down (bf16 is
# emulated without avx512_bf16/AMX).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source launch/env.sh
if ! grep -qw avx512f /proc/cpuinfo; then
  echo "[numerics] AVX2-only CPU: the main test run already used AVX2 kernels; no rerun needed"
  exit 0
fi
FORCE=(ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2)
probe='import time, torch
torch.set_num_threads(2)
a = torch.randn(512, 512, dtype=torch.bfloat16)
a @ a
t = time.perf_counter(); [a @ a for _ in range(5)]; dt = (time.perf_counter() - t) / 5
print(torch.backends.cpu.get_cpu_capability(), f"{2 * 512**3 / dt / 1e9:.2f}")'
read -r cap_native rate_native < <(python -c "$probe")
read -r cap_forced rate_forced < <(env "${FORCE[@]}" python -c "$probe")
echo "[numerics] ATen kernels: native $cap_native, forced $cap_forced; bf16 512^3 matmul GFLOP/s: native $rate_native, forced $rate_forced"
if [ "$cap_forced" != "AVX2" ]; then
  echo "[numerics] ATEN_CPU_CAPABILITY=avx2 did not take (ATen reports $cap_forced)" >&2
  exit 1
fi
if ! python -c "import sys; sys.exit(0 if $rate_forced < 0.5 * $rate_native else 1)"; then
  echo "[numerics] warning: the forced bf16 matmul is not much slower; this CPU may lack avx512_bf16/AMX (oneDNN's switch cannot be seen then)" >&2
fi
start=$(date +%s)
env "${FORCE[@]}" python -m pytest tests -q -p no:cacheprovider -m numerics "$@"
echo "[numerics] forced-AVX2 rerun took $(( $(date +%s) - start )) s"
