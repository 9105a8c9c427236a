"""The engines behind the API, side by side: each owns its Serve deployment, its
parameter translation and its host."""
