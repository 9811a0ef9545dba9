"""Training data: the dataset registry, reading rows, tokenizing, batching."""
