"""Stand-ins for hardware we do not have (named as stand-ins), shipped for tests and examples."""
