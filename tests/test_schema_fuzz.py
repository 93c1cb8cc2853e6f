"""Property test of the HTTP API against its own OpenAPI document (schemathesis strategies driven by
hypothesis, in process, bounded): no 5xx for any generated request, every status code and body
documented, no internals in any answer, the engine running afterwards."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from pagellm.config import EngineArgs
from pagellm.engine.async_llm import AsyncLLM
from pagellm.entrypoints.openai_server import build_app

schemathesis = pytest.importorskip("schemathesis")

EXAMPLES_PER_OPERATION = 25


@pytest.fixture(scope="module")
def app_and_engine(tiny_llama):
    engine = AsyncLLM.from_engine_args(EngineArgs(model=tiny_llama, kv_cache_memory="16MiB", max_model_len=64))
    yield build_app(engine, "tiny"), engine
    engine.shutdown()


def test_api_answers_every_generated_request_as_documented(app_and_engine):
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import response_schema_conformance, status_code_conformance

    app, engine = app_and_engine
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/tokenize", "/health"}
    for op in operations:
        @given(case=op.as_strategy())
        @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, suppress_health_check=list(HealthCheck),
                  database=None)
        def check(case) -> None:
            response = case.call()
            case.validate_response(response, checks=[not_a_server_error, status_code_conformance,
                                                     response_schema_conformance])
            assert 'File "' not in response.text and "Traceback" not in response.text, response.text[:300]

        check()
        assert engine.is_running, f"{op.method.upper()} {op.path} took the engine down"
