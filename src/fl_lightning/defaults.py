"""Settings every method shares that no paper fixes (a method's own protocol constants stay
with it, e.g. ``feast_protocol.py``)."""

CALIB_BATCH_SIZE = 100
"""Batch size of a batch-norm statistics pass (recalibration, static BN): the papers fix the
samples and their order, not the batch."""
