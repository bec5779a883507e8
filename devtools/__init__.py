"""memlm's development tooling: what the tests, the benchmarks and `make gpu-check` use and no user of the library
needs. It lives beside the package, not in it: a built wheel holds only `memlm/` (setup.cfg lists its packages)."""
