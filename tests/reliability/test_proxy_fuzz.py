"""A bounded schemathesis run against the proxy's own OpenAPI schema: no 5xx but 503.

Bounded to fit CI (``FUZZ_EXAMPLES`` per operation; the long variant runs 200); canvases are
capped at 8 tokens so accepted generations stay fast.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from reliability_stack import ExtraProxy, long_runs

from dlm_triton.launch.launcher import TritonServerProcess

schemathesis = pytest.importorskip("schemathesis")
# Its OpenAPI adapters are imported lazily; import (and assertion-rewrite) them here at
# collection, not while the test's proxy and gRPC threads run: CPython 3.11's compile() once
# failed mid-test with "AST constructor recursion depth mismatch" on that lazy import.
pytest.importorskip("schemathesis.specs.openapi.adapter")
pytestmark = pytest.mark.integration

FUZZ_EXAMPLES = 200 if long_runs() else 8


def test_schemathesis_finds_no_server_error(stack: TritonServerProcess) -> None:
    with ExtraProxy(stack, "--max-tokens-limit", "8", "--max-n", "2") as proxy:
        schema = schemathesis.openapi.from_url(f"{proxy.base_url}/openapi.json")
        failures: list[str] = []
        calls = 0
        for result in schema.get_all_operations():
            operation = result.ok()

            @settings(
                max_examples=FUZZ_EXAMPLES,
                deadline=None,
                database=None,
                derandomize=True,
                suppress_health_check=list(HealthCheck),
            )
            @given(case=operation.as_strategy())
            def call(case) -> None:
                nonlocal calls
                calls += 1
                response = case.call(base_url=proxy.base_url, timeout=60)
                if response.status_code >= 500 and response.status_code != 503:
                    failures.append(f"{case.method} {case.formatted_path}: {response.status_code}"
                                    f" {response.text[:200]} <- {case.body!r:.200}")  # fmt: skip

            call()
    print(f"\nschemathesis: {calls} generated requests")
    assert calls > 0
    assert not failures, "\n".join(failures[:10])
