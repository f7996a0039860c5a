#!/usr/bin/env bash
# Everything GPU-side, from a clean clone, one named task per call:
#   bash scripts/gpu.sh TASK [ARGS ...]
# Tasks:
#   check        the machine, the versions, every import the runs need, the offline corpus and tokenizer
#   tests [PATHS ...]
#                the GPU tests: pytest -m gpu tests (or PATHS, e.g. tests/unit/test_ops.py; WORKERS xdist workers,
#                default 6)
#   bits         the kernels' outputs on fixed cases (scripts/kernel_bits.py) against this GPU model's committed
#                record, results/bench/kernel-bits-<gpu>.json (REF=FILE another): exit 1 when a bit moved;
#                BITS_EXP=ex2_approx_ftz: then the cases again with exp on that instruction, compared with this
#                run's record (kernel_bits_exp.log; said, not the exit status)
#   patch-tests PATCH [TESTS ...]
#                the GPU tests of a change not on this tree yet (a branch: `git diff main...BRANCH > PATCH`): this
#                tree's TESTS first, then the same TESTS in a copy with PATCH applied (default TESTS: the kernel
#                tests, PATCH_TESTS); logs pytest_here.log and pytest_patched.log; then the kernels' bits on fixed
#                cases in both trees (scripts/kernel_bits.py; kernel_bits.log, bits_*.json; BITS=0 skips them,
#                BITS_DEVICE=cpu runs them on Triton's interpreter); exit 0 only when both pass and every case is
#                bit-identical; SKIP_HERE=1: the patched copy's tests only
#   speed        attention fwd+bwd side by side (benchmarks/attention.py; TUNE=1 times launch configs first, at
#                TUNE_SHAPES; ATTN_METHODS its methods, ATTN_SHAPES its shapes;
#                ATTN_LAYOUT=bthd: q, k, v as views of one fused projection, as the model makes them;
#                ATTN_KERNELS=N (default 20, 0 none): each row's kernels profiled over N calls, their GPU time
#                without the host's), the
#                host's time per call against the GPU's (benchmarks/host_overhead.py) and the GPT-2S training step
#                (benchmarks/train_step.py; TRAIN_VARIANTS: its variants at T1024, TRAIN_ROUNDS its rounds (4),
#                TRAIN_STREAM its --stream-steps; "+jitlaunch" ones time Triton's own
#                launch beside the launch cache); SPEED_PARTS="host train1024" runs only those; SPEED_PARTS=cudagraphs:
#                the training step under torch.compile(mode="reduce-overhead") beside the default compile
#   tune         launch configs timed on CUDA graphs (benchmarks/tune.py; TUNE_SHAPES, TUNE_FAMILIES, default the
#                paper_1gpu preset's tiles at T1024; TUNE_REGS, e.g. fwd=128,dkdv=168: register caps for every launch
#                timed); its JSON also lands in TUNE_TABLE (/tmp/ff-tune.json) for later
#                items: FF_LAUNCH_TABLE=<it> bits / first-steps (bit for bit with it?), TUNED_TABLE=<it> speed
#                (train1024's ATTN+tuned variants)
#   bench        the other benchmarks: emulator vs SDPA, monitor overhead, probe cost, stabilizer throughput
#                (benchmarks/stabilizers.py in a budget: STAB_BENCH_SECONDS, default 100), a GPT-2S checkpoint's
#                stall of the step loop, written in the loop vs on a thread (benchmarks/checkpoint_write.py)
#   stabilizer-cost
#                the stabilizers' throughput cost at the paper's shape (GPT-2S B16 T1024; benchmarks/stabilizers.py
#                --shapes gpt2s): the Triton-route variants first, the emulator ones last, within STAB_SECONDS
#                (default 200; SKIP_EMULATOR=1 leaves those out; STAB_VARIANTS the order within a kind, the never
#                measured Triton pbar_clamp, sfa_guarded, stoch_round first; ARGS go to the script); a cut-short run
#                keeps what it measured (partial: true in stabilizers-gpt2s.json)
#   e2e          a smoke sweep through run.py on CUDA (baseline, fp32, sfa, pv_fp32)
#   embedding-grad
#                the token embedding's backward timed three ways at GPT-2S's shape (benchmarks/embedding_grad.py:
#                inductor's atomic one, aten's sorted one, kernels/triton_embedding.py), then its GPU test
#   compile-repro
#                compiled training's bits run to run (scripts/compile_repro.py): default compile twice and CUDA graphs
#                once on repeated-token text: the embedding's backward inductor's, then the sorted one (the model's),
#                then that inside torch's deterministic algorithms (train.deterministic)
#   own-model    the transformers backend on CUDA: its GPU tests and a Llama's training step, emulator vs Triton vs
#                transformers' SDPA (benchmarks/hf_llama.py); the image's transformers (5.17.0 in 2026-11: in the declared
#                range since 5.13), else from .whl_hf/ (wheels), so the lease need not carry them
#   baseline-time
#                the paper_1gpu baseline alone to step STEP (9697) and no further, SEED (1337), as the one-lease plan
#                runs it (checkpoints from CKPT_START, default this GPU model's as paper-table's): its result.json's
#                wall_s is the time to that step
#   ddp          2 GPUs (DDP) vs 1 GPU with gradient accumulation (benchmarks/ddp.py; needs 2 GPUs)
#   mini-repro   the miniature over 3 seeds, baseline vs FP32 reference (sweeps/mini_repro_seeds)
#   capture-mini the miniature's baseline (seed 1337) with a capture at step CAPTURE_STEP (850) of layer 2, heads 0
#                and 1, first 8 sequences: a file small enough to come back, for `flash-forensics analyze` on a CPU
#   isolation    the isolation table on the miniature (scripts/paper_isolation.sh ARGS: Hydra overrides)
#   rounding     the miniature's rounding-point forks (flash-forensics isolate --sweeps rounding_refs rounding_points)
#   paper-1gpu   the paper's regime on one GPU (scripts/paper_1gpu.sh ARGS)
#   first-steps [OVERRIDES...]
#                the paper regime's first STEPS (3) training steps of each of SEEDS (1), their losses bit for bit
#                against those recorded per GPU and commit (scripts/first_steps.py, results/bench/
#                first-steps-paper_1gpu.json): which GPU's run this one repeats, or the first step it leaves them.
#                Hydra OVERRIDES go to every run: `first-steps train.compile=true` says whether compiling keeps the
#                preset's bits for those steps (a step that differs settles it; equal steps are necessary only)
#   paper-table start|wait|collect|run
#                the paper's regime in one lease: the FP32-reference benchmark, the baseline, every fork at once, the
#                report; `wait` prints progress, `collect` packs reports, logs and compact MLflow exports into $OUT
#   scratch-table start|wait|collect|run
#                the paper's regime from step 0 (scripts/paper_scratch.sh: baseline, fp32, qk_norm, gated_attn and a
#                baseline at another lr, all at once), then its reports; same modes as paper-table. With
#                TESTS_PATCH=PATCH, `start` also runs `patch-tests PATCH` beside the runs (its logs come back in
#                scratch-logs.tar.xz)
#   round start|status|collect
#                one lease's work on one GPU, in the background: quiet benchmarks, then the miniature's rounding-point
#                and stabilizer forks beside the paper_1gpu seeds, then the GPU tests; `status` prints progress,
#                `collect` packs reports, logs and MLflow stores into $OUT
#   queue start 'TASK [ARGS]' ['VAR=VALUE TASK [ARGS]' ...] | wait [SECONDS] | collect
#                (each item shell words: "SPEED_PARTS='attention train1024' speed")
#                gpu.sh tasks one after another in the background (from a copy of the tree taken at start), so that
#                a lease's calls only wait and bring back: `start` queues them and returns; `wait SECONDS` (default
#                540) prints progress until the queue ends or SECONDS pass, then collects; `collect` packs every
#                task's output so far ($Q/out: logs, JSONs, reports; files of 12 MB or more and checkpoints stay, each
#                named) into $OUT/queue-out.tar.xz (cut into 15 MB parts when bigger). A task that fails is said in
#                the queue's status and the next one starts; a runner that died is said (exit 1). A task that leaves
#                runs in the background (scratch-table run SECONDS past its SECONDS) ends its item, not its runs.
#                Q (default /tmp/queue, outside the tree) holds it all; a new start moves the last one to $Q.prev
#   stop         ends what a lease left in the background: the queue, and the round, paper-table and scratch-table
#                plans with their training runs (each started as its own process group; folders: Q, ROUND_R,
#                PAPER_R, SCRATCH_R, default /tmp/queue, /tmp/round, /tmp/paper, /tmp/scratch), then lists what still
#                holds the GPU. Not `pkill -f PATTERN` in a call: a pattern in the call's own command line kills it
#   wheels       on a machine WITH a network and a python3.12: .whl/site-py312.tar.xz, the packages the GPU image
#                lacks (../shared/gpu/wheels.sh's list), installed and packed for setup below
#   stage [data=NAME ...]
#                on a machine WITH a network: pack the corpus cache (and prepared corpora, e.g. data=debian_docs)
#                into .stage/ for a GPU machine without one
# What it sets up itself, before every task:
#   - packages the GPU image lacks (hydra, omegaconf, submitit, the submitit launcher, mlflow): installed from the
#     wheels in .whl/ into $FF_SITE (default /tmp/site), else with `pip install -e .` when a network is there.
#     .whl/ holds wheels for the GPU machine's Python (3.12, x86-64), e.g. from `pip download --only-binary=:all:
#     --python-version 3.12 --platform manylinux2014_x86_64 -d .whl hydra-core omegaconf submitit
#     hydra-submitit-launcher mlflow` (antlr4-python3-runtime 4.9.3 needs `pip wheel` first: sdist only);
#   - PYTHONPATH=$FF_SITE:<repo>, so `python -m flash_forensics.cli` and run.py import this checkout;
#   - the corpus cache: .stage/*.tar.xz (from `stage`) unpacked once, then FLASH_FORENSICS_CACHE=<repo>/.ffcache and
#     TIKTOKEN_CACHE_DIR=<repo>/.ffcache/tiktoken when .ffcache/ exists.
#   .whl/, .stage/ and .ffcache/ are git-ignored: copy them along with the tree. With them the tracked tree no
#   longer fits what a lent machine's call carries (64 MiB): `bash scripts/lease_aside.sh out` first (committed
#   results but results/bench/ wait in /tmp/ff-aside), `back` after the lease.
# Logs and benchmark JSONs go to $OUT/<task> (default results/bench/gpu/<task>). Env: PY (python3), WORKERS.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PY:-python3}
task=${1:-}
shift || true
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

die() { echo "gpu.sh: $*" >&2; exit 1; }

setup() {  # in the current directory (the repo root, or round's copy of it)
  local site=${FF_SITE:-/tmp/site}
  export PYTHONPATH=$site:$PWD${PYTHONPATH:+:$PYTHONPATH}
  if ! $PY -c "import hydra, omegaconf, submitit, mlflow, hydra_plugins.hydra_submitit_launcher" 2>/dev/null; then
    if [ -f .whl/site-py312.tar.xz ]; then  # `gpu.sh wheels`: the packages installed once here, packed (half the size)
      mkdir -p "$site" && tar -xJf .whl/site-py312.tar.xz -C "$site" || die "unpacking .whl/site-py312.tar.xz failed"
    elif compgen -G ".whl/*.whl" >/dev/null; then
      $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
        || die "installing .whl/*.whl into $site failed"
    else
      $PY -m pip install -q -e . || die "packages missing and no .whl/: see the header of scripts/gpu.sh"
    fi
  fi
  if [ ! -d .ffcache ] && [ -f .stage/ffcache.tar.xz ]; then tar -xJf .stage/ffcache.tar.xz || die "bad .stage/ffcache.tar.xz"; fi
  for t in .stage/data-*.tar.xz; do
    [ -f "$t" ] || continue
    mkdir -p data && tar -xJf "$t" -C data --skip-old-files || die "bad $t"
  done
  if [ -d .ffcache ]; then
    export FLASH_FORENSICS_CACHE=$PWD/.ffcache TIKTOKEN_CACHE_DIR=$PWD/.ffcache/tiktoken
  fi
}

env_txt() {
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
}

logdir() { LOG=${OUT:-$ROOT/results/bench/gpu}/$1; mkdir -p "$LOG"; env_txt > "$LOG/env.txt" 2>&1; cat "$LOG/env.txt"; }
# bounded SECONDS LOGFILE CMD...: CMD under `timeout`, its output to LOGFILE; a kill by the limit is said in the log
# (the benchmark itself cannot: it is killed mid-line, e.g. probes at 2 of 5 rounds on 2026-12-06). Returns CMD's rc.
bounded() {
  local secs=$1 log=$2 rc=0; shift 2
  timeout "$secs" "$@" > "$log" 2>&1 || rc=$?
  [ "$rc" = 124 ] && printf '\n[gpu.sh] stopped by its %s s limit (timeout %s): no result written\n' "$secs" "$secs" >> "$log"
  return "$rc"
}

# the kernel tests a patch to kernels/ must pass on the GPU (patch-tests' default)
PATCH_TESTS="tests/unit/test_launch_cache.py tests/unit/test_triton_stabilizers.py tests/unit/test_ops.py tests/unit/test_triton.py
  tests/unit/test_rounding_points.py tests/unit/test_sdpa_dropin.py tests/integration/test_hf_fast_path.py
  tests/integration/test_compile_faithful.py"

ckpt_start() {  # $1: the seeds. CKPT_START as given (an integer >= 0), else this GPU model's from the records
  if [ -n "${CKPT_START:-}" ]; then
    [[ $CKPT_START =~ ^[0-9]+$ ]] || { echo "CKPT_START=$CKPT_START is not allowed: expected an integer >= 0"; return 1; }
    echo "$CKPT_START"
  else  # 1,000 steps before the earliest divergence recorded here (scripts/first_steps.py ckpt-start), else 0
    $PY scripts/first_steps.py ckpt-start --seeds "$1"
  fi
}
gpu_tests() {  # $1: log file, then the test paths (default: tests)
  local log=$1; shift
  [ $# -gt 0 ] || set -- tests
  # the launch cache in check mode: each cached launch also asks Triton which kernel it would run (launch_cache.py)
  FF_TRITON_LAUNCH=${FF_TRITON_LAUNCH:-check} timeout "${TEST_TIMEOUT:-420}" $PY -m pytest -q -m gpu "$@" \
    -n "${WORKERS:-6}" -p no:cacheprovider -o addopts="-ra" \
    > "$log" 2>&1
  local rc=$?; tail -15 "$log"; return $rc
}

case "$task" in
  check)
    setup; logdir check
    $PY - <<'EOF'
import importlib
for m in ("torch", "triton", "hydra", "omegaconf", "submitit", "mlflow", "tiktoken", "flash_forensics.cli",
          "flash_forensics.kernels.triton_flash", "flash_forensics.orchestrator.analysis.isolate"):
    importlib.import_module(m)
import torch
assert torch.cuda.is_available(), "no CUDA device"
from flash_forensics.orchestrator.data import tokenizer
print("imports ok; CUDA devices:", torch.cuda.device_count(), "; GPT-2 BPE ranks:", tokenizer.ranks_path(),
      "present" if tokenizer.ranks_path().is_file() else "MISSING (the runs need .ffcache: see `stage`)")
EOF
    ;;
  tests)
    setup; logdir tests
    gpu_tests "$LOG/pytest_gpu.log" "$@"
    ;;
  bits)
    # this tree's kernel bits (scripts/kernel_bits.py), compared with a committed record of the same GPU model when
    # there is one (results/bench/kernel-bits-<gpu>.json; REF=FILE another); BITS_DEVICE=cpu: Triton's interpreter
    setup; logdir bits
    $PY scripts/kernel_bits.py record "$LOG/kernel-bits.json" --device "${BITS_DEVICE:-cuda}" \
      --tensors /tmp/kernel-bits.pt || exit 1
    gpu=$($PY -c "import json, re, sys; g = json.load(open(sys.argv[1]))['env']['gpu'].split(' (')[0].lower()
print(re.sub('[^a-z0-9]+', '-', g).strip('-'))" "$LOG/kernel-bits.json") || die "unreadable $LOG/kernel-bits.json"
    mv "$LOG/kernel-bits.json" "$LOG/kernel-bits-$gpu.json"
    ref=${REF:-results/bench/kernel-bits-$gpu.json}
    if [ -f "$ref" ]; then
      $PY scripts/kernel_bits.py compare "$ref" "$LOG/kernel-bits-$gpu.json" | tee "$LOG/kernel_bits_vs_ref.log"
      rc=${PIPESTATUS[0]}
    else
      echo "[bits] no $ref yet: commit $LOG/kernel-bits-$gpu.json there as this GPU's reference"; rc=0
    fi
    if [ -n "${BITS_EXP:-}" ]; then  # the same cases with exp on another instruction, against this run's record
      echo "[bits] again with --exp $BITS_EXP, against this run's record (kernel_bits_exp.log)"
      $PY scripts/kernel_bits.py record "$LOG/kernel-bits-$gpu-$BITS_EXP.json" --device "${BITS_DEVICE:-cuda}" \
        --exp "$BITS_EXP" --tensors /tmp/kernel-bits-exp.pt > "$LOG/kernel_bits_exp.log" 2>&1 || exit 1
      $PY scripts/kernel_bits.py compare "$LOG/kernel-bits-$gpu.json" "$LOG/kernel-bits-$gpu-$BITS_EXP.json" \
        --tensors /tmp/kernel-bits.pt /tmp/kernel-bits-exp.pt >> "$LOG/kernel_bits_exp.log" 2>&1
      tail -20 "$LOG/kernel_bits_exp.log"
    fi
    exit "$rc"
    ;;
  patch-tests)
    patch=${1:-}; [ -n "$patch" ] && shift || die "usage: gpu.sh patch-tests PATCH [TESTS ...]"
    patch=$(cd "$(dirname "$patch")" && pwd)/$(basename "$patch"); [ -f "$patch" ] || die "no patch file $patch"
    # shellcheck disable=SC2206
    sel=("$@"); [ ${#sel[@]} -gt 0 ] || sel=($PATCH_TESTS)
    setup; logdir patch-tests; rc=0
    here=(); for t in "${sel[@]}"; do [ -e "${t%%::*}" ] && here+=("$t"); done  # a file the patch adds is not here yet
    if [ ${#here[@]} -gt 0 ] && [ "${SKIP_HERE:-0}" = 1 ]; then
      echo "[patch-tests] this tree's tests skipped (SKIP_HERE=1: e.g. \`tests\` ran them in this lease)"
    elif [ ${#here[@]} -gt 0 ]; then
      echo "[patch-tests] this tree: ${here[*]}"
      timeout "${TEST_TIMEOUT:-420}" $PY -m pytest -q -m gpu "${here[@]}" -n "${WORKERS:-4}" -p no:cacheprovider \
        -o addopts="-ra" > "$LOG/pytest_here.log" 2>&1; r=$?; [ $r = 0 ] || [ $r = 5 ] || rc=1  # 5: no gpu test there
      tail -3 "$LOG/pytest_here.log"
    fi
    dst=${PATCHED:-/tmp/patched}; rm -rf "$dst"; mkdir -p "$dst"
    tar -C "$ROOT" --exclude=./.git --exclude=./.ffcache --exclude=./data -cf - . | tar -C "$dst" -xf - \
      || die "copying the tree failed"
    ln -s "$ROOT/.ffcache" "$dst/.ffcache" 2>/dev/null; ln -s "$ROOT/data" "$dst/data" 2>/dev/null
    (cd "$dst" && { git apply "$patch" 2>/dev/null || patch -p1 -s < "$patch"; }) || die "$patch does not apply here"
    echo "[patch-tests] patched copy in $dst: ${sel[*]}"
    (cd "$dst" && PYTHONPATH=${FF_SITE:-/tmp/site}:$dst timeout "${TEST_TIMEOUT:-420}" $PY -m pytest -q -m gpu \
      "${sel[@]}" -n "${WORKERS:-4}" -p no:cacheprovider -o addopts="-ra") > "$LOG/pytest_patched.log" 2>&1
    r=$?; [ $r = 0 ] || [ $r = 5 ] || rc=1
    tail -3 "$LOG/pytest_patched.log"
    if [ "${BITS:-1}" = 1 ]; then  # the existing recipes' bits: this tree against the patched copy, same machine
      bd=${BITS_DEVICE:-cuda}; bt=${dst}.bits; mkdir -p "$bt"  # outputs (.pt) stay here: only the JSONs come back
      echo "[patch-tests] kernel bits ($bd): scripts/kernel_bits.py in this tree, then in the patched copy"
      if (cd "$ROOT" && timeout "${BITS_TIMEOUT:-600}" $PY scripts/kernel_bits.py record "$LOG/bits_here.json" \
            --device "$bd" --tensors "$bt/here.pt") > "$LOG/kernel_bits.log" 2>&1 \
         && (cd "$dst" && PYTHONPATH=${FF_SITE:-/tmp/site}:$dst timeout "${BITS_TIMEOUT:-600}" $PY \
            scripts/kernel_bits.py record "$LOG/bits_patched.json" --device "$bd" --tensors "$bt/patched.pt") \
            >> "$LOG/kernel_bits.log" 2>&1; then
        $PY scripts/kernel_bits.py compare "$LOG/bits_here.json" "$LOG/bits_patched.json" \
          --tensors "$bt/here.pt" "$bt/patched.pt" >> "$LOG/kernel_bits.log" 2>&1 || rc=1
      else
        echo "[patch-tests] kernel bits: a record failed (kernel_bits.log)"; rc=1
      fi
      grep -a "^\[kernel_bits\] .* cases identical\|DIFFERENT\|MISSING" "$LOG/kernel_bits.log" | tail -8
    fi
    echo "[patch-tests] exit $rc"; exit $rc
    ;;
  speed)
    # SPEED_PARTS (default "attention host train1024 train256"; also "cudagraphs"): which benchmarks run, in this order
    setup; logdir speed; rc=0; parts=" ${SPEED_PARTS:-attention host train1024 train256} "
    if [[ $parts == *" attention "* ]]; then
    # ATTN_LAYOUT=bthd: q, k, v as the model makes them (views of the fused QKV projection; benchmarks/attention.py)
    # ATTN_GRAPH (default 3; 0: off): rounds of each row's CUDA-graph replay, the GPU's time without the host's
    bounded "${ATTN_TIMEOUT:-360}" "$LOG/attention.log" $PY benchmarks/attention.py ${TUNE:+--tune} \
      ${TUNE_SHAPES:+--tune-shapes "$TUNE_SHAPES"} ${ATTN_METHODS:+--methods "$ATTN_METHODS"} \
      --graph "${ATTN_GRAPH:-3}" \
      ${ATTN_SHAPES:+--shapes "$ATTN_SHAPES"} \
      ${ATTN_LAYOUT:+--layout "$ATTN_LAYOUT"} --kernels "${ATTN_KERNELS:-20}" --rounds 3 --out "$LOG/attention${ATTN_LAYOUT:+-$ATTN_LAYOUT}.json" || rc=1
    grep -E "^\|" "$LOG/attention.log"
    fi
    if [[ $parts == *" host "* ]]; then
    # two knob sets: each compiles its four kernels first (cold Triton cache: tens of seconds)
    bounded "${HOST_TIMEOUT:-240}" "$LOG/host_overhead.log" $PY benchmarks/host_overhead.py --device cuda \
      --knobs "${HOST_KNOBS:-fa2,paper_bf16_counters}" --out "$LOG/host_overhead.json" || rc=1
    grep '"shape"' "$LOG/host_overhead.log" | cut -c1-200
    fi
    if [[ $parts == *" train1024 "* ]]; then
    # every variant built first, then round-robin (benchmarks/train_step.py); 4 compiles take most of the time
    # TRAIN_ROUNDS (default 4), TRAIN_STREAM (--stream-steps; the script's default 6): more of both, less noise
    bounded "${TRAIN_TIMEOUT:-420}" "$LOG/train_T1024.log" $PY benchmarks/train_step.py --shapes 16x1024 --steps 24 \
      --rounds "${TRAIN_ROUNDS:-4}" ${TRAIN_STREAM:+--stream-steps "$TRAIN_STREAM"} \
      --out "$LOG/train_T1024.json" ${TUNED_TABLE:+--tuned-table "$TUNED_TABLE"} \
      --variants "${TRAIN_VARIANTS:-sdpa+compile,triton_fa2+compile,triton_fa2_exp2+compile,triton_paper_bf16+compile,paper_1gpu+compile,sdpa,triton_fa2,triton_fa2+jitlaunch,triton_paper_bf16,paper_1gpu,paper_1gpu+jitlaunch}" \
      || rc=1
    fi
    if [[ $parts == *" cudagraphs "* ]]; then
    # torch.compile(mode="reduce-overhead") against the default compile, SDPA's and the Triton recipes' alike: what
    # taking the host off the critical path gives each (CUDAGRAPH_VARIANTS: the variants)
    bounded "${TRAIN_TIMEOUT:-420}" "$LOG/train_T1024_cudagraphs.log" $PY benchmarks/train_step.py --shapes 16x1024 \
      --steps 24 --rounds 4 --out "$LOG/train_T1024_cudagraphs.json" \
      --variants "${CUDAGRAPH_VARIANTS:-sdpa+compile,sdpa+cudagraphs,triton_fa2+compile,triton_fa2+cudagraphs,triton_paper_bf16+compile,triton_paper_bf16+cudagraphs}" \
      || rc=1
    fi
    if [[ $parts == *" train256 "* ]]; then
    bounded "${TRAIN_TIMEOUT:-300}" "$LOG/train_T256.log" $PY benchmarks/train_step.py --shapes 32x256 --steps 24 \
      --rounds 4 --variants sdpa+compile,triton_fa2+compile,triton_paper_bf16+compile,triton_paper_bf16 \
      --out "$LOG/train_T256.json" || rc=1
    fi
    grep -h '"variant"' "$LOG"/train_T*.log 2>/dev/null | cut -c1-230
    exit $rc
    ;;
  tune)
    # speed-only launch configs timed on CUDA graphs (benchmarks/tune.py): TUNE_SHAPES (default gpt2s_T1024),
    # TUNE_FAMILIES (default paper_1gpu); the JSON also goes to TUNE_TABLE (default /tmp/ff-tune.json), where a later
    # queue item reads it: FF_LAUNCH_TABLE=/tmp/ff-tune.json bits | first-steps, TUNED_TABLE=... speed
    setup; logdir tune
    bounded "${TUNE_TIMEOUT:-300}" "$LOG/tune.log" $PY benchmarks/tune.py --shapes "${TUNE_SHAPES:-gpt2s_T1024}" \
      --families "${TUNE_FAMILIES:-paper_1gpu}" ${TUNE_REGS:+--regs "$TUNE_REGS"} --out "$LOG/tune.json"; rc=$?
    grep -E "best" "$LOG/tune.log"
    [ -f "$LOG/tune.json" ] && cp "$LOG/tune.json" "${TUNE_TABLE:-/tmp/ff-tune.json}"
    exit $rc
    ;;
  bench)
    setup; logdir bench; rc=0
    bounded 120 "$LOG/emulator.log" $PY benchmarks/emulator.py --device cuda --reps 3 --out "$LOG/emulator.json" || rc=1
    bounded 150 "$LOG/monitors.log" $PY benchmarks/monitors.py --model gpt2_s --out "$LOG/monitors.json" || rc=1
    bounded 150 "$LOG/monitors_flash.log" $PY benchmarks/monitors.py --model gpt2_s --impl flash \
      --out "$LOG/monitors_flash.json" || rc=1
    # 5 rounds of ~33 s each on an H200 (2026-12-06): 90 s killed it at round 2
    bounded "${PROBES_SECONDS:-200}" "$LOG/probes.log" $PY benchmarks/probes.py --out "$LOG/probes.json" || rc=1
    sb=${STAB_BENCH_SECONDS:-100}  # a budget: the JSON says what it measured (partial: true) when it runs out
    timeout -k 15 $((sb + 40)) $PY benchmarks/stabilizers.py --shapes mini,gpt2s --rounds 2 --max-seconds "$sb" \
      --out "$LOG/stabilizers.json" > "$LOG/stabilizers.log" 2>&1 || rc=1
    # on the disk the paper runs write to (/tmp): the loop's stall per GPT-2S checkpoint, in the loop vs on a thread
    bounded 240 "$LOG/checkpoint_write.log" $PY benchmarks/checkpoint_write.py --rounds 3 --dir /tmp/ckpt-bench \
      --out "$LOG/checkpoint_write.json" || rc=1
    for f in emulator monitors monitors_flash probes stabilizers checkpoint_write; do echo "== $f"; tail -8 "$LOG/$f.log"; done
    exit $rc
    ;;
  stabilizer-cost)
    # the emulator-route variants (pbar_clamp, sfa_guarded, stoch_round) take seconds per step here: they come last,
    # and --max-seconds stops before work that would end past the budget; the timeout (budget + 90 s: about one
    # emulator step the estimate could not foresee) only backs it up, and its SIGTERM still writes the JSON
    # STAB_VARIANTS: the order within each kind, so what a short budget leaves out comes last (default: the Triton
    # stabilizers whose cost was never measured at this shape first; 2026-12-06's 150 s timed only the first two)
    setup; logdir stabilizer-cost
    sb=${STAB_SECONDS:-200}
    timeout -k 15 $((sb + 90)) $PY benchmarks/stabilizers.py --shapes gpt2s --rounds "${STAB_ROUNDS:-2}" \
      --variants "${STAB_VARIANTS:-baseline,pbar_clamp,sfa_guarded,stoch_round,fp32,qk_norm,qk_clip,gated_attn,sfa,z_loss}" \
      --steps "${STAB_STEPS:-5}" --emulator-steps "${STAB_EMULATOR_STEPS:-1}" --max-seconds "$sb" \
      ${SKIP_EMULATOR:+--skip-emulator} --out "$LOG/stabilizers-gpt2s.json" "$@" > "$LOG/stabilizers-gpt2s.log" 2>&1
    rc=$?
    grep -E '^\[gpt2s\] (round [0-9]+/[0-9]+:|budget)|^missing|^stopped|^wrote' "$LOG/stabilizers-gpt2s.log" | tail -20
    [ $rc -eq 0 ] || tail -5 "$LOG/stabilizers-gpt2s.log"
    exit $rc
    ;;
  e2e)
    setup; logdir e2e
    timeout 240 $PY run.py -m experiment=smoke train.device=cuda intervention=baseline,fp32,sfa,pv_fp32 \
      results_dir="$LOG/results" > "$LOG/e2e.log" 2>&1; rc=$?
    tail -20 "$LOG/e2e.log"; exit $rc
    ;;
  embedding-grad)
    # the token embedding's backward at GPT-2S's shape: inductor's atomic one, aten's sorted one and the Triton kernel
    # (benchmarks/embedding_grad.py), then its GPU test
    setup; logdir embedding-grad
    timeout "${EG_TIMEOUT:-240}" $PY benchmarks/embedding_grad.py --out "$LOG/embedding_grad.json" \
      > "$LOG/embedding_grad.log" 2>&1; rc=$?
    grep -v Warning "$LOG/embedding_grad.log" | tail -8
    $PY -m pytest -q -m gpu tests/unit/test_embedding.py > "$LOG/pytest_embedding.log" 2>&1 || rc=1
    tail -2 "$LOG/pytest_embedding.log"; exit $rc
    ;;
  compile-repro)
    # whether compiled training reproduces its bits: inductor's embedding backward, the sorted one, and that with
    # torch's deterministic algorithms (scripts/compile_repro.py: default compile twice, CUDA graphs once)
    setup; logdir compile-repro
    timeout "${REPRO_TIMEOUT:-300}" $PY scripts/compile_repro.py --json "$LOG/compile_repro.json" \
      > "$LOG/compile_repro.log" 2>&1; rc=$?
    grep -v Warning "$LOG/compile_repro.log" | tail -6; exit $rc
    ;;
  own-model)
    setup; logdir own-model; rc=0
    if ! $PY -c "import transformers" 2>/dev/null && compgen -G ".whl_hf/*.whl" >/dev/null; then
      $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "${FF_SITE:-/tmp/site}" \
        .whl_hf/*.whl || die "installing .whl_hf/*.whl failed"
    fi
    $PY -c "import transformers; print('transformers', transformers.__version__, transformers.__file__)" \
      || die "transformers is not importable: carry .whl_hf/ (its wheels) or install it"
    timeout "${TEST_TIMEOUT:-300}" $PY -m pytest -q -m gpu -n "${WORKERS:-4}" -p no:cacheprovider -o addopts="-ra" \
      tests/integration/test_hf_fast_path.py tests/unit/test_triton.py tests/unit/test_ops.py \
      > "$LOG/pytest_gpu_own_model.log" 2>&1 || rc=1
    tail -8 "$LOG/pytest_gpu_own_model.log"
    bounded "${BENCH_TIMEOUT:-240}" "$LOG/hf_llama.log" $PY benchmarks/hf_llama.py --out "$LOG/hf-llama.json" || rc=1
    tail -5 "$LOG/hf_llama.log"
    bounded "${BENCH_TIMEOUT:-240}" "$LOG/hf_llama_padded.log" $PY benchmarks/hf_llama.py --left-pad 100 \
      --out "$LOG/hf-llama-padded.json" || rc=1
    tail -5 "$LOG/hf_llama_padded.log"; exit $rc
    ;;
  first-steps)
    setup; logdir first-steps; rc=0
    for s in ${SEEDS:-1}; do
      timeout "${FS_TIMEOUT:-300}" $PY scripts/first_steps.py run --seed "$s" --steps "${STEPS:-3}" --out "$LOG/seed$s" \
        -- "$@" || rc=1
    done
    exit $rc
    ;;
  baseline-time)
    # the paper_1gpu baseline alone on the GPU, to step STEP (9697: seed 1337's divergence on an H200) and no further,
    # as the one-lease plan runs it (checkpoints from CKPT_START, evaluation, monitors, probes, MLflow), its
    # divergence not stopping it (train.early_stop=false): result.json's wall_s is the time to that step. Runs and
    # checkpoints under BT_R (default /tmp/baseline-time); result.json and the log come back. Hydra overrides: ARGS
    R=$(realpath -m "${BT_R:-/tmp/baseline-time}"); step=${STEP:-9697}
    case "$R/" in /|"$ROOT"/*|"$HOME"/) die "BT_R=$R: give a scratch folder outside the tree (it is emptied first)";; esac
    setup; logdir baseline-time
    ckpt=$(ckpt_start "${SEED:-1337}") || die "train.ckpt_start: ${ckpt:-scripts/first_steps.py ckpt-start failed}"
    echo "[baseline-time] train.ckpt_start=$ckpt${CKPT_START:+ (CKPT_START)}"
    rm -rf "$R"; mkdir -p "$R"
    timeout "${BT_TIMEOUT:-1200}" $PY run.py experiment=paper_1gpu train.seed="${SEED:-1337}" data.seed="${SEED:-1337}" \
      train.max_steps=$((step + 1)) train.ckpt_start="$ckpt" train.early_stop=false results_dir="$R" \
      "$@" > "$LOG/run.log" 2>&1; rc=$?
    res=$(find "$R" -name result.json | head -1)
    [ -n "$res" ] && cp "$res" "$LOG/result.json" && $PY -c "import json, sys; r = json.load(open(sys.argv[1])); \
print({k: r.get(k) for k in ('steps_done', 'wall_s', 'observed', 'divergence_step', 'min_loss', 'min_loss_step')})" "$res"
    tail -5 "$LOG/run.log"
    exit $rc
    ;;
  ddp)
    setup; logdir ddp
    timeout 300 $PY benchmarks/ddp.py --steps "${DDP_STEPS:-200}" > "$LOG/ddp.log" 2>&1; rc=$?
    tail -15 "$LOG/ddp.log"; exit $rc
    ;;
  mini-repro)
    setup; logdir mini-repro
    timeout "${SEEDS_TIMEOUT:-480}" $PY run.py +sweep=mini_repro_seeds experiment=mini_repro hydra/launcher=local \
      train.ckpt_every=0 hydra.sweep.dir="$LOG/runs" "$@" > "$LOG/seeds.log" 2>&1; rc=$?
    for r in "$LOG"/runs/*/result.json; do
      [ -f "$r" ] && $PY -c "import json,sys; r=json.load(open(sys.argv[1])); print(sys.argv[1], r['intervention'], r['observed'], r['divergence_step'], r['steps_done'], r['final_loss'], r['wall_s'])" "$r"
    done
    exit $rc
    ;;
  capture-mini)  # the miniature's baseline (seed 1337, diverges at step 867) with an attention capture shortly before
    setup; logdir capture-mini
    step=${CAPTURE_STEP:-850}
    timeout "${CAPTURE_TIMEOUT:-480}" $PY run.py experiment=mini_repro intervention=baseline train.seed=1337 \
      train.max_steps="${MAX_STEPS:-900}" train.ckpt_every=0 "monitor.capture.steps=[$step]" \
      "monitor.capture.layers=[${CAPTURE_LAYER:-2}]" "monitor.capture.heads=[${CAPTURE_HEADS:-0,1}]" \
      monitor.capture.batch="${CAPTURE_BATCH:-8}" monitor.capture.max_mib=15 hydra.run.dir="$LOG/run" "$@" \
      > "$LOG/run.log" 2>&1; rc=$?
    tail -5 "$LOG/run.log"
    find "$LOG/run" -name "*.safetensors" -exec cp {} "$LOG/" \; -exec ls -la {} \;
    [ -f "$LOG/run/result.json" ] && cp "$LOG/run/result.json" "$LOG/"
    exit $rc
    ;;
  isolation)
    setup; exec bash scripts/paper_isolation.sh "$@"
    ;;
  rounding)
    setup; exec $PY -m flash_forensics.cli isolate --experiment mini_repro --sweeps rounding_refs rounding_points "$@"
    ;;
  paper-1gpu)
    setup; exec bash scripts/paper_1gpu.sh "$@"
    ;;
  round)
    # Checkpoints cannot leave a lent machine, so a baseline and its forks run in one lease. Runs live under $R
    # (default /tmp/round, outside the checkout: a later call may re-send the tree, never under a running job); the
    # code they run is a copy taken at start.
    R=${R:-/tmp/round}; L=$R/logs; mode=${1:-start}
    if [ "$mode" = start ]; then
      mkdir -p "$L" "$R/src"
      cp -a . "$R/src" 2>/dev/null; cd "$R/src" || die "no copy"
      setup; env_txt | tee "$L/env.txt"
      t0=$(date +%s)
      # 1. quiet benchmarks first (nothing else on the GPU)
      timeout 90 $PY benchmarks/probes.py --out "$L/probes-h200.json" > "$L/bench_probes.log" 2>&1; tail -6 "$L/bench_probes.log"
      timeout 130 $PY benchmarks/stabilizers.py --shapes mini,gpt2s --rounds 2 --out "$L/stabilizers-h200.json" \
        > "$L/bench_stabilizers.log" 2>&1; tail -12 "$L/bench_stabilizers.log"
      echo "[round] benchmarks done at $(( $(date +%s) - t0 )) s"
      # 2. every run, in the background (each its own session: this call can return)
      setsid nohup $PY -m flash_forensics.cli isolate --experiment mini_repro \
        --sweeps rounding_refs rounding_points stabilizers --root "$R/mini" --out "$R/mini/report" \
        --uri "sqlite:///$R/mini/mlflow.db" --per-gpu "${MINI_PER_GPU:-3}" > "$L/mini.log" 2>&1 < /dev/null &
      setsid nohup env ROOT="$R/paper" SEEDS="${SEEDS:-1337 1 2}" CONTROL_SWEEPS=paper_1gpu_fp32 \
        ISOLATION_SWEEPS="paper_1gpu_numerics paper_1gpu_key" PER_GPU_FIRST=2 PER_GPU_OTHERS=1 CKPT_EVERY_OTHERS=250 \
        PROGRESS_EVERY=60 bash scripts/paper_1gpu.sh > "$L/paper.log" 2>&1 < /dev/null &
      # disk: finished forks' checkpoints go at once; paper baselines keep their newest 8
      setsid nohup bash -c 'while true; do
          find "$0" -path "*/forks/*/result.json" 2>/dev/null | while read -r r; do rm -f "$(dirname "$r")"/checkpoints/*.pt; done
          for d in "$0"/paper/seed*/baseline/checkpoints; do
            [ -d "$d" ] && ls "$d"/step_*.pt 2>/dev/null | sed "s/.*step_\([0-9]*\)\.pt/\1 &/" | sort -n | head -n -8 \
              | cut -d" " -f2 | xargs -r rm -f
          done; sleep 20; done' "$R" > /dev/null 2>&1 < /dev/null &
      # 3. the GPU tests beside them (correctness only: nothing here is timed)
      gpu_tests "$L/pytest_gpu.log"
      echo "[round] started; tests done at $(( $(date +%s) - t0 )) s"
    elif [ "$mode" = status ]; then
      date -u +%T; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader; df -h "$R" | tail -1
      grep -a '^\[paper_isolation\|^\[isolate\|/5 ' "$L/mini.log" | tail -4
      ls "$R"/mini/forks/*/result.json 2>/dev/null | wc -l | sed 's/^/mini forks done: /'
      tail -4 "$L/paper.log"
    elif [ "$mode" = collect ]; then
      : "${OUT:?collect writes into \$OUT}"
      cd "$R" || die "no $R"
      find . \( -path ./src -prune \) -o \( -name '*.json' -o -name '*.md' -o -name '*.png' -o -name '*.log' \
           -o -name '*.txt' \) -type f -size -4M -print | grep -v '/checkpoints/' > /tmp/round_files
      tar -cJf "$OUT/round-reports.tar.xz" -T /tmp/round_files
      # each store copied consistently while its writers run (sqlite's backup API), xz-compressed, cut into 15 MB parts
      i=0
      for db in $(find . -path ./src -prune -o -name 'mlflow*.db' -print); do
        i=$((i+1)); name="db$i-$(echo "${db#./}" | tr '/.' '__')"
        $PY -c "import sqlite3,sys; d=sqlite3.connect(sys.argv[2]); sqlite3.connect(sys.argv[1]).backup(d); d.close()" \
          "$db" "/tmp/$name.sqlite" && xz -T0 -6 -c "/tmp/$name.sqlite" | split -b 15M -d - "$OUT/$name.xz.part"
      done
      ls -la "$OUT"
    else
      die "usage: gpu.sh round start|status|collect"
    fi
    ;;
  paper-table)
    # The paper's regime, the whole method in one lease (one H200): the FP32-reference benchmark on a quiet GPU,
    # then the seed's baseline alone, its pre-divergence checkpoint, every fork at once (controls, the isolation
    # table, the beta sweep, the baseline again with dense mechanism probes), localization and the report; the GPU
    # tests run beside the baseline's first minutes. Runs live under $R (default /tmp/paper, outside the checkout: a
    # later call re-sends the tree, never under a running job); the code is a copy taken at start.
    #   gpu.sh paper-table start          returns once the runs are in the background (benchmark + tests done)
    #   gpu.sh paper-table wait [SECONDS] progress lines until the plan ends or SECONDS pass (default 540)
    #   gpu.sh paper-table collect        (waits up to COLLECT_WAIT s, default 0, then) packs $OUT: <= 8 files
    #   gpu.sh paper-table run [SECONDS]  start, wait, collect in ONE call that ends within SECONDS (default 560):
    #                                     a short plan (e.g. SEED=1 CKPT_START=0 with few forks) needs no second
    #                                     call, and a machine lost between calls (idle > 30 s) loses nothing collected
    # Env: SEED (1337), BENCH (1), TESTS (1), and the plan's: STOP_AFTER (20), PICK (before-divergence), MARGIN (150),
    # PAST_DIVERGENCE (310), FORK_MEMORY (26 GiB; "" no check), PER_GPU_FIRST (6), FORK_OVERRIDES (attention.fp32_gemm=tf32x3),
    # MAX_STEPS (20000), CKPT_START (default: 1,000 steps before the earliest divergence recorded for the seeds on this
    # GPU model, down to a multiple of 250, `scripts/first_steps.py ckpt-start`: 8,500 for seed 1337 on an H200,
    # which diverges at 9,697 there, 7,000 on an H100, where it diverges at 8,064; 0, every checkpoint, for a seed
    # whose divergence here is not known. The checkpoints before it cost lease time and are never forked from),
    # OVERRIDES (more Hydra overrides for every run, space-separated), RACE (0; 1 with several
    # seeds, SEED="2 1337": every seed gets the first's plan and the first whose baseline diverges keeps the GPU, the
    # others stop: for a GPU on which no seed's divergence step is known), OVERRIDES_<seed> (Hydra overrides of that
    # seed's runs only, after OVERRIDES, e.g. OVERRIDES_1337="train.ckpt_start=8500"; passed on as they are, in the
    # environment): see scripts/paper_1gpu.sh.
    R=${R:-/tmp/paper}; L=$R/logs; mode=${1:-start}
    plan_alive() { [ -f "$R/plan.pid" ] && kill -0 "$(cat "$R/plan.pid")" 2>/dev/null; }
    progress_line() {
      local ck nd nf db s
      ck=$( (ls "$R"/runs/seed*/baseline/checkpoints/ 2>/dev/null || true) | sed -n 's/step_\([0-9]*\)\.pt/\1/p' | sort -n | tail -1)
      nd=$( (ls "$R"/runs/seed*/forks/*/result.json 2>/dev/null || true) | wc -l)
      nf=$( (ls "$R"/runs/seed*/forks/*.log 2>/dev/null || true) | wc -l)
      echo "[paper-table $(date -u +%T)] baseline ckpt ${ck:-none}; forks done $nd/$nf; GPU $(nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader | tr -d '\n'); disk $(df -h --output=avail "$R" | tail -1 | tr -d ' ')"
      grep -a "1/5\|2/5\|3/5\|4/5\|5/5\|done\|FAILED\|stopped\|preflight" "$L/paper.log" 2>/dev/null | tail -3 | cut -c1-220
      # once the baseline has logged 3 steps: does this GPU repeat a recorded run of the seed, whose divergence step
      # is then known here (scripts/first_steps.py check)? Said once, kept in $L/first_steps.txt
      if [ ! -s "$L/first_steps.txt" ]; then
        for db in "$R"/runs/seed*/mlflow.db; do
          [ -f "$db" ] || continue; s=${db%/mlflow.db}; s=${s##*seed}
          $PY scripts/first_steps.py check "sqlite:///$db" --seed "$s" > "$L/first_steps.tmp" 2>&1 \
            && mv "$L/first_steps.tmp" "$L/first_steps.txt" && cat "$L/first_steps.txt"
        done
      fi
      # no step line yet is not a failure (pipefail would make it `start`'s exit status: the queue said "exit 1")
      tail -c 2000 "$R"/runs/seed*/baseline/run.log 2>/dev/null | tr '\r' '\n' | grep -a "it/s\|s/it\|\[job\]" | tail -1 | cut -c1-200 \
        || true
    }
    if [ "$mode" = run ]; then  # the collect gets the last ~60 s of the budget, whatever the plan is doing
      t_run=$(date +%s); budget=${2:-560}; self=$ROOT/scripts/gpu.sh
      rm -f "$R/plan.pid"; bash "$self" paper-table start || die "start exited $?"
      [ -f "$R/plan.pid" ] || die "start failed: no plan was started"
      bash "$self" paper-table wait $(( budget - ($(date +%s) - t_run) - 60 ))
      COLLECT_WAIT=0 bash "$self" paper-table collect
      echo "[paper-table] run took $(( $(date +%s) - t_run )) s of $budget"
    elif [ "$mode" = start ]; then
      mkdir -p "$L" "$R/src"
      cp -a . "$R/src" 2>/dev/null; cd "$R/src" || die "no copy"
      setup; env_txt | tee "$L/env.txt"
      $PY scripts/first_steps.py known | tee "$L/known.txt"  # which seed diverges where on this GPU model, if known
      echo "[paper-table] seeds: ${SEED:-1337}"
      ckpt=$(ckpt_start "${SEED:-1337}") || die "train.ckpt_start: ${ckpt:-scripts/first_steps.py ckpt-start failed}"
      echo "[paper-table] train.ckpt_start=$ckpt${CKPT_START:+ (CKPT_START)}"
      t0=$(date +%s)
      if [ "${BENCH:-1}" = 1 ]; then  # a quiet GPU: nothing else runs yet
        timeout 240 $PY benchmarks/fp32_reference.py --rounds 3 --train-steps 6 --out "$L/fp32-reference-h200.json" \
          > "$L/bench_fp32_reference.log" 2>&1; echo "[paper-table] benchmark exit $? at $(( $(date +%s) - t0 )) s"
        grep -a "summary\|Error\|error" "$L/bench_fp32_reference.log" | tail -5 | cut -c1-600
      fi
      export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
      # env VAR=... keeps the rest of the environment: OVERRIDES_<seed> reach the plan as they are
      setsid nohup env ROOT="$R/runs" SEEDS="${SEED:-1337}" RACE="${RACE:-0}" STOP_AFTER="${STOP_AFTER:-20}" \
        PICK="${PICK:-before-divergence}" MARGIN="${MARGIN:-150}" PAST_DIVERGENCE="${PAST_DIVERGENCE:-310}" \
        KEEP_CHECKPOINTS="${KEEP_CHECKPOINTS:-3}" FORK_MEMORY="${FORK_MEMORY-26}" PER_GPU_FIRST="${PER_GPU_FIRST:-6}" \
        FORK_OVERRIDES="${FORK_OVERRIDES-attention.fp32_gemm=tf32x3}" CONTROL_SWEEPS="${CONTROL_SWEEPS:-paper_isolation}" \
        ISOLATION_SWEEPS="${ISOLATION_SWEEPS-paper_1gpu_numerics paper_1gpu_mechanism beta_sweep}" PROGRESS_EVERY=60 \
        bash scripts/paper_1gpu.sh "train.max_steps=${MAX_STEPS:-20000}" "train.ckpt_start=$ckpt" ${OVERRIDES:-} \
        > "$L/paper.log" 2>&1 < /dev/null &
      echo $! > "$R/plan.pid"; date +%s > "$R/plan.t0"
      echo "[paper-table] plan started (pid $(cat "$R/plan.pid")) at $(( $(date +%s) - t0 )) s"
      if [ "${TESTS:-1}" = 1 ]; then  # correctness only, beside the baseline: nothing here is timed
        WORKERS=${WORKERS:-4} gpu_tests "$L/pytest_gpu.log"; echo "[paper-table] tests done at $(( $(date +%s) - t0 )) s"
      fi
      if [ "${CAPTURES:-1}" = 1 ]; then  # real kernels' captures for `flash-forensics analyze` (numerics, not timed)
        timeout 240 $PY scripts/capture_kernels.py --out "$R/captures" > "$L/capture_kernels.log" 2>&1
        echo "[paper-table] captures exit $? at $(( $(date +%s) - t0 )) s: $(tail -1 "$L/capture_kernels.log")"
      fi
      if [ -n "${OUT:-}" ]; then  # what is done so far comes back with this call
        cp "$L"/*.json "$L/pytest_gpu.log" "$L/env.txt" "$OUT/" 2>/dev/null
        [ -d "$R/captures" ] && tar -cJf - -C "$R" captures | split -b 15M -d - "$OUT/captures.tar.xz.part"
        ls -la "$OUT"
      fi
      progress_line
    elif [ "$mode" = wait ]; then
      end=$(( $(date +%s) + ${2:-540} ))
      next=0  # polls every 5 s, a progress line a minute: it returns within 5 s of the plan's end
      while plan_alive && [ "$(date +%s)" -lt "$end" ]; do
        [ "$(date +%s)" -ge "$next" ] && { progress_line; next=$(( $(date +%s) + 60 )); }
        sleep 5
      done
      progress_line; plan_alive && echo "[paper-table] still running" || echo "[paper-table] plan ended"
    elif [ "$mode" = collect ]; then
      : "${OUT:?collect writes into \$OUT}"
      end=$(( $(date +%s) + ${COLLECT_WAIT:-0} ))
      while plan_alive && [ "$(date +%s)" -lt "$end" ]; do sleep 5; done
      cd "$R/src" || die "no $R/src"; setup
      state=ended; plan_alive && state=running
      echo "[paper-table] plan $state after $(( $(date +%s) - $(cat "$R/plan.t0") )) s" | tee -a "$L/paper.log"
      for d in "$R"/runs/seed*/; do  # the seed folders, not their seed<S>.log files
        d=${d%/}; s=${d##*seed}
        if [ ! -f "$d/report/verdicts.json" ] || [ "$state" = running ]; then  # the finished rows, read-only
          runs=("$d/baseline"); [ -d "$d/forks" ] && runs+=("$d/forks")  # no forks yet: the baseline alone
          $PY -m flash_forensics.cli report "${runs[@]}" --out "$d/report_partial" --sweep paper_isolation \
            --tracking-uri "sqlite:///$d/mlflow.db" --meta "partial=collected while the plan was $state" \
            > "$L/report_partial_$s.log" 2>&1 || echo "[paper-table] partial report failed: $L/report_partial_$s.log"
        fi
        $PY scripts/mlflow_export.py "sqlite:///$d/mlflow.db" "$OUT/mlflow-seed$s.json.gz" || true
      done
      (cd "$R/runs" && find . \( -name '*.json' -o -name '*.md' -o -name '*.png' -o -name '*.csv' \) -type f -size -4M \
          -not -path '*/checkpoints/*' -print > /tmp/paper_files; tar -cJf "$OUT/paper-reports.tar.xz" -T /tmp/paper_files)
      (cd "$R" && find logs runs \( -name '*.log' -o -name '*.txt' \) -type f -not -path '*/checkpoints/*' -print \
          > /tmp/paper_logs; tar -cJf "$OUT/paper-logs.tar.xz" -T /tmp/paper_logs)
      cp "$L"/*.json "$OUT/" 2>/dev/null || true
      [ -f "$L/pytest_gpu.log" ] && cp "$L/pytest_gpu.log" "$OUT/"
      ls -la "$OUT"
    else
      die "usage: gpu.sh paper-table start|wait [SECONDS]|collect|run [SECONDS]"
    fi
    ;;
  scratch-table)
    # scripts/paper_scratch.sh in one lease, like paper-table: its runs live under $R (default /tmp/scratch, outside
    # the checkout), the code is a copy taken at start. Env: the script's (SEED 1, MAX_STEPS 2598, INTERVENTIONS, LRS,
    # OVERRIDES_ALL, STOP_AFTER) and OVERRIDES (Hydra overrides for every run, space-separated).
    #   gpu.sh scratch-table run [SECONDS]  start, wait, collect in ONE call that ends within SECONDS (default 560)
    R=${R:-/tmp/scratch}; mode=${1:-start}
    alive() { [ -f "$R/plan.pid" ] && kill -0 "$(cat "$R/plan.pid")" 2>/dev/null; }
    tests_alive() { [ -f "$R/tests.pid" ] && kill -0 "$(cat "$R/tests.pid")" 2>/dev/null; }  # TESTS_PATCH's
    if [ "$mode" = run ]; then
      t_run=$(date +%s); budget=${2:-560}; self=$ROOT/scripts/gpu.sh
      rm -f "$R/plan.pid" "$R/tests.pid"; bash "$self" scratch-table start
      [ -f "$R/plan.pid" ] || die "start failed: no plan was started"
      bash "$self" scratch-table wait $(( budget - ($(date +%s) - t_run) - 45 ))
      bash "$self" scratch-table collect
      echo "[scratch-table] run took $(( $(date +%s) - t_run )) s of $budget"
    elif [ "$mode" = start ]; then
      mkdir -p "$R/src"; cp -a . "$R/src" 2>/dev/null; cd "$R/src" || die "no copy"
      setup; env_txt | tee "$R/env.txt"
      export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
      # shellcheck disable=SC2086
      setsid nohup env ROOT="$R/runs" PROGRESS_EVERY=60 bash scripts/paper_scratch.sh ${OVERRIDES:-} \
        > "$R/plan.log" 2>&1 < /dev/null &
      echo $! > "$R/plan.pid"; date +%s > "$R/plan.t0"
      if [ -n "${TESTS_PATCH:-}" ]; then  # beside the runs: they only slow each other down
        setsid nohup env OUT="$R/tests" PATCHED="$R/patched" bash scripts/gpu.sh patch-tests "$(cd "$ROOT" && realpath "$TESTS_PATCH")" \
          > "$R/patch_tests.log" 2>&1 < /dev/null &
        echo $! > "$R/tests.pid"
      fi
      sleep 5; head -3 "$R/plan.log" | cut -c1-300
    elif [ "$mode" = wait ]; then
      end=$(( $(date +%s) + ${2:-540} ))
      while { alive || tests_alive; } && [ "$(date +%s)" -lt "$end" ]; do sleep 5; done
      (grep -a "^\[paper_scratch" "$R/plan.log" || true) | tail -7 | cut -c1-220
      echo "[scratch-table $(date -u +%T)] GPU $(nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader | tr -d '\n')"
      [ -f "$R/patch_tests.log" ] && grep -a "^\[patch-tests\]\| passed\| failed" "$R/patch_tests.log" | tail -4
      tests_alive && echo "[scratch-table] patch tests still running"
      alive && echo "[scratch-table] still running" || echo "[scratch-table] plan ended"
    elif [ "$mode" = collect ]; then
      : "${OUT:?collect writes into \$OUT}"
      cd "$R/src" || die "no $R/src"; setup
      state=ended; alive && state=running
      echo "[scratch-table] plan $state after $(( $(date +%s) - $(cat "$R/plan.t0") )) s" | tee -a "$R/plan.log"
      tests_alive && echo "[scratch-table] patch tests still running: their logs so far come back"
      if [ "$state" = running ]; then  # the finished runs' rows (a running one has no result.json yet; the export
        dirs=()                         # below has every run's history so far)
        for d in "$R"/runs/*/; do [ -f "$d/result.json" ] && dirs+=("${d%/}"); done
        echo "[scratch-table] finished runs: ${#dirs[@]}"
        [ "${#dirs[@]}" -gt 0 ] && { $PY -m flash_forensics.cli report "${dirs[@]}" --out "$R/runs/report_partial" \
          --sweep paper_scratch --tracking-uri "sqlite:///$R/runs/mlflow.db" \
          --meta "partial=collected while the plan was running" > "$R/report_partial.log" 2>&1 \
          || echo "[scratch-table] partial report failed: $R/report_partial.log"; }
      fi
      [ -f "$R/runs/mlflow.db" ] && { $PY scripts/mlflow_export.py "sqlite:///$R/runs/mlflow.db" "$OUT/mlflow-scratch.json.gz" || true; }
      (cd "$R/runs" && find . \( -name '*.json' -o -name '*.md' -o -name '*.png' -o -name '*.csv' \) -type f -size -4M \
          -print > /tmp/scratch_files; tar -cJf "$OUT/scratch-reports.tar.xz" -T /tmp/scratch_files)
      (cd "$R" && find . \( -name '*.log' -o -name '*.txt' \) -type f -not -path './src/*' -not -path './patched/*' \
         -print > /tmp/scratch_logs
       tar -cJf "$OUT/scratch-logs.tar.xz" -T /tmp/scratch_logs)
      ls -la "$OUT"
    else
      die "usage: gpu.sh scratch-table start|wait [SECONDS]|collect|run [SECONDS]"
    fi
    ;;
  queue)
    Q=$(realpath -m "${Q:-/tmp/queue}"); mode=${1:-}; shift || true
    qalive() { [ -f "$Q/queue.pid" ] && kill -0 "$(cat "$Q/queue.pid")" 2>/dev/null; }
    qstatus() {
      echo "[queue $(date -u +%T)] GPU $(nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader \
        2>/dev/null | tr -d '\n'); disk $(df -h "$Q" | awk 'END {print $4}') free"
      cat "$Q/status" 2>/dev/null
      local cur; cur=$(ls -t "$Q"/out/*.log 2>/dev/null | head -1)
      if qalive && [ -n "$cur" ]; then
        echo "  now: $(basename "$cur" .log): $(tail -c 2000 "$cur" | tr '\r' '\n' | grep -v '^\s*$' | tail -1 | cut -c1-200)"
      fi
    }
    qwords() {  # $1: an item -> the array w (shell words); refused: command substitution, newlines, bad quotes
      case "$1" in *'$('*|*'`'*|*$'\n'*) die "queue item '$1': no \$( ), backticks or newlines in an item";; esac
      eval "w=($1)" 2>/dev/null || die "queue item '$1': not shell words (unbalanced quotes?)"
    }
    case "$mode" in
      start)
        [ $# -gt 0 ] || die "usage: gpu.sh queue start 'TASK [ARGS]' ['VAR=VALUE TASK [ARGS]' ...]"
        qalive && die "a queue is running in $Q: wait for it, or kill -- -\$(cat $Q/queue.pid)"
        case "$Q/" in "$ROOT"/*) die "Q=$Q is inside the tree it copies: give a folder outside $ROOT";; esac
        tasks=$(grep -oE '^  [a-z0-9-]+\)' "$0" | tr -d ' )')
        for item in "$@"; do  # every item names a task of this script, before anything starts
          qwords "$item"; i=0
          while [ $i -lt ${#w[@]} ] && [[ ${w[$i]} =~ ^[A-Za-z_][A-Za-z0-9_]*= ]]; do i=$((i+1)); done
          [ $i -lt ${#w[@]} ] && grep -Fxq -- "${w[$i]}" <<< "$tasks" && [ "${w[$i]}" != queue ] && [ "${w[$i]}" != stop ] \
            || die "queue item '$item': no gpu.sh task in it (the tasks: the header of scripts/gpu.sh)"
        done
        if [ -d "$Q" ]; then  # an earlier queue's output is kept, once
          rm -rf "$Q.prev" && mv "$Q" "$Q.prev" && echo "[queue] the earlier queue in $Q moved to $Q.prev"
        fi
        mkdir -p "$Q/out" "$Q/src" || die "cannot make $Q"
        cp -a . "$Q/src" || die "copying the tree to $Q/src failed"
        printf '%s\n' "$@" > "$Q/items"
        # its own session (setsid -f: always a new process, whatever this one's group), so it outlives this call; it
        # writes its pid, which is its process group's: `kill -- -PID` stops it and its task
        setsid -f nohup bash "$Q/src/scripts/gpu.sh" queue _run > "$Q/queue.log" 2>&1 < /dev/null
        for _ in $(seq 50); do [ -s "$Q/queue.pid" ] && break; sleep 0.1; done
        [ -s "$Q/queue.pid" ] || die "the queue's runner did not start: $Q/queue.log"
        echo "[queue] started $# tasks in $Q (pid $(cat "$Q/queue.pid")):"; sed 's/^/  /' "$Q/items"
        ;;
      _run)  # the runner (started by `start`, in the copy): each item in turn, its output in $Q/out/<n>-<task>
        echo $$ > "$Q/queue.pid"; n=0
        while IFS= read -r item; do
          n=$((n+1)); qwords "$item"; envs=(); i=0  # shell words: VAR='a b' keeps its space
          while [[ ${w[$i]} =~ ^[A-Za-z_][A-Za-z0-9_]*= ]]; do envs+=("${w[$i]}"); i=$((i+1)); done
          name="$n-${w[$i]}"; t=$(date +%s)
          printf '  %s: started %s (%s)\n' "$name" "$(date -u +%T)" "$item" >> "$Q/status"
          mkdir -p "$Q/out/$name"  # the item's $OUT exists, as a `run` call's does (paper-table start copies into it)
          env "${envs[@]}" OUT="$Q/out/$name" bash scripts/gpu.sh "${w[@]:$i}" > "$Q/out/$name.log" 2>&1
          rc=$?
          printf '  %s: exit %s after %s s\n' "$name" "$rc" "$(( $(date +%s) - t ))" >> "$Q/status"
        done < "$Q/items"
        echo "  queue ended at $(date -u +%T)" >> "$Q/status"
        ;;
      wait)
        [ -d "$Q" ] || die "no queue in $Q (gpu.sh queue start first)"
        end=$(( $(date +%s) + ${1:-540} )); next=0
        while qalive && [ "$(date +%s)" -lt "$end" ]; do
          [ "$(date +%s)" -ge "$next" ] && { qstatus; next=$(( $(date +%s) + 60 )); }
          sleep 5
        done
        qstatus; rc=0
        if qalive; then echo "[queue] still running"
        elif grep -q "queue ended at" "$Q/status" 2>/dev/null; then echo "[queue] ended"
        else  # killed, or the machine's processes ended: say what did not finish
          last=$(grep -c ': started ' "$Q/status" 2>/dev/null); done_=$(grep -c ': exit ' "$Q/status" 2>/dev/null)
          echo "[queue] the runner DIED: $(( ${last:-0} - ${done_:-0} )) task interrupted, $(( $(wc -l < "$Q/items") \
            - ${last:-0} )) never started (see $Q/queue.log)"; rc=1
        fi
        bash "$0" queue collect || rc=1
        exit $rc
        ;;
      collect)
        : "${OUT:?collect writes into \$OUT}"
        [ -d "$Q/out" ] || die "no queue output in $Q"
        # files under 12 MB, no checkpoints (what comes back from a lent machine: 8 files of 16 MiB a call); one
        # archive, cut into 15 MB parts when it must be: `cat queue-out.tar.xz.part* | tar -xJf -` joins them
        (cd "$Q" && find out status items queue.log -type f 2>/dev/null | sort > "$Q/all" \
          && find out status items queue.log -type f -size -12M ! -name '*.pt' 2>/dev/null | sort > "$Q/files" \
          && tar -cJf "$OUT/queue-out.tar.xz" -T "$Q/files") || die "packing $Q/out failed"
        comm -23 "$Q/all" "$Q/files" | sed 's/^/[queue] left on the machine (12 MB or more, or a checkpoint): /'
        if [ "$(stat -c %s "$OUT/queue-out.tar.xz")" -gt 15000000 ]; then
          split -b 15M -d "$OUT/queue-out.tar.xz" "$OUT/queue-out.tar.xz.part" && rm "$OUT/queue-out.tar.xz"
          echo "[queue] archive cut into parts: cat queue-out.tar.xz.part* | tar -xJf -"
        fi
        echo "[queue] collected $(wc -l < "$Q/files") files: $(du -sh "$OUT" | cut -f1)"
        ;;
      *) die "usage: gpu.sh queue start 'TASK [ARGS]' ... | wait [SECONDS] | collect" ;;
    esac
    ;;
  stop)
    n=0
    for f in "${Q:-/tmp/queue}/queue.pid" "${ROUND_R:-/tmp/round}/plan.pid" "${PAPER_R:-/tmp/paper}/plan.pid" \
             "${SCRATCH_R:-/tmp/scratch}/plan.pid" "${SCRATCH_R:-/tmp/scratch}/tests.pid"; do
      [ -s "$f" ] || continue
      pid=$(cat "$f")
      [[ $pid =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null || continue
      kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null  # its group: the runs it started go too
      for _ in $(seq 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
      kill -0 "$pid" 2>/dev/null && { kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null; }
      echo "[stop] ended $f (pid $pid, with its process group)"; n=$((n + 1))
    done
    [ "$n" -gt 0 ] || echo "[stop] nothing of a queue or plan was running"
    if command -v nvidia-smi > /dev/null; then
      sleep 2
      apps=$(nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader 2>/dev/null)
      [ -n "$apps" ] && echo "$apps" | sed 's/^/[stop] still on the GPU: /' || echo "[stop] nothing holds the GPU"
    fi
    ;;
  wheels)
    # on a machine with a network: the packages the GPU image lacks, for its Python 3.12, as ONE .whl/site-py312.tar.xz
    # (the wheels installed into a folder and xz-packed: ~15 MB where the wheels are ~28 MB, with mlflow's web UI,
    # never used there, left out): the tree a lease carries is capped at 64 MiB. Needs a python3.12 here (PY312).
    py312=${PY312:-python3.12}
    if [ -z "${PY312:-}" ] && ! python3.12 -c '' 2>/dev/null; then  # pyenv's shim, 3.12 not active: its own binary
      for p in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12; do [ -x "$p" ] && py312=$p; done
    fi
    $py312 -c 'import sys; assert sys.version_info[:2] == (3, 12)' || die "no Python 3.12 here (set PY312)"
    echo "wheels: $py312"
    bash "${WHEELS_SH:-../shared/gpu/wheels.sh}" "$@" || die "wheels.sh failed"
    tmp=$(mktemp -d)
    $py312 -m pip install -q --no-index --no-deps --no-compile --target "$tmp/site" .whl/*.whl || die "install failed"
    rm -rf "$tmp/site/mlflow/server/js" "$tmp/site/bin"
    tar -cJf .whl/site-py312.tar.xz -C "$tmp/site" . && rm -rf "$tmp" .whl/*.whl || die "packing failed"
    ls -la .whl
    ;;
  stage)
    # on a machine with a network and the project installed: the cache, and each named corpus prepared, packed
    # (the user cache, filled once if needed, packed as .ffcache/; a corpus prepared into data/<name>-<fingerprint>)
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    mkdir -p .stage
    $PY -m flash_forensics.cli data fetch || die "data fetch failed"
    cache=$($PY -c "from flash_forensics.orchestrator.data.cache import cache_dir; print(cache_dir())")
    # only the tokenizer's ranks (0.3 MB xz): the corpora travel prepared, as data-*.tar.xz (the raw .debs would add
    # ~16 MB to a tree capped at 64 MiB)
    tmp=$(mktemp -d) && mkdir "$tmp/.ffcache" && cp -a "$cache"/tiktoken "$tmp/.ffcache/" \
      && tar -cJf .stage/ffcache.tar.xz -C "$tmp" .ffcache && rm -rf "$tmp" || die "packing $cache failed"
    for spec in "$@"; do
      name=${spec#data=}
      $PY -m flash_forensics.cli data prepare "$spec" || die "prepare $spec failed"
      (cd data && tar -cJf "../.stage/data-$name.tar.xz" "$name"-*) || die "no prepared data/$name-*"
    done
    ls -la .stage
    ;;
  *)
    sed -n '2,/^set -uo pipefail$/p' "$0" | sed '$d' >&2; exit 2  # the header, whatever its length
    ;;
esac
