"""flash-forensics: `python run.py` trains a tiny GPT on the CPU with the BF16 flash baseline and the FP32
reference and prints the verdicts. Everything is a Hydra override: see README.md and conf/."""
import hydra
from omegaconf import DictConfig

import orchestrator.schema  # noqa: F401  registers the structured config `base_config`
from orchestrator.job import run_job


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig):
    result = run_job(cfg)
    return result


if __name__ == "__main__":
    main()
