"""What a patched layer calls while it runs: packed attention, MoE routing, offloaded checkpointing."""
