"""The real-engine tests run only where vLLM is importable: inside an engine virtualenv
(``python3 scripts/engine_envs.py``, then ``.venvs/vllm-0.32/bin/python -m pytest
plugins/vllm/tests/engine``). The main test run runs them there through
``plugins/vllm/tests/test_real_engines.py``."""

import importlib.util

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py"]
