"""The compat suites reuse the integration suite's fixtures (the tiny model, server dirs)."""

from tests.integration.conftest import serve_tmp, tiny_model  # noqa: F401
