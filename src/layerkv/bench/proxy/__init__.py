"""Suite `proxy` (opt-in): `layerkv pd-proxy`'s own cost per request, in front of fake vLLM
servers with a fixed service time (fake_vllm.py), against calling the servers directly."""
