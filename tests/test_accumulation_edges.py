"""Edge cases of accumulation behaviour."""
