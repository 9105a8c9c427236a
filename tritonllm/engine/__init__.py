"""The CPU/torch engine of the ``tensorrt_llm`` slot (CUDA when torch sees a GPU)."""
