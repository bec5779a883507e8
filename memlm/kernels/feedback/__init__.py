"""The Feedback Transformer's recurrence over steps (SPEC §3)."""
