"""kvcore-trtllm: TensorRT-LLM's KV cache pool for kvcore (an example out-of-tree plugin)."""
