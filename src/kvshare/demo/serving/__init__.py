"""Real model servers on this machine: vLLM's CPU build serving a tiny local model.

- :mod:`.environment` — where ``make engines`` puts the serving environments and the model;
- :mod:`.tiny_model` — the deterministic tiny model (run inside a serving environment);
- :mod:`.vllm_server` — start and stop one ``vllm serve`` (with kvshare or without);
- :mod:`.client` — its OpenAI HTTP API and its Prometheus metrics, as a user's client sees them.

The tests, the benchmarks and ``kvshare demo --engine vllm`` all start servers through
:class:`~kvshare.demo.serving.vllm_server.VllmServer`.
"""
