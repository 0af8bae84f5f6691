"""Wan2.2-S2V-14B (and LiveAvatar on top of it): the project's own implementation, key-for-key compatible with
the released checkpoints, checked against the official code at a tiny size (tests/golden/)."""
