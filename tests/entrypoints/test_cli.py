"""The `minivllm` command, run in-process (generate, bench) and as `python -m minivllm`."""

import json
import subprocess
import sys

import pytest

from minivllm import LLM, SamplingParams
from minivllm.entrypoints.cli import bench_workload, main


def test_generate_prints_prompt_and_completion(tiny_llama, capsys):
    path, _ = tiny_llama
    assert main(["generate", "To be", "Q", "--model", path, "--device", "cpu", "--max-tokens", "6",
                 "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    expected = LLM(path, device="cpu").generate(["To be", "Q"], SamplingParams(temperature=0.0, max_tokens=6),
                                                use_tqdm=False)
    for output in expected:
        assert output.prompt + output.outputs[0].text in out


def test_bench_prints_json_throughput(tiny_llama, capsys):
    path, _ = tiny_llama
    args = ["bench", "--model", path, "--device", "cpu", "--num-seqs", "4", "--min-len", "4", "--max-input-len", "12",
            "--max-output-len", "6", "--max-num-seqs", "4", "--max-model-len", "64"]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["num_seqs"] == 4
    assert 4 * 4 <= result["output_tokens"] <= 4 * 6
    # elapsed_s is printed rounded to the millisecond, hence the tolerance.
    assert result["output_tokens_per_s"] == pytest.approx(result["output_tokens"] / result["elapsed_s"], rel=0.05)


def test_python_dash_m_shows_every_subcommand():
    out = subprocess.run([sys.executable, "-m", "minivllm", "--help"], capture_output=True, text=True, check=True).stdout
    assert all(name in out for name in ("generate", "bench", "serve"))
    serve = subprocess.run([sys.executable, "-m", "minivllm", "serve", "--help"], capture_output=True, text=True,
                           check=True).stdout
    assert "--port" in serve and "--max-num-seqs" in serve


def test_readme_quickstart_generates_readable_text_with_the_bundled_model():
    """`minivllm generate "ROMEO:"` (the README's main job), as a real subprocess."""
    args = [sys.executable, "-m", "minivllm", "generate", "ROMEO:", "--max-tokens", "24", "--device", "cpu",
            "--num-gpu-blocks-override", "32"]
    out = subprocess.run(args, capture_output=True, text=True, check=True, timeout=300).stdout
    assert out.startswith("ROMEO:")
    completion = out.split("ROMEO:", 1)[1].split("-" * 40)[0]
    words = completion.split()
    assert len(words) >= 5 and all(w.isprintable() for w in words)


def test_bench_workload_is_nano_vllms():
    """nano-vllm's README reports 133,966 output tokens for its 256-request benchmark."""
    from minivllm.entrypoints.cli import bench_workload

    prompts, output_lens = bench_workload(256, 100, 1024, 1024)
    assert len(prompts) == 256 and sum(output_lens) == 133_966
    assert all(100 <= len(p) <= 1024 for p in prompts) and max(t for p in prompts for t in p) <= 10_000


# ----------------------------------------------------------------------------- flags from field metadata

def _engine_parser():
    import argparse

    from minivllm.engine.arg_utils import EngineArgs

    return EngineArgs.add_cli_args(argparse.ArgumentParser())


def test_every_engine_flag_comes_from_a_field_and_says_its_default():
    import dataclasses

    from minivllm.engine.arg_utils import EngineArgs

    actions = {a.dest: a for a in _engine_parser()._actions if a.dest != "help"}
    assert set(actions) == {f.name for f in dataclasses.fields(EngineArgs)}
    for name, action in actions.items():
        assert action.help and "default" in action.help, name
        assert action.choices is None or None not in action.choices, f"{name} lists None as a choice"
    assert actions["dtype"].choices == ("auto", "float32", "float16", "bfloat16")
    # The parsed defaults are the dataclass's: `minivllm ...` with no flags == EngineArgs().
    assert EngineArgs.from_cli_args(_engine_parser().parse_args([])) == EngineArgs()


def test_optional_choice_flags_default_to_none_and_take_only_real_values():
    parser = _engine_parser()
    assert parser.parse_args([]).preemption_mode is None
    assert parser.parse_args(["--preemption-mode", "swap"]).preemption_mode == "swap"
    args = parser.parse_args(["--max-model-len", "64", "--gpu-memory-utilization", "0.5", "--enable-prefix-caching"])
    assert (args.max_model_len, args.gpu_memory_utilization, args.enable_prefix_caching) == (64, 0.5, True)
    with pytest.raises(SystemExit):
        parser.parse_args(["--preemption-mode", "None"])


def test_async_scheduling_is_on_off_or_the_engines_choice():
    parser = _engine_parser()
    assert parser.parse_args([]).async_scheduling is None
    assert parser.parse_args(["--async-scheduling"]).async_scheduling is True
    assert parser.parse_args(["--no-async-scheduling"]).async_scheduling is False


@pytest.mark.parametrize("flags, expected", [([], False), (["--async-scheduling"], True),
                                             (["--no-async-scheduling"], False)])
def test_the_server_runs_without_async_scheduling_unless_asked(monkeypatch, flags, expected):
    from minivllm.entrypoints.cli import make_parser
    from minivllm.entrypoints.openai import api_server

    built = []

    def refuse(engine_args, disable_frontend_multiprocessing):
        built.append(engine_args)
        raise SystemExit(0)

    monkeypatch.setattr(api_server, "build_engine_client", refuse)
    with pytest.raises(SystemExit):
        api_server.run_server(make_parser().parse_args(["serve", "some-model", *flags]))
    assert built[0].async_scheduling is expected


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "--max-tokens MAX_TOKENS most new tokens per completion" in out and "(default: 64)" in out
    assert "--block-size BLOCK_SIZE tokens per KV-cache block (a power of two) (default: 16)" in out
    assert "--preemption-mode {recompute,swap}" in out and "(default: vLLM v0's rule" in out


def test_version_is_the_installed_package_version():
    from importlib.metadata import version

    out = subprocess.run([sys.executable, "-m", "minivllm", "--version"], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == f"minivllm {version('minivllm')}"


# ----------------------------------------------------------------------------- errors

@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if a sub-command gets as far as building an LLM."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr("minivllm.entrypoints.llm.LLM", refuse)
    monkeypatch.delenv("MINIVLLM_DEBUG", raising=False)


@pytest.mark.parametrize("argv, reason", [
    (["generate", "ROMEO:", "--max-tokens", "0"], "max_tokens"),
    (["generate", "ROMEO:", "--top-p", "1.5"], "top_p"),
    (["generate", ""], "prompt is empty"),
    (["bench", "--min-len", "50", "--max-input-len", "10", "--device", "cpu"], "--min-len"),
    (["bench", "--num-seqs", "0", "--device", "cpu"], "--num-seqs"),
])
def test_bad_arguments_fail_in_one_line_before_a_model_loads(no_model_load, capsys, argv, reason):
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"minivllm {argv[0]}: error: ") and reason in err
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("argv, prog, reason", [
    (["generate", "--max-tokens", "0"], "minivllm generate", "required: prompts"),
    (["generat", "ROMEO:"], "minivllm", "invalid choice: 'generat'"),
    (["serve", "--port", "abc"], "minivllm serve", "--port"),
    ([], "minivllm", "required: command"),
])
def test_a_malformed_command_line_is_one_line_not_the_usage(capsys, argv, prog, reason):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2  # argparse's status for a usage error
    err = capsys.readouterr().err
    assert err.startswith(f"{prog}: error: ") and reason in err and f"{prog} --help" in err
    assert err.count("\n") == 1 and "usage:" not in err


def test_a_missing_model_folder_is_one_line(capsys, monkeypatch):
    monkeypatch.delenv("MINIVLLM_DEBUG", raising=False)
    assert main(["generate", "ROMEO:", "--model", "/no/such/checkpoint"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no such folder" in err


def test_debug_shows_the_traceback(monkeypatch):
    monkeypatch.delenv("MINIVLLM_DEBUG", raising=False)
    with pytest.raises(ValueError, match="no such folder"):
        main(["generate", "ROMEO:", "--model", "/no/such/checkpoint", "--debug"])
    monkeypatch.setenv("MINIVLLM_DEBUG", "1")
    with pytest.raises(ValueError, match="no such folder"):
        main(["generate", "ROMEO:", "--model", "/no/such/checkpoint"])


def test_a_user_error_in_a_real_process_prints_no_traceback():
    result = subprocess.run([sys.executable, "-m", "minivllm", "generate", "ROMEO:", "--max-tokens", "0"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert result.stderr.startswith("minivllm generate: error: max_tokens must be") and "Traceback" not in result.stderr


# ----------------------------------------------------------------------------- serve MODEL

@pytest.fixture
def served(monkeypatch):
    """The namespace `minivllm serve` would start a server with (the server is not started)."""
    seen = []
    monkeypatch.setattr("minivllm.entrypoints.openai.api_server.run_server", seen.append)
    return seen


def test_serve_takes_the_model_positionally_like_vllm(served):
    assert main(["serve", "/models/my-llama", "--port", "8001"]) == 0
    assert main(["serve", "--model", "/models/my-llama"]) == 0
    assert main(["serve"]) == 0
    assert [a.model for a in served] == ["/models/my-llama", "/models/my-llama", None]
    assert served[0].port == 8001


def test_serve_refuses_two_different_models(served, capsys, monkeypatch):
    monkeypatch.delenv("MINIVLLM_DEBUG", raising=False)
    assert main(["serve", "a-model", "--model", "another-model"]) == 1
    assert "two models given" in capsys.readouterr().err and not served


# ----------------------------------------------------------------------------- bench sizes

def test_bench_defaults_are_nano_vllms_on_a_gpu_and_small_on_a_cpu():
    import argparse

    from minivllm.entrypoints.cli import CPU_BENCH, GPU_BENCH, bench_workload_from_args

    none = argparse.Namespace(num_seqs=None, min_len=None, max_input_len=None, max_output_len=None)
    assert bench_workload_from_args(none, GPU_BENCH) == GPU_BENCH
    assert (GPU_BENCH.num_seqs, GPU_BENCH.min_len, GPU_BENCH.max_input_len, GPU_BENCH.max_output_len) == (
        256, 100, 1024, 1024)
    assert bench_workload_from_args(none, CPU_BENCH) == CPU_BENCH
    _, output_lens = bench_workload(CPU_BENCH.num_seqs, CPU_BENCH.min_len, CPU_BENCH.max_input_len,
                                    CPU_BENCH.max_output_len)
    assert sum(output_lens) < 2_000, "a CPU run of the default workload should take seconds, not minutes"
    given = argparse.Namespace(num_seqs=4, min_len=None, max_input_len=None, max_output_len=32)
    assert bench_workload_from_args(given, CPU_BENCH).num_seqs == 4


def test_bench_on_a_cpu_runs_the_cpu_workload_with_a_progress_bar(tiny_llama, capsys):
    path, _ = tiny_llama
    assert main(["bench", "--model", path, "--device", "cpu", "--max-model-len", "256"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out.strip().splitlines()[-1])
    from minivllm.entrypoints.cli import CPU_BENCH

    assert result["num_seqs"] == CPU_BENCH.num_seqs and result["device"] == "cpu"
    assert "Processed prompts" in captured.err  # tqdm's bar, on stderr
