"""Pieces every API dialect uses: errors, API keys and tenants' limits, fair shares,
metering, the backend interface, SSE, sampling defaults, stops, structured outputs
and tool-call parsing."""
