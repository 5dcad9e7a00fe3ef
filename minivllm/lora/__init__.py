"""Multi-LoRA serving (vLLM's `vllm/lora/`): many fine-tuned adapters of one base model in
one engine, different adapters in the same batch.

    request.py         LoRARequest: which adapter a request uses (name, id, folder)
    peft_helper.py     reads and checks a PEFT adapter folder (no torch: the engine checks
                       an adapter before it queues a request)
    layers.py          the column/row-parallel linear layers with a LoRA slot table
    punica_wrapper.py  per-step mapping of rows to slots, and the shrink/expand calls
    models.py          LoRAModel (one adapter's weights) and LoRAModelManager (GPU slots)
    worker_manager.py  LRUCacheWorkerLoRAManager: the CPU cache behind the GPU slots

This package imports nothing at import time, so `minivllm.lora.request` stays light.
"""
