"""Anthropic's Messages API: its route and its schemas."""
