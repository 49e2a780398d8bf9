#!/usr/bin/env python
"""Thin wrapper: the training entry point is nemo_dcr_callback.recipes.train (Hydra app)."""

from nemo_dcr_callback.recipes.train import main

if __name__ == "__main__":
    main()
