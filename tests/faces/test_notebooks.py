"""The tutorial notebooks: each runs top to bottom on the tiny presets (no GPU, no network) and leaves what
it promises; each is committed without outputs, opens with badges and an install cell that point at this
project, and has one parameters cell; the README links every one, and Binder is set up on CPU torch."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
# pyproject's [project.urls] Repository: the one place the address is written
REPOSITORY = re.search(
    r'^Repository = "([^"]+)"', (ROOT / "pyproject.toml").read_text(encoding="utf-8"), re.M
).group(1)
SLUG = REPOSITORY.removeprefix("https://github.com/")  # owner/name
# the install cells pin the release tag of pyproject's version, never a moving branch
VERSION = re.search(
    r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(encoding="utf-8"), re.M
).group(1)
BINDER_NOTEBOOK = "00_studio.ipynb"  # the notebook Binder opens
WARNING = re.compile(r"\b\w*Warning: ")  # how `warnings` prints one: "path:line: UserWarning: text"

# What each notebook leaves in its working folder once it has run to its last cell.
PRODUCES = {
    "00_studio.ipynb": ["runs/studio/adapter/adapter_config.json"],
    "01_quickstart_sft.ipynb": [
        "runs/quickstart/adapter/adapter_config.json",
        "runs/quickstart/merged/config.json",
        "runs/quickstart/model.Q8_0.gguf",  # written only if its read-back check passed
    ],
    "02_qlora_long_context.ipynb": ["runs/qlora_long_context/adapter/adapter_config.json"],
    "03_moe.ipynb": ["runs/moe/adapter/adapter_config.json"],
    "04_profiling.ipynb": ["runs/profiling/trace.json"],
    "05_grpo.ipynb": ["runs/grpo/adapter/adapter_config.json"],
    "06_preference.ipynb": ["runs/preference/adapter/adapter_config.json"],
}


def _code_cells(notebook) -> list:
    return [cell for cell in notebook.cells if cell.cell_type == "code"]


def colab_url(name: str) -> str:
    return f"https://colab.research.google.com/github/{SLUG}/blob/main/notebooks/{name}"


def binder_url(name: str) -> str:
    return f"https://mybinder.org/v2/gh/{SLUG}/HEAD?urlpath=lab/tree/notebooks/{name}"


def test_the_tutorials_are_all_there():
    assert [path.name for path in NOTEBOOKS] == sorted(PRODUCES)
    assert SLUG.count("/") == 1 and REPOSITORY.startswith("https://github.com/"), REPOSITORY


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_committed_without_outputs(path):
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    for cell in _code_cells(notebook):
        assert not cell.outputs and cell.execution_count is None, (
            f"{path.name}: clear outputs before committing"
        )
    assert "widgets" not in notebook.metadata, f"{path.name}: saved widget state; clear it before committing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_badges_and_install_cell_point_at_this_project(path):
    notebook = nbformat.read(path, as_version=4)
    first = notebook.cells[0]
    assert first.cell_type == "markdown" and first.source.startswith("# "), "open with a title"
    assert f"]({colab_url(path.name)})" in first.source, f"{path.name}: no Colab badge for this notebook"
    # Every notebook address anywhere in it (badges, links) is this repository's copy of this notebook.
    text = "\n".join(cell.source for cell in notebook.cells)
    addresses = re.findall(r"github(?:\.com)?/([\w.-]+/[\w.-]+)/blob/([\w.-]+)/notebooks/([\w.-]+)", text)
    assert addresses and set(addresses) == {(SLUG, "main", path.name)}, addresses

    install = _code_cells(notebook)[0].source
    pip = [line for line in install.splitlines() if "pip install" in line]
    assert len(pip) == 1 and pip[0].lstrip().startswith("%pip install"), install
    assert f'"fastft[gpu] @ git+{REPOSITORY}@v{VERSION}"' in pip[0], pip[0]
    assert "torch" not in pip[0], "the install cell must never install torch (Colab's and Kaggle's stay)"
    # pip runs only when fastft cannot be imported: inside the except block of `import fastft`
    assert re.search(r"^try:\n    import fastft\nexcept ImportError:\n", install, re.M), install
    assert pip[0].startswith("    "), "the pip line belongs inside `except ImportError:`"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_one_parameters_cell_picks_the_model_by_device(path):
    notebook = nbformat.read(path, as_version=4)
    tagged = [
        i for i, cell in enumerate(_code_cells(notebook)) if "parameters" in cell.metadata.get("tags", [])
    ]
    assert tagged == [1], f"{path.name}: one code cell tagged 'parameters', right after the install cell"
    parameters = _code_cells(notebook)[1].source
    assert "torch.cuda.is_available()" in parameters and re.search(r"^\s*MODEL = .*\"tiny-", parameters, re.M)


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_top_to_bottom(path, tmp_path):
    """As a user runs it on a CPU: a fresh kernel in an empty folder, every cell in order, no edits; and no
    cell shows a Python warning (a warning fastft means to give is part of what a cell prints, not stderr
    noise: the tutorials are written so that none fires)."""
    from nbclient import NotebookClient

    import fastft

    assert "HF_HUB_OFFLINE" in os.environ  # conftest: a hub download fails at once instead of hanging
    notebook = nbformat.read(path, as_version=4)
    started = time.perf_counter()
    client = NotebookClient(
        notebook,
        timeout=600,
        kernel_name="python3",
        store_widget_state=False,
        resources={"metadata": {"path": str(tmp_path)}},
    )
    # No emulated Output widget either: nbclient 0.11's emulation writes what an Output widget captures into
    # the widget state it was told not to keep (KeyError in output_widget.py). Headless, it stays in the cell.
    client.widget_registry = {}
    client.execute()
    seconds = time.perf_counter() - started
    print(f"{path.name}: {seconds:.0f} s")
    # fastft was importable, so the install cell printed its version and pip never ran
    install = _code_cells(notebook)[0]
    assert "".join(o.get("text", "") for o in install.outputs) == f"fastft {fastft.__version__}\n"
    assert "widgets" not in notebook.metadata
    for produced in PRODUCES[path.name]:
        assert (tmp_path / produced).is_file(), f"{path.name} did not write {produced}"
    warned = [
        f"cell {index}: {line.strip()}"
        for index, cell in enumerate(_code_cells(notebook))
        for output in cell.outputs
        if output.get("output_type") == "stream" and output.get("name") == "stderr"
        for line in output.get("text", "").splitlines()
        if WARNING.search(line)
    ]
    assert not warned, f"{path.name} shows warnings a user would have to read past:\n" + "\n".join(warned)


def test_the_warning_check_sees_what_the_warnings_module_prints():
    import warnings

    printed = warnings.formatwarning("64 of 64 pairs cut", UserWarning, "fastft/data/pairs.py", 12)
    assert WARNING.search(printed) and WARNING.search("x.py:3: FutureWarning: soon\n")
    assert not WARNING.search("Packing 100%|██████████| 48/48 [00:00<00:00]")  # a progress bar on stderr


def test_readme_links_every_notebook_and_the_binder_badge():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Notebooks\n", 1)[1].split("\n## ", 1)[0]
    for path in NOTEBOOKS:
        assert f"](notebooks/{path.name})" in section, f"README's Notebooks section does not link {path.name}"
        assert f"]({colab_url(path.name)})" in section, f"README has no Colab badge for {path.name}"
    assert f"(https://mybinder.org/badge_logo.svg)]({binder_url(BINDER_NOTEBOOK)})" in section


def test_binder_installs_fastft_on_the_cpu_torch_that_ci_tests():
    binder = ROOT / "binder"
    assert (ROOT / "notebooks" / BINDER_NOTEBOOK).is_file()
    assert (binder / "runtime.txt").read_text(encoding="utf-8").strip() == "python-3.11"
    requirements = (binder / "requirements.txt").read_text(encoding="utf-8").splitlines()
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in requirements
    ci_torch = re.search(r"torch==([\w.]+)", (ROOT / ".ci" / "run").read_text(encoding="utf-8")).group(1)
    assert f"torch=={ci_torch}+cpu" in requirements, f"binder should pin the CPU build of torch {ci_torch}"
    post_build = binder / "postBuild"
    assert os.access(post_build, os.X_OK), "binder/postBuild must be executable"
    assert re.search(
        r"^pip install .*-e \"?\.(\[[\w,]+\])?\"?$", post_build.read_text(encoding="utf-8"), re.M
    )
