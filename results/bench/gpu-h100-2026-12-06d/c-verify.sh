#!/usr/bin/env bash
# this session's last GPU call: GPU tests, kernel bits, attention with kernel profiles (not committed)
cd "$(dirname "$0")/.."
F=$OUT; export OUT=/tmp/o; mkdir -p $OUT
bash scripts/gpu.sh tests > $OUT/tests.log 2>&1; echo "tests rc $?"; tail -2 $OUT/tests.log
bash scripts/gpu.sh bits > $OUT/bits.log 2>&1; echo "bits rc $?"; grep -a "cases identical\|DIFFERENT" $OUT/bits.log | tail -3
ATTN_KERNELS=20 ATTN_METHODS=sdpa_cudnn,sdpa_flash,triton_fa2,triton_fa2_counters,triton_fa2_sfa_counters,triton_paper_bf16 \
  SPEED_PARTS=attention bash scripts/gpu.sh speed > $OUT/speed.log 2>&1; echo "speed rc $?"; grep -a "^|" $OUT/speed.log
tar -cJf $F/verify.tar.xz -C /tmp o
