"""Test helpers (import as ``from helpers.launch import ...``): ``launch`` starts child Pythons (a snippet,
``child_json``, torchrun), ``requires`` imports what a test needs (``require``, ``importable``), ``stock`` runs
stock Megatron-LM."""
