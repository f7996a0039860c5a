"""Monitors: the paper's signals on the device, early-warning signals, the in-run alarm and the mechanism probes."""
