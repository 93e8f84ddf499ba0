"""Preloaded by a GPU test's fork server: it starts CUDA there (torch.cuda.is_available() starts the
driver), as a preloaded module might, so that no fork of that server could use the GPU."""
import torch

torch.cuda.is_available()
