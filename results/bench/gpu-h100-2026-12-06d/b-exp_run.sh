#!/usr/bin/env bash
# exploratory forward variants, one process each, on one machine in one call (not committed)
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
B="python3 benchmarks/attention.py --rounds 1 --rep-ms 100 --kernels 20"
$B --methods sdpa_cudnn,triton_fa2,triton_fa2_counters,triton_fa2_sfa_counters,triton_paper_bf16 \
  --shapes gpt2s_T1024,T4096,D128_T2048 --out $OUT/base.json > $OUT/base.log 2>&1; echo "base rc $?"
cp kernels/triton_kernels.py /tmp/orig.py
for v in fcount pvacc; do
  cp /tmp/orig.py kernels/triton_kernels.py
  python3 .lease/exp_fwd.py (b-exp_fwd.py.txt here) $v && $B --methods sdpa_cudnn,triton_fa2,triton_fa2_counters --shapes gpt2s_T1024,T4096 \
    --out $OUT/$v.json > $OUT/$v.log 2>&1; echo "$v rc $?"
done
cp /tmp/orig.py kernels/triton_kernels.py
python3 - <<'PY'
import json, os
for f in ("base", "fcount", "pvacc"):
    p = os.path.join(os.environ["OUT"], f + ".json")
    if not os.path.exists(p):
        print(f, "missing"); continue
    d = json.load(open(p))
    for r in d["rows"]:
        ks = {k["name"][:12]: round(k["us"], 1) for k in r.get("kernels", [])[:5]}
        print(f, r["shape"], r["method"], round(r.get("ms", 0), 3), round(r.get("total_us", 0), 1), ks)
PY
