"""Held-out evaluation: validation metrics, bits per byte, forced acceptance, decode speed, the MTP plan."""
