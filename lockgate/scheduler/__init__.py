"""Scheduling side of the engine (numpy and ints only, never torch): requests, admission
by peak KV usage, waiting-queue policies and the per-step scheduler."""
