#!/usr/bin/env bash
# What travels to a lent GPU machine is capped at 64 MiB a call: the tracked files present in the tree, untracked
# files git does not ignore, and what the call carries (.whl and .stage: ~31 MB). The committed results outside
# results/bench/ (~33 MB of plots and exports) are read by no GPU task, so they wait outside the tree meanwhile:
#
#   bash scripts/lease_aside.sh size   # MiB that would travel now, with .whl and .stage carried
#   bash scripts/lease_aside.sh out    # before the lease's first call: moves them to $ASIDE (default /tmp/ff-aside)
#   bash scripts/lease_aside.sh back   # after its last call: puts them back (git checkout -- results would too)
#
# results/bench/ stays: `gpu.sh bits` compares against results/bench/kernel-bits-<gpu>.json. `back` never
# overwrites: a file written at the same path meanwhile is kept, and the set-aside copy stays in $ASIDE, named.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
ASIDE=$(realpath -m "${ASIDE:-/tmp/ff-aside}")
cd "$ROOT"
die() { echo "lease_aside: $*" >&2; exit 1; }

case "${1:-}" in
  size)
    # du -cb per xargs batch: every batch's "total" line counts (missing files: set aside, nothing to count)
    tree=$({ git ls-files -z; git ls-files -z --others --exclude-standard; } \
      | { xargs -0 -r du -cb -- 2>/dev/null || true; } | awk '$2 == "total" {s += $1} END {printf "%d", s}')
    carried=$({ du -cb .whl .stage 2>/dev/null || true; } | awk '$2 == "total" {print $1}')
    awk -v t="$tree" -v c="${carried:-0}" 'BEGIN {printf "tree %.1f MiB + .whl/.stage %.1f MiB = %.1f MiB of 64\n",
      t / 2^20, c / 2^20, (t + c) / 2^20}'
    ;;
  out)
    case "$ASIDE/" in "$ROOT"/*) die "ASIDE=$ASIDE is inside the tree: give a folder outside $ROOT";; esac
    [ -e "$ASIDE" ] && die "$ASIDE exists (an earlier 'out'?): put it back first (lease_aside.sh back)"
    n=0
    while IFS= read -r -d '' f; do
      [ -f "$f" ] || continue
      mkdir -p "$ASIDE/$(dirname "$f")" && mv -- "$f" "$ASIDE/$f" || die "moving $f to $ASIDE failed"
      n=$((n + 1))
    done < <(git ls-files -z -- results ':!results/bench')
    echo "lease_aside: $n committed result files moved to $ASIDE; 'bash scripts/lease_aside.sh back' after the lease"
    ;;
  back)
    [ -d "$ASIDE" ] || die "nothing set aside: no $ASIDE"
    n=0; kept=0
    while IFS= read -r -d '' f; do
      f=${f#./}
      if [ -e "$ROOT/$f" ]; then
        echo "lease_aside: $f was written meanwhile: kept; the set-aside copy stays in $ASIDE/$f" >&2; kept=$((kept + 1))
      else
        mkdir -p "$ROOT/$(dirname "$f")" && mv -- "$ASIDE/$f" "$ROOT/$f" || die "putting back $f failed"
        n=$((n + 1))
      fi
    done < <(cd "$ASIDE" && find . -type f -print0)
    find "$ASIDE" -depth -type d -empty -delete
    echo "lease_aside: $n files put back"
    [ "$kept" -eq 0 ] || die "$kept files left in $ASIDE (named above)"
    ;;
  *) die "usage: lease_aside.sh size|out|back (ASIDE=folder, default /tmp/ff-aside)";;
esac
