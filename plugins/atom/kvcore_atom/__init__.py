"""kvcore-atom: the KV caches of AMD's ATOM engine (ROCm/ATOM) for kvcore.

``kvcore.detect(per_layer_caches, engine="atom")``; see :mod:`kvcore_atom.plugin` for the
engine facts (with file and function), the hints and the fixtures.
"""

from kvcore_atom.plugin import INDEX_FORMAT, LATENT_FORMAT, allocate, index_view, latent_view

__all__ = ["LATENT_FORMAT", "INDEX_FORMAT", "allocate", "latent_view", "index_view"]
