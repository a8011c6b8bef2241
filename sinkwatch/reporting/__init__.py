"""Reporters and text summaries. Only the W&B reporter imports wandb, and only when used."""
