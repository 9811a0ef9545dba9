"""The thin trainer: knows models and data, asks the tiermem store for layers."""
