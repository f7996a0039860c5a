"""flash-forensics: `python run.py` trains a tiny GPT on the CPU with the BF16 flash baseline and the FP32
reference and prints the verdicts. Everything is a Hydra override: see README.md and conf/."""
import sys

import hydra
from omegaconf import DictConfig

import flash_forensics.orchestrator.config.schema  # noqa: F401  registers the structured config `base_config`
from flash_forensics.orchestrator.config.keys import check_keys
from flash_forensics.orchestrator.launch.task import exit_status, is_multirun, run_job, sweep_status

_status = 0
_results = []  # this process's jobs (a multirun's, with the basic launcher)


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig):
    global _status
    result = run_job(cfg)
    _results.append(result)
    _status = max(_status, exit_status(result, is_multirun()))  # a failed single run exits 1
    return result


def multirun_flag_first(argv):
    """`python run.py a=1 -m b=1,2`: Hydra's parser takes the overrides in one run of positionals, so those after -m
    were 'unrecognized arguments: b=1,2' (naming the override, not the flag's place); -m/--multirun go first."""
    flags = [a for a in argv[1:] if a in ("-m", "--multirun")]
    return [argv[0], *flags, *(a for a in argv[1:] if a not in flags)]


if __name__ == "__main__":
    sys.argv = multirun_flag_first(sys.argv)
    bad = check_keys(sys.argv[1:])  # a typo'd key, before Hydra composes (its hint, `+key=...`, would not help)
    if bad:
        print("Error: configuration rejected, nothing launched.\n" + "\n".join(bad), file=sys.stderr)
        sys.exit(1)
    main()
    sys.exit(max(_status, sweep_status(_results)))  # a multirun whose every job failed exits 1 too
