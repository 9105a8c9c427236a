"""The Ray Serve application around Triton (the Serve parts land with their issue)."""
