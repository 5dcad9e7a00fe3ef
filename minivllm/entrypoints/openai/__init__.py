"""An OpenAI-compatible HTTP server for minivllm (mirrors `vllm/entrypoints/openai/`).

Read in this order:
    protocol.py            the API's requests and responses (pydantic) -> SamplingParams
    serving_engine.py      what every endpoint shares: validation, limits, streams, deltas
    serving_completion.py  POST /v1/completions
    serving_chat.py        POST /v1/chat/completions (the chat template)
    metrics.py             Prometheus metrics with vLLM's names
    api_server.py          the FastAPI app, error handlers, the API key / Host / body-size
                           guards, `run_server`, `ServerThread`
    cli_args.py            `minivllm serve` flags

This `__init__` imports nothing, so `cli_args` stays light (no FastAPI for `--help`).
"""
