"""Capture and analyze the default CPU model: train the embedded default's tiny GPT briefly (experiment=default,
the paper_bf16 baseline, through the project's own job), capture every layer's attention at the last step, and
analyze the layer with the most tie rows offline. Writes results/capture_default/: the capture (.safetensors), its
report (.md, .html, .json) and RUN.md (the command, the job's numbers, the times).

    python scripts/capture_default.py                 # 60 steps, a few minutes on a 2-core CPU
    python scripts/capture_default.py --steps 20 --out /tmp/cd
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60, help="optimizer steps (the capture is at the last one)")
    ap.add_argument("--recipe", default="paper_bf16", help="attention.recipe of the run (default: the baseline's)")
    ap.add_argument("--out", default=str(ROOT / "results" / "capture_default"))
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (see `--threads` of the analysis)")
    args = ap.parse_args(argv)
    import torch
    torch.set_num_threads(args.threads)
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import flash_forensics.orchestrator.config.schema  # noqa: F401  (registers base_config)
    from flash_forensics.capture import snapshot as S
    from flash_forensics.capture.cli import main as analyze_main
    from flash_forensics.kernels.config import AttentionKnobs
    from flash_forensics.kernels.probes import tie_rows
    from flash_forensics.orchestrator.launch.task import run_job

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        overrides = ["experiment=default", "intervention=baseline", f"attention.recipe={args.recipe}",
                     f"train.max_steps={args.steps}",
                     "train.ckpt_every=0", "train.eval_every=0", f"monitor.capture.steps=[{args.steps - 1}]",
                     f"tracking.uri=sqlite:///{tmp}/mlflow.db", f"results_dir={tmp}/results"]
        GlobalHydra.instance().clear()
        with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
            cfg = compose("config", overrides=overrides)
        GlobalHydra.instance().clear()
        res = run_job(cfg, job_dir=Path(tmp) / "job", overrides=overrides)
        train_s = time.perf_counter() - t0
        if res.get("observed") == "failed" or not res.get("captures"):
            print(f"the job failed or captured nothing: {res.get('error')}", file=sys.stderr)
            return 1

        def ties(p):
            s = S.read(p)
            return int(tie_rows(s.q, s.k, AttentionKnobs(**s.meta["knobs"]))[0].sum())
        counts = {p: ties(p) for p in res["captures"]}
        best = max(counts, key=lambda p: (counts[p], p))
        for old in out.glob("*.safetensors"):
            old.unlink()
        dest = out / Path(best).name
        shutil.copyfile(best, dest)
    t1 = time.perf_counter()
    rc = analyze_main([os.path.relpath(dest), "--out", str(out), "--quiet", "--threads", str(args.threads)])
    analyze_s = time.perf_counter() - t1
    meta = S.read(dest).meta
    cmd = "python scripts/capture_default.py" + "".join(f" {a}" for a in (sys.argv[1:] if argv is None else argv))
    (out / "RUN.md").write_text(
        "# The default CPU model, captured and analyzed\n\n"
        f"Command: `{cmd}` (then, on any machine: `flash-forensics analyze {dest.name}`)\n\n"
        f"- job: `{' '.join(overrides[:7])}`; final loss {res.get('final_loss')}, observed {res.get('observed')}\n"
        f"- captured every layer at step {args.steps - 1}; tie rows per capture: "
        + ", ".join(f"{Path(p).stem}: {n}" for p, n in counts.items())
        + f"; kept `{dest.name}` (the most tie rows), {dest.stat().st_size / 2**20:.2f} MiB\n"
        f"- layer {meta['layer']}, heads {meta['heads']}, shape {meta['shape']}, commit `{meta['git_commit']}`\n"
        f"- training + capture {train_s:.0f} s, analysis {analyze_s:.0f} s on {os.cpu_count()} CPUs "
        f"(load averages {[round(x, 2) for x in os.getloadavg()]} at the end)\n"
        f"- report: {dest.stem}.md, {dest.stem}.html, {dest.stem}.json\n")
    print(f"wrote {out}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
