"""Unsloth's trainer names: `UnslothTrainer` / `UnslothTrainingArguments` (TRL's SFT trainer and config with
``embedding_learning_rate``, the continued-pretraining notebooks' learning rate for the embeddings and head
trained whole), `unsloth_train`, and `PatchDPOTrainer` / `PatchFastRL`, which Unsloth's notebooks call before
building a DPO / GRPO trainer: here they make sure TRL takes Unsloth's argument names
(`fastft.unsloth.trl_compat`, already done on ``import fastft.unsloth``)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from trl import SFTConfig, SFTTrainer

from fastft.unsloth.trl_compat import _adapt_init, _config_kwargs, adapt_trl


@dataclass
class UnslothTrainingArguments(SFTConfig):
    """`trl.SFTConfig` with ``embedding_learning_rate``: the learning rate of the modules trained whole
    (``modules_to_save``: ``embed_tokens``, ``lm_head``); None trains them at ``learning_rate``."""

    embedding_learning_rate: float | None = field(
        default=None, metadata={"help": "Learning rate of the modules trained whole (embeddings, head)."}
    )


_adapt_init(UnslothTrainingArguments, functools.partial(_config_kwargs, UnslothTrainingArguments))


class UnslothTrainer(SFTTrainer):
    """`trl.SFTTrainer` whose optimizer gives the modules trained whole (``modules_to_save``) their own
    learning rate, ``args.embedding_learning_rate`` (Unsloth's continued-pretraining recipe)."""

    def create_optimizer(self, model=None):
        rate = getattr(self.args, "embedding_learning_rate", None)
        if rate is None or self.optimizer is not None:
            return super().create_optimizer(model)
        model = self.model if model is None else model
        decay = set(self.get_decay_parameter_names(model))
        groups: dict[tuple[bool, bool], list] = {}
        for name, parameter in model.named_parameters():
            if parameter.requires_grad:
                groups.setdefault(("modules_to_save" in name, name in decay), []).append(parameter)
        optimizer_cls, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(self.args, model)
        self.optimizer = optimizer_cls(
            [
                {
                    "params": parameters,
                    "weight_decay": self.args.weight_decay if decayed else 0.0,
                    **({"lr": rate} if whole else {}),
                }
                for (whole, decayed), parameters in groups.items()
            ],
            **optimizer_kwargs,
        )
        return self.optimizer


def unsloth_train(trainer, *args, **kwargs):
    """Unsloth's ``unsloth_train(trainer)``: ``trainer.train()`` (transformers 5 already accumulates gradients
    the way Unsloth's function fixed)."""
    return trainer.train(*args, **kwargs)


def PatchDPOTrainer() -> None:  # noqa: N802 (Unsloth's name)
    """Unsloth's ``PatchDPOTrainer()``: TRL's DPO / ORPO / KTO trainers take Unsloth's argument names
    (done once on ``import fastft.unsloth``; calling it again changes nothing)."""
    adapt_trl()


def PatchFastRL(algorithm: str | None = None, FastLanguageModel=None) -> None:  # noqa: N802, N803
    """Unsloth's ``PatchFastRL("GRPO", FastLanguageModel)``: TRL's GRPO trainer takes Unsloth's argument names
    (done once on ``import fastft.unsloth``; calling it again changes nothing)."""
    adapt_trl()
