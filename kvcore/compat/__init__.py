"""Compatibility facades: other projects' public function names over kvcore's API.

* :mod:`kvcore.compat.lmcache` — LMCache's ``lmcache/v1/gpu_connector/utils.py`` and
  ``kv_format`` helpers (``normalize_kv_and_discover_format``, ``get_num_layers``, ...).
"""
