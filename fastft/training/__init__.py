"""Training: the trainer and its events, the loss, CUDA graphs, checkpoints, evaluation, step timing."""
