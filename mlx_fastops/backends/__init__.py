"""Op implementations: `reference` (pure MLX, runs everywhere), `metal`, `cuda`."""
