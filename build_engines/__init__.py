"""Fills ``model_repository/`` for this machine: TensorRT-LLM engines or the torch engine."""
