"""The training engine: loss, the trainer and its events, checkpoints, evaluation."""
