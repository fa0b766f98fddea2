"""The Run tab's GRPO parts: the sampling controls, the reward choice, the live curves and the rollouts inspector.

`GRPOControls` holds the widgets only GRPO has (completions per prompt, prompts per step, longest completion,
temperature, KL coefficient, the bundled rewards to score with); `RunPanel` shows them when the method is GRPO.
`grpo_figure` draws, over the steps and two by two, the mean reward and each reward function's, the KL to the reference, the
mean completion length and the accuracy (numbers from ``StepEvent.grpo``, `fastft.training.objectives.grpo`).
`rollout_html` shows the latest rollout as the model wrote it: each prompt with its G completions, each
completion's rewards, total and advantage.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

import ipywidgets as widgets
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from fastft.data import rewards
from fastft.report.figures import grid_layout
from fastft.training.objectives.grpo import GRPOConfig

__all__ = ["REWARDS", "GRPOControls", "grpo_figure", "reward_functions", "rollout_html"]

# the bundled rewards the Run tab offers: key -> (label, the code that makes it)
# (exact and content match read the rows' 'answer' column: the Run tab names it when the rows lack it)
REWARDS = {
    "exact_match": ("exact match", "fastft.rewards.exact_match"),
    "content_match": ("content match", "fastft.rewards.content_match"),
    "format": ("one short line", "fastft.rewards.format_reward()"),
    "length": ("length penalty", "fastft.rewards.length_penalty()"),
}


def reward_functions(keys: Sequence[str]) -> list:
    """The reward callables for the chosen `REWARDS` keys, in their order."""

    made = {
        "exact_match": lambda: rewards.exact_match,
        "content_match": lambda: rewards.content_match,
        "format": rewards.format_reward,
        "length": rewards.length_penalty,
    }
    return [made[key]() for key in keys]


class GRPOControls:
    """The GRPO settings of the Run tab, as widgets (`widgets`) and as `GRPOConfig` fields (`config_kwargs`)."""

    def __init__(self, style: dict, layout_of) -> None:

        defaults = GRPOConfig()
        self.generations = widgets.BoundedIntText(
            value=defaults.num_generations, min=2, max=256, description="completions (G)", style=style,
            layout=layout_of(),
        )  # fmt: skip
        self.prompts_per_step = widgets.BoundedIntText(
            value=defaults.prompts_per_step, min=1, max=4096, description="prompts per step", style=style,
            layout=layout_of(),
        )  # fmt: skip
        self.max_new_tokens = widgets.BoundedIntText(
            value=defaults.max_new_tokens, min=1, max=32768, description="max new tokens", style=style,
            layout=layout_of(),
        )  # fmt: skip
        self.temperature = widgets.BoundedFloatText(
            value=defaults.temperature, min=0.01, max=10.0, step=0.1, description="temperature", style=style,
            layout=layout_of(),
        )  # fmt: skip
        self.kl_coef = widgets.BoundedFloatText(
            value=defaults.kl_coef, min=0.0, max=100.0, step=0.01, description="KL coefficient", style=style,
            layout=layout_of(),
        )  # fmt: skip
        self.rewards = widgets.SelectMultiple(  # ctrl/shift-click picks several
            options=[(label, key) for key, (label, _) in REWARDS.items()],
            value=("exact_match",),
            rows=len(REWARDS),
            description="rewards",
            style=style,
            layout=layout_of(),
        )
        tip = "tooltip" if "tooltip" in self.rewards.traits() else "description_tooltip"  # ipywidgets 8 / 7
        setattr(
            self.rewards,
            tip,
            "ctrl/shift-click to score with several; exact and content match compare with the rows' 'answer'",
        )
        self.widgets = [
            self.generations,
            self.prompts_per_step,
            self.max_new_tokens,
            self.temperature,
            self.kl_coef,
            self.rewards,
        ]

    def config_kwargs(self) -> dict:
        return dict(
            num_generations=int(self.generations.value),
            prompts_per_step=int(self.prompts_per_step.value),
            max_new_tokens=int(self.max_new_tokens.value),
            temperature=float(self.temperature.value),
            kl_coef=float(self.kl_coef.value),
        )

    @property
    def reward_keys(self) -> list[str]:
        return list(self.rewards.value)

    def show(self, visible: bool) -> None:
        for widget in self.widgets:
            widget.layout.display = None if visible else "none"


def grpo_figure(reward_names: Sequence[str] = (), *, max_steps: int | None = None) -> go.Figure:
    """Four panels over the steps, two by two (they stay readable in a narrow notebook): the mean reward with
    each reward function's, the KL to the reference, the mean completion length, and the accuracy. Traces:
    ``reward``, ``reward/<name>`` for each of `reward_names`, ``kl``, ``completion length``, ``accuracy``
    (in that order; empty until set)."""
    fig = make_subplots(
        rows=2,
        cols=2,
        subplot_titles=("Reward", "KL to the reference", "Completion tokens", "Accuracy"),
        horizontal_spacing=0.09,
        vertical_spacing=0.16,
    )
    line = {"mode": "lines", "hoverlabel": {"namelength": -1}}
    palette = ("#1f6fb4", "#2a9d5c", "#d62728", "#8e5ec9", "#e39c1f", "#17becf")
    traces = [("reward", (1, 1), "#222222", 3)]
    traces += [
        (f"reward/{name}", (1, 1), palette[i % len(palette)], 1.5) for i, name in enumerate(reward_names)
    ]
    traces += [
        ("kl", (1, 2), "#1f6fb4", 2),
        ("completion length", (2, 1), "#2a9d5c", 2),
        ("accuracy", (2, 2), "#8e5ec9", 2),
    ]
    for name, (row, col), color, width in traces:
        fig.add_trace(
            go.Scatter(x=[], y=[], name=name, line={"color": color, "width": width}, **line), row=row, col=col
        )
    grid_layout(fig, "grpo")
    fig.update_yaxes(exponentformat="e", row=1, col=1)  # values near 0 read 2e-12, not plotly's SI "2p"
    fig.update_yaxes(rangemode="tozero", exponentformat="e", row=1, col=2)
    fig.update_yaxes(rangemode="tozero", row=2, col=1)
    fig.update_yaxes(range=[0, 1], tickformat=".0%", row=2, col=2)
    if max_steps:
        fig.update_xaxes(range=[0, max_steps])
    return fig


def _prompt_text(prompt) -> str:
    """A prompt as a person reads it: the text, or the last user message of a chat."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        users = [m.get("content", "") for m in prompt if m.get("role") == "user"]
        return str(users[-1] if users else prompt[-1].get("content", ""))
    return f"{len(prompt)} token ids"


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def rollout_html(
    rollout, reward_names: Sequence[str], group: int, step: int | None = None, prompts: int = 2
) -> str:
    """The first `prompts` prompts of `rollout` (a `fastft.training.objectives.grpo.Rollout`, prompt-major, `group`
    completions each) with their completions, each completion's reward per function, total and advantage, as
    an HTML table ("" without a rollout)."""
    if rollout is None or not len(rollout.completions):
        return ""
    head = "".join(f"<th>{html.escape(name)}</th>" for name in reward_names)
    rows = []
    for start in range(0, min(len(rollout.completions), prompts * group), group):
        prompt = html.escape(_clip(_prompt_text(rollout.prompts[start]), 200))
        rows.append(
            f'<tr><td colspan="{4 + len(reward_names)}" style="background:#f3f5f8"><b>prompt</b> {prompt}</td></tr>'
        )
        for index in range(start, start + group):
            text = html.escape(_clip(rollout.completions[index], 240)) or "<i>(empty)</i>"
            cut = " <span title='ran out of tokens'>✂</span>" if rollout.truncated[index] else ""
            values = "".join(f"<td>{value:+.2f}</td>" for value in rollout.rewards[index])
            advantage = rollout.advantages[index]
            color = "#2a9d5c" if advantage > 0 else "#d62728" if advantage < 0 else "#666"
            rows.append(
                f"<tr><td>{index - start + 1}</td><td style='white-space:pre-wrap;max-width:36em'>{text}{cut}</td>"
                f"{values}<td><b>{rollout.total[index]:+.2f}</b></td>"
                f"<td style='color:{color}'>{advantage:+.2f}</td></tr>"
            )
    title = f"Latest rollout (step {step})" if step else "Latest rollout"
    shown = min(prompts, len(rollout.completions) // group)
    return (
        f"<b>{title}</b>: {shown} of {len(rollout.completions) // group} prompts, {group} completions each"
        "<table style='border-collapse:collapse;font-size:0.9em'>"
        f"<tr><th>#</th><th>completion</th>{head}<th>total</th><th>advantage</th></tr>{''.join(rows)}</table>"
    )
