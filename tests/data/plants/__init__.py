"""TEST-ONLY adaptors that plant faults (put tests/data on PYTHONPATH: `--adaptor plants.megatron_adaptor`)."""
