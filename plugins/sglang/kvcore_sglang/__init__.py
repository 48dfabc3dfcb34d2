"""kvcore-sglang: sglang's KV cache layouts for kvcore."""
