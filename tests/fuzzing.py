"""schemathesis over an app's own OpenAPI schema: valid and invalid requests alike."""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode


def server_errors(schema, call: Callable, max_examples: int) -> list[tuple]:
    """Send ``max_examples`` generated requests per operation (positive and negative
    cases, via ``call(case)``); returns those answered with a 5xx."""
    failures = []
    for result in schema.get_all_operations():
        operation = result.ok()
        cases = st.one_of(
            operation.as_strategy(GenerationMode.POSITIVE),
            operation.as_strategy(GenerationMode.NEGATIVE),
        )

        @settings(
            max_examples=max_examples,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=cases)
        def fuzz(case):
            response = call(case)
            if response.status_code >= 500:
                failures.append((case.method, case.path, case.body, response.text[:300]))

        fuzz()
    return failures
