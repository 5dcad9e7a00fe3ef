"""The scheduler and the block manager: plain Python, no torch, runnable with no model."""
