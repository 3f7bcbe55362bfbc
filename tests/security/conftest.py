from tests.e2e.conftest import make_oracle  # noqa: F401  (the oracle harness for the attacks on engines)
