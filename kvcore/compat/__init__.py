"""Compatibility facades: other projects' public function names over kvcore's API.

* :mod:`kvcore.compat.lmcache` — LMCache's ``lmcache/v1/gpu_connector/utils.py`` and the
  ``kv_format`` package it fronts (``normalize_kv_and_discover_format``, ``get_spec``,
  ``get_spec_class``, ``get_num_layers``, ``EngineKVFormat``, ``PageBufferShapeDesc``, ...).
"""
