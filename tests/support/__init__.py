"""Helpers shared by the test suites: the one place test modules import from (never each other)."""
