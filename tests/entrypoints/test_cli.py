"""The `minivllm` command, run in-process (generate, bench) and as `python -m minivllm`."""

import json
import subprocess
import sys

import pytest

from minivllm import LLM, SamplingParams
from minivllm.entrypoints.cli import main


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
