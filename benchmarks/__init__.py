"""airspeed velocity (asv) benchmarks of tfmath; see ``bench_attention.py`` for how to run them."""
