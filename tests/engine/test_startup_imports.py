"""What start-up imports, asked of fresh interpreters.

`from minivllm import LLM` loads no transformers: its import belongs to the config phase,
where `ModelConfig` logs reading config.json with its seconds and the modules it imported,
in the form benchmarks/startup.py reads. A config.json that sets every field minivllm reads
is read into transformers' base config class: the model type's class (AutoConfig's) imports
much of transformers' modeling code, and so would AutoTokenizer without the config.
"""

import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))  # only while importing: the folder also holds `kernels.py`
try:
    import startup  # noqa: E402
finally:
    sys.path.remove(str(BENCHMARKS))


def run_python(script: str, tmp_path) -> list[str]:
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.splitlines()


def test_importing_the_llm_class_loads_no_transformers(tmp_path):
    out = run_python("import sys\n"
                     "from minivllm import LLM, SamplingParams\n"
                     "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))\n", tmp_path)
    assert out[-1] == "[]"


def test_the_model_config_line_times_the_config_in_the_benchmarks_form(tmp_path):
    out = run_python("import logging, sys\n"
                     "logging.basicConfig(level=logging.INFO, stream=sys.stdout, format='%(name)s|%(message)s')\n"
                     "from minivllm.config import ModelConfig\n"
                     "config = ModelConfig()\n"
                     "config.load_tokenizer()\n"
                     "print('modeling|' + str(sorted(m for m in sys.modules if m.startswith('transformers.models.llama'))))\n",
                     tmp_path)
    lines = [line.split("|", 1)[1] for line in out if line.startswith("minivllm.config|")]
    assert len(lines) == 1, out
    found = startup.parse_engine_log([(0.0, lines[0])])
    assert lines[0].startswith("model config: llama from config.json in "), lines[0]
    assert found["hf_config_from"] == "config.json" and found["hf_config_s"] > 0
    assert found["hf_config_modules"] > 100  # transformers itself comes in with the first config
    assert out[-1] == "modeling|[]"  # neither the config nor the tokenizer loaded Llama's classes
