"""kvcore-lmdeploy: LMDeploy's PyTorch-engine KV caches for kvcore.

``kvcore.detect(cache_engine.gpu_cache, engine="lmdeploy", hints={...})`` -- every
generation (0.6 per-layer tensors, 0.6.4-0.10 cross-layer tensors, 0.11+ the uint8 pool),
NHD and Cambricon's HND blocks, fp8, MLA, and the quantised caches (int8 / int4 with
per-token-head (scale, zero) tensors, TurboQuant) as multi-plane layouts. See
:mod:`kvcore_lmdeploy.hints` for the hints, :mod:`kvcore_lmdeploy.allocation` for LMDeploy's
allocation repeated per version, :mod:`kvcore_lmdeploy.quant` to quantise and
dequantise the way LMDeploy's kernels do, and :mod:`kvcore_lmdeploy.blocks` for the block
manager's ids when 0.14's ``kernel_block_size`` is smaller than ``block_size`` (a layout's
block ids are then kernel blocks).
"""

from kvcore_lmdeploy.allocation import CacheConfig, allocate
from kvcore_lmdeploy.blocks import gather_manager_blocks, kernel_block_ids, scatter_manager_blocks
from kvcore_lmdeploy.hints import LMDeployHints

__all__ = ["CacheConfig", "LMDeployHints", "allocate", "gather_manager_blocks", "kernel_block_ids", "scatter_manager_blocks"]
