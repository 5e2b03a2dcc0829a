"""Shared test set-up: keep torch single-threaded-ish on the 2-core CI machine."""

import torch

torch.set_num_threads(1)
