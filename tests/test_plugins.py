"""`minivllm.general_plugins` entry points: found through package metadata, run once per
process, filtered by MINIVLLM_PLUGINS, a failing one logged and skipped."""

from __future__ import annotations

import sys

import pytest

from minivllm import plugins


@pytest.fixture
def installed_plugins(tmp_path, monkeypatch):
    """Two plugin packages 'installed' (a module and its dist-info) on sys.path."""
    (tmp_path / "good_plugin.py").write_text(
        "CALLS = []\ndef register():\n    CALLS.append('registered')\n")
    (tmp_path / "bad_plugin.py").write_text("def register():\n    raise RuntimeError('broken plugin')\n")
    for name in ("good_plugin", "bad_plugin"):
        info = tmp_path / f"{name}-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text(f"[minivllm.general_plugins]\n{name} = {name}:register\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(plugins, "_loaded", False)
    yield
    for name in ("good_plugin", "bad_plugin"):
        sys.modules.pop(name, None)


def test_plugins_run_once_and_a_broken_one_is_skipped(installed_plugins, monkeypatch, caplog):
    monkeypatch.delenv(plugins.PLUGINS_ENV, raising=False)
    assert sorted(plugins.load_general_plugins()) == ["good_plugin"]
    import good_plugin

    assert good_plugin.CALLS == ["registered"]
    assert "broken plugin" in caplog.text
    assert plugins.load_general_plugins() == []  # once per process
    assert good_plugin.CALLS == ["registered"]


def test_the_environment_variable_picks_plugins(installed_plugins, monkeypatch):
    monkeypatch.setenv(plugins.PLUGINS_ENV, "bad_plugin")
    assert plugins.load_general_plugins() == []
    assert "good_plugin" not in sys.modules


def test_an_engine_loads_plugins_before_it_builds_anything(installed_plugins, monkeypatch):
    monkeypatch.setenv(plugins.PLUGINS_ENV, "good_plugin")
    from minivllm.engine.arg_utils import EngineArgs
    from minivllm.engine.llm_engine import LLMEngine

    LLMEngine.from_engine_args(EngineArgs(device="cpu", num_gpu_blocks_override=16, max_model_len=64))
    import good_plugin

    assert good_plugin.CALLS == ["registered"]
