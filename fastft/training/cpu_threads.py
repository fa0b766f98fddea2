"""The CPU thread count for a training run, chosen as the demo chooses it: one training micro-batch timed at
one thread and at torch's default (`fastft.runtime.threads.choose_cpu_threads`), the faster kept."""

from __future__ import annotations

from fastft.runtime.threads import ThreadChoice, choose_cpu_threads
from fastft.training.loss import causal_lm_loss_sum


def choose_training_threads(model, train_data, micro_batch_bins: int) -> ThreadChoice | None:
    """On a CPU, keep the faster of one thread and torch's default for one training micro-batch of
    `train_data` (a `PackedDataset`, pairs included); None on a GPU (nothing is timed or set)."""
    device = next(model.parameters()).device
    if device.type != "cpu":
        return None
    batch = train_data.batch(range(min(micro_batch_bins, len(train_data)))).to(device)

    def micro_batch() -> None:
        causal_lm_loss_sum(model, batch).backward()
        model.zero_grad(set_to_none=True)

    return choose_cpu_threads(micro_batch)
