"""Test support: fixtures (registered as a plugin by tests/conftest.py) and helpers that several test
modules share. Test modules import from here, never from each other."""
