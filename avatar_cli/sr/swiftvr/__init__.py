"""SwiftVR (H-oliday/SwiftVR): one-step causal streaming video super-resolution, key-for-key with the release."""
