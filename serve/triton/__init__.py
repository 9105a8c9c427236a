"""One Triton server per replica."""
