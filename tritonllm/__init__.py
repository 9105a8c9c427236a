"""Plain Python that runs inside Triton's Python backend.

The ``model.py`` files under ``model_repository/`` are thin adapters between
``triton_python_backend_utils`` and this package, so that everything here can be
unit-tested without a Triton server. Nothing in this package imports pb_utils.
"""
