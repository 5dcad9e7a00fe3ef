"""Notebook engines: unchanged on a CPU; fp32 and a bounded pool on a GPU, explicit choices win."""

from minivllm.viz import device


def test_cpu_arguments_pass_through():
    assert device.engine_kwargs(device="cpu", max_num_seqs=4) == {"device": "cpu", "max_num_seqs": 4}


def test_gpu_arguments_are_fp32_with_a_bounded_pool():
    kwargs = device.engine_kwargs(device="cuda", max_model_len=256)
    assert kwargs == {"device": "cuda", "dtype": "float32", "num_gpu_blocks_override": device.GPU_POOL_BLOCKS,
                      "num_scheduler_steps": 1, "max_model_len": 256}
    assert device.engine_kwargs(device="cuda", num_gpu_blocks_override=12)["num_gpu_blocks_override"] == 12


def test_default_device_follows_torch():
    import torch

    assert device.engine_kwargs()["device"] == ("cuda" if torch.cuda.is_available() else "cpu")
