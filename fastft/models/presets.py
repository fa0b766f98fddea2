"""Embedded tiny presets: real `transformers` architectures that need no download.

Each preset is a config of a real architecture (Llama, Qwen3, Mistral, Qwen3-MoE, Mixtral, gpt-oss)
shrunk until it trains on two CPU cores, plus a byte-level BPE tokenizer trained on the bundled
data (``assets/tokenizer.json``) with a ChatML chat template. A preset of a family whose chat format
fastft carries (`FAMILY_CHATS`: tiny-qwen3 and tiny-moe have Qwen3's template with its thinking turns,
tiny-llama3 Llama-3.1's, tiny-gpt-oss gpt-oss's harmony format) adds that family's special tokens after
the shared vocabulary and takes its template, BOS, EOS and pad, so templates render and tokenize as with
the real models. Weights are initialised from a fixed seed, so
``load_model("tiny-llama")`` gives the same model in every process.

``python -m fastft.models.presets`` retrains the tokenizer from the bundled data.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used, so listing presets (`fastft models`) needs neither
    import torch
    from transformers import PretrainedConfig, PreTrainedTokenizerFast

# Function-local imports: the CLI's parser and light commands read this module without torch or transformers
# (tests/faces/test_cli.py).

ASSETS_DIR = Path(__file__).parent / "assets"
TOKENIZER_FILE = ASSETS_DIR / "tokenizer.json"
TOKENIZER_VOCAB_SIZE = 512
PRESET_SEED = 1234

SPECIAL_TOKENS = {"pad": "<|endoftext|>", "bos": "<|im_start|>", "eos": "<|im_end|>"}
# ChatML; an assistant reply and its <|im_end|> inside {% generation %} markers, so
# apply_chat_template(return_assistant_tokens_mask=True) and TRL's assistant_only_loss mark what is trained.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{ '\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class FamilyChat:
    """A model family's chat format on the preset tokenizer: the tokens it adds (`special`: never split nor
    skipped; `plain`: added, decoded like text, as Qwen3's ``<think>``), its EOS, its BOS (None: none; when
    set, encoding prepends it, as Llama 3's tokenizer does), its pad (None: the shared ``<|endoftext|>``)
    and its chat template."""

    template: str  # a name of fastft.data.chat_templates.TEMPLATES
    eos: str
    special: tuple[str, ...] = ()
    plain: tuple[str, ...] = ()
    bos: str | None = None
    pad: str | None = None


_LLAMA3_TOKENS = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
FAMILY_CHATS = {
    "qwen3": FamilyChat("qwen3", eos="<|im_end|>", plain=("<think>", "</think>")),
    # Llama-3.1 Instruct's tokenizer: BOS <|begin_of_text|> prepended on encoding, EOS <|eot_id|> (the end of
    # a turn), pad <|finetune_right_pad_id|> (as Unsloth sets it)
    "llama-3.1": FamilyChat(
        "llama-3.1",
        eos="<|eot_id|>",
        special=(*_LLAMA3_TOKENS, "<|finetune_right_pad_id|>"),
        bos="<|begin_of_text|>",
        pad="<|finetune_right_pad_id|>",
    ),
    # gpt-oss's harmony format: a final answer ends with <|return|> (its EOS), other messages with <|end|>
    "gpt-oss": FamilyChat(
        "gpt-oss",
        eos="<|return|>",
        special=("<|start|>", "<|message|>", "<|channel|>", "<|end|>", "<|return|>"),
    ),
}


@dataclass(frozen=True)
class Preset:
    """An embedded model: a `transformers` model type and the config fields that shrink it; `chat` names its
    family's chat format (`FAMILY_CHATS`), ChatML when None."""

    name: str
    model_type: str
    description: str
    config: dict = field(default_factory=dict)
    chat: str | None = None

    @property
    def vocab_size(self) -> int:
        """The embedding rows: the shared vocabulary and the family's added tokens (`load_preset_tokenizer`'s
        length, known without building the tokenizer)."""
        if self.chat is None:
            return TOKENIZER_VOCAB_SIZE
        chat = FAMILY_CHATS[self.chat]
        return TOKENIZER_VOCAB_SIZE + len(chat.special) + len(chat.plain)

    def make_config(self, vocab_size: int) -> PretrainedConfig:
        from transformers import AutoConfig

        fields = dict(self.config, vocab_size=vocab_size, max_position_embeddings=4096)
        return AutoConfig.for_model(self.model_type, **fields)


_ATTENTION = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=10000.0)

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "tiny-llama",
            "llama",
            "Llama architecture, 4 layers, hidden 128 (the default)",
            dict(_ATTENTION, hidden_size=128, intermediate_size=344, num_hidden_layers=4),
        ),
        Preset(
            "tiny-llama3",
            "llama",
            "Llama architecture as tiny-llama, random weights, with Llama-3.1's tokens and chat template",
            dict(_ATTENTION, hidden_size=128, intermediate_size=344, num_hidden_layers=4),
            chat="llama-3.1",
        ),
        Preset(
            "tiny-qwen3",
            "qwen3",
            "Qwen3 architecture (per-head q/k RMSNorm, tied embeddings), 3 layers, hidden 96",
            dict(
                _ATTENTION,
                hidden_size=96,
                intermediate_size=264,
                num_hidden_layers=3,
                tie_word_embeddings=True,
            ),
            chat="qwen3",
        ),
        Preset(
            "tiny-mistral",
            "mistral",
            "Mistral architecture (sliding-window attention), 3 layers, hidden 128",
            dict(
                _ATTENTION,
                hidden_size=128,
                intermediate_size=320,
                num_hidden_layers=3,
                num_key_value_heads=1,
                sliding_window=64,
            ),
        ),
        Preset(
            "tiny-moe",
            "qwen3_moe",
            "Qwen3-MoE architecture: 8 experts, top-2, 2 layers, hidden 96",
            dict(
                _ATTENTION,
                hidden_size=96,
                intermediate_size=192,
                moe_intermediate_size=64,
                num_experts=8,
                num_experts_per_tok=2,
                norm_topk_prob=True,
                decoder_sparse_step=1,
                num_hidden_layers=2,
            ),
            chat="qwen3",  # Qwen3-30B-A3B's template is Qwen3's
        ),
        Preset(
            "tiny-mixtral",
            "mixtral",
            "Mixtral architecture: 4 experts, top-2, 2 layers, hidden 96",
            dict(
                _ATTENTION,
                hidden_size=96,
                intermediate_size=128,
                num_local_experts=4,
                num_experts_per_tok=2,
                num_hidden_layers=2,
            ),
        ),
        Preset(
            "tiny-gpt-oss",
            "gpt_oss",
            "gpt-oss architecture (attention sinks, biased experts, clamped SwiGLU): 4 experts, top-2, "
            "2 layers, hidden 96",
            dict(
                _ATTENTION,
                hidden_size=96,
                intermediate_size=64,
                num_local_experts=4,
                num_experts_per_tok=2,
                num_hidden_layers=2,
                sliding_window=16,
            ),
            chat="gpt-oss",
        ),
    )
}

DEFAULT_PRESET = "tiny-llama"


def load_preset_tokenizer(name: str | None = None) -> PreTrainedTokenizerFast:
    """The byte-level BPE tokenizer shared by every preset, with its ChatML template; for preset `name` of a
    family in `FAMILY_CHATS`, with that family's tokens, EOS and chat template."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(TOKENIZER_FILE),
        pad_token=SPECIAL_TOKENS["pad"],
        eos_token=SPECIAL_TOKENS["eos"],
        additional_special_tokens=[SPECIAL_TOKENS["bos"]],
        padding_side="right",
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    family = PRESETS[name].chat if name in PRESETS else None
    if family is not None:
        from fastft.data.chat_templates import TEMPLATES

        chat = FAMILY_CHATS[family]
        if chat.special:
            tokenizer.add_special_tokens({"additional_special_tokens": list(chat.special)})
        if chat.plain:
            tokenizer.add_tokens(list(chat.plain))
        tokenizer.eos_token = chat.eos
        if chat.pad is not None:
            tokenizer.pad_token = chat.pad
        if chat.bos is not None:
            from tokenizers.processors import TemplateProcessing

            tokenizer.bos_token = chat.bos
            bos = (chat.bos, tokenizer.convert_tokens_to_ids(chat.bos))
            tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
                single=f"{chat.bos} $A", pair=f"{chat.bos} $A {chat.bos} $B", special_tokens=[bos]
            )
        tokenizer.chat_template = TEMPLATES[chat.template].text()
    return tokenizer


def build_preset_model(
    preset: Preset,
    vocab_size: int,
    dtype: torch.dtype,
    warm_start: bool = True,
    eos_token_id: int = 2,
    pad_token_id: int = 0,
    bos_token_id: int | None = None,
) -> torch.nn.Module:
    """The preset's architecture with weights drawn from a fixed seed (global RNG left untouched),
    replaced by its shipped warm-start weights where it has them (see `fastft.training.warmstart`).
    `eos_token_id`, `pad_token_id`, `bos_token_id`: its tokenizer's (`load_preset_tokenizer(name)`; a BOS of
    None leaves the architecture's default)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, GenerationConfig

    config = preset.make_config(vocab_size)
    config.pad_token_id, config.eos_token_id = pad_token_id, eos_token_id
    if bos_token_id is not None:  # tiny-llama3's <|begin_of_text|>, as Llama 3's config names its BOS
        config.bos_token_id = bos_token_id
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(PRESET_SEED)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    weights = ASSETS_DIR / f"{preset.name}.safetensors"
    if warm_start and weights.exists():
        model.load_state_dict(load_file(weights), strict=not config.tie_word_embeddings)
        model.to(dtype)
    bos = {} if bos_token_id is None else {"bos_token_id": bos_token_id}
    model.generation_config = GenerationConfig(
        **bos, pad_token_id=pad_token_id, eos_token_id=eos_token_id, do_sample=False
    )
    return model


def train_tokenizer(path: Path = TOKENIZER_FILE, vocab_size: int = TOKENIZER_VOCAB_SIZE) -> None:
    """Train the preset tokenizer on the bundled data (all texts the demo trains and evaluates on)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from fastft.data.skills import BUNDLED_DIR

    def texts():
        for file in sorted(BUNDLED_DIR.glob("*.jsonl")):
            with open(file, encoding="utf-8") as f:
                for line in f:
                    for message in json.loads(line).get("messages", []):
                        yield message["role"] + "\n" + message["content"]

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[SPECIAL_TOKENS["pad"], SPECIAL_TOKENS["bos"], SPECIAL_TOKENS["eos"]],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts(), trainer=trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))


if __name__ == "__main__":
    train_tokenizer()
    print(f"wrote {TOKENIZER_FILE}")
