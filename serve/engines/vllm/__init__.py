"""vLLM under Ray Serve LLM: the deployment, its parameters and its server."""
