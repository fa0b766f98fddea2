"""Run names are names: `fastft.checks.run_name` is the one rule wherever a user's run name becomes a folder
(`fastft demo --name`, `DemoConfig.run_dir`), so '../x' or an absolute path never puts a run outside
`--output-dir`, and the error names the input and a name that works."""

from __future__ import annotations

import pytest

from fastft.checks import SettingError, run_name


@pytest.mark.parametrize("name", ["demo-20261207-101500", "run_1", "v1.2", "Übung", "a..b", "..."])
def test_plain_names_are_kept(name):
    assert run_name("name", name) == name


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("../../../somewhere", "is a path"),
        ("/abs/path", "is a path"),
        ("runs/a", "is a path"),
        ("a\\b", "is a path"),
        ("..", "not a new one"),
        (".", "not a new one"),
        ("", "is empty"),
        ("my run!", "characters other than"),
        ("x" * 201, "longer than 200 bytes"),
    ],
)
def test_paths_and_odd_names_are_refused_naming_a_fix(name, why):
    with pytest.raises(SettingError) as error:
        run_name("name", name)
    message = str(error.value)
    assert f"name={name!r}" in message and why in message and "Fix: e.g. name='" in message
    suggested = message.rpartition("Fix: e.g. name=")[2].rstrip(".").strip("'")
    assert run_name("name", suggested) == suggested  # the fix it offers is itself a run name


def test_a_demo_config_never_joins_a_path_to_its_output_dir(tmp_path):
    from fastft.training.demo_config import DemoConfig

    for name in ("../../../somewhere", str(tmp_path / "elsewhere")):
        with pytest.raises(SettingError, match="is not a run name"):
            DemoConfig(name=name, output_dir=str(tmp_path / "runs"))
    config = DemoConfig(name="ok", output_dir=str(tmp_path / "runs"))
    assert config.run_dir == tmp_path / "runs" / "ok"
    config.name = "../escaped"  # changed after the checks: the folder is not made from it either
    with pytest.raises(SettingError, match="is not a run name"):
        config.check_paths()


@pytest.mark.parametrize("name", ["../escaped", "{tmp}/absolute"])
def test_fastft_demo_refuses_a_name_that_leaves_the_output_dir(tmp_path, capsys, name):
    from fastft.cli import main

    name = name.format(tmp=tmp_path)
    out = tmp_path / "out"
    # an unknown model: where the name were taken, the demo would fail at loading, after making the folder
    code = main(["demo", "--name", name, "--output-dir", str(out), "--model", "not-a-model", "--no-progress"])
    assert code == 2
    err = capsys.readouterr().err
    assert repr(name) in err and "is not a run name" in err and "Fix: e.g. name=" in err
    assert not (tmp_path / "escaped").exists() and not (tmp_path / "absolute").exists() and not out.exists()
