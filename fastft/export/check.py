"""The read-back check: does the written GGUF file answer like the merged model, and does it stop and chat
like the tokenizer?

1. **Metadata against the tokenizer.** The file's tokens, EOS / BOS / PAD ids and chat template must equal
   the tokenizer's, and the file's template must render a conversation exactly as the tokenizer does.
2. **Answers against the merged model.** The file is run by `fastft.export.reference.GGUFModel` (the
   `gguf` reader, its dequantisers and a PyTorch forward written from llama.cpp's graphs, never
   transformers). The reference is the merged model (LoRA added in fp32, rounded to the 16-bit type the
   export starts from, computed in fp32) run by transformers. On each prompt both answer greedily, and
   the next-token logits are compared at every position of the prompt and the reference's answer; the
   top-1 agreement that is judged is the one at the positions that predict the answer (generation reads
   those), the prompt's own positions are reported beside it.

Tolerances per quantisation (`TOLERANCES`, stated in the README's export section): f32/f16/bf16 must give
the same greedy answer on every prompt; every file must keep its logit error within three times its type's
typical error, and reach its top-1 next-token agreement at the *decided* positions.

A quantisation moves every logit a little: relative to the spread of a position's logits (their standard
deviation over the vocabulary), the RMS error is ~0.02 for q8_0 and ~0.2 for q4_0 (measured on the presets;
each 4 bits fewer is ~16 times the rounding step). Where the reference's two best logits are closer than
such an error can move them apart, the file may pick either: an untrained model's near-uniform logits are
all such near-ties. So a position is judged for top-1 only where the reference's top-1 margin exceeds
`FLIP_MARGIN` times the type's typical error (a flip there needs the two logits' errors to differ by ~2.8
times their RMS difference), and the logit error itself is judged at every answer position: a corrupted
file (a dropped tensor, a wrong RoPE layout, a wrong scale) moves the logits by far more than its type
does, decided positions or not.
"""

from __future__ import annotations

import html
import inspect
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from fastft.export.reference import GGUFModel, read_metadata
from fastft.models.hf_save import merged_tensors
from fastft.runtime.model_state import base_model
from fastft.training.evaluate import prompt_messages

# Function-local imports: tests replace these names on their modules, so they are looked up when called.

# top-1 next-token agreement at the decided positions, whether greedy answers must all match, and the type's
# typical logit error (RMS over the vocabulary, relative to the reference's logit spread; see the docstring)
_LOW_BITS = ("q4_0", "q4_k_s", "q4_k_m", "q5_k_s", "q5_k_m", "q6_k")
TOLERANCES: dict[str, dict[str, float | bool]] = {
    "f32": {"top1": 0.99, "greedy": True, "logit_error": 0.005},
    "f16": {"top1": 0.99, "greedy": True, "logit_error": 0.005},
    "bf16": {"top1": 0.99, "greedy": True, "logit_error": 0.005},
    "q8_0": {"top1": 0.99, "greedy": False, "logit_error": 0.02},
    **{name: {"top1": 0.85, "greedy": False, "logit_error": 0.2} for name in _LOW_BITS},
    **{name: {"top1": 0.70, "greedy": False, "logit_error": 0.4} for name in ("q2_k", "q3_k_m")},
}
FLIP_MARGIN = 4.0  # a position is decided when its top-1 margin exceeds this many typical errors (x spread)
ERROR_FACTOR = 3.0  # a file fails when its mean relative logit error exceeds this many typical errors
DEFAULT_PROMPTS = "bundled:skills-eval"


class GGUFCheckError(RuntimeError):
    """The written file does not answer or stop like the model it came from; ``.check`` holds the details."""

    def __init__(self, check: ExportCheck):
        self.check = check
        super().__init__(check.message())


@dataclass(frozen=True)
class PromptResult:
    """One prompt: both greedy answers, whether they match, and the top-1 agreement of its positions."""

    prompt: str
    reference: str
    exported: str
    matched: bool
    top1: float  # at the decided positions that predict the merged model's answer (1.0 when none is)
    positions: int  # decided answer positions (the reference's top-1 margin above what the type can flip)
    max_logit_diff: float
    top1_prompt: float = 1.0  # at the prompt's own positions (reported, not judged)
    near_ties: int = 0  # answer positions passed over for top-1: margins the type's error can flip
    logit_error: float = 0.0  # mean over the answer positions of the RMS logit error / the logit spread


@dataclass
class ExportCheck:
    """The check of one exported file: per-prompt results, the metadata problems found, the verdict."""

    path: Path
    quantization: str
    prompts: list[PromptResult] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def tolerance(self) -> dict[str, float | bool]:
        return TOLERANCES[self.quantization]

    @property
    def top1(self) -> float:
        """Top-1 agreement over every prompt's decided positions (1.0 when none is decided: then the logit
        error alone judges the file)."""
        total = sum(p.positions for p in self.prompts)
        return sum(p.top1 * p.positions for p in self.prompts) / total if total else 1.0

    @property
    def logit_error(self) -> float:
        """The mean relative logit error over every prompt's answer positions."""
        weights = [p.positions + p.near_ties for p in self.prompts]
        total = sum(weights)
        return (
            sum(p.logit_error * w for p, w in zip(self.prompts, weights, strict=True)) / total
            if total
            else 0.0
        )

    @property
    def near_ties(self) -> int:
        return sum(p.near_ties for p in self.prompts)

    @property
    def matched(self) -> int:
        return sum(p.matched for p in self.prompts)

    @property
    def failures(self) -> list[str]:
        """Every reason the check fails (empty when it passes)."""
        found = list(self.problems)
        if self.prompts and self.top1 < self.tolerance["top1"]:
            found.append(
                f"top-1 next-token agreement {self.top1:.1%} (at the positions whose top-1 margin the "
                f"quantisation cannot flip) is below the {self.tolerance['top1']:.0%} that {self.quantization} "
                "must reach"
            )
        bound = ERROR_FACTOR * self.tolerance["logit_error"]
        if self.prompts and self.logit_error > bound:
            found.append(
                f"the logits differ from the merged model's by {self.logit_error:.3f} of their spread (RMS), "
                f"over {ERROR_FACTOR:.0f} times the {self.tolerance['logit_error']} that {self.quantization} "
                "typically makes: the file computes another model"
            )
        if self.tolerance["greedy"] and self.matched < len(self.prompts):
            found.append(
                f"{len(self.prompts) - self.matched} of {len(self.prompts)} greedy answers differ from the merged "
                f"model's, and at {self.quantization} every one must match"
            )
        return found

    @property
    def passed(self) -> bool:
        return not self.failures

    def message(self) -> str:
        head = (
            f"{self.path.name} ({self.quantization}): {self.matched}/{len(self.prompts)} greedy answers match the "
            f"merged model, top-1 next-token agreement {self.top1:.1%}"
            + (f" ({self.near_ties} near-tied positions passed over)" if self.near_ties else "")
            + f", logit error {self.logit_error:.3f} of the spread"
        )
        if self.passed:
            return head + "; check passed."
        return head + ". The check FAILED:\n- " + "\n- ".join(self.failures)

    def table(self) -> str:
        """A plain-text table of the prompts: matched / differs, and both answers."""
        lines = [self.message(), "", f"{'':8} {'top-1':>6}  prompt → merged | gguf"]
        for p in self.prompts:
            lines.append(
                f"{'matched' if p.matched else 'differs':8} {p.top1:6.1%}  {_short(p.prompt)} → "
                f"{p.reference!r} | {p.exported!r}"
            )
        return "\n".join(lines)

    def html(self) -> str:
        """The per-prompt table as HTML (the studio's Export tab shows it)."""
        rows = "".join(
            f"<tr><td style='color:{'#1a7f37' if p.matched else '#cf222e'}'>{'matched' if p.matched else 'differs'}</td>"
            f"<td style='text-align:right'>{p.top1:.1%}</td><td>{html.escape(_short(p.prompt, 60))}</td>"
            f"<td><code>{html.escape(p.reference)}</code></td><td><code>{html.escape(p.exported)}</code></td></tr>"
            for p in self.prompts
        )
        problems = "".join(f"<li>{html.escape(text)}</li>" for text in self.failures)
        return (
            f"<div><b>{html.escape(self.message().splitlines()[0])}</b></div>"
            + (f"<ul style='color:#cf222e'>{problems}</ul>" if problems else "")
            + "<table style='font-size:12px'><tr><th></th><th>top-1</th><th>prompt</th><th>merged model</th>"
            "<th>GGUF file</th></tr>" + rows + "</table>"
        )


def default_prompts(count: int = 8) -> list[list[dict]]:
    """The first `count` held-out questions the demo and the studio evaluate on, as chat prompts."""
    from fastft.data.loading import load_dataset

    rows = load_dataset(DEFAULT_PROMPTS)
    return [prompt_messages(rows[i]) for i in range(min(count, len(rows)))]


def check_prompts(prompts) -> None:
    """Raise `ValueError` unless `prompts` is None (the defaults) or holds at least one prompt: a check
    that compared nothing would pass having checked nothing."""
    if prompts is None:
        return
    if isinstance(prompts, str):
        raise ValueError(
            f"prompts={prompts[:40]!r} is one string: give a list of prompts (strings or chat conversations)."
        )
    if hasattr(prompts, "__len__") and len(prompts) == 0:
        raise ValueError(
            "prompts is empty: the check would compare nothing and pass having checked nothing. Give at least "
            "one prompt (or prompts=None for 8 held-out questions), or skip the check by name with check=False."
        )


def check_metadata(path: str | os.PathLike, tokenizer, model_config=None) -> list[str]:
    """What in the file's metadata disagrees with the tokenizer (empty when nothing does)."""
    meta = read_metadata(path)
    problems = []
    for kind in ("eos", "bos", "pad"):
        expected = getattr(tokenizer, f"{kind}_token_id", None)
        found = meta.get(f"tokenizer.ggml.{kind}_token_id")
        if expected is not None and found != expected:
            name = getattr(tokenizer, f"{kind}_token", None)
            problems.append(
                f"the file's {kind.upper()} token id is {found}, the tokenizer's is {expected} ({name!r})"
                + (": the exported model would not stop where the trained one does" if kind == "eos" else "")
            )
    tokens = meta.get("tokenizer.ggml.tokens") or []
    vocab = {token_id: token for token, token_id in tokenizer.get_vocab().items()}
    wrong = [i for i, token in vocab.items() if i >= len(tokens) or tokens[i] != token]
    if wrong:
        problems.append(
            f"{len(wrong)} token(s) differ from the tokenizer's vocabulary (first at id {wrong[0]})"
        )
    template = getattr(tokenizer, "chat_template", None)
    found_template = meta.get("tokenizer.chat_template")
    if template and not found_template:
        problems.append(
            "the chat template was dropped: the file has no tokenizer.chat_template, so llama.cpp and Ollama "
            "would prompt the model in a format it was not trained on"
        )
    elif template and found_template != template:
        sample = [
            {"role": "system", "content": "S"},
            {"role": "user", "content": "U"},
            {"role": "assistant", "content": "A"},
            {"role": "user", "content": "V"},
        ]
        try:
            ours = tokenizer.apply_chat_template(sample, tokenize=False, add_generation_prompt=True)
            theirs = tokenizer.apply_chat_template(
                sample, tokenize=False, add_generation_prompt=True, chat_template=found_template
            )
        except Exception as error:  # noqa: BLE001 - a template that fails to render is the problem found
            problems.append(f"the file's chat template does not render: {error}")
        else:
            if ours != theirs:
                problems.append(
                    "the file's chat template renders a conversation differently from the tokenizer's"
                )
    if model_config is not None:
        size = len(tokens)
        if size != model_config.vocab_size:
            problems.append(
                f"the file has {size} tokens, the model's embedding {model_config.vocab_size} rows"
            )
    return problems


def reference_dtype(quantization: str) -> torch.dtype:
    """The type the merged reference is rounded to: the export's own 16/32-bit type, else bf16."""
    return {"f32": torch.float32, "f16": torch.float16}.get(quantization, torch.bfloat16)


def merged_reference(model, quantization: str):
    """The merged model as plain transformers runs it: LoRA added in fp32, its matrices rounded to
    `reference_dtype`, computed in fp32 on the CPU (one extra copy of the weights)."""

    base = base_model(model)
    config = base.config
    dtype = reference_dtype(quantization)
    with torch.device("meta"):
        clean = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # rounded as the file stores them: matrices at the export's 16-bit type, norms and biases (1-D) in f32
    state = {
        key: value.to(dtype).float() if value.dim() > 1 else value.float()
        for key, value in merged_tensors(model)
    }
    clean.load_state_dict(state, strict=False, assign=True)
    clean.tie_weights()
    live_buffers = dict(base.named_buffers())
    for name, module in list(clean.named_modules()):
        if not any(buffer.is_meta for buffer in module.buffers(recurse=False)):
            continue
        # non-persistent buffers are not in a state dict: a RoPE module is rebuilt from the config (its
        # inverse frequencies in fp32); any other (Gemma's embedding scale) takes the trained model's buffer
        if "config" in inspect.signature(type(module)).parameters:
            fresh = type(module)(config=module.config if hasattr(module, "config") else config)
            parent_name, _, child = name.rpartition(".")
            setattr(clean.get_submodule(parent_name) if parent_name else clean, child, fresh)
            continue
        for buffer_name, buffer in list(module.named_buffers(recurse=False)):
            full_name = f"{name}.{buffer_name}" if name else buffer_name
            if buffer.is_meta and full_name in live_buffers:
                module.register_buffer(
                    buffer_name, live_buffers[full_name].detach().cpu().clone(), persistent=False
                )
    left = [name for name, b in clean.named_buffers() if b.is_meta]
    if left:
        raise RuntimeError(f"the merged reference lacks buffers for {left[:3]}")
    left = [name for name, p in clean.named_parameters() if p.is_meta]
    if left:
        raise RuntimeError(f"the merged reference lacks weights for {left[:3]}")
    return clean.eval()


@torch.no_grad()
def _greedy(model, ids: list[int], max_new_tokens: int, stop: set[int]) -> list[int]:
    ids, new = list(ids), []
    for _ in range(max_new_tokens):
        token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        new.append(token)
        ids.append(token)
        if token in stop:
            break
    return new


def check_gguf(
    path: str | os.PathLike,
    model,
    tokenizer,
    quantization: str,
    prompts: list | None = None,
    max_new_tokens: int = 24,
    reference=None,
    progress=None,
) -> ExportCheck:
    """Check the GGUF file at `path` against `model` (the trained PEFT model, or a plain transformers model)
    and `tokenizer`; returns an `ExportCheck` (``.passed``, ``.table()``), never raises on a mismatch.

    `prompts` are chat conversations (lists of messages, answered after a generation prompt) or plain
    strings (at least one); by default the first 8 held-out skills questions. `reference` may pass a merged model already
    built by `merged_reference`; `progress("check", done, total)` is called after each prompt."""
    prompts = list(prompts) if prompts is not None and not isinstance(prompts, str) else prompts
    check_prompts(prompts)
    path = Path(path)
    base = base_model(model)
    check = ExportCheck(path=path, quantization=quantization)
    check.problems = check_metadata(path, tokenizer, base.config)
    exported = GGUFModel(path)
    reference = reference if reference is not None else merged_reference(model, quantization)
    eos = tokenizer.eos_token_id
    file_eos = exported.meta.get("tokenizer.ggml.eos_token_id")
    prompts = prompts if prompts is not None else default_prompts()
    for number, prompt in enumerate(prompts, 1):
        if isinstance(prompt, str):
            text = prompt
        else:
            text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if exported.meta.get("tokenizer.ggml.add_bos_token") and tokenizer.bos_token_id is not None:
            ids = [tokenizer.bos_token_id, *ids] if ids[:1] != [tokenizer.bos_token_id] else ids
        ours = _greedy(reference, ids, max_new_tokens, {eos} if eos is not None else set())
        theirs = exported.generate(ids, max_new_tokens, {file_eos} if file_eos is not None else set())
        sequence = ids + ours
        with torch.no_grad():
            want = reference(torch.tensor([sequence])).logits[0].float()
        got = exported.logits(sequence)
        # the positions that predict the answer (the prompt's last token on): what generation reads; the
        # prompt's own positions (a system prompt's words) are reported apart, in `top1_prompt`
        agree = (want.argmax(-1) == got.argmax(-1)).float()
        answer = slice(len(ids) - 1, -1) if ours else slice(-1, None)
        best = want[answer].topk(2, dim=-1).values
        spread = want[answer].std(dim=-1).clamp_min(1e-12)
        decided = (best[:, 0] - best[:, 1]) > FLIP_MARGIN * check.tolerance["logit_error"] * spread
        error = (got[answer] - want[answer]).pow(2).mean(-1).sqrt() / spread
        check.prompts.append(
            PromptResult(
                prompt=_last_user(prompt),
                reference=tokenizer.decode(ours, skip_special_tokens=True),
                exported=tokenizer.decode(theirs, skip_special_tokens=True),
                matched=ours == theirs,
                top1=float(agree[answer][decided].mean()) if decided.any() else 1.0,
                positions=int(decided.sum()),
                near_ties=int((~decided).sum()),
                logit_error=float(error.mean()),
                top1_prompt=float(agree[: len(ids) - 1].mean()) if len(ids) > 1 else 1.0,
                max_logit_diff=float((want - got).abs().max()),
            )
        )
        if progress is not None:
            progress("check", number, len(prompts))
    return check


def _last_user(prompt) -> str:
    if isinstance(prompt, str):
        return prompt
    users = [m["content"] for m in prompt if m.get("role") == "user"]
    return users[-1] if users else str(prompt[-1].get("content", ""))


def _short(text: str, width: int = 40) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= width else text[: width - 1] + "…"
