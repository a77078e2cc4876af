"""Edge cases of the PyTorch-style GradScaler facade, each a behaviour a user relies on."""
