"""The Ray Serve application: one Triton per replica, an OpenAI-compatible API in front."""
