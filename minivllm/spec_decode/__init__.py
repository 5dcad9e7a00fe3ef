"""Speculative decoding (vLLM 0.6's `vllm/spec_decode/`): propose, score, accept.

    spec_decode_worker.py   SpecDecodeWorker: a Worker that, per decode step, asks a proposer
                            for k tokens per sequence, scores them in one target forward pass and
                            keeps what the rejection sampler accepts
    draft_model_worker.py   the draft-model proposer (a small Worker sharing the block tables)
    ngram_worker.py         the n-gram prompt-lookup proposer (no model)
    metrics.py              acceptance counts with vLLM's names
    util.py                 the proposals' shape, and the distribution a request samples from

The acceptance rule itself is `minivllm.model_executor.layers.rejection_sampler`.
"""
