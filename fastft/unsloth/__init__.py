"""Unsloth's names and arguments on fastft: change ``from unsloth…`` to ``from fastft.unsloth…``."""
