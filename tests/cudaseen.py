"""Preloaded by a test's fork server: its forks take CUDA for started there (forked.cuda_started), as
they would where a preloaded module had started CUDA, so that each worker runs in a new interpreter."""
from ddptune import forked

forked.cuda_started = lambda: True
