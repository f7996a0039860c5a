#!/usr/bin/env bash
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
B="python3 benchmarks/attention.py --rounds 1 --rep-ms 50 --kernels 10 --methods sdpa_cudnn,triton_fa2 --shapes gpt2s_T1024,T4096"
cp kernels/triton_kernels.py /tmp/orig.py
for v in base fold_fwd fold_both; do
  cp /tmp/orig.py kernels/triton_kernels.py
  [ $v = base ] || python3 .lease/exp_fold.py (d-exp_fold.py.txt here) $v
  $B --out $OUT/$v.json > $OUT/$v.log 2>&1; echo "$v rc $?"
done
cp /tmp/orig.py kernels/triton_kernels.py
python3 - <<'PY'
import json, os
for f in ("base", "fold_fwd", "fold_both"):
    p = os.path.join(os.environ["OUT"], f + ".json")
    if not os.path.exists(p):
        print(f, "missing"); continue
    for r in json.load(open(p))["rows"]:
        print(f, r["shape"], r["method"], round(r.get("total_us", 0), 1),
              {k["name"][:12]: round(k["us"], 1) for k in r.get("kernels", [])[:5]})
PY
