"""kvcore-transformers: transformers's KV cache layouts for kvcore."""
