"""The training job: the train loop, one step, optimizers, DDP, preemption, checkpoints, forks and the run's end."""
