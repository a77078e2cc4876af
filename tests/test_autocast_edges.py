"""Edge cases of autocast behaviour."""
