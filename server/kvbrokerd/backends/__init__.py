"""Data-plane backends: one module per backend behind `base.Backend`."""
