"""The programs' tests use the session's ``runtime`` fixture (tests/conftest.py).

Every test asserts structure (types, schema validity, choice membership, counts, the step
limit, cached tokens), never facts: the default model has 135M parameters.
"""
