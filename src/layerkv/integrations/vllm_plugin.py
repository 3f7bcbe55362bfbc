"""The vLLM general plugin's entry point before the vLLM modules became a package:
`layerkv.integrations.vllm_plugin:register`. An editable install made before the move still
names it in its entry point metadata until `pip install -e .` is rerun; without this module
vLLM's plugin loader would log a failure in every process and a front end would not know the
connector's name (MultiConnector stats). Delete once no such install is left. No state.
"""

from __future__ import annotations

from layerkv.integrations.vllm.plugin import register

__all__ = ["register"]
