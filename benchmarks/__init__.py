"""Side-by-side benchmarks of this system against TRL 1.16 (see benchmarks/README.md)."""
