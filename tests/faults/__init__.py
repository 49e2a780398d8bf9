"""The fault-injection suite (docs/FAULTS.md)."""
