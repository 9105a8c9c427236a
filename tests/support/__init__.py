"""Helpers the tests share: fake backends, request payloads."""
