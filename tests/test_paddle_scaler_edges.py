"""Edge cases of the Paddle-style GradScaler facade, each a behaviour a user relies on."""
