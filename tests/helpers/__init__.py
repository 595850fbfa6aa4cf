"""Test helpers shared by multi-process tests (import as ``from helpers.launch import ...``)."""
