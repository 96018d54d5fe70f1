"""Engine hooks: vLLM and SGLang serve their KV cache from the kvshare pool.

:mod:`.registry` is the table of supported engine lines, :mod:`.activation` the import
hooks the bundle's ``sitecustomize`` installs, :mod:`.patching` the checked patch sets,
:mod:`.pools` the runtime services the patches use, and one module per engine line
(``vllm_v0_33``, ...) over one shared module per engine (``vllm_common``,
``sglang_common``).
"""
