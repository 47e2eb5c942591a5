"""Mesh and sharding rules, the multi-process runtime, the compilation cache and the profiler."""
