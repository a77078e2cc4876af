"""Edge cases of scale behaviour."""
