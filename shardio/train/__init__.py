"""Feeding a model: loaders (pinned, on a device), batched augmentation, the Lightning data module."""
