"""The Export panel: keep the trained adapter, merge it into a 16-bit model, export a checked GGUF file or
Ollama folder, try a prompt (streamed), and score held-out answers (content accuracy beside format
compliance, as `fastft demo` reports them).

Saving, merging and generating run one at a time on a background thread (`Worker`), so a click returns
at once; ``panel.wait()`` blocks until the job is done (scripts, tests). None of them runs while a
training run is active: a step in flight would be caught halfway (the Run panel's Save checkpoint
writes one between steps instead).
"""

from __future__ import annotations

import html
import threading
import time

import ipywidgets as widgets
import torch
from transformers import TextIteratorStreamer

import fastft.weight_formats as weight_formats
from fastft.export import GGUFCheckError, save_gguf, save_ollama
from fastft.models.hf_save import save_adapter, save_merged
from fastft.models.stops import stop_token_ids
from fastft.studio.notices import Panel, button, code_html, code_section, error_html, field, row, status_html
from fastft.studio.state import StudioState, Worker
from fastft.training.evaluate import evaluate_accuracy

# Function-local imports: tests replace these names on their modules, so they are looked up when called.

__all__ = ["ExportPanel"]

STREAM_INTERVAL = 0.05  # seconds between updates of the streamed answer (≤ 20 a second)
HELD_OUT = "bundled:skills-eval"  # questions never trained on (the bundled data holds none of them)
# (label, quantization) of the GGUF export; the K-quants need llama.cpp's llama-quantize on PATH
GGUF_CHOICES = [
    ("q8_0 (8-bit, near lossless)", "q8_0"),
    ("bf16 (16-bit, exact)", "bf16"),
    ("f16 (16-bit)", "f16"),
    ("q4_0 (4-bit)", "q4_0"),
    ("q4_k_m (4-bit K-quant, llama-quantize)", "q4_k_m"),
    ("q5_k_m (5-bit K-quant, llama-quantize)", "q5_k_m"),
]


def _notice(text: str, kind: str = "info", title: str | None = None) -> str:
    if not text:
        return ""
    return error_html(text, title) if kind == "error" else status_html(text, kind)


def quantized_base(model) -> str | None:
    """ "4-bit" / "8-bit" (the studio's precision choice) when the model's base weights are quantised (merging
    is refused), else None."""
    record = weight_formats.of_model(model)
    return record.choice if record.quantized and record.merge != "as-is" else None


class ExportPanel(Panel):
    """Save the adapter, merge to 16-bit, and generate from a prompt with the trained model.

    Controls: `adapter_dir` + `save_adapter_button` (`fastft.save_adapter`), `merged_dir` +
    `merge_button` (`fastft.save_merged`, refused for a 4/8-bit base with the way round it),
    `prompt`, `max_new_tokens`, `temperature` (0: greedy) + `generate_button`. The answer streams into
    `answer` token by token (`completion` holds its text); `status` shows what happened or what to fix.
    `questions` + `score_button` ask that many held-out skills questions (`fastft.evaluate_accuracy`) and
    show, per task, content accuracy (the right answer in any wording) beside format compliance (the bare
    answer the system prompt asks for) in `scores` (`last_scores` holds the `AccuracyResult`).
    """

    def __init__(self, state: StudioState | None = None):
        self.state = state if state is not None else StudioState()
        self.worker = Worker("fastft-export")
        self.completion = ""
        self.updates = 0  # how many times the streamed answer was redrawn
        self.last_saved: str | None = None
        style = {"description_width": "10em"}  # "quantization", "max new tokens" in full

        def wide():  # each control its own Layout: grows with the panel, wraps under a narrow one
            return field("24em", max_width="40em")

        self.adapter_dir = widgets.Text(
            value="runs/adapter", description="adapter folder", style=style, layout=wide()
        )
        self.save_adapter_button = button(description="Save adapter", icon="save", button_style="primary")
        self.merged_dir = widgets.Text(
            value="runs/merged", description="merged folder", style=style, layout=wide()
        )
        self.merge_button = button(description="Merge to 16-bit", icon="compress")
        self.gguf_format = widgets.ToggleButtons(
            options=[("GGUF file", "gguf"), ("Ollama folder", "ollama")],
            value="gguf",
            description="export as",
            style=style,
        )
        self.gguf_quantization = widgets.Dropdown(
            options=GGUF_CHOICES, value="q8_0", description="quantization", style=style, layout=wide()
        )
        self.gguf_path = widgets.Text(
            value="runs/model.gguf", description="GGUF path", style=style, layout=wide()
        )
        self.gguf_button = button(description="Export + check", icon="download")
        self.gguf_progress = widgets.IntProgress(
            value=0, min=0, max=1, description="", bar_style="info", layout=wide()
        )
        self.gguf_stage = widgets.HTML("")
        self.gguf_check = widgets.HTML("")
        self.last_export = None
        self.prompt = widgets.Textarea(
            value="Compute 48 plus 8.",
            description="prompt",
            style=style,
            # no side margins: at 100 % width they would push the box past the tab's edge
            layout=widgets.Layout(width="100%", max_width="48em", height="6em", margin="2px 0"),
        )
        self.max_new_tokens = widgets.IntSlider(
            value=64, min=1, max=1024, description="max new tokens", style=style, layout=wide()
        )
        self.temperature = widgets.FloatSlider(
            value=0.0, min=0.0, max=2.0, step=0.05, description="temperature", style=style, layout=wide()
        )
        self.generate_button = button(description="Generate", icon="play", button_style="success")
        self.answer = widgets.HTML("")
        self.questions = widgets.IntSlider(
            value=64, min=8, max=256, step=8, description="questions", style=style, layout=wide()
        )
        self.score_button = button(description="Score held-out answers", icon="check")
        self.code_view = widgets.HTML("")
        self.scores = widgets.HTML("")
        self.last_scores = None
        self.status = widgets.HTML("")
        self._defaults = {
            "adapter": self.adapter_dir.value,
            "merged": self.merged_dir.value,
            "gguf": self.gguf_path.value,
        }

        self.save_adapter_button.on_click(self._on_save_adapter)
        self.merge_button.on_click(self._on_merge)
        self.gguf_button.on_click(self._on_gguf)
        self.gguf_format.observe(self._on_gguf_format, "value")
        self.generate_button.on_click(self._on_generate)
        self.score_button.on_click(self._on_score)
        self.state.observe(self._on_state, ("run", "model"))
        self.widget = widgets.VBox(
            [
                widgets.HTML("<b>Keep the result</b>"),
                row([self.adapter_dir, self.save_adapter_button]),
                row([self.merged_dir, self.merge_button]),
                widgets.HTML(
                    "<b>Export for llama.cpp / Ollama / LM Studio</b> (read back and checked against the merged model)"
                ),
                row([self.gguf_format, self.gguf_quantization]),
                row([self.gguf_path, self.gguf_button]),
                row([self.gguf_progress, self.gguf_stage]),
                self.gguf_check,
                widgets.HTML("<b>Try a prompt</b>"),
                self.prompt,
                row([self.max_new_tokens, self.temperature]),
                self.generate_button,
                self.answer,
                widgets.HTML(f"<b>Score held-out answers</b> ({HELD_OUT})"),
                row([self.questions, self.score_button]),
                self.scores,
                self.status,
                code_section(self.code_view),
            ]
        )
        for control in (
            self.adapter_dir,
            self.merged_dir,
            self.gguf_path,
            self.gguf_format,
            self.gguf_quantization,
        ):
            control.observe(lambda _change: self._show_code(), "value")
        self._on_state("run")

    # -- state -------------------------------------------------------------------------------------------
    def _show_code(self) -> None:
        self.code_view.value = code_html(self.code())

    def _on_state(self, name: str) -> None:
        """Follow the run's output folder, unless the user typed their own."""
        self._show_code()
        config = getattr(self.state.run, "config", None)
        output = getattr(config, "output_dir", None)
        if not output:
            return
        output = output.rstrip("/")
        for key, widget in (("adapter", self.adapter_dir), ("merged", self.merged_dir)):
            if widget.value == self._defaults[key]:
                widget.value = self._defaults[key] = f"{output}/{key}"
        if self.gguf_path.value == self._defaults["gguf"]:
            self.gguf_path.value = self._defaults["gguf"] = self._gguf_default(output)

    def _ready(self) -> str | None:
        """Why nothing can be exported now, or None."""
        if self.state.model is None or self.state.tokenizer is None:
            return (
                "No model yet. Fix: load one and apply LoRA in the Model tab, then train it in the Run tab."
            )
        run = self.state.run
        if run is not None and getattr(run, "active", False):
            return (
                "A run is training this model. Fix: stop it or wait for it to finish (Save checkpoint in the "
                "Run tab writes one between steps)."
            )
        if self.worker.busy:
            return "Still busy with the last export or generation; wait for it to finish."
        return None

    def _show(self, text: str, kind: str = "info", title: str | None = None) -> None:
        self.status.value = _notice(text, kind, title or "Not done")

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the running save, merge or generation is done."""
        return self.worker.wait(timeout)

    # -- save and merge ------------------------------------------------------------------------------------
    def _on_save_adapter(self, _button=None) -> None:
        folder = self.adapter_dir.value.strip()
        if not self._refused(folder, "Name a folder for the adapter."):
            self._start(f"Saving the adapter to {folder}…", self._save_adapter, folder)

    def _write(self, save, folder: str):
        """`save(model, folder, tokenizer)` of the state's model; the path it wrote is kept as `last_saved`."""
        path = save(self.state.model, folder, self.state.tokenizer)
        self.last_saved = str(path)
        return path

    def _save_adapter(self, folder: str) -> str:
        path = self._write(save_adapter, folder)
        self.state.mark_saved(str(path))  # loading another model will not save this adapter again
        return f"Adapter saved to {path}. Load it with peft.PeftModel.from_pretrained(base_model, {str(path)!r})."

    def _on_merge(self, _button=None) -> None:
        bits = None if self._ready() else quantized_base(self.state.model)
        if bits:
            self._show(
                f"This model's base is loaded in {bits}, and merging into quantised weights is "
                "lossy. Fix: save the adapter, load the base in 16-bit (precision 16-bit, or "
                "fastft.load_model(name, load_in_4bit=False)), attach the adapter with "
                "peft.PeftModel.from_pretrained(base, adapter_folder), then merge.",
                "error",
                "Not merged",
            )
            return
        folder = self.merged_dir.value.strip()
        if not self._refused(folder, "Name a folder for the merged model."):
            self._start(f"Merging into a 16-bit model in {folder}…", self._merge, folder)

    def _merge(self, folder: str) -> str:
        path = self._write(save_merged, folder)
        return f"Merged 16-bit model saved to {path}; transformers.AutoModelForCausalLM.from_pretrained loads it."

    # -- GGUF / Ollama ---------------------------------------------------------------------------------------
    def _gguf_default(self, output: str = "runs") -> str:
        return f"{output}/model.gguf" if self.gguf_format.value == "gguf" else f"{output}/ollama"

    def _on_gguf_format(self, _change=None) -> None:
        """Switch the default path between a .gguf file and an Ollama folder (unless the user typed one)."""
        if self.gguf_path.value == self._defaults["gguf"] or self.gguf_path.value in (
            "runs/model.gguf",
            "runs/ollama",
        ):
            output = self.gguf_path.value.rpartition("/")[0] or "runs"
            self.gguf_path.value = self._defaults["gguf"] = self._gguf_default(output)
        self.gguf_path.description = "GGUF path" if self.gguf_format.value == "gguf" else "Ollama folder"

    def _on_gguf(self, _button=None) -> None:
        target = self.gguf_path.value.strip()
        if self._refused(target, "Name a file (model.gguf) or an Ollama folder."):
            return
        self.gguf_progress.value, self.gguf_progress.max, self.gguf_progress.bar_style = 0, 1, "info"
        self.gguf_check.value = ""
        kind, quantization = self.gguf_format.value, self.gguf_quantization.value
        self._start(f"Exporting to {target}…", self._export_gguf, kind, target, quantization)

    def _gguf_progress(self, stage: str, done: int, total: int) -> None:
        self.gguf_progress.max = max(total, 1)
        self.gguf_progress.value = done
        what = "tensors written" if stage == "write" else "prompts checked"
        self.gguf_stage.value = f"{done}/{total} {what}"

    def _export_gguf(self, kind: str, target: str, quantization: str) -> str:
        save = save_gguf if kind == "gguf" else save_ollama
        self.gguf_stage.value = "writing…"
        try:
            result = save(
                self.state.model, target, self.state.tokenizer, quantization, progress=self._gguf_progress
            )
        except GGUFCheckError as error:
            self.gguf_progress.bar_style = "danger"
            self.gguf_stage.value = "check failed"
            self.gguf_check.value = error.check.html()
            raise
        self.last_export = result
        self.gguf_progress.value = self.gguf_progress.max
        self.gguf_progress.bar_style = "success"
        self.gguf_stage.value = "checked"
        self.gguf_check.value = result.check.html() if result.check is not None else ""
        where = f"{result.path}" + (
            f" and {result.modelfile} (ollama create NAME -f {result.modelfile})" if result.modelfile else ""
        )
        return f"Exported {where}. {result.check.message() if result.check else ''}"

    def _refused(self, value: str, missing: str) -> bool:
        """Whether a button's job cannot start: nothing can be exported now (`_ready`), or `value` (a folder,
        a path or a prompt) is blank, `missing` saying what to fill in. The reason is shown."""
        problem = self._ready() or (None if value.strip() else missing)
        if problem:
            self._show(problem, "error")
        return problem is not None

    def _start(self, busy: str, function, *args) -> None:
        """Say `busy`, then run `function(*args)` on the panel's worker (its answer or error shown)."""
        self._show(busy, "busy")
        self.worker.start(lambda: self._job(function, *args))

    def _job(self, function, *args) -> None:
        try:
            self._show(function(*args), "ok")
        except Exception as error:  # noqa: BLE001 - shown with its fix, never raised into the notebook
            self._show(str(error) or repr(error), "error", type(error).__name__)

    # -- generation ----------------------------------------------------------------------------------------
    def _on_generate(self, _button=None) -> None:
        prompt = self.prompt.value
        if self._refused(prompt, "Type a prompt first."):
            return
        self.completion, self.updates = "", 0
        self.answer.value = ""
        max_new_tokens, temperature = int(self.max_new_tokens.value), float(self.temperature.value)
        self._start("Generating…", self._generate, prompt, max_new_tokens, temperature)

    def _generate(self, prompt: str, max_new_tokens: int, temperature: float) -> str:
        """Stream the answer into `answer`: generation on its own thread, tokens read here as they come."""

        model, tokenizer = self.state.model, self.state.tokenizer
        device = next(model.parameters()).device
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
            inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False).to(device)
        else:
            inputs = tokenizer(prompt, return_tensors="pt").to(device)
        streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        sampling = (
            {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
        )
        failure: list[BaseException] = []

        def run() -> None:
            try:
                with torch.no_grad():
                    model.generate(
                        **inputs,
                        max_new_tokens=max_new_tokens,
                        streamer=streamer,
                        pad_token_id=tokenizer.pad_token_id,
                        eos_token_id=stop_token_ids(model, tokenizer),
                        **sampling,
                    )
            except BaseException as error:  # noqa: BLE001 - re-raised on the reading side
                failure.append(error)
                streamer.end()  # unblock the reader

        was_training = model.training
        model.eval()
        started = time.monotonic()
        try:
            thread = threading.Thread(target=run, name="fastft-generate", daemon=True)
            thread.start()
            last = 0.0
            for piece in streamer:
                self.completion += piece
                now = time.monotonic()
                if now - last >= STREAM_INTERVAL:
                    last = now
                    self._draw_answer()
            thread.join()
        finally:
            model.train(was_training)
        self._draw_answer()
        if failure:
            raise failure[0]
        tokens = (
            len(tokenizer(self.completion, add_special_tokens=False)["input_ids"]) if self.completion else 0
        )
        seconds = time.monotonic() - started
        return f"Generated {tokens} tokens in {seconds:.1f} s."

    # -- scoring ----------------------------------------------------------------------------------------------
    def _on_score(self, _button=None) -> None:
        problem = self._ready()
        if problem:
            self._show(problem, "error")
            return
        self._show("Scoring…", "busy")
        self.worker.start(lambda: self._job(self._score, int(self.questions.value)))

    def _score(self, count: int) -> str:
        from fastft.data.loading import load_dataset

        rows = load_dataset(HELD_OUT)
        rows = list(rows.select(range(min(count, len(rows)))))
        result = evaluate_accuracy(self.state.model, self.state.tokenizer, rows)
        self.last_scores = result
        self.scores.value = scores_html(result)
        return (
            f"{len(rows)} held-out questions: content accuracy {result.content:.1%}, "
            f"format compliance {result.overall:.1%}."
        )

    def _draw_answer(self) -> None:
        self.updates += 1
        self.answer.value = (
            "<pre style='white-space:pre-wrap;margin:0;padding:6px;background:#f6f8fa;border-radius:4px'>"
            f"{html.escape(self.completion)}</pre>"
        )

    # -- code -------------------------------------------------------------------------------------------
    def code(self) -> str:
        """Saving, merging and a streamed generation in plain Python (after training `model`)."""
        return (
            "import fastft\n"
            "from transformers import TextStreamer\n\n"
            f"fastft.save_adapter(model, {self.adapter_dir.value.strip()!r}, tokenizer)\n"
            f"fastft.save_merged(model, {self.merged_dir.value.strip()!r}, tokenizer)  # 16-bit bases only\n"
            f"export = fastft.{'save_gguf' if self.gguf_format.value == 'gguf' else 'save_ollama'}(model, "
            f"{self.gguf_path.value.strip()!r}, tokenizer, {self.gguf_quantization.value!r})\n"
            "print(export.check.table())  # per prompt: matched / differs against the merged model\n\n"
            f"messages = [{{'role': 'user', 'content': {self.prompt.value!r}}}]\n"
            "text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)\n"
            "inputs = tokenizer(text, return_tensors='pt', add_special_tokens=False).to(model.device)\n"
            "model.eval()\n"
            f"model.generate(**inputs, max_new_tokens={int(self.max_new_tokens.value)}, "
            + (
                f"do_sample=True, temperature={float(self.temperature.value)}, "
                if self.temperature.value > 0
                else "do_sample=False, "
            )
            + "streamer=TextStreamer(tokenizer, skip_prompt=True))\n\n"
            f"questions = fastft.load_dataset({HELD_OUT!r}).select(range({int(self.questions.value)}))\n"
            "scores = fastft.evaluate_accuracy(model, tokenizer, questions)\n"
            "print(f'content accuracy {scores.content:.1%}, format compliance {scores.overall:.1%}')\n"
        )


def scores_html(result) -> str:
    """A table of content accuracy and format compliance per task, "all" last."""
    rows = "".join(
        f"<tr><td>{html.escape(task)}</td><td style='text-align:right'>{content:.1%}</td>"
        f"<td style='text-align:right'>{result.per_task.get(task, 0.0):.1%}</td></tr>"
        for task, content in result.content_per_task.items()
    )
    return (
        "<table style='font-size:12px'><tr><th>task</th><th>content accuracy<br>(right answer, any wording)</th>"
        "<th>format compliance<br>(the bare answer asked for)</th></tr>" + rows + "</table>"
    )
