"""Real vLLM engines for the bench suites and the real-engine test tier, run as child processes
under the engine's Python (the vLLM venv); only host.py and the model writer import vllm / torch,
and only there. (Absolute imports: `import vllm` in these modules is vLLM itself.)

    engines.py     the driver side: `EngineProcess` starts, feeds and stops one offline engine
    host.py        python -m: one offline vLLM `LLM` in its own process, JSON commands on stdin
    serve_proc.py  `vllm serve` as a child: start, /health, /metrics, the group's RSS
    model.py       the random-weight Llama and the deterministic prompts they serve
"""
