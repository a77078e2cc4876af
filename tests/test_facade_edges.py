"""Edge cases of facade behaviour."""
