"""Stand-ins for the LoRA-serving upstreams the gateway drives: SGLang (``tests.standins.sglang``) and vLLM
(``tests.standins.vllm``).

Each is a small Starlette app that answers the routes the gateway uses with the bodies and status codes the
real server sends, runs in-process under ``tests.standin.ServerThread`` or as a process
(``python -m tests.standins.sglang --port P --model-path M``), and keeps what a test wants to look at:
``calls``, ``loaded``, ``in_flight`` and ``unload_in_flight``.
"""
