"""`minivllm serve` flags: the server's own plus every engine flag, without importing FastAPI."""

from __future__ import annotations

import argparse
import subprocess
import sys

from minivllm.engine.arg_utils import EngineArgs
from minivllm.entrypoints.openai.cli_args import add_serve_args


def test_serve_args_map_onto_engine_args():
    parser = add_serve_args(argparse.ArgumentParser())
    args = parser.parse_args(["--port", "9001", "--served-model-name", "bard", "--max-model-len", "128", "--max-num-seqs", "4",
                              "--num-scheduler-steps", "8"])
    assert (args.host, args.port, args.served_model_name) == ("127.0.0.1", 9001, ["bard"])
    engine_args = EngineArgs.from_cli_args(args)
    assert engine_args.max_model_len == 128 and engine_args.max_num_seqs == 4 and engine_args.model is None
    assert engine_args.create_engine_config().scheduler_config.num_lookahead_slots == 7


def test_cli_args_module_stays_light(tmp_path):
    script = (
        "import sys, minivllm.entrypoints.openai.cli_args\n"
        "print(sorted(m for m in ('fastapi', 'uvicorn', 'torch') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
