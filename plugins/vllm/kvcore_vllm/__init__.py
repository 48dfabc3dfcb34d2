"""kvcore-vllm: vllm's KV cache layouts for kvcore."""
