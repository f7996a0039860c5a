"""Launching: the Hydra task function, the sweep callbacks and the SLURM checks."""
